// The collective engine in one process: 2 simulated hosts x 2 ranks (and other layouts)
// on a fake coordinator, with the real Gloo backend on loopback between the hosts. Every
// collective and send/recv, the desync checks, timeouts, and a rank or host that goes away.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <numeric>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "common/shm.h"
#include "tests/engine/engine_testing.h"
#include "tests/testing/sockets.h"

namespace collserve::testing {
namespace {

using engine::CollectiveOp;
using engine::Completion;
using ::testing::HasSubstr;

std::vector<float> Iota(size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(EngineTest, AllReduceTwoHostsTwoRanksEveryAlgorithm) {
  TestCluster cluster(2);
  auto ranks = cluster.Form("ar", 4);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  // 8 elements ride with the argument exchange; 1000 take the direct exchange; 400k
  // floats (1.6 MB) Gloo's ring.
  for (size_t n : {size_t{8}, size_t{1000}, size_t{400000}}) {
    OnEveryRank(*ranks, [&](TestRank& r) {
      Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, Iota(n, static_cast<float>(r.rank))));
      ASSERT_TRUE(c.status.ok()) << c.status;
      std::vector<float> out = FloatsOf(c.inline_data);
      ASSERT_EQ(out.size(), n);
      for (size_t i = 0; i < n; i += 997) EXPECT_EQ(out[i], 4.0f * i + 6.0f) << i;
      EXPECT_EQ(c.algorithm, n == 8 ? "local+gloo_fused" : n == 1000 ? "local+gloo_direct" : "local+gloo_ring");
    });
  }
}

TEST(EngineTest, SmallAllReduceAvgAndPremulSumAcrossHosts) {
  TestCluster cluster(2);
  auto ranks = cluster.Form("small", 4);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  OnEveryRank(*ranks, [&](TestRank& r) {
    engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {static_cast<float>(r.rank), 8});
    q.reduce_op = static_cast<int>(ReduceOp::kAvg);
    Completion c = r.Call(q);
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.algorithm, "local+gloo_fused");
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(1.5f, 8.0f));
    q = FloatRequest(CollectiveOp::kAllReduce, {1, 2});
    q.reduce_op = static_cast<int>(ReduceOp::kPremulSum);
    q.premul_factor = r.rank + 1;  // 1 + 2 + 3 + 4 = 10
    c = r.Call(q);
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(10.0f, 20.0f));
  });
}

TEST(EngineTest, AllReduceThroughSharedMemory) {
  TestCluster cluster(1);
  constexpr int kWorld = 2;
  std::vector<std::unique_ptr<ShmSegment>> segments;
  std::vector<TestRank> ranks(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    engine::AttachRequest a;
    a.group = "shm";
    a.rank = r;
    a.world_size = kWorld;
    a.shared_memory = true;
    ranks[r].rank = r;
    ranks[r].session = std::make_shared<RecordingSession>();
    auto g = cluster.engine(0).Attach(a, ranks[r].session);
    ASSERT_TRUE(g.ok()) << g.status();
    ranks[r].group = *g;
    auto seg = ShmSegment::Create(4096);
    ASSERT_TRUE(seg.ok());
    segments.push_back(std::move(*seg));
  }
  for (TestRank& r : ranks) {
    auto attached = r.session->WaitAttached(absl::Seconds(30));
    ASSERT_TRUE(attached.ok()) << attached.status();
    EXPECT_TRUE(attached->shared_memory);
    // What the sidecar does with the descriptor the client passes: map it and register it.
    const ShmSegment& mine = *segments[r.rank];
    auto mapped = ShmSegment::FromFd(mine.name(), dup(mine.fd()), mine.size());
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    ASSERT_TRUE(r.group->AddSegment(r.rank, std::move(*mapped)).ok());
  }

  OnEveryRank(ranks, [&](TestRank& r) {
    float* data = reinterpret_cast<float*>(segments[r.rank]->data() + 64);
    for (int i = 0; i < 10; ++i) data[i] = static_cast<float>(r.rank + i);
    engine::Request req = FloatRequest(CollectiveOp::kAllReduce, {});
    req.count = 10;
    req.buffer.segment = segments[r.rank]->name();
    req.buffer.segment_bytes = 4096;
    req.buffer.offset = 64;
    Completion c = r.Call(req);
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_TRUE(c.inline_data.empty());
    for (int i = 0; i < 10; ++i) EXPECT_EQ(data[i], 2.0f * i + 1.0f);
  });
}

TEST(EngineTest, EveryCollectiveTwoHostsTwoRanks) {
  TestCluster cluster(2);
  auto formed = cluster.Form("all", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank>& ranks = *formed;
  constexpr int kWorld = 4;
  OnEveryRank(ranks, [&](TestRank& r) {
    const float me = static_cast<float>(r.rank);
    // broadcast from rank 2 (host 1)
    Completion c = r.Call([&] {
      auto q = FloatRequest(CollectiveOp::kBroadcast, {me, me});
      q.root = 2;
      return q;
    }());
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(2.0f, 2.0f));
    // reduce (MAX) to rank 1: only the root's tensor changes
    c = r.Call([&] {
      auto q = FloatRequest(CollectiveOp::kReduce, {me, -me});
      q.reduce_op = static_cast<int>(ReduceOp::kMax);
      q.root = 1;
      return q;
    }());
    ASSERT_TRUE(c.status.ok()) << c.status;
    if (r.rank == 1) {
      EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(3.0f, 0.0f));
    } else {
      EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(me, -me));
    }
    // all_gather with uneven sizes: rank r sends r + 1 elements
    c = r.Call([&] {
      auto q = FloatRequest(CollectiveOp::kAllGather, std::vector<float>(r.rank + 1, me));
      q.output_splits = {1, 2, 3, 4};
      q.output_count = 10;
      return q;
    }());
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(0, 1, 1, 2, 2, 2, 3, 3, 3, 3));
    // gather to rank 3
    c = r.Call([&] {
      auto q = FloatRequest(CollectiveOp::kGather, {me * 10});
      q.root = 3;
      if (r.rank == 3) {
        q.output_splits = {1, 1, 1, 1};
        q.output_count = 4;
      }
      return q;
    }());
    ASSERT_TRUE(c.status.ok()) << c.status;
    if (r.rank == 3) {
      EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(0, 10, 20, 30));
    }
    // scatter from rank 0: rank r gets 2 elements r, r
    c = r.Call([&] {
      auto q = FloatRequest(CollectiveOp::kScatter, r.rank == 0 ? std::vector<float>{0, 0, 1, 1, 2, 2, 3, 3}
                                                                : std::vector<float>{});
      q.root = 0;
      if (r.rank == 0) q.input_splits = {2, 2, 2, 2};
      q.output_count = 2;
      return q;
    }());
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(me, me));
    // reduce_scatter: every rank sends [0..7]; rank r gets 4 x [2r, 2r+1]
    c = r.Call([&] {
      auto q = FloatRequest(CollectiveOp::kReduceScatter, Iota(8, 0));
      q.input_splits = {2, 2, 2, 2};
      q.output_count = 2;
      return q;
    }());
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(8 * me, 8 * me + 4));
    // all_to_all: rank i sends (10 i + j) to rank j
    c = r.Call([&] {
      std::vector<float> in;
      for (int j = 0; j < kWorld; ++j) in.push_back(10 * me + j);
      auto q = FloatRequest(CollectiveOp::kAllToAll, in);
      q.input_splits = {1, 1, 1, 1};
      q.output_splits = {1, 1, 1, 1};
      q.output_count = 4;
      return q;
    }());
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(me, 10 + me, 20 + me, 30 + me));
    // barrier
    engine::Request barrier;
    barrier.op = CollectiveOp::kBarrier;
    c = r.Call(barrier);
    EXPECT_TRUE(c.status.ok()) << c.status;
  });
}

