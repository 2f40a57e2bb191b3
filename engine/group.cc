// Group lifecycle: attach, rendezvous, submit, failure, leaving, segments and peer reads.
// The control plane toward the coordinator (ledger, flight recorder, watch and lease) is in
// group_control.cc; the data plane (the executor and the stages) in executor.cc and
// data_plane.cc.
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

Completion TakeCompletion(const Submission& sub, const absl::Status& status) {
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
  // The input's bytes (and a failed request's all) come back now, the result's once the
  // answer is written to the client.
  InlineCharge result = sub.inline_charge.Keep(static_cast<int64_t>(c.inline_data.size()));
  if (result.bytes() > 0) c.inline_charge = std::make_shared<const InlineCharge>(std::move(result));
  return c;
}

void ObserveCompleted(const Submission& sub, const absl::Status& status, EngineObserver* observer) {
  if (observer == nullptr) return;
  observer->OnCompleted(sub.args.op, status,
                        sub.submitted == absl::Time() ? absl::ZeroDuration() : absl::Now() - sub.submitted,
                        std::max(sub.in_bytes, sub.out_bytes), status.ok() ? sub.algorithm : "");
}

void Complete(const Submission& sub, const absl::Status& status, EngineObserver* observer) {
  Completion c = TakeCompletion(sub, status);
  if (sub.session != nullptr) sub.session->OnCompletion(std::move(c));
  ObserveCompleted(sub, status, observer);
}

Group::AnswerLock::AnswerLock(Group* group) : group_(group) { group_->mu_.Lock(); }

Group::AnswerLock::~AnswerLock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Group& g = *group_;
  std::vector<Answer> batch;
  {
    absl::MutexLock lock(&g.answers_mu_);
    if (!g.HoldAnswersLocked()) g.TakeSendableLocked(&batch);
  }
  g.mu_.Unlock();
  while (!batch.empty()) {
    g.SendAnswers(batch);
    absl::MutexLock lock(&g.answers_mu_);
    for (const Answer& a : batch) g.sending_.erase(a.sub.rank);
    batch.clear();  // the submissions' mappings are let go outside mu_ too
    // Answers queued meanwhile for the ranks this thread sent were left to it.
    g.TakeSendableLocked(&batch);
  }
}

void Group::SendAnswers(const std::vector<Answer>& batch) {
  if (batch.size() == 1) {
    Complete(batch[0].sub, batch[0].status, env_.observer);
    return;
  }
  // Each session's answers together, in their order (a session is one rank's).
  std::vector<std::pair<Session*, std::vector<Completion>>> per_session;
  for (const Answer& a : batch) {
    Session* session = a.sub.session.get();
    Completion c = TakeCompletion(a.sub, a.status);
    if (session == nullptr) continue;
    auto it = std::find_if(per_session.begin(), per_session.end(), [&](const auto& p) { return p.first == session; });
    if (it == per_session.end()) {
      per_session.emplace_back(session, std::vector<Completion>());
      it = per_session.end() - 1;
    }
    it->second.push_back(std::move(c));
  }
  for (auto& [session, completions] : per_session) {
    if (completions.size() == 1) {
      session->OnCompletion(std::move(completions[0]));
    } else {
      session->OnCompletions(std::move(completions));
    }
  }
  for (const Answer& a : batch) ObserveCompleted(a.sub, a.status, env_.observer);
}

bool Group::HoldAnswersLocked() const {
  if (!holding_records_ || answers_.empty()) return false;  // the common case
  std::vector<const Submission*> fronts;
  if (running_.empty()) {
    for (const auto& [rank, local] : locals_) fronts.push_back(local.queue.empty() ? nullptr : &local.queue.front());
  }
  return HoldRecordAnswers(holding_records_, !stop_ && state_ != State::kFailed && departed_.empty(), answers_.size(),
                           locals_.size(), !running_.empty(), fronts, topology_.num_hosts, next_prefetched_);
}

void Group::TakeSendableLocked(std::vector<Answer>* batch) {
  if (answers_.empty()) return;
  std::vector<Answer> left;
  for (Answer& a : answers_) {
    (sending_.count(a.sub.rank) > 0 ? left : *batch).push_back(std::move(a));
  }
  answers_ = std::move(left);
  for (const Answer& a : *batch) sending_.insert(a.sub.rank);
}

