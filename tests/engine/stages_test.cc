// The engine's data-plane stages (engine/stages.h), each on its own: no group, executor,
// backend or clock. gather's verdict at a deadline, agree's arrival checks and disagreement
// errors, plan's data path, complete's held owner, and the per-job stage counters.
#include "engine/stages.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace collserve::engine {
namespace {

Submission Sub(CollectiveOp op, absl::Time submitted, absl::Duration timeout, int64_t seq = 0) {
  Submission s;
  s.args.op = op;
  s.args.seq = seq;
  s.submitted = submitted;
  s.deadline = submitted + timeout;
  return s;
}

std::vector<RankArgs> Arrivals(const std::vector<int>& missing, int world) {
  std::vector<RankArgs> all(world);
  for (int r = 0; r < world; ++r) all[r].rank = r;
  for (int r : missing) all[r].arrived = 0;
  return all;
}

TEST(GatherStageTest, EveryLocalRankPresentRunsWithNobodyAbsent) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  Submission a = Sub(CollectiveOp::kAllReduce, t0, absl::Seconds(5)), b = Sub(CollectiveOp::kAllReduce, t0, absl::Seconds(5));
  GatherVerdict v = DecideGather(3, "g", "host-a", {{0, &a}, {1, &b}});
  EXPECT_TRUE(v.error.ok());
  EXPECT_TRUE(v.absent.empty());
}

TEST(GatherStageTest, AMissingLocalRankTimesTheCollectiveOutNamingWhoCalled) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  Submission late = Sub(CollectiveOp::kAllGather, t0 + absl::Seconds(1), absl::Seconds(5));
  Submission first = Sub(CollectiveOp::kAllGather, t0, absl::Seconds(5));
  GatherVerdict v = DecideGather(7, "train", "host-b", {{0, &late}, {1, nullptr}, {2, &first}, {3, nullptr}});
  EXPECT_EQ(v.error.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(v.error.message(),
            "all_gather #7 of group \"train\" timed out on host host-b after 5s: local ranks [1, 3] did not call it "
            "(local ranks [0, 2] did)");
}