TEST(EngineTest, UnevenAllToAllAndGatherAcrossThreeHostsSendOnlyWhatEachHostNeeds) {
  TestCluster cluster(3);
  constexpr int kWorld = 5;  // hosts: [0, 1], [2, 3], [4]
  auto formed = cluster.Form("uneven", kWorld);
  ASSERT_TRUE(formed.ok()) << formed.status();
  OnEveryRank(*formed, [&](TestRank& r) {
    const int i = r.rank;
    // all_to_all: rank i sends (i + j) % 3 elements of value 100 i + j to rank j.
    std::vector<float> in;
    engine::Request q = FloatRequest(CollectiveOp::kAllToAll, {});
    for (int j = 0; j < kWorld; ++j) {
      q.input_splits.push_back((i + j) % 3);
      q.output_splits.push_back((j + i) % 3);
      for (int k = 0; k < (i + j) % 3; ++k) in.push_back(100.0f * i + j);
    }
    q.buffer = Floats(in);
    q.count = static_cast<int64_t>(in.size());
    q.output_count = q.count;  // symmetric splits
    Completion c = r.Call(q);
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.algorithm, "local+gloo_alltoallv");
    std::vector<float> want;
    for (int j = 0; j < kWorld; ++j) {
      for (int k = 0; k < (i + j) % 3; ++k) want.push_back(100.0f * j + i);
    }
    EXPECT_EQ(FloatsOf(c.inline_data), want) << "rank " << i;
    // gather to rank 2 (the middle host): rank i sends i elements of value i.
    engine::Request g = FloatRequest(CollectiveOp::kGather, std::vector<float>(i, static_cast<float>(i)));
    g.root = 2;
    if (i == 2) {
      g.output_splits = {0, 1, 2, 3, 4};
      g.output_count = 10;
    }
    c = r.Call(g);
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.algorithm, "local+gloo_alltoallv_to_root");
    if (i == 2) {
      EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(1, 2, 2, 3, 3, 3, 4, 4, 4, 4));
    }
  });
}

// Messages of at least PointToPoint::kMoverHostBytes are copied by the mover, not by the
// thread that submits (in the sidecar, the one that reads every session's ops channel): a
// local pair either way round, and a message from another host received before its recv.
// Every element arrives, from the right source.
TEST(EngineTest, LargeSendsAndRecvsArriveWholeThroughTheMover) {
  TestCluster cluster(2);
  auto formed = cluster.Form("p2p-large", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  constexpr size_t kFloats = (size_t{2} << 20) / sizeof(float);  // 2 MiB
  auto pattern = [](int rank) {
    std::vector<float> v(kFloats);
    for (size_t k = 0; k < kFloats; ++k) v[k] = static_cast<float>(rank * 1000003 + k % 65521);
    return v;
  };
  OnEveryRank(*formed, [&](TestRank& r) {
    // Even ranks post their recv first, odd ones their send: both orders of a local pair.
    engine::Request send = FloatRequest(CollectiveOp::kSend, pattern(r.rank));
    send.peer = (r.rank + 1) % 4;
    send.tag = 9;
    engine::Request recv = FloatRequest(CollectiveOp::kRecv, {});
    recv.count = static_cast<int64_t>(kFloats);
    recv.peer = (r.rank + 3) % 4;
    recv.tag = 9;
    if (r.rank % 2 == 0) {
      recv.seq = r.next_seq++;
      send.seq = r.next_seq++;
      r.group->Submit(r.rank, recv);
      r.group->Submit(r.rank, send);
    } else {
      send.seq = r.next_seq++;
      recv.seq = r.next_seq++;
      r.group->Submit(r.rank, send);
      r.group->Submit(r.rank, recv);
    }
    Completion s = r.session->WaitCompletion(send.seq, absl::Seconds(60));
    Completion c = r.session->WaitCompletion(recv.seq, absl::Seconds(60));
    ASSERT_TRUE(s.status.ok()) << s.status;
    ASSERT_TRUE(c.status.ok()) << c.status;
    const int from = (r.rank + 3) % 4;
    EXPECT_EQ(c.source, from);
    EXPECT_TRUE(FloatsOf(c.inline_data) == pattern(from)) << "rank " << r.rank << " got another message";
  });
}

TEST(EngineTest, SendRecvOnOneHostAndAcrossHosts) {
  TestCluster cluster(2);
  auto formed = cluster.Form("p2p", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  // A ring: each rank sends to rank + 1 (0->1 on one host, 1->2 across hosts, ...) and
  // receives from any source.
  OnEveryRank(*formed, [&](TestRank& r) {
    engine::Request send = FloatRequest(CollectiveOp::kSend, {static_cast<float>(r.rank), 7});
    send.peer = (r.rank + 1) % 4;
    send.tag = 5;
    send.seq = r.next_seq++;
    engine::Request recv = FloatRequest(CollectiveOp::kRecv, {});
    recv.count = 2;
    recv.peer = -1;
    recv.tag = 5;
    recv.seq = r.next_seq++;
    r.group->Submit(r.rank, send);
    r.group->Submit(r.rank, recv);
    Completion s = r.session->WaitCompletion(send.seq, absl::Seconds(30));
    Completion c = r.session->WaitCompletion(recv.seq, absl::Seconds(30));
    ASSERT_TRUE(s.status.ok()) << s.status;
    ASSERT_TRUE(c.status.ok()) << c.status;
    const int from = (r.rank + 3) % 4;
    EXPECT_EQ(c.source, from);
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(static_cast<float>(from), 7.0f));
  });
}

TEST(EngineTest, DisagreementNamesTheRanksAndTheGroupStaysUsable) {
  TestCluster cluster(2);
  auto formed = cluster.Form("desync", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  OnEveryRank(*formed, [&](TestRank& r) {
    // rank 3 (host 1) calls with 5 elements, the others with 4
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, std::vector<float>(r.rank == 3 ? 5 : 4, 1)));
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
    EXPECT_THAT(c.status.message(), HasSubstr("count=4 on ranks [0, 1, 2] but count=5 on ranks [3]"));
    // ... and an all_to_all whose sizes do not fit
    engine::Request q = FloatRequest(CollectiveOp::kAllToAll, {1, 2, 3, 4});
    q.input_splits = {1, 1, 1, 1};
    q.output_splits = r.rank == 2 ? std::vector<int64_t>{2, 0, 1, 1} : std::vector<int64_t>{1, 1, 1, 1};
    q.output_count = 4;
    c = r.Call(q);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
    EXPECT_THAT(c.status.message(), HasSubstr("rank 0 sends 1 elements to rank 2, but rank 2 expects 2"));
    // each host agrees within itself but the hosts differ (the small all_reduce's data
    // already travelled with the arguments, and is not used)
    std::vector<float> mine(r.host == 0 ? 4 : 3, 5);
    c = r.Call(FloatRequest(CollectiveOp::kAllReduce, mine));
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
    EXPECT_THAT(c.status.message(), HasSubstr("count=3 on ranks [2, 3] but count=4 on ranks [0, 1]"));
    EXPECT_TRUE(c.inline_data.empty());
    // nothing moved: the next collective works
    c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1, 2}));
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(4.0f, 8.0f));
  });
}

TEST(EngineTest, CallSitesThatDifferNameTheRanksAndBothPlacesAcrossHosts) {
  TestCluster cluster(2);
  auto formed = cluster.Form("sites", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  OnEveryRank(*formed, [&](TestRank& r) {
    // Rank 3 (host 1) skipped the collective at train.py:10 and calls the next one, at
    // train.py:12, with the same op, count and dtype: only the call sites tell them apart.
    engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {1, 2});
    q.call_site = r.rank == 3 ? "train.py:12" : "train.py:10";
    Completion c = r.Call(q);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
    EXPECT_THAT(c.status.message(), HasSubstr("all_reduce #0 of group \"sites\": ranks disagree: ranks called it "
                                              "from different places: "));
    EXPECT_THAT(c.status.message(), HasSubstr("at train.py:10 on ranks [0, 1, 2]"));
    EXPECT_THAT(c.status.message(), HasSubstr("at train.py:12 on ranks [3]"));
    // Nothing moved: the next collective works; a rank without a call site is not checked.
    q = FloatRequest(CollectiveOp::kAllReduce, {1, 2});
    q.call_site = r.rank == 0 ? "" : "train.py:20";
    c = r.Call(q);
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(4.0f, 8.0f));
  });
}

