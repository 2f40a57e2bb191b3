// Group lifecycle: attach, rendezvous, submit, failure, leaving. The executor (what runs
// the collectives) is in executor.cc.
#include "engine/group.h"

#include <fcntl.h>
#include <glog/logging.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace collserve::engine {

void Complete(const Submission& sub, const absl::Status& status, EngineObserver* observer) {
  Completion c;
  c.seq = sub.args.seq;
  c.status = status;
  c.source = sub.source;
  c.algorithm = sub.algorithm;
  if (status.ok() && sub.peer_rank >= 0) {
    c.peer_rank = sub.peer_rank;
    c.peer_segment = sub.peer_segment;
    c.peer_offset = sub.peer_offset;
    c.peer_bytes = sub.peer_bytes;
    c.peer_fill_offset = sub.peer_fill_offset;
  }
  if (status.ok() && sub.inline_mode) c.inline_data = IsInPlace(sub.args.op) ? *sub.inline_in : *sub.inline_out;
  if (sub.session != nullptr) sub.session->OnCompletion(std::move(c));
  if (observer != nullptr) {
    observer->OnCompleted(sub.args.op, status,
                          sub.submitted == absl::Time() ? absl::ZeroDuration() : absl::Now() - sub.submitted,
                          std::max(sub.in_bytes, sub.out_bytes), status.ok() ? sub.algorithm : "");
  }
}

Group::Group(GroupEnv env, GroupParams params) : env_(std::move(env)), params_(std::move(params)) {}

Group::~Group() {
  Stop();
  if (executor_.joinable()) executor_.join();
}

absl::Status Group::Attach(int rank, int world_size, std::shared_ptr<Session> session, bool shared_memory,
                          const std::string& credential, bool peer_reads) {
  {
    absl::MutexLock lock(&mu_);
    if (world_size != params_.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("group \"", params_.name, "\" has world_size ",
                                                     params_.world_size, "; rank ", rank,
                                                     " asked for world_size ", world_size));
    }
    if (emptied_) return absl::AbortedError("group is being removed");
    if (state_ == State::kFailed || stop_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group \"", params_.name, "\" failed on this host and cannot take new ranks until every "
          "local rank has left: ", failure_.message()));
    }
    if (departed_.count(rank) > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " left generation ", topology_.generation, " of group \"", params_.name,
          "\" on this host; it can join again once every local rank has left (a new generation)"));
    }
    if (locals_.count(rank) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("rank ", rank, " is already attached to group \"",
                                                   params_.name, "\" on host ", env_.host_id));
    }
    LocalRank& local = locals_[rank];
    local.session = std::move(session);
    local.shared_memory = shared_memory;
    local.peer_reads = shared_memory && peer_reads;
    if (credential_.empty()) credential_ = credential;
  }
  CoordinatorLink::JoinParams join;
  join.job = params_.job;
  join.group = params_.name;
  join.world_size = params_.world_size;
  join.rank = rank;
  join.timeout = params_.init_timeout;
  join.credential = credential;
  join.generation = params_.generation;
  // The callback may run before Join returns; the canceller is stored only if the join is
  // still in flight then. It may also run after the group is gone (the session ended and
  // the emptied group was destroyed while the join was in flight: found by fuzzing the
  // sidecar's Session stream, a use after free), hence the weak reference.
  std::weak_ptr<Group> self = weak_from_this();
  std::function<void()> cancel = env_.coordinator->Join(join, [self, rank](absl::StatusOr<Membership> result) {
    if (std::shared_ptr<Group> group = self.lock()) group->OnJoined(rank, result);
  });
  bool session_gone;
  {
    absl::MutexLock lock(&mu_);
    auto it = locals_.find(rank);
    session_gone = it == locals_.end();
    if (!session_gone && !it->second.joined && state_ != State::kFailed) it->second.cancel_join = std::move(cancel);
  }
  // The session ended before the join started: withdraw it.
  if (session_gone && cancel) cancel();
  return absl::OkStatus();
}

