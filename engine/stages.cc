#include "engine/stages.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace collserve::engine {

const char* StageName(Stage stage) {
  switch (stage) {
    case Stage::kQueued: return "queued";
    case Stage::kAgree: return "agree";
    case Stage::kExecute: return "execute";
    case Stage::kComplete: return "complete";
  }
  return "unknown";
}

RankArgs ArgsOfSubmission(int rank, const Submission& sub) {
  RankArgs a = ArgsOf(rank, sub.args, sub.error.ok());
  a.arrived_ns = absl::ToUnixNanos(sub.submitted);
  return a;
}

GatherVerdict DecideGather(int64_t seq, const std::string& group, const std::string& host_id,
                           const std::map<int, const Submission*>& fronts) {
  GatherVerdict verdict;
  std::vector<int> missing, called;
  bool monitored = true;
  const Submission* first = nullptr;
  for (const auto& [rank, front] : fronts) {
    if (front == nullptr) {
      missing.push_back(rank);
      continue;
    }
    called.push_back(rank);
    if (first == nullptr || front->submitted < first->submitted) first = front;
    if (front->args.op != CollectiveOp::kMonitoredBarrier) monitored = false;
  }
  if (missing.empty() || first == nullptr) return verdict;
  if (!monitored) {
    verdict.error = absl::DeadlineExceededError(absl::StrCat(
        OpName(first->args.op), " #", seq, " of group \"", group, "\" timed out on host ", host_id, " after ",
        absl::FormatDuration(first->deadline - first->submitted), ": local ranks [", absl::StrJoin(missing, ", "),
        "] did not call it (local ranks [", absl::StrJoin(called, ", "), "] did)"));
    return verdict;
  }
  verdict.absent = std::move(missing);
  return verdict;
}

Agreement CheckArrivals(int64_t seq, const std::string& group, const Request& args,
                        const std::vector<RankArgs>& all) {
  Agreement agreement;
  std::vector<int64_t> missing;
  for (const RankArgs& a : all) {
    if (!a.arrived) missing.push_back(a.rank);
  }
  if (missing.empty()) return agreement;
  if (args.op != CollectiveOp::kMonitoredBarrier) {
    agreement.kind = Agreement::Kind::kRanksLeft;
    agreement.error = absl::UnavailableError(absl::StrCat(
        OpName(args.op), " #", seq, " of group \"", group, "\": rank", missing.size() > 1 ? "s " : " ",
        absl::StrJoin(missing, ", "), " left the group (a session ended: destroyed the group, exited or died); ",
        "collectives need every rank"));
    return agreement;
  }
  // The first only unless wait_all_ranks (erase, not resize(1): GCC 14's -Warray-bounds
  // misreads resize's growing path here).
  if (!args.wait_all_ranks) missing.erase(missing.begin() + 1, missing.end());
  agreement.kind = Agreement::Kind::kBarrierMissed;
  agreement.error = absl::DeadlineExceededError(absl::StrCat(
      "monitored_barrier #", seq, " of group \"", group, "\": rank", missing.size() > 1 ? "s " : " ",
      absl::StrJoin(missing, ", "), " failed to pass monitored_barrier within ",
      absl::FormatDuration(absl::Milliseconds(args.timeout_ms))));
  return agreement;
}

absl::Status DisagreementError(int64_t seq, const std::string& group, CollectiveOp op,
                               const std::string& disagreement, const absl::Status& own_error) {
  std::string msg = absl::StrCat(OpName(op), " #", seq, " of group \"", group, "\": ranks disagree: ", disagreement);
  if (!own_error.ok()) absl::StrAppend(&msg, "; this rank's request: ", own_error.message());
  // A request refused by a quota keeps its code (RESOURCE_EXHAUSTED) on its own rank.
  if (own_error.code() == absl::StatusCode::kResourceExhausted) return absl::ResourceExhaustedError(msg);
  return absl::InvalidArgumentError(msg);
}

DataPath ChooseDataPath(const RankArgs& first, bool several_hosts, bool fused) {
  if (first.device == 2) return DataPath::kInRank;
  if (first.device != 0) return DataPath::kDevice;
  if (several_hosts && fused) return DataPath::kFused;
  return DataPath::kHost;
}

CompletionPlan PlanCompletion(const std::map<int, Submission>& subs, bool ok,
                              const std::function<bool(int)>& attached) {
  CompletionPlan plan;
  if (!ok) return plan;
  for (const auto& [rank, sub] : subs) {
    if (sub.peer_rank < 0) continue;
    plan.owner = sub.peer_rank;
    if (attached(rank)) plan.readers[rank] = sub.args.seq;
  }
  if (plan.readers.empty()) plan.owner = -1;  // nobody reads: the owner is answered at once
  return plan;
}

void JobStageCounters::Add(const StageTimes& times, uint64_t b) {
  collectives.fetch_add(1, std::memory_order_relaxed);
  bytes.fetch_add(b, std::memory_order_relaxed);
  for (int s = 0; s < kNumStages; ++s) {
    ns[s].fetch_add(absl::ToInt64Nanoseconds(std::max(times[s], absl::ZeroDuration())), std::memory_order_relaxed);
  }
}

JobStageCounters* JobStageTable::For(const std::string& job, int priority) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  if (it == jobs_.end()) {
    // Past the bound, every new name shares one entry.
    const std::string& name = jobs_.size() >= kMaxJobs ? std::string("(others)") : job;
    it = jobs_.try_emplace(name).first;
    if (it->second == nullptr) it->second = std::make_unique<JobStageCounters>();
    if (name != job) return it->second.get();
  }
  it->second->priority.store(priority, std::memory_order_relaxed);
  return it->second.get();
}

std::vector<JobStageTable::Usage> JobStageTable::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<Usage> out;
  out.reserve(jobs_.size());
  for (const auto& [name, c] : jobs_) {
    Usage u;
    u.job = name;
    u.priority = c->priority.load(std::memory_order_relaxed);
    u.collectives = c->collectives.load(std::memory_order_relaxed);
    u.bytes = c->bytes.load(std::memory_order_relaxed);
    for (int s = 0; s < kNumStages; ++s) u.times[s] = absl::Nanoseconds(c->ns[s].load(std::memory_order_relaxed));
    out.push_back(std::move(u));
  }
  return out;
}

bool RecordWaitsForNothing(const Submission& sub, int num_hosts, bool prefetched) {
  if (!sub.args.in_rank || !sub.error.ok()) return false;
  return num_hosts <= 1 || (prefetched && !NeedsSplits(sub.args.op));
}

bool HoldRecordAnswers(bool holding, bool group_ok, size_t queued, size_t local_ranks, bool running,
                       const std::vector<const Submission*>& fronts, int num_hosts, bool next_prefetched) {
  if (!holding || !group_ok || queued == 0 || local_ranks == 0) return false;
  if (queued >= kMaxHeldAnswersPerRank * local_ranks) return false;
  if (running) return true;
  if (fronts.size() != local_ranks) return false;
  for (const Submission* f : fronts) {
    if (f == nullptr || !RecordWaitsForNothing(*f, num_hosts, next_prefetched)) return false;
  }
  return true;
}

}  // namespace collserve::engine