TEST(EngineTest, BackToBackCollectivesShareOneArgumentExchange) {
  TestCluster cluster(2);
  auto formed = cluster.Form("ahead", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank>& ranks = *formed;
  const int64_t before = cluster.exchanges(0), before1 = cluster.exchanges(1);
  // 8 all_reduces of 1000 floats (too large to ride with the exchange themselves) issued
  // back to back by every rank before waiting for any; op 5 disagrees (rank 2 passes 999).
  // The first exchange is held once done until every op is queued: otherwise an executor
  // woken by each submission could start every exchange before the next op is there (a
  // loaded 2-core CI machine did: 8 exchanges), and the count would measure the scheduler.
  cluster.HoldExchanges();
  constexpr int kOps = 8;
  for (int k = 0; k < kOps; ++k) {
    for (TestRank& r : ranks) {
      engine::Request q = FloatRequest(CollectiveOp::kAllReduce,
                                       std::vector<float>(k == 5 && r.rank == 2 ? 999 : 1000, float(r.rank + k)));
      q.seq = r.next_seq++;
      r.group->Submit(r.rank, std::move(q));
    }
  }
  cluster.ReleaseExchanges();
  for (TestRank& r : ranks) {
    for (int k = 0; k < kOps; ++k) {
      Completion c = r.session->WaitCompletion(k, absl::Seconds(60));
      if (k == 5) {
        EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
        EXPECT_THAT(std::string(c.status.message()), HasSubstr("count=999 on ranks [2]"));
        EXPECT_THAT(std::string(c.status.message()), HasSubstr("count=1000 on ranks [0, 1, 3]"));
        continue;
      }
      ASSERT_TRUE(c.status.ok()) << "op " << k << ": " << c.status;
      std::vector<float> out = FloatsOf(c.inline_data);
      ASSERT_EQ(out.size(), 1000u);
      EXPECT_EQ(out[0], 6.0f + 4 * k) << "op " << k;
      EXPECT_EQ(out[999], 6.0f + 4 * k) << "op " << k;
    }
  }
  // The first exchange carries what every rank had queued by then; by the second every op
  // is queued everywhere, and the rest ride with it: 2 rounds (3 when the hosts' first
  // messages carried different prefixes of the queue), not 8.
  const int64_t exchanges = cluster.exchanges(0) - before;
  EXPECT_GE(exchanges, 1);
  EXPECT_LE(exchanges, 3);
  EXPECT_EQ(cluster.exchanges(1) - before1, exchanges);  // the hosts stay in step
  // A collective issued alone still works (and exchanges its own arguments).
  OnEveryRank(ranks, [&](TestRank& r) {
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, std::vector<float>(2000, 1)));
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(FloatsOf(c.inline_data)[1999], 4.0f);
  });
}

TEST(EngineTest, InvalidRequestIsAnErrorOnEveryRankNeverATouch) {
  TestCluster cluster(2);
  auto formed = cluster.Form("invalid", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  OnEveryRank(*formed, [&](TestRank& r) {
    engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {1, 2});
    if (r.rank == 1) {
      // count x element size wraps around size_t: rejected before any memory is touched
      q.count = (int64_t{1} << 62) + 1;
    }
    Completion c = r.Call(q);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
    EXPECT_THAT(c.status.message(), HasSubstr("ranks [1] sent invalid requests"));
    if (r.rank == 1) {
      EXPECT_THAT(c.status.message(), HasSubstr("exceeds the largest tensor"));
    }
  });
}

// The sidecar's max_inflight_collectives quota refuses a rank's request: it still takes its
// place in the group's sequence, so the collective fails on every rank at once (the refused
// rank with the quota's RESOURCE_EXHAUSTED, the others naming it) and the next one runs.
TEST(EngineTest, ARequestRefusedByAQuotaFailsItsCollectiveOnEveryRankAndTheGroupGoesOn) {
  TestCluster cluster(2);
  auto formed = cluster.Form("quota", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  OnEveryRank(*formed, [&](TestRank& r) {
    engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {1, 2});
    q.seq = r.next_seq++;
    const int64_t seq = q.seq;
    r.group->Submit(r.rank, std::move(q),
                    r.rank == 2 ? absl::ResourceExhaustedError("request refused (max_inflight_collectives 4)")
                                : absl::OkStatus());
    Completion c = r.session->WaitCompletion(seq, absl::Seconds(60));
    if (r.rank == 2) {
      EXPECT_EQ(c.status.code(), absl::StatusCode::kResourceExhausted) << c.status;
      EXPECT_THAT(c.status.message(), HasSubstr("max_inflight_collectives 4"));
    } else {
      EXPECT_EQ(c.status.code(), absl::StatusCode::kInvalidArgument) << c.status;
    }
    EXPECT_THAT(c.status.message(), HasSubstr("ranks [2] sent invalid requests"));
    c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1, 2}));
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(4.0f, 8.0f));
  });
}

// A group answers with its lock released: a session may call back into its group from an
// answer (here each rank submits its next all_reduce, asks for the group's in-flight count,
// and, at the end, sends an out-of-sequence request that fails the group) without a
// deadlock, and every answer comes once, in order. Answering under the group's lock made
// such a call wait for that lock forever (and, in the sidecar, made every rank that an
// answer woke wait for the executor to finish answering).
TEST(EngineTest, ASessionMayCallIntoItsGroupFromAnAnswer) {
  TestCluster cluster(1);
  auto formed = cluster.Form("reentrant", 2);
  ASSERT_TRUE(formed.ok()) << formed.status();
  constexpr int64_t kChain = 200;
  std::vector<std::vector<int64_t>> answered(2);
  for (TestRank& r : *formed) {
    std::vector<int64_t>* order = &answered[static_cast<size_t>(r.rank)];
    r.session->SetOnCompletion([&r, order](const Completion& c) {
      order->push_back(c.seq);  // answers of one session come one at a time
      int64_t ranks = 0, in_flight = 0, mapped = 0;
      absl::Time oldest = absl::InfiniteFuture();
      r.group->InFlight(&ranks, &in_flight, &oldest, &mapped);
      EXPECT_EQ(ranks, 2);
      if (c.seq + 1 < kChain) {
        EXPECT_TRUE(c.status.ok()) << c.status;
        engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {static_cast<float>(c.seq + 1)});
        q.seq = c.seq + 1;
        r.group->Submit(r.rank, std::move(q));
      } else if (c.seq + 1 == kChain) {
        engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {1});
        q.seq = kChain + 5;  // out of sequence: fails the group, answered like the rest
        r.group->Submit(r.rank, std::move(q));
      }
    });
  }
  OnEveryRank(*formed, [&](TestRank& r) {
    engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {0});
    q.seq = 0;
    r.group->Submit(r.rank, std::move(q));
    Completion last = r.session->WaitCompletion(kChain - 1, absl::Seconds(60));
    ASSERT_TRUE(last.status.ok()) << last.status;
    EXPECT_THAT(FloatsOf(last.inline_data), ::testing::ElementsAre(2.0f * (kChain - 1)));
    Completion bad = r.session->WaitCompletion(kChain + 5, absl::Seconds(60));
    EXPECT_EQ(bad.status.code(), absl::StatusCode::kInvalidArgument) << bad.status;
    EXPECT_THAT(bad.status.message(), HasSubstr("was expected"));
  });
  for (TestRank& r : *formed) r.session->SetOnCompletion(nullptr);
  for (const auto& order : answered) {
    ASSERT_EQ(order.size(), static_cast<size_t>(kChain + 1));
    for (int64_t i = 0; i < kChain; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
    EXPECT_EQ(order.back(), kChain + 5);
  }
}

// A transport whose every call waits for `release` (or its timeout), whatever ShutdownPeer
// says: Gloo's receive whose payload it was reading when the connection failed (Debian's
// 2022 Gloo does not wake it).
class StrandingComm : public backends::Communicator {
 public:
  StrandingComm(int rank, int size, absl::Notification* release, std::atomic<int>* entered,
                std::atomic<int>* shutdowns)
      : rank_(rank), size_(size), release_(release), entered_(entered), shutdowns_(shutdowns) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllReduce(void*, size_t, DataType, ReduceOp, absl::Duration timeout,
                         backends::AllReduceAlgorithm) override {
    return Strand(timeout);
  }
  absl::Status Broadcast(void*, size_t, int, absl::Duration timeout) override { return Strand(timeout); }
  absl::Status AllGather(const void*, void*, size_t, absl::Duration timeout) override { return Strand(timeout); }
  absl::Status AllGatherV(const void*, void*, const std::vector<size_t>&, absl::Duration timeout) override {
    return Strand(timeout);
  }
  void ShutdownPeer(int) override { shutdowns_->fetch_add(1); }
  // The group's point-to-point receive loop: waits until AbortRecv.
  absl::Status Recv(void*, size_t, const std::vector<int>&, uint32_t, int*, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&recv_aborted_), timeout);
    return absl::CancelledError("receive aborted");
  }
  void AbortRecv() override {
    absl::MutexLock lock(&mu_);
    recv_aborted_ = true;
  }

 private:
  absl::Status Strand(absl::Duration timeout) {
    entered_->fetch_add(1);
    release_->WaitForNotificationWithTimeout(timeout);
    return absl::UnavailableError("test: the stranded transport call returned");
  }
  const int rank_, size_;
  absl::Notification* release_;
  std::atomic<int>* entered_;
  std::atomic<int>* shutdowns_;
  absl::Mutex mu_;
  bool recv_aborted_ ABSL_GUARDED_BY(mu_) = false;
};