std::unique_ptr<backends::RendezvousStore> Group::RendezvousStore() {
  std::string credential;
  {
    absl::MutexLock lock(&mu_);
    credential = credential_;
  }
  return env_.coordinator->RendezvousStoreFor(params_.job, credential);
}

void Group::OnJoined(int rank, const absl::StatusOr<Membership>& result) {
  absl::MutexLock lock(&mu_);
  auto it = locals_.find(rank);
  if (it == locals_.end()) return;  // session already gone
  it->second.cancel_join = nullptr;
  if (!result.ok()) {
    it->second.session->Close(result.status());
    locals_.erase(it);
    if (formed_) {
      // The group formed, but this rank's join failed: the group cannot run here.
      FailLocked(absl::UnavailableError(absl::StrCat("local rank ", rank, " failed to join: ",
                                                     result.status().message())));
    }
    MaybeEmptyLocked();
    return;
  }
  if (!formed_) {
    auto topology = Topology::FromMembership(*result, params_.world_size, env_.host_id);
    if (!topology.ok()) {
      FailLocked(absl::InternalError(absl::StrCat("group \"", params_.name, "\": ", topology.status().message())));
      return;
    }
    topology_ = std::move(*topology);
    formed_ = true;
    // The coordinator leases this host the generation from now on (on one host as across
    // hosts): the engine's reporter starts the watch within about a second (the executor,
    // once the backend connected, at once).
    rewatch_at_ = absl::Now();
  } else if (result->generation != topology_.generation) {
    FailLocked(absl::InternalError(absl::StrCat("rank ", rank, " joined generation ", result->generation,
                                                " but this host's ranks joined generation ", topology_.generation)));
    return;
  }
  it->second.joined = true;
  if (state_ != State::kJoining) return;
  for (int r : topology_.local_ranks) {
    if (locals_.count(r) == 0) {
      // The group formed with a rank of this host whose session ended while its join was
      // in flight: the generation cannot run. Tell the coordinator it left.
      FailLocked(absl::UnavailableError(absl::StrCat("rank ", r, " of group \"", params_.name,
                                                     "\" disconnected from host ", env_.host_id,
                                                     " during rendezvous")));
      env_.coordinator->Leave(params_.job, params_.name, r, topology_.generation, credential_);
      return;
    }
  }
  for (int r : topology_.local_ranks) {
    if (!locals_[r].joined) return;
  }
  state_ = State::kConnecting;
  p2p_ = std::make_unique<PointToPoint>(topology_, params_.op_timeout, env_.observer,
                                        [this](const absl::Status& s) { Fail(s); });
  // Remote ranks the coordinator said left before this (the watch starts at formation).
  for (const auto& [rank, why] : remote_left_) p2p_->DepartSendsTo(rank, absl::UnavailableError(why));
  // The job's share of the host's data-path threads (ThreadPool's scheduling).
  backends::PoolTenant* tenant =
      env_.pool != nullptr ? env_.pool->Tenant(params_.job, params_.priority, params_.share_weight) : nullptr;
  algorithms_ = std::make_unique<Hierarchical>(topology_, env_.pool, env_.algorithms, tenant);
  executor_ = std::thread([this] { ExecutorMain(); });
}

