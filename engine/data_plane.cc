// A group's data plane: one collective through its stages (engine/stages.h draws them),
// on the group's executor thread. RunCollective is the sequence; each stage is a method of
// its own, and each decision a pure function of stages.h.
#include <glog/logging.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/group.h"
#include "engine/stages.h"

namespace collserve::engine {

void Group::RunCollective(int64_t seq, std::map<int, Submission>& subs, const std::vector<int>& absent,
                          const std::vector<std::vector<RankArgs>>& ahead, absl::Time queued_since) {
  Running run;
  run.seq = seq;
  run.subs = &subs;
  run.started = absl::Now();
  run.times[static_cast<int>(Stage::kQueued)] = std::max(run.started - queued_since, absl::ZeroDuration());
  for (const auto& [rank, sub] : subs) {
    run.deadline = std::min(run.deadline, sub.deadline);
    run.bytes += std::max(sub.in_bytes, sub.out_bytes);
  }
  run.timeout = std::max(run.deadline - run.started, absl::Milliseconds(1));
  const Request& args = subs.begin()->second.args;
  if (args.op == CollectiveOp::kMonitoredBarrier) {
    // Hosts whose ranks are all present start the exchange early; those missing a rank
    // join at their deadline. Give them one more barrier timeout to arrive.
    run.timeout += args.timeout_ms > 0 ? absl::Milliseconds(args.timeout_ms) : params_.op_timeout;
  }
  absl::Time mark = run.started;
  auto lap = [&](Stage stage) {
    const absl::Time now = absl::Now();
    run.times[static_cast<int>(stage)] += now - mark;
    mark = now;
  };
  // Between hosts: better classes' collectives go first on this host's link
  // (LinkScheduler), from the argument exchange to the end of the data step.
  // A record whose arguments were prefetched sends nothing between hosts: no turn to wait for.
  const bool sends_nothing = args.in_rank && !prefetched_.empty() && !NeedsSplits(args.op);
  LinkScheduler::Active on_link;
  if (env_.link != nullptr && topology_.num_hosts > 1 && !sends_nothing) on_link = env_.link->Begin(params_.priority);
  if (AgreeStage(run, absent, ahead)) {
    lap(Stage::kAgree);
    const char* algorithm = "local";
    const absl::Status status = ExecuteStage(run, &algorithm);
    on_link.End();
    lap(Stage::kExecute);
    CompleteStage(run, status, algorithm);
    lap(Stage::kComplete);
  } else {
    lap(Stage::kAgree);  // answered there (or the group failed)
  }
  if (env_.job_stages != nullptr) env_.job_stages->Add(run.times, run.bytes);
}

void Group::AnswerAll(Running& run, const absl::Status& status, bool fails_group) {
  AnswerLock lock(this);
  // Recorded first, so that a rank that has its answer finds it in the ledger.
  RecordCompletedLocked(run.seq, *run.subs, status, run.agreed ? &run.all : nullptr, "", run.started, fails_group);
  if (!running_answered_) {
    for (auto& [rank, sub] : *run.subs) AnswerLocked(std::move(sub), status);
  }
  if (fails_group) FailLocked(status);
}

bool Group::AgreeStage(Running& run, const std::vector<int>& absent, const std::vector<std::vector<RankArgs>>& ahead) {
  std::map<int, Submission>& subs = *run.subs;
  const Request& args = subs.begin()->second.args;
  std::vector<RankArgs> mine;
  for (const auto& [rank, sub] : subs) mine.push_back(ArgsOfSubmission(rank, sub));
  for (int rank : absent) {
    RankArgs a = ArgsOf(rank, args, true);
    a.arrived = 0;
    mine.push_back(a);
  }
  const bool several_hosts = topology_.num_hosts > 1;
  absl::StatusOr<std::vector<RankArgs>> exchanged;
  if (!prefetched_.empty()) {
    // An earlier exchange carried every rank's arguments of this collective.
    exchanged = std::move(prefetched_.front());
    prefetched_.pop_front();
    for (RankArgs& a : mine) {
      a.piece_bytes = (*exchanged)[a.rank].piece_bytes;  // the host's proposal when it was sent
      if (std::memcmp(&a, &(*exchanged)[a.rank], sizeof a) != 0) {
        exchanged = absl::InternalError(absl::StrCat("rank ", a.rank, "'s arguments changed after they were sent"));
        break;
      }
    }
  } else {
    // A small all_reduce's partial result rides with the arguments (Hierarchical::Fused).
    if (several_hosts) {
      fused_partial_.assign(Hierarchical::kFusedBytes, 0);
      algorithms_->ReducePartial(subs, fused_partial_.data());
    }
    exchanged = ExchangeArgs(std::move(mine), ahead, fused_partial_.data(), &run.stride, run.timeout);
  }
  if (!exchanged.ok()) {
    AnswerAll(run, ExchangeError(run, exchanged.status()), /*fails_group=*/true);
    return false;
  }
  run.all = std::move(*exchanged);
  run.agreed = true;
  std::string disagreement = Disagreement(run.all);
  if (disagreement.empty()) {
    // The same op with the same arguments called from different places: a rank skipped or
    // added a collective (no signature check sees it).
    auto sites = CallSiteDisagreement(run.all);
    if (!sites.empty()) disagreement = DescribeCallSites(sites, subs, run.timeout);
  }
  if (disagreement.empty()) {
    const Agreement arrivals = CheckArrivals(run.seq, params_.name, args, run.all);
    if (arrivals.kind != Agreement::Kind::kRun) {
      // Ranks that left: nothing moved, point-to-point goes on. A monitored_barrier's
      // missing ranks: the group fails.
      AnswerAll(run, arrivals.error, /*fails_group=*/arrivals.kind == Agreement::Kind::kBarrierMissed);
      return false;
    }
  }
  if (disagreement.empty() && NeedsSplits(args.op)) {
    auto exchanged_splits = ExchangeSplits(subs, run.timeout);
    if (!exchanged_splits.ok()) {
      AnswerAll(run, exchanged_splits.status(), /*fails_group=*/true);
      return false;
    }
    run.splits = std::move(*exchanged_splits);
    disagreement = SizeDisagreement(run.all, run.splits);
  }
  if (disagreement.empty()) return true;
  AnswerLock lock(this);
  RecordCompletedLocked(run.seq, subs, absl::InvalidArgumentError(absl::StrCat("ranks disagree: ", disagreement)),
                        &run.all, "", run.started, /*fails_group=*/false);
  const CollectiveOp op = args.op;  // `args` is the first submission's, answered (moved) first
  for (auto& [rank, sub] : subs) {
    if (running_answered_) break;
    absl::Status error = DisagreementError(run.seq, params_.name, op, disagreement, sub.error);
    AnswerLocked(std::move(sub), std::move(error));
  }
  return false;  // nothing moved: the group stays usable
}

absl::Status Group::ExchangeError(const Running& run, absl::Status s) {
  const Request& args = run.subs->begin()->second.args;
  if (args.op == CollectiveOp::kMonitoredBarrier && s.code() == absl::StatusCode::kDeadlineExceeded) {
    std::vector<int> remote_ranks;
    for (int r = 0; r < topology_.world_size; ++r) {
      if (topology_.rank_host[r] != topology_.host_index) remote_ranks.push_back(r);
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "monitored_barrier #", run.seq, " of group \"", params_.name, "\": ranks [", absl::StrJoin(remote_ranks, ", "),
        "] on other hosts did not report within ", absl::FormatDuration(run.timeout),
        " (a whole host's ranks missing, or a host down): ", s.message()));
  }
  if (env_.observer != nullptr) env_.observer->OnBackendError(BlamedHost(s.message()));
  // The exchange broke (a timeout, or a host that gave up on the collective): what the
  // coordinator's ledger says about it names who is missing, and where.
  return absl::Status(s.code(), absl::StrCat(OpName(args.op), " #", run.seq, " of group \"", params_.name,
                                             "\": the argument exchange between hosts failed: ", s.message(),
                                             DiagnosisSuffix(s, run.deadline + kExplainSlack)));
}