// Once this host shut its connections to a host the coordinator lost, a collective the
// transport still holds is answered with the group's failure (Group::kStrandedAfter later),
// not at the op timeout; when the transport returns, nobody is answered twice. (The CI
// failure of NetnsHosts.CutHostIsTakenAsLostByTheCoordinatorLongBeforeTheOpTimeout: a rank
// had no answer 20 s after the cut with a 60 s op timeout.)
TEST(EngineTest, ACollectiveStrandedInTheTransportAfterItsPeerWasLostIsAnsweredWithoutWaitingForIt) {
  absl::Notification release;
  std::atomic<int> entered{0}, shutdowns{0};
  TestCluster cluster(2);
  ASSERT_TRUE(cluster.backends()
                  .Register("stranded", {DeviceType::kCpu},
                            [&](backends::RendezvousStore&, const backends::ConnectParams& p)
                                -> absl::StatusOr<std::unique_ptr<backends::Communicator>> {
                              return std::make_unique<StrandingComm>(p.rank, p.size, &release, &entered, &shutdowns);
                            })
                  .ok());
  ASSERT_TRUE(cluster.backends().SetDefault(DeviceType::kCpu, "stranded").ok());
  auto formed = cluster.Form("stranded", 4, /*op_timeout=*/absl::Seconds(60));
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank>& ranks = *formed;
  absl::Mutex mu;
  std::map<int, int> answers;  // rank -> completions of seq 0
  for (TestRank& r : ranks) {
    r.session->SetOnCompletion([&mu, &answers, rank = r.rank](const Completion& c) {
      absl::MutexLock lock(&mu);
      if (c.seq == 0) ++answers[rank];
    });
    engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {1, 2});
    q.seq = r.next_seq++;
    r.group->Submit(r.rank, std::move(q));
  }
  ASSERT_TRUE(WaitFor([&] { return entered.load() == 2; }, absl::Seconds(20)));  // each host's exchange
  const absl::Time lost = absl::Now();
  cluster.coordinator().Depart("stranded", engine::Departure{2, "host1", "its lease ran out (the test)", true});
  for (int r : {0, 1}) {
    Completion c = ranks[r].session->WaitCompletion(0, absl::Seconds(20));
    EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
    EXPECT_THAT(c.status.message(), HasSubstr("ranks [2] were lost with their host (its lease ran out (the test))"));
    EXPECT_THAT(c.status.message(), HasSubstr("was answered without waiting for the transport to return"));
  }
  const absl::Duration took = absl::Now() - lost;
  EXPECT_GE(took, engine::Group::kStrandedAfter);
  EXPECT_LT(took, absl::Seconds(10));  // the op timeout is 60 s
  EXPECT_EQ(shutdowns.load(), 1);      // host 0 shut its connections to host 1 down
  release.Notify();                    // the transports return (with an error)
  for (int r : {2, 3}) {               // host 1 was the lost one: its own collective ended with the transport
    EXPECT_FALSE(ranks[r].session->WaitCompletion(0, absl::Seconds(20)).status.ok());
  }
  cluster.engine(0).Shutdown();  // joins the executors: whatever they answered is in
  cluster.engine(1).Shutdown();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(answers, (std::map<int, int>{{0, 1}, {1, 1}, {2, 1}, {3, 1}}));
}

// A group across hosts marks its backend's connections with its job's class's marks
// (EngineOptions::traffic_marks; the sidecar's --traffic_dscp and --traffic_socket_priority):
// one connection on each host, and collectives still run over them.
TEST(EngineTest, AGroupAcrossHostsMarksItsConnectionsWithItsClasssTrafficMarks) {
  const int before = TcpSocketsMarked(10 << 2, 3);
  TestCluster cluster(2, [](engine::EngineOptions& o) {
    o.traffic_marks[backends::PoolTenant::kDefault] = engine::TrafficMark{10, 3};
    o.traffic_marks[backends::PoolTenant::kBulk] = engine::TrafficMark{8, 2};
  });
  auto formed = cluster.Form("marked", 2);  // a job of the default class, a rank on each host
  ASSERT_TRUE(formed.ok()) << formed.status();
  EXPECT_TRUE(WaitFor([&] { return TcpSocketsMarked(10 << 2, 3) == before + 2; }, absl::Seconds(10)))
      << TcpSocketsMarked(10 << 2, 3);
  EXPECT_EQ(TcpSocketsMarked(8 << 2, 2), 0);  // no bulk job here
  OnEveryRank(*formed, [](TestRank& r) {
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1, 2}));
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(FloatsOf(c.inline_data), (std::vector<float>{2, 4}));
  });
}

// The host-wide scheduler of steps between hosts (engine::LinkScheduler): once a
// latency-critical job ran collectives between hosts here, a bulk job's all_reduce and
// broadcast between hosts go in pieces (the hosts agree on the smaller of their proposals),
// and a piece waits while the latency-critical job has a collective running on its host.
TEST(EngineTest, ABulkJobsTransfersBetweenHostsGoInPiecesThatWaitForALatencyCriticalJob) {
  TestCluster cluster(2, [](engine::EngineOptions& o) {
    o.link.piece_bytes = o.host_id == "host0" ? (64 << 10) : (128 << 10);
    o.link.max_wait = absl::Seconds(60);
    o.link.recent = absl::Minutes(10);
    // Gloo's ring at every size, as a large all_reduce between hosts takes it (the direct
    // exchange, at most direct_max_bytes, goes whole).
    o.algorithms.direct_max_bytes = 0;
    o.algorithms.ring_min_bytes = 0;
  });
  auto lc = cluster.Form("lc", 2, absl::Seconds(30), false, [](engine::AttachRequest& a) {
    a.job = "a";
    a.priority = 0;
  });
  ASSERT_TRUE(lc.ok()) << lc.status();
  auto bulk = cluster.Form("bulk", 2, absl::Seconds(30), false, [](engine::AttachRequest& a) {
    a.job = "b";
    a.priority = 2;
  });
  ASSERT_TRUE(bulk.ok()) << bulk.status();
  constexpr size_t kCount = 64 << 10;  // floats: 256 KiB, 4 pieces of 64 KiB
  const auto input = [](int rank) {
    std::vector<float> v(kCount);
    for (size_t i = 0; i < kCount; ++i) v[i] = static_cast<float>(rank * 1000 + static_cast<int>(i % 977));
    return v;
  };
  std::atomic<int> bulk_done{0};
  const auto all_reduce_bulk = [&](TestRank& r) {
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, input(r.rank)));
    ASSERT_TRUE(c.status.ok()) << c.status;
    const std::vector<float> got = FloatsOf(c.inline_data);
    ASSERT_EQ(got.size(), kCount);
    for (size_t i = 0; i < kCount; ++i) {
      ASSERT_EQ(got[i], static_cast<float>(1000 + 2 * static_cast<int>(i % 977))) << "element " << i;
    }
    bulk_done.fetch_add(1);
  };
  const auto counters = [&](int host) { return cluster.engine(host).link().CountersOf(2); };
  // No better class has run here yet: the transfer goes whole.
  OnEveryRank(*bulk, all_reduce_bulk);
  EXPECT_EQ(counters(0).cut, 0u);
  EXPECT_EQ(counters(1).cut, 0u);
  OnEveryRank(*lc, [](TestRank& r) { ASSERT_TRUE(r.Call(FloatRequest(CollectiveOp::kAllReduce, {1})).status.ok()); });
  // The latency-critical job's rank 0 calls its next all_reduce alone: host 0 has a
  // latency-critical collective running (its exchange waits for rank 1).
  TestRank& lc0 = (*lc)[0];
  engine::Request held = FloatRequest(CollectiveOp::kAllReduce, {1});
  held.seq = lc0.next_seq++;
  const int64_t held_seq = held.seq;
  lc0.group->Submit(0, std::move(held));
  ASSERT_TRUE(WaitFor([&] { return cluster.engine(0).link().Running(0) == 1; }, absl::Seconds(20)));
  bulk_done = 0;
  std::thread bulk_calls([&] { OnEveryRank(*bulk, all_reduce_bulk); });
  // Its first piece goes; the second waits on host 0 for the latency-critical collective.
  const bool waited = WaitFor([&] { return cluster.engine(0).link().Waiting() == 1; }, absl::Seconds(20));
  EXPECT_TRUE(waited);
  EXPECT_EQ(bulk_done.load(), 0);
  Completion c1 = (*lc)[1].Call(FloatRequest(CollectiveOp::kAllReduce, {1}));
  ASSERT_TRUE(c1.status.ok()) << c1.status;
  EXPECT_EQ(FloatsOf(c1.inline_data), (std::vector<float>{2}));
  Completion c0 = lc0.session->WaitCompletion(held_seq, absl::Seconds(30));
  ASSERT_TRUE(c0.status.ok()) << c0.status;
  bulk_calls.join();
  EXPECT_EQ(bulk_done.load(), 2);
  for (int host = 0; host < 2; ++host) {
    EXPECT_EQ(counters(host).cut, 1u) << host;
    EXPECT_EQ(counters(host).pieces, 4u) << host;  // the smaller proposal: 64 KiB
    EXPECT_EQ(cluster.engine(host).link().CountersOf(0).cut, 0u) << host;  // the better class goes whole
  }
  EXPECT_GE(counters(0).waits, 1u);
  EXPECT_GT(counters(0).waited, absl::ZeroDuration());
  // A broadcast from host 1's rank: in pieces too, every element delivered.
  OnEveryRank(*bulk, [&](TestRank& r) {
    auto q = FloatRequest(CollectiveOp::kBroadcast, r.rank == 1 ? input(7) : std::vector<float>(kCount, -1));
    q.root = 1;
    Completion c = r.Call(std::move(q));
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(FloatsOf(c.inline_data), input(7));
  });
  for (int host = 0; host < 2; ++host) EXPECT_EQ(counters(host).pieces, 8u) << host;
}