void Group::Submit(int rank, Request request, absl::Status refused) {
  absl::MutexLock lock(&mu_);
  auto it = locals_.find(rank);
  if (it == locals_.end()) return;
  LocalRank& local = it->second;
  Submission sub;
  sub.rank = rank;
  sub.session = local.session;
  sub.args = std::move(request);
  sub.peer_reads = local.peer_reads;
  const absl::Duration timeout = sub.args.timeout_ms > 0 ? absl::Milliseconds(sub.args.timeout_ms) : params_.op_timeout;
  sub.submitted = absl::Now();
  sub.deadline = sub.submitted + timeout;
  if (state_ == State::kFailed) {
    Complete(sub, failure_, env_.observer);
    return;
  }
  if (state_ != State::kReady) {
    Complete(sub, absl::FailedPreconditionError("collective sent before the session was attached"), env_.observer);
    return;
  }
  if (sub.args.seq != local.next_seq) {
    absl::Status s = absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " sent seq ", sub.args.seq, " but seq ", local.next_seq, " was expected"));
    Complete(sub, s, env_.observer);
    FailLocked(s);
    return;
  }
  ++local.next_seq;
  for (const std::string& name : sub.args.released_segments) local.segments.Release(name);
  sub.error = refused.ok() ? ValidateRequest(sub.args, rank, params_.world_size) : std::move(refused);
  if (sub.error.ok() && !sub.args.buffer.segment.empty() && !local.shared_memory) {
    sub.error = absl::PermissionDeniedError("this session may not use shared memory: send tensors inline");
  }
  if (sub.error.ok() && sub.args.OnDevice()) {
    sub.error = ResolveDeviceBuffers(local, sub);
  } else if (sub.error.ok()) {
    sub.error = ResolveBuffers(local.segments, sub, env_.observer);
  }
  if (sub.args.op == CollectiveOp::kSend || sub.args.op == CollectiveOp::kRecv) {
    if (!sub.error.ok()) {
      Complete(sub, sub.error, env_.observer);
      return;
    }
    p2p_->Submit(std::move(sub));
    return;
  }
  if (!collectives_failure_.ok()) {
    Complete(sub, collectives_failure_, env_.observer);  // a rank left: no collective can run
    return;
  }
  local.last_issued = sub.args;
  local.last_issued.buffer = BufferRef();  // the ledger needs the arguments, not the bytes
  local.last_issued.output = BufferRef();
  local.issued_at = sub.submitted;
  ++local.collectives;
  ++progress_version_;
  local.queue.push_back(std::move(sub));
  ++submissions_;
}

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

void Group::InFlight(int64_t* ranks, int64_t* in_flight, absl::Time* oldest, int64_t* mapped_bytes) {
  absl::MutexLock lock(&mu_);
  *ranks = static_cast<int64_t>(locals_.size());
  *in_flight = 0;
  *mapped_bytes = 0;
  for (const auto& [rank, local] : locals_) *mapped_bytes += static_cast<int64_t>(local.segments.bytes());
  if (state_ == State::kFailed) return;  // every request was answered with the failure
  for (const auto& [rank, local] : locals_) {
    // Collectives are answered in order: those after completed_seq are in flight.
    *in_flight += std::max<int64_t>(local.collectives - 1 - local.completed_seq, 0);
    if (!local.queue.empty()) *oldest = std::min(*oldest, local.queue.front().submitted);
  }
  if (running_since_ != absl::InfiniteFuture()) *oldest = std::min(*oldest, running_since_);
}

GroupProgress Group::Progress(std::string* credential, uint64_t* version) {
  absl::MutexLock lock(&mu_);
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

absl::Status Group::AddSegment(int rank, std::shared_ptr<ShmSegment> segment) {
  absl::MutexLock lock(&mu_);
  auto it = locals_.find(rank);
  if (it == locals_.end() || !it->second.shared_memory) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of group \"", params_.name,
                                                      "\" is not attached here with shared memory"));
  }
  const uint64_t bytes = segment->size();
  absl::Status added = it->second.segments.Add(std::move(segment));
  if (added.ok() && env_.observer != nullptr) env_.observer->OnSegmentRegistered(bytes);
  return added;
}

void Group::Fail(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  FailLocked(status);
}

void Group::FailLocked(const absl::Status& status) {
  if (state_ == State::kFailed) return;
  size_t pending = 0;
  for (const auto& [rank, local] : locals_) pending += local.queue.size();
  // A rank leaving an idle, attached group is how every job ends: not worth a warning.
  if (pending == 0 && attached_ && status.code() == absl::StatusCode::kUnavailable) {
    LOG(INFO) << "group \"" << params_.name << "\" (job " << params_.job << ") ended on host " << env_.host_id
              << ": " << status.message();
  } else {
    LOG(WARNING) << "group \"" << params_.name << "\" (job " << params_.job << ") failed on host "
                 << env_.host_id << " with " << pending << " collectives pending: " << status;
  }
  state_ = State::kFailed;
  failure_ = status;
  if (p2p_ != nullptr) p2p_->Fail(status);
  for (auto& [rank, local] : locals_) {
    for (const Submission& sub : local.queue) Complete(sub, status, env_.observer);
    local.queue.clear();
    // Sessions still waiting for Attached would otherwise wait for their init timeout.
    if (!attached_) local.session->Close(status);
  }
}