void Group::AnswerLocked(Submission sub, absl::Status status) {
  absl::MutexLock lock(&answers_mu_);
  answers_.push_back(Answer{std::move(sub), std::move(status)});
}

Group::Group(GroupEnv env, GroupParams params) : env_(std::move(env)), params_(std::move(params)) {}

Group::~Group() {
  Stop();
  if (executor_.joinable()) executor_.join();
}

absl::Status Group::Attach(int rank, int world_size, std::shared_ptr<Session> session, bool shared_memory,
                          const std::string& credential, bool peer_reads) {
  {
    AnswerLock lock(this);
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
  join.backend = params_.backend;
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
    AnswerLock lock(this);
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
    AnswerLock lock(this);
    credential = credential_;
  }
  return env_.coordinator->RendezvousStoreFor(params_.job, credential);
}

void Group::OnJoined(int rank, const absl::StatusOr<Membership>& result) {
  AnswerLock lock(this);
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
                                        [this](const absl::Status& s) { Fail(s); }, env_.device);
  // Remote ranks the coordinator said left before this (the watch starts at formation).
  for (const auto& [rank, why] : remote_left_) p2p_->DepartSendsTo(rank, absl::UnavailableError(why));
  // The job's share of the host's data-path threads (ThreadPool's scheduling).
  backends::PoolTenant* tenant =
      env_.pool != nullptr
          ? env_.pool->Tenant(params_.job, params_.priority, params_.share_weight, params_.max_data_threads)
          : nullptr;
  algorithms_ = std::make_unique<Hierarchical>(topology_, env_.pool, env_.algorithms, tenant);
  algorithms_->set_link(env_.link, params_.priority);
  executor_ = std::thread([this] { ExecutorMain(); });
}

void Group::Submit(int rank, Request request, absl::Status refused) {
  AnswerLock lock(this);
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
    RefuseFailedLocked(std::move(sub));
    return;
  }
  if (state_ != State::kReady) {
    AnswerLocked(std::move(sub), absl::FailedPreconditionError("collective sent before the session was attached"));
    return;
  }
  if (sub.args.seq != local.next_seq) {
    absl::Status s = absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " sent seq ", sub.args.seq, " but seq ", local.next_seq, " was expected"));
    AnswerLocked(std::move(sub), s);
    FailLocked(s);
    return;
  }
  ++local.next_seq;
  for (const std::string& name : sub.args.released_segments) local.segments.Release(name);
  sub.error = refused.ok() ? ValidateRequest(sub.args, rank, params_.world_size) : std::move(refused);
  if (sub.error.ok() && !sub.args.buffer.segment.empty() && !local.shared_memory) {
    sub.error = absl::PermissionDeniedError("this session may not use shared memory: send tensors inline");
  }
  if (sub.error.ok() && sub.args.in_rank) {
    // A record (the rank runs the op with NCCL itself): nothing to map; its sizes count in
    // the metrics as the op's.
    const size_t es = ElementSize(static_cast<DataType>(sub.args.dtype));
    sub.in_bytes = static_cast<size_t>(sub.args.count) * es;
    sub.out_bytes = IsInPlace(sub.args.op) ? 0 : static_cast<size_t>(sub.args.output_count) * es;
  } else if (sub.error.ok() && sub.args.OnDevice()) {
    sub.error = ResolveDeviceBuffers(local, sub);
  } else if (sub.error.ok()) {
    sub.error = ResolveBuffers(local.segments, sub, env_.observer, env_.inline_budget);
  }
  // A refused request keeps no inline bytes while it waits for its group (it holds no charge
  // in the inline budget: up to 1 GiB of input would otherwise stay uncounted until then).
  if (!sub.error.ok()) std::string().swap(sub.args.buffer.inline_data);
  if (sub.args.op == CollectiveOp::kSend || sub.args.op == CollectiveOp::kRecv) {
    if (!sub.error.ok()) {
      absl::Status error = sub.error;
      AnswerLocked(std::move(sub), std::move(error));
      return;
    }
    p2p_->Submit(std::move(sub));
    return;
  }
  if (!collectives_failure_.ok()) {
    AnswerLocked(std::move(sub), collectives_failure_);  // a rank left: no collective can run
    return;
  }
  local.last_issued = sub.args;
  local.last_issued.buffer = BufferRef();  // the ledger needs the arguments, not the bytes
  local.last_issued.output = BufferRef();
  local.issued_at = sub.submitted;
  ++local.collectives;
  ++progress_version_;
  // The executor waits until every local rank queued one, or the earliest deadline: only a
  // submission due before that wakes it early (each wakeup costs a context switch per op).
  if (sub.deadline < executor_wakes_at_) ++submissions_;
  local.queue.push_back(std::move(sub));
}

