// A group's control plane toward the coordinator (the rest of Group is in group.cc, its
// data plane in executor.cc and data_plane.cc): the ledger this host keeps of its ranks'
// collectives and the flight recorder (RecordCompletedLocked, Progress), and the watch of
// the group's generation with this host's lease on it (Watch, MaybeRewatch, OnWatched),
// through which the coordinator reports ranks of other hosts that left and a generation
// that ended. What a watch's answer means is decided by DecideWatch (engine/control.h, pure
// and tested on its own); OnWatched applies it.
#include <glog/logging.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/control.h"
#include "engine/group.h"

namespace collserve::engine {

void Group::RecordCompletedLocked(int64_t seq, const std::map<int, Submission>& subs, const absl::Status& status,
                                  const std::vector<RankArgs>* all, const char* algorithm, absl::Time started,
                                  bool fails_group) {
  const absl::Time now = absl::Now();
  for (const auto& [rank, sub] : subs) {
    auto it = locals_.find(rank);
    if (it == locals_.end()) continue;
    it->second.completed_seq = seq;
    it->second.completed_at = now;
    it->second.completed_code = status.code();
  }
  ++progress_version_;
  if (status.ok() && env_.observer != nullptr) {
    const double n = params_.world_size;
    for (const auto& [rank, sub] : subs) {
      const CollectiveOp op = sub.args.op;
      const uint64_t bytes = std::max(sub.in_bytes, sub.out_bytes);
      double factor = 1;
      if (op == CollectiveOp::kAllReduce) {
        factor = 2 * (n - 1) / n;
      } else if (op == CollectiveOp::kAllGather || op == CollectiveOp::kReduceScatter ||
                 op == CollectiveOp::kAllToAll || op == CollectiveOp::kGather || op == CollectiveOp::kScatter) {
        factor = (n - 1) / n;
      }
      if (bytes > 0) env_.observer->OnCollectiveBytes(op, bytes, static_cast<double>(bytes) * factor);
    }
  }
  if (env_.flight_recorder_entries <= 0 || subs.empty()) return;

  // The flight recorder.
  const Submission& first = subs.begin()->second;
  FlightRecord r;
  r.seq = seq;
  r.op = static_cast<int>(first.args.op);
  if (first.args.op != CollectiveOp::kBarrier && first.args.op != CollectiveOp::kMonitoredBarrier) {
    r.dtype = first.args.dtype;
    r.count = first.args.count;
    if (IsValidDataType(first.args.dtype) && first.args.count >= 0 && first.args.count <= kMaxTensorBytes) {
      r.bytes = first.args.count * static_cast<int64_t>(ElementSize(static_cast<DataType>(first.args.dtype)));
    }
  }
  r.algorithm = algorithm;
  r.code = status.code();
  r.error = std::string(status.message().substr(0, FlightRecord::kMaxErrorBytes));
  r.started = started;
  r.completed = now;
  for (const auto& [rank, local] : locals_) r.local_ranks.push_back(rank);
  if (all != nullptr) {
    for (const RankArgs& a : *all) {
      if (a.arrived && a.arrived_ns > 0) r.arrivals.push_back({static_cast<int>(a.rank), absl::FromUnixNanos(a.arrived_ns)});
    }
  } else {
    for (const auto& [rank, sub] : subs) r.arrivals.push_back({rank, sub.submitted});
  }
  absl::Time earliest = now;
  if (!r.arrivals.empty()) {
    // Skew over every rank only: with the local ranks' alone it would understate it.
    const bool every_rank = static_cast<int>(r.arrivals.size()) == params_.world_size;
    const FlightRecord::Arrival* lo = &r.arrivals[0];
    const FlightRecord::Arrival* hi = &r.arrivals[0];
    for (const FlightRecord::Arrival& a : r.arrivals) {
      if (a.arrived < lo->arrived) lo = &a;
      if (a.arrived > hi->arrived) hi = &a;
    }
    earliest = lo->arrived;
    if (every_rank && formed_) {
      r.last_rank = hi->rank;
      r.arrival_skew = hi->arrived - lo->arrived;
      if (env_.observer != nullptr) {
        if (topology_.rank_host[0] == topology_.host_index) {
          env_.observer->OnArrivalSkew(params_.job, params_.name, r.arrival_skew);
        }
        if (r.arrival_skew >= env_.straggler_threshold && locals_.count(r.last_rank) > 0) {
          env_.observer->OnStraggler(params_.job, params_.name);
        }
      }
    }
  }
  const bool slow =
      env_.flight_recorder_log_threshold > absl::ZeroDuration() && now - earliest > env_.flight_recorder_log_threshold;
  flight_.push_back(std::move(r));
  while (flight_.size() > static_cast<size_t>(env_.flight_recorder_entries)) flight_.pop_front();
  if ((slow || (fails_group && !status.ok())) && env_.observer != nullptr) {
    const std::string reason =
        slow ? absl::StrCat(OpName(first.args.op), " #", seq, " took ", absl::FormatDuration(now - earliest),
                            " from its first rank's call, over the flight recorder's log threshold of ",
                            absl::FormatDuration(env_.flight_recorder_log_threshold))
             : absl::StrCat(OpName(first.args.op), " #", seq, " failed the group: ", status.message());
    env_.observer->OnFlightRecorderDump(params_.job, params_.name, formed_ ? topology_.generation : 0, reason,
                                        std::vector<FlightRecord>(flight_.begin(), flight_.end()));
  }
}

GroupProgress Group::Progress(std::string* credential, uint64_t* version) {
  AnswerLock lock(this);
  const absl::Time now = absl::Now();
  GroupProgress p;
  p.job = params_.job;
  p.group = params_.name;
  p.world_size = params_.world_size;
  p.host_id = env_.host_id;
  if (formed_) p.generation = topology_.generation;
  switch (state_) {
    case State::kJoining:
      p.state = "joining";
      break;
    case State::kConnecting:
      p.state = "connecting";
      break;
    case State::kReady:
      p.state = "ready";
      break;
    case State::kFailed:
      p.state = "failed";
      p.failure = std::string(failure_.message());
      break;
  }
  for (const auto& [rank, local] : locals_) {
    RankProgress r;
    r.rank = rank;
    r.issued_seq = local.collectives - 1;
    if (local.collectives > 0) {
      r.op = local.last_issued.op;
      r.dtype = local.last_issued.dtype;
      r.count = local.last_issued.count;
      r.root = local.last_issued.root;
      r.reduce_op = local.last_issued.reduce_op;
      r.issued_age = now - local.issued_at;
    }
    r.completed_seq = local.completed_seq;
    if (local.completed_seq >= 0) {
      r.completed_age = now - local.completed_at;
      if (local.completed_code != absl::StatusCode::kOk) r.completed_status = absl::StatusCodeToString(local.completed_code);
    }
    p.ranks.push_back(std::move(r));
  }
  const size_t published = std::min(flight_.size(), GroupProgress::kPublishedFlightRecords);
  for (auto it = flight_.end() - static_cast<std::ptrdiff_t>(published); it != flight_.end(); ++it) {
    FlightRecord r = *it;
    // Each host publishes its own ranks' arrivals (the coordinator merges them).
    std::vector<FlightRecord::Arrival> local;
    for (const FlightRecord::Arrival& a : r.arrivals) {
      if (locals_.count(a.rank) > 0) local.push_back(a);
    }
    r.arrivals = std::move(local);
    p.records.push_back(std::move(r));
  }
  *credential = credential_;
  *version = progress_version_ + (static_cast<uint64_t>(state_) << 56);
  return p;
}

void Group::Watch() {
  CoordinatorLink::WatchParams params;
  uint64_t id;
  {
    AnswerLock lock(this);
    if (stop_ || emptied_ || state_ == State::kFailed || watching_ || !formed_) return;
    watching_ = true;
    rewatch_at_ = absl::InfiniteFuture();
    id = ++watch_id_;
    params.job = params_.job;
    params.group = params_.name;
    params.generation = topology_.generation;
    params.known = watch_known_;
    params.wait = env_.lease_renewal;
    params.credential = credential_;
    for (int r = 0; watch_with_members_ && r < topology_.world_size; ++r) {
      const int h = topology_.rank_host[r];
      params.members.push_back(Member{r, topology_.host_ids[h], topology_.host_addresses[h]});
    }
  }
  std::weak_ptr<Group> weak = weak_from_this();
  auto cancel = env_.coordinator->WatchGroup(params, [weak, id](absl::StatusOr<GroupEvents> events) {
    if (auto self = weak.lock()) self->OnWatched(id, std::move(events));
  });
  std::function<void()> stopped;
  {
    AnswerLock lock(this);
    if (watching_ && watch_id_ == id) {
      // Stop ran while the call started: it found nothing to cancel, so cancel it here
      // (no watch may outlive the group's Stop, nor the sidecar's shutdown).
      (stop_ ? stopped : cancel_watch_) = std::move(cancel);
    }
  }
  if (stopped) stopped();
}

void Group::MaybeRewatch() {
  {
    AnswerLock lock(this);
    if (watching_ || rewatch_at_ > absl::Now()) return;
  }
  Watch();
}

void Group::OnWatched(uint64_t id, absl::StatusOr<GroupEvents> events) {
  std::vector<std::pair<int, std::string>> left;  // remote ranks that left: point-to-point
  bool rewatch = false;
  PointToPoint* p2p = nullptr;  // set once, with the executor; lives as long as the group
  {
    AnswerLock lock(this);
    p2p = p2p_.get();
    if (id != watch_id_) return;
    watching_ = false;
    cancel_watch_ = nullptr;
    if (stop_ || emptied_ || state_ == State::kFailed) return;
    if (!events.ok()) VLOG(1) << "watch of group " << params_.name << " ended: " << events.status();
    WatchOutcome out = DecideWatch(events, topology_, params_.name, watch_known_, watch_with_members_, remote_departed_);
    watch_known_ = out.known;
    watch_with_members_ = out.with_members;
    if (out.next == WatchOutcome::Next::kLater) rewatch_at_ = absl::Now() + absl::Seconds(1);
    rewatch = out.next == WatchOutcome::Next::kNow;
    for (const auto& [rank, why] : out.left) {
      remote_departed_.insert(rank);
      remote_left_[rank] = why;
      for (auto& [r, l] : locals_) l.session->OnGroupEvent(rank, absl::UnavailableError(why));
    }
    left = std::move(out.left);
    if (!out.failure.ok()) {
      FailLocked(out.failure);
      ++progress_version_;
      for (int h : out.shut_hosts) {
        if (comm_ == nullptr) break;
        comm_->ShutdownPeer(h);
        peers_shut_at_ = absl::Now();
      }
    }
  }
  if (p2p != nullptr) {
    for (const auto& [rank, why] : left) p2p->DepartSendsTo(rank, absl::UnavailableError(why));
  }
  if (rewatch) Watch();
}

void Group::AnswerStrandedCollective() {
  AnswerLock lock(this);
  if (state_ != State::kFailed || running_.empty() || running_answered_ ||
      absl::Now() < peers_shut_at_ + kStrandedAfter) {
    return;
  }
  LOG(WARNING) << "group \"" << params_.name << "\" (job " << params_.job << "): collective #" << running_[0].seq
               << " (" << OpName(running_[0].op) << ") of its " << running_.size()
               << " local ranks is still in the transport " << absl::FormatDuration(absl::Now() - peers_shut_at_)
               << " after the connections to the lost hosts were shut down: its ranks are answered now";
  running_answered_ = true;
  const absl::Status why(failure_.code(),
                         absl::StrCat(failure_.message(), " (collective #", running_[0].seq,
                                      " was answered without waiting for the transport to return)"));
  for (const RunningRank& r : running_) {
    Submission sub;
    sub.rank = r.rank;
    sub.session = r.session;
    sub.args.seq = r.seq;
    sub.args.op = r.op;
    sub.submitted = r.submitted;
    AnswerLocked(std::move(sub), why);
  }
}

}  // namespace collserve::engine