void Group::OnSessionClosed(int rank) {
  std::function<void()> cancel_join;
  absl::Status left;  // set when the rank left a ready group without failing it
  bool was_member = false;
  std::string credential;
  int64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    credential = credential_;
    generation = formed_ ? topology_.generation : params_.generation;
    auto it = locals_.find(rank);
    if (it == locals_.end()) return;
    // Peer reads: a reader that went reads no more; an owner that went needs no answer.
    for (HeldCompletion& h : held_) {
      h.readers.erase(rank);
      if (h.owner.rank == rank) h.readers.clear();
    }
    if (!held_.empty()) ReleaseHeldLocked(absl::Now());
    was_member = it->second.joined;
    if (!was_member) {
      // Still in rendezvous: withdraw the join; the other ranks keep waiting for a
      // replacement of this rank rather than failing.
      cancel_join = std::move(it->second.cancel_join);
      locals_.erase(it);
      MaybeEmptyLocked();
    } else if (state_ == State::kReady && !stop_ && (topology_.num_hosts == 1 || it->second.queue.empty())) {
      // Leaving is local (torch.distributed's semantics): the others' point-to-point ops
      // among themselves go on; what needs the leaver fails naming it. Every collective
      // needs every rank, so the queued and later ones fail. Across hosts only a rank with
      // no collective queued leaves this way (one queued may already be in another host's
      // lookahead); the executor then gives the argument exchange an absent marker for it,
      // so that every host fails each later collective naming it, at once.
      left = absl::UnavailableError(absl::StrCat("rank ", rank, " left group \"", params_.name,
                                                 "\" (its session on host ", env_.host_id,
                                                 " ended: it destroyed the group, exited or died)"));
      for (const Submission& sub : it->second.queue) Complete(sub, left, env_.observer);
      locals_.erase(it);
      departed_.insert(rank);
      ++submissions_;  // the executor may now have every remaining local rank's next collective
      // The last local rank gone: the group ends now, under this lock (the executor must
      // never find it ready with no local rank: it would run a collective of nobody).
      MaybeEmptyLocked();
    }
    if (!left.ok() && topology_.num_hosts == 1) {
      if (collectives_failure_.ok()) {
        collectives_failure_ =
            absl::UnavailableError(absl::StrCat(left.message(), "; collectives need every rank of the group"));
        LOG(INFO) << "group \"" << params_.name << "\" (job " << params_.job << ") on host " << env_.host_id
                  << ": " << left.message() << "; its point-to-point ops among the other ranks go on";
      }
      for (auto& [r, l] : locals_) {
        for (const Submission& sub : l.queue) Complete(sub, collectives_failure_, env_.observer);
        l.queue.clear();
      }
    }
    if (!left.ok()) {
      ++progress_version_;
    } else if (was_member) {
      // A rank that leaves a group not yet (or no longer) ready, or one across hosts with a
      // collective still queued, ends the generation.
      if (state_ != State::kFailed) {
        FailLocked(absl::UnavailableError(absl::StrCat("rank ", rank, " of group \"", params_.name,
                                                       "\" disconnected from host ", env_.host_id)));
      }
      for (const Submission& sub : it->second.queue) Complete(sub, failure_, env_.observer);
      locals_.erase(it);
    }
  }
  if (!left.ok() && p2p_ != nullptr) p2p_->Depart(rank, left);
  if (cancel_join) cancel_join();
  if (was_member) env_.coordinator->Leave(params_.job, params_.name, rank, generation, credential);
  absl::MutexLock lock(&mu_);
  MaybeEmptyLocked();
}

void Group::MaybeEmptyLocked() {
  if (!locals_.empty() || emptied_) return;
  emptied_ = true;
  state_ = State::kFailed;
  if (failure_.ok()) failure_ = absl::UnavailableError("every local rank left the group");
  // The engine destroys the group on another thread (the destructor joins the executor).
  if (env_.on_empty) env_.on_empty(this);
}