TEST(EngineTest, RankThatNeverCallsTimesOutEveryRank) {
  TestCluster cluster(2);
  auto formed = cluster.Form("timeout", 4, /*op_timeout=*/absl::Seconds(2));
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank> callers(formed->begin(), formed->begin() + 3);  // rank 3 never calls
  const absl::Time start = absl::Now();
  OnEveryRank(callers, [&](TestRank& r) {
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1}));
    EXPECT_FALSE(c.status.ok());
    if (r.host == 1) {
      EXPECT_EQ(c.status.code(), absl::StatusCode::kDeadlineExceeded) << c.status;
      EXPECT_THAT(c.status.message(), HasSubstr("all_reduce #0 of group \"timeout\" timed out on host host1 after 2s: "
                                                "local ranks [3] did not call it (local ranks [2] did)"));
    } else {
      // Host 0 learns it from the broken exchange, and asks the coordinator's ledger why.
      EXPECT_THAT(c.status.message(), HasSubstr("all_reduce #0 of group \"timeout\": the argument exchange"));
      EXPECT_THAT(c.status.message(), HasSubstr("; the coordinator's ledger: the fake ledger of group timeout"));
    }
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  // Each host wrote its flight recorder when the timeout failed the group: just after it
  // answered its ranks (the answers and the dump are made in that order, so the dump may
  // still be on its way when a rank has its answer).
  auto dumps_of = [&](int host) {
    WaitFor([&] { return !cluster.observer(host).dumps().empty(); }, absl::Seconds(10));
    return cluster.observer(host).dumps();
  };
  auto dumps = dumps_of(1);
  ASSERT_EQ(dumps.size(), 1u);
  EXPECT_THAT(dumps[0].first, HasSubstr("local ranks [3] did not call it"));
  dumps = dumps_of(0);
  ASSERT_EQ(dumps.size(), 1u);
  EXPECT_THAT(dumps[0].first, HasSubstr("all_reduce #0 failed the group"));
  ASSERT_EQ(dumps[0].second.size(), 1u);
  // Both hosts' deadlines fall at about the same moment: host 0's exchange either times out
  // itself or sees host 1 close the connection when host 1's timer fired first (seen once
  // in CI under ASan: host 0's exchange then failed UNAVAILABLE, "Connection closed by peer").
  EXPECT_THAT(dumps[0].second[0].code,
              ::testing::AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kUnavailable));
  EXPECT_EQ(dumps[0].second[0].arrivals.size(), 2u);  // the exchange failed: its own ranks' only
}

TEST(EngineTest, LedgerReportsWhatEachRankIssuedAndCompleted) {
  TestCluster cluster(2);
  auto formed = cluster.Form("ledger", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank>& ranks = *formed;
  // Ranks 0, 1 and 2 call all_reduce #0; rank 3 has not yet.
  for (int r = 0; r < 3; ++r) {
    engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {1, 2, 3});
    q.seq = ranks[r].next_seq++;
    ranks[r].group->Submit(r, std::move(q));
  }
  auto until = [&](const std::function<bool()>& done) { return WaitFor(done, absl::Seconds(20)); };
  auto rank_of = [&](const std::string& host, int rank) -> std::optional<engine::RankProgress> {
    auto report = cluster.coordinator().report("ledger", host);
    if (!report.has_value()) return std::nullopt;
    for (const engine::RankProgress& p : report->ranks) {
      if (p.rank == rank) return p;
    }
    return std::nullopt;
  };
  ASSERT_TRUE(until([&] {
    auto r2 = rank_of("host1", 2);
    auto r0 = rank_of("host0", 0);
    return r2.has_value() && r2->issued_seq == 0 && r0.has_value() && r0->issued_seq == 0;
  }));
  auto r2 = rank_of("host1", 2);
  EXPECT_EQ(r2->op, CollectiveOp::kAllReduce);
  EXPECT_EQ(r2->count, 3);
  EXPECT_EQ(r2->completed_seq, -1);
  EXPECT_EQ(rank_of("host1", 3)->issued_seq, -1);
  auto report = cluster.coordinator().report("ledger", "host1");
  EXPECT_EQ(report->state, "ready");
  EXPECT_GE(report->generation, 1);
  EXPECT_EQ(report->world_size, 4);
  // Rank 3 calls: the collective completes everywhere, and the ledgers say so.
  engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {1, 2, 3});
  q.seq = ranks[3].next_seq++;
  ranks[3].group->Submit(3, std::move(q));
  for (TestRank& r : ranks) {
    Completion c = r.session->WaitCompletion(0, absl::Seconds(30));
    ASSERT_TRUE(c.status.ok()) << c.status;
  }
  ASSERT_TRUE(until([&] {
    for (int r = 0; r < 4; ++r) {
      auto p = rank_of(r < 2 ? "host0" : "host1", r);
      if (!p.has_value() || p->completed_seq != 0 || !p->completed_status.empty()) return false;
    }
    return true;
  }));
}