TEST(GatherStageTest, AMonitoredBarrierGoesOnWithItsMissingRanksAbsent) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  Submission a = Sub(CollectiveOp::kMonitoredBarrier, t0, absl::Seconds(2));
  GatherVerdict v = DecideGather(0, "g", "h", {{0, &a}, {1, nullptr}, {2, nullptr}});
  EXPECT_TRUE(v.error.ok()) << v.error;
  EXPECT_EQ(v.absent, (std::vector<int>{1, 2}));
  // A monitored_barrier beside another op (ranks out of step): the timeout, not a barrier.
  Submission b = Sub(CollectiveOp::kBarrier, t0, absl::Seconds(2));
  EXPECT_EQ(DecideGather(0, "g", "h", {{0, &a}, {1, &b}, {2, nullptr}}).error.code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(AgreeStageTest, EveryRankArrivedRuns) {
  Request args;
  args.op = CollectiveOp::kAllReduce;
  EXPECT_EQ(CheckArrivals(0, "g", args, Arrivals({}, 4)).kind, Agreement::Kind::kRun);
}

TEST(AgreeStageTest, RanksThatLeftFailTheCollectiveButNotTheGroup) {
  Request args;
  args.op = CollectiveOp::kBroadcast;
  Agreement a = CheckArrivals(12, "g", args, Arrivals({1, 3}, 4));
  EXPECT_EQ(a.kind, Agreement::Kind::kRanksLeft);
  EXPECT_EQ(a.error.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(a.error.message(),
            "broadcast #12 of group \"g\": ranks 1, 3 left the group (a session ended: destroyed the group, exited or "
            "died); collectives need every rank");
}

TEST(AgreeStageTest, AMonitoredBarrierNamesItsFirstMissingRankOrAllOfThem) {
  Request args;
  args.op = CollectiveOp::kMonitoredBarrier;
  args.timeout_ms = 1500;
  Agreement first = CheckArrivals(2, "g", args, Arrivals({2, 5}, 6));
  EXPECT_EQ(first.kind, Agreement::Kind::kBarrierMissed);
  EXPECT_EQ(first.error.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(first.error.message(), "monitored_barrier #2 of group \"g\": rank 2 failed to pass monitored_barrier within 1.5s");
  args.wait_all_ranks = true;
  EXPECT_EQ(CheckArrivals(2, "g", args, Arrivals({2, 5}, 6)).error.message(),
            "monitored_barrier #2 of group \"g\": ranks 2, 5 failed to pass monitored_barrier within 1.5s");
}

TEST(AgreeStageTest, ADisagreementIsInvalidArgumentAndAQuotaKeepsItsCode) {
  absl::Status plain = DisagreementError(4, "g", CollectiveOp::kAllReduce, "rank 1 count 3, others 4", absl::OkStatus());
  EXPECT_EQ(plain.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plain.message(), "all_reduce #4 of group \"g\": ranks disagree: rank 1 count 3, others 4");
  absl::Status own = DisagreementError(4, "g", CollectiveOp::kAllReduce, "rank 1 is invalid",
                                       absl::InvalidArgumentError("dtype 99"));
  EXPECT_EQ(own.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(own.message().find("; this rank's request: dtype 99"), std::string::npos) << own;
  absl::Status quota = DisagreementError(4, "g", CollectiveOp::kAllReduce, "rank 0 was refused",
                                         absl::ResourceExhaustedError("max_in_flight 8"));
  EXPECT_EQ(quota.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(quota.message().find("max_in_flight 8"), std::string::npos) << quota;
}

TEST(PlanStageTest, TheDataPathFollowsTheTensorsAndTheHosts) {
  RankArgs host, device;
  device.device = 1;
  EXPECT_EQ(ChooseDataPath(device, true, true), DataPath::kDevice);
  EXPECT_EQ(ChooseDataPath(device, false, false), DataPath::kDevice);
  EXPECT_EQ(ChooseDataPath(host, true, true), DataPath::kFused);
  EXPECT_EQ(ChooseDataPath(host, false, true), DataPath::kHost);  // one host: nothing was fused
  EXPECT_EQ(ChooseDataPath(host, true, false), DataPath::kHost);
  RankArgs record;  // collserve.v1.Collective.in_rank: the ranks run NCCL themselves
  record.device = 2;
  EXPECT_EQ(ChooseDataPath(record, true, true), DataPath::kInRank);
  EXPECT_EQ(ChooseDataPath(record, false, false), DataPath::kInRank);
}

// A record of a collective a rank runs with NCCL itself (COLLSERVE_CUDA_PATH=nccl) names no
// memory and is only for collectives with tensors; its arguments are checked as the op's,
// and it disagrees with the same op through the sidecar.
TEST(AgreeStageTest, InRankRecordsAreCheckedAsTheirOpAndNameNoMemory) {
  Request r;
  r.op = CollectiveOp::kAllGather;
  r.dtype = static_cast<int>(DataType::kFloat32);
  r.count = 2;
  r.output_count = 4;
  r.output_splits = {2, 2};
  r.in_rank = true;
  EXPECT_TRUE(ValidateRequest(r, 0, 2).ok()) << ValidateRequest(r, 0, 2);
  EXPECT_EQ(ArgsOf(0, r, true).device, 2);
  Request split = r;
  split.output_splits = {2, 3};  // the op's own checks still hold
  EXPECT_EQ(ValidateRequest(split, 0, 2).code(), absl::StatusCode::kInvalidArgument);
  for (int which = 0; which < 4; ++which) {
    Request named = r;
    if (which == 0) named.buffer.inline_data = "abcdefgh";
    if (which == 1) named.output.segment = "/collserve-x";
    if (which == 2) named.buffer.cuda_ipc_handle = std::string(64, 'h');
    if (which == 3) named.cuda_done_event = std::string(64, 'e');
    const absl::Status s = ValidateRequest(named, 0, 2);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << which;
    EXPECT_NE(s.message().find("names a tensor or an event"), std::string::npos) << s;
  }
  for (CollectiveOp op : {CollectiveOp::kBarrier, CollectiveOp::kSend, CollectiveOp::kRecv}) {
    Request other;
    other.op = op;
    other.dtype = r.dtype;
    other.in_rank = true;
    const absl::Status s = ValidateRequest(other, 0, 2);
    EXPECT_NE(s.message().find("in_rank records a collective with tensors"), std::string::npos) << s;
  }
  Request through_sidecar = r;
  through_sidecar.in_rank = false;
  through_sidecar.buffer.cuda_ipc_handle = std::string(64, 'h');
  const std::string d = Disagreement({ArgsOf(0, r, true), ArgsOf(1, through_sidecar, true)});
  EXPECT_NE(d.find("device=cuda on ranks [1] but device=cuda with NCCL in the rank (COLLSERVE_CUDA_PATH=nccl) on "
                   "ranks [0]"),
            std::string::npos)
      << d;
}

// The answers of records (in_rank) checked back to back wait for the next ones' while the
// executor runs records that wait for nothing, and go at anything else.
TEST(CompleteStageTest, RecordAnswersWaitOnlyForRecordsTheExecutorTakesAtOnce) {
  Submission record, host_op, bad_record, splits_record;
  record.args.in_rank = true;
  record.args.op = CollectiveOp::kAllReduce;
  host_op.args.op = CollectiveOp::kAllReduce;
  bad_record.args = record.args;
  bad_record.error = absl::InvalidArgumentError("dtype 99");
  splits_record.args = record.args;
  splits_record.args.op = CollectiveOp::kAllToAll;
  EXPECT_TRUE(RecordWaitsForNothing(record, 1, false));
  EXPECT_FALSE(RecordWaitsForNothing(record, 2, false));  // its arguments cross hosts first
  EXPECT_TRUE(RecordWaitsForNothing(record, 2, true));    // prefetched
  EXPECT_FALSE(RecordWaitsForNothing(splits_record, 2, true));  // the splits are exchanged
  EXPECT_TRUE(RecordWaitsForNothing(splits_record, 1, false));
  EXPECT_FALSE(RecordWaitsForNothing(host_op, 1, false));
  EXPECT_FALSE(RecordWaitsForNothing(bad_record, 1, false));

  const std::vector<const Submission*> next = {&record, &record};
  // Two local ranks, 3 answers queued, nothing running, both ranks' next is a record.
  EXPECT_TRUE(HoldRecordAnswers(true, true, 3, 2, false, next, 1, false));
  EXPECT_FALSE(HoldRecordAnswers(false, true, 3, 2, false, next, 1, false));  // not running records
  EXPECT_FALSE(HoldRecordAnswers(true, false, 3, 2, false, next, 1, false));  // failed, or a rank left
  EXPECT_FALSE(HoldRecordAnswers(true, true, 0, 2, false, next, 1, false));   // nothing to hold
  EXPECT_FALSE(HoldRecordAnswers(true, true, 2 * kMaxHeldAnswersPerRank, 2, false, next, 1, false));
  EXPECT_TRUE(HoldRecordAnswers(true, true, 2 * kMaxHeldAnswersPerRank - 1, 2, false, next, 1, false));
  EXPECT_TRUE(HoldRecordAnswers(true, true, 3, 2, true, {}, 1, false));  // the executor runs one now
  EXPECT_FALSE(HoldRecordAnswers(true, true, 3, 2, false, {&record, nullptr}, 1, false));  // rank 1: none queued
  EXPECT_FALSE(HoldRecordAnswers(true, true, 3, 2, false, {&record, &host_op}, 1, false));
  EXPECT_FALSE(HoldRecordAnswers(true, true, 3, 2, false, {&record, &bad_record}, 1, false));
  EXPECT_FALSE(HoldRecordAnswers(true, true, 3, 2, false, {&record}, 1, false));  // not every rank's
  EXPECT_FALSE(HoldRecordAnswers(true, true, 3, 2, false, next, 2, false));  // two hosts, not prefetched
  EXPECT_TRUE(HoldRecordAnswers(true, true, 3, 2, false, next, 2, true));
}

TEST(CompleteStageTest, APeerReadResultsOwnerWaitsForItsAttachedReaders) {
  std::map<int, Submission> subs;
  for (int r = 0; r < 4; ++r) {
    subs[r].args.seq = 10 + r;
    subs[r].peer_rank = r == 0 ? -1 : 0;  // ranks 1..3 read rank 0's result
  }
  auto attached = [](int rank) { return rank != 2; };  // rank 2 left meanwhile
  CompletionPlan plan = PlanCompletion(subs, true, attached);
  EXPECT_EQ(plan.owner, 0);
  EXPECT_EQ(plan.readers, (std::map<int, int64_t>{{1, 11}, {3, 13}}));
  // Failed: everyone is answered at once.
  EXPECT_EQ(PlanCompletion(subs, false, attached).owner, -1);
  // Every reader gone: the owner is answered at once.
  EXPECT_EQ(PlanCompletion(subs, true, [](int rank) { return rank == 0; }).owner, -1);
  // No peer reads.
  for (auto& [rank, sub] : subs) sub.peer_rank = -1;
  EXPECT_EQ(PlanCompletion(subs, true, attached).owner, -1);
}

TEST(JobStageTableTest, CountsEachJobsStagesAndBoundsItsNames) {
  JobStageTable table;
  JobStageCounters* a = table.For("a", 0);
  EXPECT_EQ(table.For("a", 2), a);  // the same job: the same counters, its class updated
  StageTimes t{absl::Microseconds(5), absl::Microseconds(7), absl::Milliseconds(2), absl::Microseconds(1)};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      for (int k = 0; k < 250; ++k) a->Add(t, 1024);
    });
  }
  for (auto& th : threads) th.join();
  std::vector<JobStageTable::Usage> usage = table.Snapshot();
  ASSERT_EQ(usage.size(), 1u);
  EXPECT_EQ(usage[0].job, "a");
  EXPECT_EQ(usage[0].priority, 2);
  EXPECT_EQ(usage[0].collectives, 1000u);
  EXPECT_EQ(usage[0].bytes, 1024000u);
  EXPECT_EQ(usage[0].times[static_cast<int>(Stage::kExecute)], absl::Seconds(2));
  EXPECT_EQ(usage[0].times[static_cast<int>(Stage::kQueued)], absl::Milliseconds(5));
  for (size_t i = 1; i < JobStageTable::kMaxJobs + 10; ++i) table.For(absl::StrCat("job-", i), 1);
  usage = table.Snapshot();
  EXPECT_EQ(usage.size(), JobStageTable::kMaxJobs + 1);  // the bound, plus "(others)"
  EXPECT_EQ(table.For("one-more", 1), table.For("and-another", 1));
  EXPECT_STREQ(StageName(Stage::kAgree), "agree");
}

}  // namespace
}  // namespace collserve::engine