bool Group::Leaving() {
  absl::MutexLock lock(&mu_);
  return !departed_.empty() || state_ == State::kFailed || stop_ || emptied_;
}

bool Group::AwaitEmptied(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(&emptied_), deadline);
}

int64_t Group::Generation() {
  absl::MutexLock lock(&mu_);
  return formed_ ? topology_.generation : params_.generation;
}

void Group::Watch() {
  CoordinatorLink::WatchParams params;
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
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
    absl::MutexLock lock(&mu_);
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
    absl::MutexLock lock(&mu_);
    if (watching_ || rewatch_at_ > absl::Now()) return;
  }
  Watch();
}

void Group::OnWatched(uint64_t id, absl::StatusOr<GroupEvents> events) {
  std::vector<std::pair<int, absl::Status>> left;  // remote ranks that left: point-to-point
  bool rewatch = false;
  PointToPoint* p2p = nullptr;  // set once, with the executor; lives as long as the group
  {
    absl::MutexLock lock(&mu_);
    p2p = p2p_.get();
    if (id != watch_id_) return;
    watching_ = false;
    cancel_watch_ = nullptr;
    if (stop_ || emptied_ || state_ == State::kFailed) return;
    if (!events.ok() || events->generation != topology_.generation) {
      // Unreachable or restarted coordinator: try again later (the data path needs it not).
      const absl::StatusCode code = events.status().code();
      if (!events.ok()) VLOG(1) << "watch of group " << params_.name << " ended: " << events.status();
      if (code == absl::StatusCode::kNotFound && !watch_with_members_) {
        // A coordinator that restarted does not know the generation: again at once (below),
        // with the membership it can adopt the generation from.
        watch_with_members_ = true;
        rewatch = true;
      } else {
        // Cancelled: by Stop (stop_, returned above) or by a channel going away; a
        // coordinator without watches (Unimplemented) is not asked again.
        if (code != absl::StatusCode::kUnimplemented) rewatch_at_ = absl::Now() + absl::Seconds(1);
        return;
      }
    } else {
      watch_with_members_ = false;
      if (events->state != "FORMED" && events->state != "BROKEN") {
        // SUPERSEDED or ENDED: the coordinator has done with this generation.
        FailLocked(absl::UnavailableError(absl::StrCat(
            "generation ", topology_.generation, " of group \"", params_.name, "\" is over (", events->state,
            " at the coordinator: ",
            events->state == "SUPERSEDED" ? "a later generation of the group formed or forms there"
            : events->state == "DELETED"  ? "an operator deleted the group (collservectl delete-group)"
                                          : "every rank left it (or its hosts were lost)",
            "); re-form the group (reconfigure) to go on")));
        ++progress_version_;
        // The collective in flight waits in the backend for hosts that will never answer
        // for this generation (or were lost: the coordinator forgets an ended group's
        // departures): it fails now instead of at the op timeout.
        for (int h = 0; comm_ != nullptr && h < topology_.num_hosts; ++h) {
          if (h != topology_.host_index) comm_->ShutdownPeer(h);
        }
        return;
      }
      std::set<int> lost_hosts;
      std::vector<int> lost_ranks;
      std::string lost_reason;
      const auto& departures = events->departures;
      for (size_t i = static_cast<size_t>(watch_known_); i < departures.size(); ++i) {
        const Departure& d = departures[i];
        if (d.rank < 0 || d.rank >= topology_.world_size) continue;  // not of this generation
        if (d.host_lost) {
          lost_hosts.insert(topology_.rank_host[d.rank]);
          lost_ranks.push_back(d.rank);
          lost_reason = d.reason;
        } else if (topology_.local_ranks.count(d.rank) == 0 && remote_departed_.insert(d.rank).second) {
          left.emplace_back(d.rank, absl::UnavailableError(absl::StrCat("rank ", d.rank, " left group \"",
                                                                        params_.name, "\" (the coordinator: ", d.reason,
                                                                        ")")));
          remote_left_[d.rank] = std::string(left.back().second.message());
        }
      }
      watch_known_ = static_cast<int>(departures.size());
      if (!lost_ranks.empty()) {
        const bool self_lost = lost_hosts.count(topology_.host_index) != 0;
        FailLocked(absl::UnavailableError(absl::StrCat(
            "generation ", topology_.generation, " of group \"", params_.name, "\" is over (", events->state,
            " at the coordinator): ranks [", absl::StrJoin(lost_ranks, ", "), "] ",
            self_lost ? "are taken as lost with this host (" : "were lost with their host (", lost_reason,
            "); re-form the group (reconfigure) to go on")));
        ++progress_version_;
        for (int h : lost_hosts) {
          if (comm_ != nullptr && h != topology_.host_index) comm_->ShutdownPeer(h);
        }
      } else {
        rewatch = true;
      }
    }
  }
  if (p2p != nullptr) {
    for (const auto& [rank, why] : left) p2p->DepartSendsTo(rank, why);
  }
  if (rewatch) Watch();
}