TEST(EngineTest, FlightRecorderTimesEveryRankAndNamesTheStraggler) {
  TestCluster cluster(2, [](engine::EngineOptions& o) {
    o.flight_recorder_log_threshold = absl::Milliseconds(150);
    o.straggler_threshold = absl::Milliseconds(100);
  });
  auto formed = cluster.Form("recorder", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank>& ranks = *formed;
  // Three all_reduces; rank 3 (host1) calls each one 200 ms after the others.
  constexpr int kSteps = 3;
  for (int step = 0; step < kSteps; ++step) {
    for (int r = 0; r < 4; ++r) {
      // A pause the test is about: the straggler's 200 ms (skews are measured against it).
      if (r == 3) absl::SleepFor(absl::Milliseconds(200));
      engine::Request q = FloatRequest(CollectiveOp::kAllReduce, {1, 2, 3});
      q.seq = ranks[r].next_seq++;
      ranks[r].group->Submit(r, std::move(q));
    }
    for (TestRank& r : ranks) {
      Completion c = r.session->WaitCompletion(step, absl::Seconds(30));
      ASSERT_TRUE(c.status.ok()) << c.status;
    }
  }
  // The skew is observed once per collective, on rank 0's host; the straggler is counted on
  // rank 3's.
  std::vector<absl::Duration> skews = cluster.observer(0).skews();
  ASSERT_EQ(skews.size(), kSteps);
  for (absl::Duration s : skews) EXPECT_GE(s, absl::Milliseconds(190));
  EXPECT_TRUE(cluster.observer(1).skews().empty());
  EXPECT_EQ(cluster.observer(1).stragglers(), kSteps);
  EXPECT_EQ(cluster.observer(0).stragglers(), 0);
  // Each collective took over the 150 ms log threshold: each host dumped its records.
  for (int h = 0; h < 2; ++h) {
    auto dumps = cluster.observer(h).dumps();
    ASSERT_EQ(dumps.size(), kSteps) << "host " << h;
    EXPECT_THAT(dumps.back().first, HasSubstr("all_reduce #2 took "));
    EXPECT_THAT(dumps.back().first, HasSubstr("over the flight recorder's log threshold of 150ms"));
    const std::vector<FlightRecord>& records = dumps.back().second;
    ASSERT_EQ(records.size(), kSteps);
    for (int step = 0; step < kSteps; ++step) {
      const FlightRecord& f = records[step];
      EXPECT_EQ(f.seq, step);
      EXPECT_EQ(f.op, static_cast<int>(CollectiveOp::kAllReduce));
      EXPECT_EQ(f.count, 3);
      EXPECT_EQ(f.bytes, 12);
      EXPECT_EQ(f.code, absl::StatusCode::kOk);
      EXPECT_FALSE(f.algorithm.empty());
      ASSERT_EQ(f.arrivals.size(), 4u);  // every rank's, from the exchange
      EXPECT_EQ(f.last_rank, 3);
      EXPECT_GE(f.arrival_skew, absl::Milliseconds(190));
      EXPECT_GE(f.completed, f.started);
      EXPECT_EQ(f.local_ranks, (h == 0 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    }
  }
  // The published ledger carries the records with the host's own ranks' arrivals.
  std::optional<engine::GroupProgress> report;
  WaitFor(
      [&] {
        report = cluster.coordinator().report("recorder", "host1");
        return report.has_value() && report->records.size() == kSteps;
      },
      absl::Seconds(20));
  ASSERT_TRUE(report.has_value());
  ASSERT_EQ(report->records.size(), kSteps);
  ASSERT_EQ(report->records[0].arrivals.size(), 2u);
  EXPECT_EQ(report->records[0].arrivals[0].rank, 2);
  EXPECT_EQ(report->records[0].arrivals[1].rank, 3);
  EXPECT_EQ(report->records[0].last_rank, 3);
}

TEST(EngineTest, MonitoredBarrierNamesTheMissingRank) {
  TestCluster cluster(2);
  auto formed = cluster.Form("monitored", 4, absl::Seconds(2));
  ASSERT_TRUE(formed.ok()) << formed.status();
  std::vector<TestRank> callers = {(*formed)[0], (*formed)[1], (*formed)[3]};  // rank 2 is missing
  OnEveryRank(callers, [&](TestRank& r) {
    engine::Request q;
    q.op = CollectiveOp::kMonitoredBarrier;
    q.timeout_ms = 1000;
    q.wait_all_ranks = true;
    Completion c = r.Call(q);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kDeadlineExceeded) << c.status;
    EXPECT_THAT(c.status.message(), HasSubstr("rank 2 failed to pass monitored_barrier"));
  });
}

// Every local rank of a one-host group leaves, one right after the other: the group ends
// with the last one (under the same lock), and its executor never runs a collective of no
// rank (the sidecar_session fuzzer once found it reading an empty submission set).
TEST(EngineTest, EveryRankLeavingEndsTheGroupCleanly) {
  for (int round = 0; round < 20; ++round) {
    TestCluster cluster(1);
    auto formed = cluster.Form(absl::StrCat("gone", round), 3);
    ASSERT_TRUE(formed.ok()) << formed.status();
    for (int r = 0; r < 3; ++r) (*formed)[r].group->OnSessionClosed(r);
    // The cluster's teardown joins the group's executor: it must have stopped, not run.
  }
}

// A rank that leaves a group across hosts (its session ends with nothing queued) does not
// fail it: every host fails each later collective at once, naming the rank (the argument
// exchange carries an absent marker for it), and point-to-point between the other ranks,
// across hosts too, goes on.
TEST(EngineTest, RankThatLeavesIsNamedInEveryHostsCollectivesAndPointToPointGoesOn) {
  TestCluster cluster(2);
  auto formed = cluster.Form("leave", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  (*formed)[2].group->OnSessionClosed(2);
  std::vector<TestRank> rest = {(*formed)[0], (*formed)[1], (*formed)[3]};
  for (int round = 0; round < 2; ++round) {
    OnEveryRank(rest, [&](TestRank& r) {
      const absl::Time start = absl::Now();
      Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(45));
      EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
      EXPECT_THAT(c.status.message(), HasSubstr("of group \"leave\": rank 2 left the group"));
      EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "not the op timeout";
    });
  }
  // Rank 0 (host 0) and rank 3 (host 1) still exchange messages.
  OnEveryRank(rest, [&](TestRank& r) {
    if (r.rank == 1) return;
    engine::Request q = r.rank == 0 ? FloatRequest(CollectiveOp::kSend, {5, 6}) : FloatRequest(CollectiveOp::kRecv, {});
    q.count = 2;
    q.peer = r.rank == 0 ? 3 : 0;
    Completion c = r.Call(q, absl::Seconds(30));
    ASSERT_TRUE(c.status.ok()) << c.status;
    if (r.rank == 3) {
      EXPECT_THAT(FloatsOf(c.inline_data), ::testing::ElementsAre(5.0f, 6.0f));
    }
  });
  bool left = false;
  for (const auto& [job, group, rank] : cluster.coordinator().leaves()) left |= group == "leave" && rank == 2;
  EXPECT_TRUE(left);
  // Rank 3, on rank 2's host, heard of it without a request of its own
  // (collserve.v1.GroupEvent, for ranks that run NCCL themselves); the other host hears of
  // it from the coordinator (TheCoordinatorsWordThatARemoteRankLeftFailsSendsToItAtOnce).
  std::vector<std::string> events = (*formed)[3].session->WaitEvents(1, absl::Seconds(20));
  ASSERT_FALSE(events.empty());
  EXPECT_THAT(events[0], HasSubstr("rank 2 left: rank 2 left group \"leave\""));
}

// A host re-watches its generation about every second: its watches carry no membership
// (O(world_size) each) except the one right after a NOT_FOUND answer (a restarted
// coordinator adopts the generation from it); the next answered watch drops it again.
TEST(EngineTest, WatchesCarryTheMembershipOnlyAfterTheCoordinatorForgotTheGeneration) {
  TestCluster cluster(2);
  auto formed = cluster.Form("forgotten", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  auto watches_reach = [&](int n) {
    return WaitFor([&] { return cluster.coordinator().watches_started("forgotten") >= n; }, absl::Seconds(10));
  };
  ASSERT_TRUE(watches_reach(2));
  EXPECT_THAT(cluster.coordinator().watch_members("forgotten"), ::testing::ElementsAre(0, 0));
  cluster.coordinator().Forget("forgotten");
  // Both hosts watch again at once (no 1 s retry), each with every rank.
  ASSERT_TRUE(watches_reach(4));
  EXPECT_THAT(cluster.coordinator().watch_members("forgotten"), ::testing::ElementsAre(0, 0, 4, 4));
  // Answered (a rank of host 1 left): the next watches carry no membership again.
  cluster.coordinator().Depart("forgotten", engine::Departure{3, "host1", "left: the test says so", false});
  ASSERT_TRUE(watches_reach(6));
  EXPECT_THAT(cluster.coordinator().watch_members("forgotten"), ::testing::ElementsAre(0, 0, 4, 4, 0, 0));
}

TEST(EngineTest, ARemoteRankThatLeftFailsPointToPointWithItButNeverBeforeItsEarlierMessages) {
  TestCluster cluster(2);
  auto formed = cluster.Form("remote-leave", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  // Both hosts watch the generation at the coordinator once it is ready.
  WaitFor([&] { return cluster.coordinator().watches_started("remote-leave") >= 2; }, absl::Seconds(10));
  EXPECT_EQ(cluster.coordinator().watches_started("remote-leave"), 2);
  TestRank& r0 = (*formed)[0];
  // Rank 2 (host 1) sends rank 0 (host 0) a message and leaves at once; rank 0 waits for a
  // second message from it.
  engine::Request sent = FloatRequest(CollectiveOp::kSend, {3, 4});
  sent.peer = 0;
  Completion handed = (*formed)[2].Call(sent, absl::Seconds(20));
  ASSERT_TRUE(handed.status.ok()) << handed.status;
  engine::Request second = FloatRequest(CollectiveOp::kRecv, {});
  second.count = 2;
  second.peer = 2;
  second.tag = 9;
  second.seq = r0.next_seq++;
  r0.group->Submit(0, second);
  const absl::Time departed = absl::Now();
  (*formed)[2].group->OnSessionClosed(2);
  cluster.coordinator().Depart("remote-leave", engine::Departure{2, "host1", "left: the test says so", false});
  // The second message will never come: the recv fails once host 1's word arrives (in band).
  Completion c = r0.session->WaitCompletion(second.seq, absl::Seconds(20));
  EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
  EXPECT_THAT(c.status.message(), HasSubstr("rank 2 left the group (its session on host host1 ended"));
  EXPECT_LT(absl::Now() - departed, absl::Seconds(2)) << "not the op timeout";
  // The message it sent before it left is still received, whatever arrived first.
  engine::Request first = FloatRequest(CollectiveOp::kRecv, {});
  first.count = 2;
  first.peer = 2;
  Completion got = r0.Call(first, absl::Seconds(20));
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_THAT(FloatsOf(got.inline_data), ::testing::ElementsAre(3.0f, 4.0f));
  // A send to it fails at once.
  engine::Request send = FloatRequest(CollectiveOp::kSend, {1, 2});
  send.peer = 2;
  Completion s = (*formed)[1].Call(send, absl::Seconds(20));
  EXPECT_EQ(s.status.code(), absl::StatusCode::kUnavailable) << s.status;
  // Every host's next collective fails naming it, at once.
  std::vector<TestRank> rest = {(*formed)[0], (*formed)[1], (*formed)[3]};
  OnEveryRank(rest, [&](TestRank& r) {
    Completion done = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(30));
    EXPECT_EQ(done.status.code(), absl::StatusCode::kUnavailable) << done.status;
    EXPECT_THAT(done.status.message(), HasSubstr("rank 2 left the group"));
  });
  // Point-to-point among the others goes on, across hosts.
  std::vector<TestRank> pair = {rest[1], rest[2]};
  OnEveryRank(pair, [&](TestRank& r) {
    engine::Request q = r.rank == 1 ? FloatRequest(CollectiveOp::kSend, {5, 6}) : FloatRequest(CollectiveOp::kRecv, {});
    q.count = 2;
    q.peer = r.rank == 1 ? 3 : 1;
    Completion done = r.Call(q, absl::Seconds(30));
    ASSERT_TRUE(done.status.ok()) << done.status;
  });
}

// Rank 2 (host 1) leaves and host 0 hears it in band; then host 0's group fails for another
// reason (here a request out of sequence). A recv from rank 2 or a collective issued after
// that names rank 2's leave (why they could never complete), not the later failure; a recv
// from rank 3 gets the failure. (LeaveTest's two-host run met this order when telling a host
// of a departure found the host gone, and the group failed with that.)
TEST(EngineTest, AfterTheGroupFailedWhatNeededARankThatLeftNamesItsLeave) {
  TestCluster cluster(2);
  auto formed = cluster.Form("leave-then-fail", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  TestRank& r0 = (*formed)[0];
  (*formed)[2].group->OnSessionClosed(2);
  // Host 0 heard it once a send to rank 2 fails naming host 1's word.
  ASSERT_TRUE(WaitFor(
      [&] {
        engine::Request send = FloatRequest(CollectiveOp::kSend, {1});
        send.peer = 2;
        Completion c = r0.Call(send, absl::Seconds(20));
        return absl::StrContains(c.status.message(), "its session on host host1 ended");
      },
      absl::Seconds(20)));
  TestRank& r1 = (*formed)[1];
  r1.next_seq += 5;  // out of sequence: host 0's group fails
  Completion wrong = r1.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(20));
  ASSERT_THAT(std::string(wrong.status.message()), HasSubstr("but seq 0 was expected"));
  engine::Request from2 = FloatRequest(CollectiveOp::kRecv, {});
  from2.peer = 2;
  Completion c = r0.Call(from2, absl::Seconds(20));
  EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
  EXPECT_THAT(std::string(c.status.message()),
              HasSubstr("recv on rank 0 from rank 2 (tag 0) cannot complete: rank 2 left the group"));
  Completion ar = r0.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(20));
  EXPECT_EQ(ar.status.code(), absl::StatusCode::kUnavailable) << ar.status;
  EXPECT_THAT(std::string(ar.status.message()), HasSubstr("all_reduce of group \"leave-then-fail\": rank 2 left the group"));
  engine::Request from3 = FloatRequest(CollectiveOp::kRecv, {});
  from3.peer = 3;
  Completion c3 = r0.Call(from3, absl::Seconds(20));
  EXPECT_EQ(c3.status.code(), absl::StatusCode::kInvalidArgument) << c3.status;
  EXPECT_THAT(std::string(c3.status.message()), HasSubstr("but seq 0 was expected"));
}

TEST(EngineTest, TheCoordinatorsWordThatARemoteRankLeftFailsSendsToItAtOnce) {
  TestCluster cluster(2);
  auto formed = cluster.Form("remote-word", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  cluster.coordinator().Depart("remote-word", engine::Departure{2, "host1", "left: the test says so", false});
  engine::Request send = FloatRequest(CollectiveOp::kSend, {1, 2});
  send.peer = 2;
  Completion s = (*formed)[1].Call(send, absl::Seconds(20));
  EXPECT_EQ(s.status.code(), absl::StatusCode::kUnavailable) << s.status;
  EXPECT_THAT(s.status.message(), HasSubstr("rank 2 left group \"remote-word\" (the coordinator: left: the test says so)"));
  // Host 0's ranks are told at once (collserve.v1.GroupEvent).
  for (int r : {0, 1}) {
    std::vector<std::string> events = (*formed)[r].session->WaitEvents(1, absl::Seconds(20));
    ASSERT_FALSE(events.empty()) << "rank " << r;
    EXPECT_THAT(events[0], HasSubstr("rank 2 left: ")) << "rank " << r;
  }
  // Collectives go on until its own host says it left (its session is still attached here).
  std::vector<TestRank> all = *formed;
  OnEveryRank(all, [&](TestRank& r) {
    Completion done = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(30));
    ASSERT_TRUE(done.status.ok()) << done.status;
    EXPECT_THAT(FloatsOf(done.inline_data), ::testing::ElementsAre(4.0f));
  });
}

TEST(EngineTest, AHostTheCoordinatorLostEndsTheGenerationAndNoCollectiveWaitsForIt) {
  TestCluster cluster(2);
  auto formed = cluster.Form("host-lost", 2, /*op_timeout=*/absl::Seconds(60));
  ASSERT_TRUE(formed.ok()) << formed.status();
  TestRank& r0 = (*formed)[0];
  // Rank 0's all_reduce waits in the backend for host 1, whose rank never calls (as if its
  // link were cut: its connections stay open and silent).
  engine::Request ar = FloatRequest(CollectiveOp::kAllReduce, {1});
  ar.seq = r0.next_seq++;
  r0.group->Submit(0, ar);
  // A pause, not an ordering: time for the all_reduce to reach its exchange with host 1,
  // so that the loss meets it in flight (a loss before it fails it the same way, sooner).
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time lost = absl::Now();
  cluster.coordinator().Depart(
      "host-lost", engine::Departure{1, "host1", "lost with host host1: its sidecar stopped renewing its lease", true});
  Completion c = r0.session->WaitCompletion(ar.seq, absl::Seconds(90));
  EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
  EXPECT_THAT(c.status.message(), HasSubstr("generation 1 of group \"host-lost\" is over (BROKEN at the coordinator): "
                                             "ranks [1] were lost with their host"));
  EXPECT_LT(absl::Now() - lost, absl::Seconds(5)) << "waited for the op timeout";
  // Later requests get the same failure.
  Completion later = r0.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(10));
  EXPECT_THAT(later.status.message(), HasSubstr("is over"));
  // Rank 0 was told as soon as the generation ended (collserve.v1.GroupEvent).
  std::vector<std::string> events = r0.session->WaitEvents(1, absl::Seconds(5));
  ASSERT_FALSE(events.empty());
  EXPECT_THAT(events.back(), HasSubstr("failed: generation 1 of group \"host-lost\" is over"));
}

// The coordinator's word that the generation is over (SUPERSEDED here; ENDED, when it
// forgot a group whose hosts all lapsed, takes the same path) fails the collective waiting in
// the backend for the other host at once, not at the op timeout.
TEST(EngineTest, AGenerationTheCoordinatorEndedFailsTheCollectiveInFlightAtOnce) {
  TestCluster cluster(2);
  auto formed = cluster.Form("ended", 2, /*op_timeout=*/absl::Seconds(60));
  ASSERT_TRUE(formed.ok()) << formed.status();
  TestRank& r0 = (*formed)[0];
  engine::Request ar = FloatRequest(CollectiveOp::kAllReduce, {1});
  ar.seq = r0.next_seq++;
  r0.group->Submit(0, ar);  // host 1's rank never calls: host 0 waits in the backend
  // A pause, not an ordering: time for the all_reduce to reach the backend (an end before
  // it fails it the same way, sooner).
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time ended = absl::Now();
  cluster.coordinator().Supersede("ended", "host0");  // host 1 never hears it: it stays connected
  Completion c = r0.session->WaitCompletion(ar.seq, absl::Seconds(90));
  EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
  EXPECT_THAT(c.status.message(), HasSubstr("generation 1 of group \"ended\" is over (SUPERSEDED at the coordinator"));
  EXPECT_LT(absl::Now() - ended, absl::Seconds(5)) << "waited for the op timeout";
}

// Re-forming a name in place (AttachRequest::generation): the coordinator's word that a
// later generation began ends the running one on every host at once; the ranks attach to
// the next generation while the old one is still on their hosts (retired, apart, until its
// sessions end), and an attach to an earlier generation than the host runs is refused.
TEST(EngineTest, TheNextGenerationOfAGroupRetiresTheEarlierOneOnEachHost) {
  TestCluster cluster(2);
  auto formed = cluster.Form("reform", 2, /*op_timeout=*/absl::Seconds(60));
  ASSERT_TRUE(formed.ok()) << formed.status();
  OnEveryRank(*formed, [](TestRank& r) {
    EXPECT_TRUE(r.Call(FloatRequest(CollectiveOp::kAllReduce, {1})).status.ok());
  });
  ASSERT_TRUE(WaitFor([&] { return cluster.coordinator().watches_started("reform") >= 2; }, absl::Seconds(10)));
  cluster.coordinator().Supersede("reform");
  for (TestRank& r : *formed) {
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(10));
    EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
    EXPECT_THAT(c.status.message(), HasSubstr("generation 1 of group \"reform\" is over (SUPERSEDED at the "
                                               "coordinator: a later generation of the group formed or forms there)"));
  }
  // Generation 2, while generation 1's sessions are still open.
  std::vector<TestRank> next(2);
  for (int r = 0; r < 2; ++r) {
    next[r].rank = r;
    next[r].host = r;
    next[r].session = std::make_shared<RecordingSession>();
    engine::AttachRequest a;
    a.job = "test";
    a.group = "reform";
    a.rank = r;
    a.world_size = 2;
    a.init_timeout = absl::Seconds(30);
    a.generation = 2;
    auto g = cluster.engine(r).Attach(a, next[r].session);
    ASSERT_TRUE(g.ok()) << g.status();
    next[r].group = *g;
    EXPECT_NE(next[r].group, (*formed)[r].group);
  }
  for (TestRank& t : next) {
    auto attached = t.session->WaitAttached(absl::Seconds(60));
    ASSERT_TRUE(attached.ok()) << attached.status();
    EXPECT_EQ(attached->generation, 2);
  }
  OnEveryRank(next, [](TestRank& r) {
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {float(r.rank + 1)}));
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(FloatsOf(c.inline_data), std::vector<float>({3}));
  });
  EXPECT_EQ(cluster.engine(0).GetStats().groups, 2);  // the retired one lives on for its session
  engine::AttachRequest stale;
  stale.job = "test";
  stale.group = "reform";
  stale.rank = 0;
  stale.world_size = 2;
  stale.generation = 1;
  auto refused = cluster.engine(0).Attach(stale, std::make_shared<RecordingSession>());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("generation 1 of group \"reform\" is over on host host0"));
  stale.generation = -1;
  EXPECT_EQ(cluster.engine(0).Attach(stale, std::make_shared<RecordingSession>()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Generation 1's sessions end: the retired groups go; generation 2 runs on.
  for (TestRank& r : *formed) r.group->OnSessionClosed(r.rank);
  WaitFor([&] { return cluster.engine(0).GetStats().groups == 1; }, absl::Seconds(10));
  EXPECT_EQ(cluster.engine(0).GetStats().groups, 1);
  EXPECT_EQ(cluster.engine(1).GetStats().groups, 1);
  OnEveryRank(next, [](TestRank& r) {
    EXPECT_TRUE(r.Call(FloatRequest(CollectiveOp::kAllReduce, {1})).status.ok());
  });
}

TEST(EngineTest, CoordinatorCallsCarryTheAttachingRanksCredentials) {
  TestCluster cluster(2);
  auto formed = cluster.Form("credentials", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  // Each rank's join carries its own credential; the backend's rendezvous store (one per
  // host, for the Gloo connect) the credential of the host's first attached rank.
  std::vector<std::string> seen = cluster.coordinator().credentials();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(std::count(seen.begin(), seen.end(), absl::StrCat("credential of rank ", r)), r % 2 == 0 ? 2 : 1)
        << "rank " << r;
  }
  EXPECT_EQ(seen.size(), 6u);
  // A leave carries the group's credential on that host.
  (*formed)[3].group->OnSessionClosed(3);
  seen = cluster.coordinator().credentials();
  ASSERT_EQ(seen.size(), 7u);
  EXPECT_EQ(seen.back(), "credential of rank 2");
}

TEST(EngineTest, HostThatGoesAwayFailsTheOtherHost) {
  TestCluster cluster(2);
  auto formed = cluster.Form("host", 4);
  ASSERT_TRUE(formed.ok()) << formed.status();
  cluster.engine(1).Shutdown();
  std::vector<TestRank> host0 = {(*formed)[0], (*formed)[1]};
  const absl::Time start = absl::Now();
  OnEveryRank(host0, [&](TestRank& r) {
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(45));
    EXPECT_FALSE(c.status.ok());
    EXPECT_NE(c.status.code(), absl::StatusCode::kDeadlineExceeded) << "failed by the test's wait: " << c.status;
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  // The backend's failure is counted against the group's only other host.
  EXPECT_EQ(cluster.observer(0).backend_errors(), std::vector<std::string>{"host1"});
}

TEST(EngineTest, ABackendErrorAmongSeveralHostsOnOneAddressBlamesNoHost) {
  // Three hosts that all advertise 127.0.0.1: a Gloo error's "[127.0.0.1]:<port>" cannot
  // tell them apart, so the survivors count it as "unknown" rather than guess.
  TestCluster cluster(3);
  auto formed = cluster.Form("three", 3);
  ASSERT_TRUE(formed.ok()) << formed.status();
  cluster.engine(2).Shutdown();
  std::vector<TestRank> survivors = {(*formed)[0], (*formed)[1]};
  OnEveryRank(survivors, [&](TestRank& r) {
    Completion c = r.Call(FloatRequest(CollectiveOp::kAllReduce, {1}), absl::Seconds(45));
    EXPECT_FALSE(c.status.ok());
  });
  for (int h = 0; h < 2; ++h) {
    for (const std::string& blamed : cluster.observer(h).backend_errors()) EXPECT_EQ(blamed, "unknown") << h;
  }
  EXPECT_FALSE(cluster.observer(0).backend_errors().empty() && cluster.observer(1).backend_errors().empty());
}

TEST(EngineTest, AttachErrors) {
  TestCluster cluster(1);
  engine::AttachRequest a;
  a.group = "g";
  a.rank = 2;
  a.world_size = 2;
  EXPECT_EQ(cluster.engine(0).Attach(a, std::make_shared<RecordingSession>()).status().code(),
            absl::StatusCode::kInvalidArgument);
  a.rank = 0;
  a.backend = "nosuch";
  auto unknown = cluster.engine(0).Attach(a, std::make_shared<RecordingSession>());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.status().message(), HasSubstr("gloo"));
  a.backend = "";
  a.init_timeout = absl::Seconds(1);
  auto session = std::make_shared<RecordingSession>();
  ASSERT_TRUE(cluster.engine(0).Attach(a, session).ok());
  EXPECT_EQ(cluster.engine(0).Attach(a, std::make_shared<RecordingSession>()).status().code(),
            absl::StatusCode::kAlreadyExists);
  // rank 1 never comes: the rendezvous times out and closes the session
  auto attached = session->WaitAttached(absl::Seconds(20));
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kDeadlineExceeded) << attached.status();
  EXPECT_THAT(attached.status().message(), HasSubstr("missing ranks [1]"));
}