void Group::InFlight(int64_t* ranks, int64_t* in_flight, absl::Time* oldest, int64_t* mapped_bytes) {
  AnswerLock lock(this);
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

absl::Status Group::AddSegment(int rank, std::shared_ptr<ShmSegment> segment) {
  AnswerLock lock(this);
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

void Group::RefuseFailedLocked(Submission sub) {
  // A rank known to have left before the group failed is the reason the call cannot
  // complete, whatever broke since (e.g. telling that rank's host of another departure found
  // it gone): point-to-point names its peer's leave, a collective the first rank that left.
  const bool p2p = sub.args.op == CollectiveOp::kSend || sub.args.op == CollectiveOp::kRecv;
  if (p2p && p2p_ != nullptr) {
    p2p_->Refuse(std::move(sub), failure_);
    return;
  }
  absl::Status why = p2p || collectives_failure_.ok() ? failure_ : collectives_failure_;
  if (!p2p && collectives_failure_.ok() && p2p_ != nullptr) {
    const absl::Status left = p2p_->FirstDeparture();
    if (!left.ok()) {
      why = absl::Status(left.code(), absl::StrCat(OpName(sub.args.op), " of group \"", params_.name, "\": ",
                                                   left.message(), "; collectives need every rank"));
    }
  }
  AnswerLocked(std::move(sub), std::move(why));
}

void Group::Fail(const absl::Status& status) {
  AnswerLock lock(this);
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
    if (attached_) local.session->OnGroupEvent(-1, status);
    for (Submission& sub : local.queue) AnswerLocked(std::move(sub), status);
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
    AnswerLock lock(this);
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
      for (Submission& sub : it->second.queue) AnswerLocked(std::move(sub), left);
      locals_.erase(it);
      departed_.insert(rank);
      for (auto& [r, l] : locals_) l.session->OnGroupEvent(rank, left);
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
        for (Submission& sub : l.queue) AnswerLocked(std::move(sub), collectives_failure_);
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
      for (Submission& sub : it->second.queue) AnswerLocked(std::move(sub), failure_);
      locals_.erase(it);
    }
  }
  if (!left.ok() && p2p_ != nullptr) p2p_->Depart(rank, left);
  if (cancel_join) cancel_join();
  if (was_member) env_.coordinator->Leave(params_.job, params_.name, rank, generation, credential);
  AnswerLock lock(this);
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
  AnswerLock lock(this);
  return !departed_.empty() || state_ == State::kFailed || stop_ || emptied_;
}

bool Group::AwaitEmptied(absl::Time deadline) {
  AnswerLock lock(this);
  return mu_.AwaitWithDeadline(absl::Condition(&emptied_), deadline);
}

int64_t Group::Generation() {
  AnswerLock lock(this);
  return formed_ ? topology_.generation : params_.generation;
}

void Group::Stop() {
  std::function<void()> cancel_watch;
  {
    AnswerLock lock(this);
    stop_ = true;  // in the same section as the cancel: no watch starts after it (Watch)
    cancel_watch = std::move(cancel_watch_);
    cancel_watch_ = nullptr;
  }
  if (cancel_watch) cancel_watch();
  AnswerLock lock(this);
  ReleaseHeldLocked(absl::InfiniteFuture());  // their data moved: they succeeded
  FailLocked(absl::UnavailableError(absl::StrCat("sidecar ", env_.host_id, " is shutting down")));
  for (auto& [rank, local] : locals_) local.session->Close(failure_);
}

absl::StatusOr<int> Group::OpenPeerSegment(int asker, int owner, const std::string& name) {
  AnswerLock lock(this);
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
  AnswerLock lock(this);
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
  AnswerLock lock(this);
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
    AnswerLocked(std::move(h.owner), absl::OkStatus());
    held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

}  // namespace collserve::engine
