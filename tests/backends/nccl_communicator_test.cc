// The NCCL communicator. Needs a GPU: skipped (not failed) on machines without one.
// One process drives one GPU per rank, so on a single-GPU machine only size 1 runs; with
// N GPUs every rank gets its own device on a thread.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "backends/nccl/nccl_communicator.h"
#include "tests/testing/in_memory_rendezvous_store.h"

namespace collserve::testing {
namespace {

TEST(NcclCommunicatorTest, AllReduceAndAllGatherOnEveryVisibleGpu) {
  const int gpus = backends::CudaDeviceCount();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device";
  InMemoryRendezvousStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < gpus; ++r) {
    threads.emplace_back([&, r] {
      backends::NcclOptions o;
      o.device = r;
      auto comm = backends::ConnectNccl(store, "nccl-test", r, gpus, o);
      ASSERT_TRUE(comm.ok()) << comm.status();
      std::vector<float> x(1 << 20, static_cast<float>(r + 1));
      ASSERT_TRUE((*comm)->AllReduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum, absl::Seconds(60)).ok());
      EXPECT_EQ(x[12345], gpus * (gpus + 1) / 2.0f);
      int64_t mine = r * 10;
      std::vector<int64_t> all(gpus);
      ASSERT_TRUE((*comm)->AllGather(&mine, all.data(), sizeof(mine), absl::Seconds(60)).ok());
      for (int h = 0; h < gpus; ++h) EXPECT_EQ(all[h], h * 10);
      int32_t bits = 3;
      EXPECT_EQ((*comm)->AllReduce(&bits, 1, DataType::kInt32, ReduceOp::kBxor, absl::Seconds(5)).code(),
                absl::StatusCode::kInvalidArgument);
    });
  }
  for (auto& t : threads) t.join();
}

TEST(NcclCommunicatorTest, NoGpuIsFailedPrecondition) {
  if (backends::CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  InMemoryRendezvousStore store;
  auto comm = backends::ConnectNccl(store, "x", 0, 1, backends::NcclOptions());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
}

}  // namespace
}  // namespace collserve::testing