TEST(BackendRegistryTest, ResolvesByNameAndDeviceType) {
  backends::BackendRegistry registry;
  ASSERT_TRUE(backends::AddBuiltinBackends(registry).ok());
  EXPECT_EQ(*registry.Resolve("", DeviceType::kCpu), "gloo");
  EXPECT_EQ(*registry.Resolve("gloo", DeviceType::kCpu), "gloo");
  EXPECT_EQ(registry.Resolve("gloo", DeviceType::kCuda).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Resolve("nosuch", DeviceType::kCpu).status().code(), absl::StatusCode::kNotFound);
  const std::vector<std::string> names = registry.Names();
  if (std::find(names.begin(), names.end(), "mpi") != names.end()) {
    // Built with MPI: it serves CPU tensors, and a sidecar outside an MPI world says so.
    EXPECT_EQ(*registry.Resolve("mpi", DeviceType::kCpu), "mpi");
    EXPECT_EQ(registry.Resolve("mpi", DeviceType::kCuda).status().code(), absl::StatusCode::kInvalidArgument);
    InMemoryRendezvousStore store;
    backends::ConnectParams params;
    params.size = 2;
    auto comm = registry.Connect("mpi", store, params);
    EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
    EXPECT_THAT(std::string(comm.status().message()), HasSubstr("mpirun or srun"));
  } else {
    EXPECT_EQ(registry.Resolve("mpi", DeviceType::kCpu).status().code(), absl::StatusCode::kNotFound);
  }
  const bool nccl = std::find(names.begin(), names.end(), "nccl") != names.end();
  if (nccl) {
    EXPECT_EQ(*registry.Resolve("", DeviceType::kCuda), "nccl");
  } else {
    EXPECT_EQ(registry.Resolve("", DeviceType::kCuda).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(registry.Register("gloo", {DeviceType::kCpu}, [](backends::RendezvousStore&,
                                                            const backends::ConnectParams&) {
              return absl::StatusOr<std::unique_ptr<backends::Communicator>>(absl::UnimplementedError(""));
            }).code(),
            absl::StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace collserve::testing