void Group::Stop() {
  std::function<void()> cancel_watch;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;  // in the same section as the cancel: no watch starts after it (Watch)
    cancel_watch = std::move(cancel_watch_);
    cancel_watch_ = nullptr;
  }
  if (cancel_watch) cancel_watch();
  absl::MutexLock lock(&mu_);
  ReleaseHeldLocked(absl::InfiniteFuture());  // their data moved: they succeeded
  FailLocked(absl::UnavailableError(absl::StrCat("sidecar ", env_.host_id, " is shutting down")));
  for (auto& [rank, local] : locals_) local.session->Close(failure_);
}

absl::StatusOr<int> Group::OpenPeerSegment(int asker, int owner, const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto a = locals_.find(asker);
  if (a == locals_.end() || !a->second.peer_reads) {
    return absl::PermissionDeniedError(absl::StrCat("rank ", asker, " is not attached to group \"", params_.name,
                                                    "\" here with peer reads"));
  }
  auto o = locals_.find(owner);
  if (o == locals_.end()) {
    return absl::PermissionDeniedError(absl::StrCat("rank ", owner, " of group \"", params_.name,
                                                    "\" is not attached to this sidecar"));
  }
  std::shared_ptr<ShmSegment> segment = o->second.segments.Find(name);
  if (segment == nullptr || segment->fd() < 0) {
    return absl::NotFoundError(absl::StrCat("rank ", owner, " of group \"", params_.name, "\" has no segment \"",
                                            absl::CHexEscape(name.substr(0, 64)), "\" this sidecar can share"));
  }
  const int fd = fcntl(segment->fd(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("dup of rank ", owner, "'s segment: ", std::strerror(errno)));
  }
  return fd;
}

void Group::OnReadDone(int rank, int64_t seq) {
  absl::MutexLock lock(&mu_);
  bool found = false;
  for (HeldCompletion& h : held_) {
    auto it = h.readers.find(rank);
    if (it != h.readers.end() && it->second == seq) {
      h.readers.erase(it);
      found = true;
      break;
    }
  }
  if (found) ReleaseHeldLocked(absl::Now());
}

void Group::ExpireHeldCompletions() {
  absl::MutexLock lock(&mu_);
  if (!held_.empty()) ReleaseHeldLocked(absl::Now());
}

void Group::ReleaseHeldLocked(absl::Time now) {
  for (size_t i = 0; i < held_.size();) {
    HeldCompletion& h = held_[i];
    if (!h.readers.empty() && now < h.deadline) {
      ++i;
      continue;
    }
    if (!h.readers.empty() && now != absl::InfiniteFuture()) {
      LOG(WARNING) << "group \"" << params_.name << "\" (job " << params_.job << "): rank " << h.owner.rank
                   << "'s request " << h.owner.args.seq << " completes at its deadline without ReadDone from "
                   << h.readers.size() << " peer reader(s) (rank " << h.readers.begin()->first << ", ...)";
    }
    // The data moved when the collective ran; only the readers' copies were awaited.
    Complete(h.owner, absl::OkStatus(), env_.observer);
    held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

}  // namespace collserve::engine