absl::Status Group::ExecuteStage(Running& run, const char** algorithm) {
  std::map<int, Submission>& subs = *run.subs;
  const bool several_hosts = topology_.num_hosts > 1;
  absl::Status status;
  switch (ChooseDataPath(run.all[0], several_hosts, Hierarchical::Fused(run.all[0]))) {
    case DataPath::kDevice:
      status = RunOnDevice(run.all, run.splits, subs, run.timeout, algorithm);
      break;
    case DataPath::kInRank:  // every rank agreed; each runs it with NCCL itself
      *algorithm = "rank_nccl";
      break;
    case DataPath::kFused:  // never prefetched: the stride is set
      algorithms_->FinishFused(run.all[0], subs, exchange_recv_.data() + payload_offset_, run.stride, algorithm);
      break;
    case DataPath::kHost:
      if (!several_hosts) PlanPeerReads(run.all[0], subs);
      status = AwaitFilled(subs, several_hosts, run.deadline);
      if (status.ok()) status = algorithms_->Run(run.all, run.splits, subs, run.timeout, algorithm);
      break;
  }
  if (status.ok() && run.seq == env_.fail_after_data_step_seq && params_.name == env_.fail_after_data_step_group) {
    status = absl::UnavailableError(absl::StrCat("fault injected after the data step on host ", env_.host_id,
                                                 " (--testing_fail_after_data_step)"));
  }
  if (status.ok()) return status;
  if (several_hosts && env_.observer != nullptr) env_.observer->OnBackendError(BlamedHost(status.message()));
  return absl::Status(status.code(),
                      absl::StrCat(OpName(subs.begin()->second.args.op), " #", run.seq, " of group \"", params_.name,
                                   "\": ", status.message(), FailedMeanwhileSuffix(status, run.deadline + kExplainSlack)));
}

void Group::CompleteStage(Running& run, const absl::Status& status, const char* algorithm) {
  std::map<int, Submission>& subs = *run.subs;
  AnswerLock lock(this);
  RecordCompletedLocked(run.seq, subs, status, &run.all, algorithm, run.started, /*fails_group=*/!status.ok());
  for (auto& [rank, sub] : subs) sub.algorithm = algorithm;
  const CompletionPlan plan = PlanCompletion(
      subs, status.ok(), [this](int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return locals_.count(rank) > 0; });
  if (running_answered_) {
    // Answered with the group's failure already (AnswerStrandedCollective).
    if (status.ok()) {
      LOG(WARNING) << "group \"" << params_.name << "\": collective #" << run.seq
                   << " succeeded after its ranks were told it failed with the group";
    }
    return;
  }
  for (auto& [rank, sub] : subs) {
    if (rank != plan.owner) AnswerLocked(std::move(sub), status);
  }
  if (plan.owner >= 0) {
    // The readers copy out of the owner's segment: its completion (which frees the segment
    // for the owner's next op) waits for their ReadDone, or the op deadline.
    HeldCompletion held;
    held.owner = std::move(subs.at(plan.owner));
    held.readers = plan.readers;
    held.deadline = held.owner.deadline;
    held_.push_back(std::move(held));
  }
  if (!status.ok()) FailLocked(status);
}

}  // namespace collserve::engine
