// The Gloo communicator with every host on a thread (Gloo's BaseTest::spawn) over an
// in-memory rendezvous store, plus the reduction kernels it uses.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/gloo/gloo_communicator.h"
#include "backends/reduce.h"
#include "tests/testing/in_memory_rendezvous_store.h"

namespace collserve::testing {
namespace {

using backends::Communicator;

std::vector<std::unique_ptr<Communicator>> ConnectAll(InMemoryRendezvousStore& store, const std::string& prefix,
                                                      int size) {
  std::vector<std::unique_ptr<Communicator>> comms(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      backends::GlooOptions o;
      o.connect_timeout = absl::Seconds(20);
      auto c = backends::ConnectGloo(store, prefix, r, size, o);
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  return comms;
}

TEST(GlooCommunicatorTest, AllReduceAndAllGatherAcrossFiveHosts) {
  InMemoryRendezvousStore store;
  constexpr int kSize = 5;
  auto comms = ConnectAll(store, "g5", kSize);
  std::vector<std::thread> threads;
  for (int r = 0; r < kSize; ++r) {
    threads.emplace_back([&, r] {
      std::vector<int64_t> data(1000);
      for (size_t i = 0; i < data.size(); ++i) data[i] = r * 1000 + static_cast<int64_t>(i);
      ASSERT_TRUE(comms[r]->AllReduce(data.data(), data.size(), DataType::kInt64, ReduceOp::kSum, absl::Seconds(20)).ok());
      for (size_t i = 0; i < data.size(); ++i) EXPECT_EQ(data[i], 10000 + 5 * static_cast<int64_t>(i));
      std::vector<double> m = {static_cast<double>(r), -static_cast<double>(r)};
      ASSERT_TRUE(comms[r]->AllReduce(m.data(), 2, DataType::kFloat64, ReduceOp::kMax, absl::Seconds(20)).ok());
      EXPECT_EQ(m[0], 4.0);
      EXPECT_EQ(m[1], 0.0);
      int32_t mine[2] = {r, r * r};
      std::vector<int32_t> all(2 * kSize);
      ASSERT_TRUE(comms[r]->AllGather(mine, all.data(), sizeof(mine), absl::Seconds(20)).ok());
      for (int h = 0; h < kSize; ++h) {
        EXPECT_EQ(all[2 * h], h);
        EXPECT_EQ(all[2 * h + 1], h * h);
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST(GlooCommunicatorTest, MissingPeerIsDeadlineExceededThenAborted) {
  InMemoryRendezvousStore store;
  auto comms = ConnectAll(store, "g2", 2);
  // Host 1 never calls: host 0 times out, and its communicator stays failed.
  float x = 1;
  absl::Status s = comms[0]->AllReduce(&x, 1, DataType::kFloat32, ReduceOp::kSum, absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  s = comms[0]->AllReduce(&x, 1, DataType::kFloat32, ReduceOp::kSum, absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

TEST(GlooCommunicatorTest, PeerThatGoesAwayIsUnavailable) {
  InMemoryRendezvousStore store;
  auto comms = ConnectAll(store, "g3", 2);
  std::thread closer([&] {
    absl::SleepFor(absl::Milliseconds(200));
    comms[1].reset();  // closes its pairs
  });
  std::vector<float> x(1 << 16, 1.0f);
  absl::Status s = comms[0]->AllReduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum, absl::Seconds(10));
  closer.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST(GlooCommunicatorTest, ConnectWithoutPeersTimesOut) {
  InMemoryRendezvousStore store;
  backends::GlooOptions o;
  o.connect_timeout = absl::Milliseconds(300);
  auto c = backends::ConnectGloo(store, "lonely", 0, 2, o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_EQ(backends::ConnectGloo(store, "bad", 2, 2, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReduceKernelsTest, EveryOpOnEveryDtype) {
  int32_t a[3] = {6, -3, 0x0f}, b[3] = {3, 5, 0x3c}, out[3];
  backends::Reduce(DataType::kInt32, ReduceOp::kBand, out, a, b, 3);
  EXPECT_EQ(out[2], 0x0c);
  backends::Reduce(DataType::kInt32, ReduceOp::kBor, out, a, b, 3);
  EXPECT_EQ(out[2], 0x3f);
  backends::Reduce(DataType::kInt32, ReduceOp::kBxor, out, a, b, 3);
  EXPECT_EQ(out[2], 0x33);
  backends::Reduce(DataType::kInt32, ReduceOp::kMin, out, a, b, 3);
  EXPECT_EQ(out[1], -3);
  backends::Reduce(DataType::kInt32, ReduceOp::kProduct, out, a, b, 3);
  EXPECT_EQ(out[0], 18);
  int64_t big[1] = {std::numeric_limits<int64_t>::max()}, one[1] = {1}, wrap[1];
  backends::Reduce(DataType::kInt64, ReduceOp::kSum, wrap, big, one, 1);  // wraps like torch
  EXPECT_EQ(wrap[0], std::numeric_limits<int64_t>::min());
  float f[2] = {1.5f, -2.0f}, g[2] = {0.5f, 4.0f}, fo[2];
  backends::Reduce(DataType::kFloat32, ReduceOp::kMax, fo, f, g, 2);
  EXPECT_EQ(fo[1], 4.0f);
  int32_t avg[2] = {7, -7};
  backends::DivideInPlace(DataType::kInt32, avg, 2, 2);
  EXPECT_EQ(avg[0], 3);
  EXPECT_EQ(avg[1], -3);  // truncation toward zero
  EXPECT_EQ(ValidateReduce(DataType::kFloat64, ReduceOp::kBxor).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace collserve::testing
