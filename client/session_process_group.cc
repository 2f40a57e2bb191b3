// SessionProcessGroup's session with the sidecar (client/session_process_group.h): attach,
// the channels, writing requests, reading completions and finishing them on the lanes.
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/channel.h"
#include "client/session_process_group.h"
#include "common/fd_channel.h"
#include "common/grpc_status.h"
#include "common/ops_channel.h"

namespace collserve::client {

namespace pb = ::collserve::v1;

namespace {

grpc::ChannelArguments ChannelArgs(absl::Duration keepalive_timeout) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxMessageBytes));
  args.SetMaxSendMessageSize(static_cast<int>(kMaxMessageBytes));
  // gRPC keepalive (InitOptions::keepalive_timeout): a sidecar that answers no ping closes
  // the connection, which fails a write its full buffers held (cancelling the call alone
  // does not: the bytes wait in the socket). Pings while nothing else is sent too (a write
  // that cannot go out sends nothing else).
  const int64_t timeout_ms =
      std::clamp<int64_t>(absl::ToInt64Milliseconds(keepalive_timeout), 1000, int64_t{1} << 30);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(std::max<int64_t>(1000, timeout_ms / 2)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(timeout_ms));
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Every session gets its own connection so one busy stream does not delay another.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

}  // namespace


SessionProcessGroup::~SessionProcessGroup() {
  {
    // COLLSERVE_CUDA_PATH=nccl: the communicator lets what it queued finish (bounded) and
    // ends, before the session's end would abort it.
    std::shared_ptr<RankComm> comm;
    {
      absl::MutexLock lock(&rank_comm_mu_);
      comm = std::move(rank_comm_);
      if (rank_comm_failure_.ok()) rank_comm_failure_ = absl::CancelledError("process group destroyed");
    }
  }
  {
    // The records still queued are written first: the other ranks' sidecars wait for them.
    std::thread sender;
    {
      absl::MutexLock lock(&write_mu_);
      record_sender_stop_ = true;
      sender = std::move(record_sender_);
    }
    if (sender.joinable()) sender.join();
  }
  if (fd_channel_ >= 0) close(fd_channel_);  // registrations only; the sidecar keeps its mappings
  if (!reader_.joinable()) {
    // Init failed before the session started: end the stream if it is still open.
    if (stream_ != nullptr && !finished_) {
      ctx_.TryCancel();
      stream_->Finish();
    }
    if (ops_sock_ >= 0) close(ops_sock_);
    return;
  }
  {
    absl::MutexLock send(&send_mu_);
    absl::MutexLock lock(&write_mu_);
    if (stream_ != nullptr && !closed_) WatchedWrite([this] { return stream_->WritesDone(); });
    closed_ = true;
  }
  // The sidecar ends the stream after WritesDone; cancel if it does not promptly.
  if (!reader_done_.WaitForNotificationWithTimeout(absl::Seconds(5))) ctx_.TryCancel();
  if (reader_.joinable()) reader_.join();
  {
    absl::MutexLock lock(&watch_mu_);
    watch_stop_ = true;
    watch_wake_ = true;
  }
  if (write_watch_.joinable()) write_watch_.join();
  FailAll(absl::CancelledError("process group destroyed"));
  AbortRankComm(absl::CancelledError("process group destroyed"));
  collective_lane_.reset();  // finishes what it holds, then joins
  p2p_lane_.reset();
  if (ops_sock_ >= 0) close(ops_sock_);  // its reader was joined by reader_
}

absl::Status SessionProcessGroup::Init() {
  const std::string address = options_.sidecar_address.empty()
                                  ? std::string(kDefaultSidecarAddress)
                                  : options_.sidecar_address;
  auto channel = CreateChannel(address, options_.tls, ChannelArgs(options_.keepalive_timeout));
  if (!channel.ok()) return channel.status();
  channel_ = std::move(*channel);
  const absl::Time init_deadline = absl::Now() + options_.init_timeout;
  if (!channel_->WaitForConnected(absl::ToChronoTime(std::min(
          init_deadline, absl::Now() + std::min(options_.init_timeout, absl::Seconds(30)))))) {
    return absl::UnavailableError(absl::StrCat("no collserve sidecar reachable at ", address));
  }
  stub_ = pb::Collectives::NewStub(channel_);
  AddJobToken(ctx_, options_.token);  // the sidecar checks it with the coordinator before it serves us
  stream_ = stub_->Session(&ctx_);

  pb::SessionRequest req;
  pb::Attach* attach = req.mutable_attach();
  attach->set_job(options_.job);
  attach->set_group(options_.group);
  attach->set_rank(options_.rank);
  attach->set_world_size(options_.world_size);
  attach->set_init_timeout_ms(absl::ToInt64Milliseconds(options_.init_timeout));
  attach->set_op_timeout_ms(absl::ToInt64Milliseconds(options_.op_timeout));
  attach->set_shared_memory(options_.shared_memory);
  attach->set_generation(options_.generation);
  attach->set_peer_reads(options_.shared_memory && options_.peer_reads);
  attach->set_backend(options_.backend);
  if (!stream_->Write(req)) return FinishWithError("the sidecar closed the session at attach");

  // Watchdog: the sidecar bounds rendezvous by init_timeout; if it does not answer at
  // all, cancel the stream shortly after.
  absl::Notification attached;
  std::thread watchdog([&] {
    if (!attached.WaitForNotificationWithDeadline(init_deadline + kClientGrace)) ctx_.TryCancel();
  });
  pb::SessionResponse resp;
  bool got = stream_->Read(&resp);
  while (got && resp.has_group_event()) got = stream_->Read(&resp);  // not an answer to attach
  attached.Notify();
  watchdog.join();
  if (!got) return FinishWithError("the sidecar closed the session before attaching");
  if (!resp.has_attached()) {
    return absl::InternalError("the sidecar answered attach with something else");
  }
  shared_memory_ = resp.attached().shared_memory();
  if (shared_memory_) {
    // Segments go to the sidecar as descriptors; if its channel cannot be reached (say,
    // the socket's directory is not visible here), tensors go inline instead.
    auto sock = fdchannel::Connect(resp.attached().fd_socket(), resp.attached().session_token(),
                                   absl::Now() + absl::Seconds(10));
    if (sock.ok()) {
      fd_channel_ = *sock;
    } else {
      shared_memory_ = false;
    }
  }
  if (shared_memory_ && options_.ops_channel) {
    // Requests and completions over a datagram socket (common/ops_channel.h); a sidecar
    // that refuses keeps them on the stream.
    auto ops = fdchannel::ConnectOps(resp.attached().fd_socket(), resp.attached().session_token(),
                                     absl::Now() + absl::Seconds(10));
    if (ops.ok()) {
      ops_sock_ = *ops;
    } else {
      std::fprintf(stderr, "collserve: no ops channel (requests go over the session's stream): %s\n",
                   ops.status().ToString().c_str());
    }
  }
  peer_reads_ = shared_memory_ && resp.attached().peer_reads();
  num_hosts_ = resp.attached().num_hosts();
  generation_ = resp.attached().generation();
  rendezvous_id_ = resp.attached().rendezvous_id();
  local_world_size_ = resp.attached().local_world_size();
  if (resp.attached().has_traffic_dscp() && resp.attached().traffic_dscp() >= 0 &&
      resp.attached().traffic_dscp() <= 63) {
    traffic_dscp_ = resp.attached().traffic_dscp();
  }
  collective_lane_ = std::make_unique<Lane>([this](Done& d) { Finish(d); });
  p2p_lane_ = std::make_unique<Lane>([this](Done& d) { Finish(d); });
  reader_ = std::thread([this] { ReadLoop(); });
  write_watch_ = std::thread([this] { WriteWatchLoop(); });
  return absl::OkStatus();
}

bool SessionProcessGroup::WatchedWrite(const std::function<bool()>& write) {
  {
    absl::MutexLock lock(&watch_mu_);
    write_started_ = absl::Now();
  }
  const bool ok = write();
  absl::MutexLock lock(&watch_mu_);
  write_started_ = absl::InfiniteFuture();
  return ok;
}

void SessionProcessGroup::WriteWatchLoop() {
  {
    absl::MutexLock lock(&watch_mu_);
    while (!watch_stop_) {
      watch_wake_ = false;
      const absl::Duration timeout = OpTimeout();
      const absl::Time now = absl::Now();
      if (write_started_ != absl::InfiniteFuture() && now - write_started_ >= timeout) {
        write_timed_out_ = true;
        timed_out_after_ = timeout;
        break;
      }
      // Looks again when the write in progress would pass the op timeout (none: a timeout
      // from now, the soonest a write starting now could), or when woken.
      const absl::Time next = (write_started_ == absl::InfiniteFuture() ? now : write_started_) + timeout;
      watch_mu_.AwaitWithDeadline(absl::Condition(&watch_wake_), next);
    }
    if (!write_timed_out_) return;
  }
  // The write in progress then fails, and the reader sees the stream end.
  ctx_.TryCancel();
}

absl::Status SessionProcessGroup::WriteTimeout() const {
  absl::MutexLock lock(&watch_mu_);
  if (!write_timed_out_) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(
      "the session with the sidecar was ended: a request could not be written to it within the op timeout (",
      absl::FormatDuration(timed_out_after_),
      "); the sidecar is not reading this session (stopped, hung, or this process did not read its answers)"));
}

void SessionProcessGroup::SetCallSite(pb::Collective* c) {
  if (c->op() != pb::SEND && c->op() != pb::RECV && !CallSiteOfThisThread().empty()) {
    c->set_call_site(CallSiteOfThisThread().substr(0, 256));
  }
}

absl::Status SessionProcessGroup::OpsMessageSizeOk(const pb::SessionRequest& req) const {
  if (ops_sock_ < 0 || req.ByteSizeLong() + 16 <= opschannel::kMaxOpsMessageBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("a request of ", req.ByteSizeLong(),
                                                 " bytes exceeds the ops channel's limit of ",
                                                 opschannel::kMaxOpsMessageBytes, " bytes"));
}

void SessionProcessGroup::NumberLocked(pb::Collective* c, std::unique_ptr<Pending> pending) {
  const int64_t seq = next_seq_++;
  c->set_seq(seq);
  if (c->op() != pb::SEND && c->op() != pb::RECV) pending->collective_seq = next_collective_seq_++;
  absl::MutexLock plock(&pending_mu_);
  pending_[seq] = std::move(pending);
}

std::shared_ptr<Work> SessionProcessGroup::Enqueue(pb::SessionRequest& req, std::unique_ptr<Pending> pending, bool* sent) {
  pb::Collective* c = req.mutable_collective();
  SetCallSite(c);
  std::shared_ptr<WorkImpl> work = pending->work;
  {
    std::vector<std::string> released;
    arena_->TakeReleased(&released);
    staging_.TakeReleased(&released);
    for (std::string& name : released) c->add_released_segments(std::move(name));
  }

  absl::MutexLock send(&send_mu_);
  absl::MutexLock lock(&write_mu_);
  absl::Status refused = UsableLocked();
  if (refused.ok()) refused = OpsMessageSizeOk(req);  // refused before it takes a seq
  if (!refused.ok()) {
    ReleaseSegment(std::move(pending->segment), pending->collective);
    work->Complete(refused);
    return work;
  }
  NumberLocked(c, std::move(pending));
  // On failure the reader thread sees the session end and fails every pending Work.
  FlushRecordsLocked();
  WriteLocked(req);
  if (sent != nullptr) *sent = true;
  return work;
}

absl::Status SessionProcessGroup::UsableLocked() const {
  if (!broken_.ok()) return broken_;
  if (!write_failure_.ok()) return write_failure_;  // the reader has yet to see the session end
  if (closed_ || record_sender_stop_) return absl::FailedPreconditionError("process group destroyed");
  return absl::OkStatus();
}

absl::Status SessionProcessGroup::QueueRecord(pb::SessionRequest req, std::unique_ptr<Pending> pending) {
  pb::Collective* c = req.mutable_collective();
  SetCallSite(c);
  if (absl::Status s = OpsMessageSizeOk(req); !s.ok()) return s;
  absl::MutexLock lock(&write_mu_);
  if (absl::Status s = UsableLocked(); !s.ok()) return s;
  NumberLocked(c, std::move(pending));
  unsent_records_.push_back(std::move(req));
  if (!record_sender_.joinable()) record_sender_ = std::thread([this] { RecordSendLoop(); });
  return absl::OkStatus();
}

void SessionProcessGroup::FlushRecordsLocked() {
  for (const pb::SessionRequest& record : unsent_records_) {
    if (!closed_) WriteLocked(record);
  }
  unsent_records_.clear();
}

void SessionProcessGroup::RecordSendLoop() {
  const auto queued_or_stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) {
    return !unsent_records_.empty() || record_sender_stop_;
  };
  std::vector<pb::SessionRequest> batch;
  for (;;) {
    {
      absl::MutexLock lock(&write_mu_, absl::Condition(&queued_or_stop));
      if (unsent_records_.empty()) return;  // stopped with nothing queued
    }
    // write_mu_ is released while writing, so the training thread queues the next records
    // meanwhile; send_mu_ keeps any other writer (whose requests take later seqs) behind.
    absl::MutexLock send(&send_mu_);
    bool usable;
    {
      absl::MutexLock lock(&write_mu_);
      batch.swap(unsent_records_);
      usable = !closed_ && broken_.ok();  // else the reader fails their Works
    }
    // Several records per system call (sendmmsg) when several queued.
    absl::Status written = usable ? WriteRawBatch(batch) : absl::OkStatus();
    batch.clear();
    if (!written.ok()) {
      absl::MutexLock lock(&write_mu_);
      WriteFailedLocked(written);
    }
  }
}

absl::StatusOr<std::shared_ptr<SharedBuffer>> SessionProcessGroup::AllocateShared(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("AllocateShared needs bytes > 0");
  if (!shared_memory_) return std::shared_ptr<SharedBuffer>(std::make_shared<HeapBuffer>(bytes));
  auto seg = NewRegisteredSegment(bytes);
  if (!seg.ok()) return seg.status();
  return std::shared_ptr<SharedBuffer>(std::make_shared<ArenaBuffer>(arena_, std::move(*seg), bytes));
}

StoreClient* SessionProcessGroup::store() {
  absl::MutexLock lock(&store_mu_);
  if (store_ == nullptr && !options_.coordinator_address.empty() && !store_tried_) {
    store_tried_ = true;
    StoreClientOptions so;
    so.job = options_.job;
    so.timeout = options_.op_timeout;
    so.tls = options_.tls;
    so.token = options_.token;
    auto s = StoreClient::Connect(options_.coordinator_address, so);
    if (s.ok()) store_ = std::move(*s);
  }
  return store_.get();
}

absl::Status SessionProcessGroup::FinishWithError(absl::string_view what) {
  finished_ = true;
  grpc::Status s = stream_->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return absl::UnavailableError(what);
}

absl::StatusOr<std::unique_ptr<ShmSegment>> SessionProcessGroup::AcquireSegment(size_t bytes, bool collective, absl::Time deadline) {
  const bool on_lane = collective_lane_ != nullptr && (collective_lane_->OnThisThread() || p2p_lane_->OnThisThread());
  return staging_.Acquire(bytes, collective, /*may_wait=*/!on_lane, deadline);
}

absl::StatusOr<std::unique_ptr<ShmSegment>> SessionProcessGroup::NewRegisteredSegment(size_t bytes) {
  auto seg = ShmSegment::Create(bytes);
  if (!seg.ok()) return seg.status();
  absl::MutexLock lock(&fd_channel_mu_);
  absl::Status s = fdchannel::RegisterSegment(fd_channel_, (*seg)->name(), (*seg)->size(), (*seg)->fd(),
                                              absl::Now() + absl::Seconds(30));
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("registering a ", bytes, "-byte shared-memory segment: ", s.message()));
  }
  return seg;
}

void SessionProcessGroup::Finish(Done& done) {
  Pending* p = done.pending.get();
  if (p->filled != nullptr) p->filled->WaitForNotification();  // a memcpy on the issuing thread
  const pb::Completion& c = done.completion;
  absl::Status status(static_cast<absl::StatusCode>(c.code()), c.message());
  const bool peer_read = status.ok() && c.has_peer_source();
  if (peer_read) {
    // The result is in a peer's segment (collserve.v1.PeerSource): copy it out of there,
    // then tell the sidecar (ReadDone), which holds the owner's completion until then.
    status = CopyFromPeer(c.peer_source(), *p);
    SendReadDone(c.seq());
  } else if (status.ok() && p->out_bytes > 0) {
    const char* result = nullptr;
    if (p->segment != nullptr) {
      result = p->segment->data() + p->out_offset;
    } else if (c.inline_data().size() == p->out_bytes) {
      result = c.inline_data().data();
    } else {
      status = absl::InternalError(absl::StrCat("the sidecar returned ", c.inline_data().size(),
                                                " bytes for a ", p->out_bytes, "-byte result"));
    }
    if (result != nullptr) CopyResultRange(ResultTarget{&p->outputs, p->out_bytes}, result, 0, p->out_bytes);
  }
  if (status.ok()) {
    p->work->SetSourceRank(c.source());
    p->work->SetAlgorithm(c.algorithm());
  }
  if (p->collective_seq >= 0) NoteCollectiveDone(p->collective_seq, status.ok());
  if (p->record != nullptr) RecordAnswered(*p, status);
  p->work->Complete(std::move(status));
  // After Complete: a collective waiting for room sees this one completed.
  ReleaseSegment(std::move(p->segment), p->collective);
}

absl::Status SessionProcessGroup::CopyFromPeer(const pb::PeerSource& source, Pending& p) {
  if (!peer_reads_) {
    return absl::InternalError(absl::StrCat("the sidecar named a result in rank ", source.rank(),
                                            "'s segment, but this session did not ask for peer reads"));
  }
  return peer_reader_.Copy(source, ResultTarget{&p.outputs, p.out_bytes}, OpTimeout());
}

absl::StatusOr<int> SessionProcessGroup::OpenPeerSegment(int rank, const std::string& name) {
  absl::MutexLock channel(&fd_channel_mu_);
  return fdchannel::OpenPeerSegment(fd_channel_, rank, name, absl::Now() + absl::Seconds(10));
}

void SessionProcessGroup::NoteCollectiveDone(int64_t collective_seq, bool ok) {
  absl::MutexLock lock(&completed_mu_);
  if (!ok) {
    collectives_failed_ = true;
    return;
  }
  if (collectives_failed_) return;
  completed_ahead_.insert(collective_seq);
  while (!completed_ahead_.empty() && *completed_ahead_.begin() == last_completed_seq_ + 1) {
    last_completed_seq_ = *completed_ahead_.begin();
    completed_ahead_.erase(completed_ahead_.begin());
  }
}

void SessionProcessGroup::SendReadDone(int64_t seq) {
  pb::SessionRequest req;
  req.mutable_read_done()->set_seq(seq);
  absl::MutexLock send(&send_mu_);
  absl::MutexLock lock(&write_mu_);
  if (closed_ || !broken_.ok()) return;
  WriteLocked(req);  // on failure the reader sees the session end
}

void SessionProcessGroup::WriteLocked(const pb::SessionRequest& req) {
  if (absl::Status s = WriteRaw(req); !s.ok()) WriteFailedLocked(s);
}

void SessionProcessGroup::WriteFailedLocked(const absl::Status& why) {
  closed_ = true;
  if (write_failure_.ok()) write_failure_ = why;
}

absl::Status SessionProcessGroup::WriteRaw(const pb::SessionRequest& req) {
  if (ops_sock_ < 0) {
    if (WatchedWrite([&] { return stream_->Write(req); })) return absl::OkStatus();
    if (absl::Status timed_out = WriteTimeout(); !timed_out.ok()) return timed_out;
    return absl::UnavailableError("the session with the sidecar broke: its stream took no more requests");
  }
  // The sidecar's channel thread reads continuously: waiting the op timeout for room means
  // it is stuck.
  absl::Status s = opschannel::SendOpsMessage(ops_sock_, req.SerializeAsString(), absl::Now() + OpTimeout());
  return s.ok() ? s : OpsWriteFailed(s);
}

absl::Status SessionProcessGroup::WriteRawBatch(const std::vector<pb::SessionRequest>& reqs) {
  if (ops_sock_ < 0 || reqs.size() == 1) {
    for (const pb::SessionRequest& req : reqs) {
      if (absl::Status s = WriteRaw(req); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  std::vector<std::string> messages;
  messages.reserve(reqs.size());
  for (const pb::SessionRequest& req : reqs) messages.push_back(req.SerializeAsString());
  absl::Status s = opschannel::SendOpsMessages(ops_sock_, messages, absl::Now() + OpTimeout());
  return s.ok() ? s : OpsWriteFailed(s);
}

absl::Status SessionProcessGroup::OpsWriteFailed(const absl::Status& s) {
  std::fprintf(stderr, "collserve: the ops channel broke: %s\n", s.ToString().c_str());
  shutdown(ops_sock_, SHUT_RDWR);
  return absl::UnavailableError(absl::StrCat("the session with the sidecar broke: its ops channel: ", s.message()));
}

void SessionProcessGroup::Dispatch(pb::SessionResponse& resp) {
  if (resp.has_group_event()) {
    // COLLSERVE_CUDA_PATH=nccl: the group's later NCCL collectives cannot complete (a rank is
    // gone, or the generation is over); end the communicator once what it queued drained
    // (AbortRankComm: at most kRankCommDrain) rather than let the GPU wait for the op
    // timeout (torch's watchdog).
    const pb::GroupEvent& e = resp.group_event();
    const absl::Status why(static_cast<absl::StatusCode>(e.code()), e.message());
    if (RankNccl()) {
      AbortRankComm(e.kind() == pb::GroupEvent::RANK_LEFT
                        ? absl::UnavailableError(absl::StrCat("rank ", e.rank(), " left the group: ", why.message()))
                        : absl::Status(why.code(), absl::StrCat("the group failed: ", why.message())));
    }
    return;
  }
  if (!resp.has_completion()) return;
  Done done;
  {
    absl::MutexLock lock(&pending_mu_);
    auto it = pending_.find(resp.completion().seq());
    if (it == pending_.end()) return;
    done.pending = std::move(it->second);
    pending_.erase(it);
  }
  done.completion = std::move(*resp.mutable_completion());
  (done.pending->p2p ? p2p_lane_ : collective_lane_)->Push(std::move(done));
}

void SessionProcessGroup::OpsReadLoop() {
  // What the sidecar sent meanwhile comes in one system call (completions come in bursts when
  // the rank issues faster than one round trip per op).
  opschannel::BatchReceiver receiver(kOpsReceiveBatch);
  opschannel::Reassembler reassembler;
  pb::SessionResponse resp;
  const auto malformed = [&](const absl::Status& why) {
    std::fprintf(stderr, "collserve: a malformed message on the ops channel; ending the session: %s\n",
                 why.ToString().c_str());
    shutdown(ops_sock_, SHUT_RDWR);
    ctx_.TryCancel();
  };
  for (bool reading = true; reading;) {
    absl::StatusOr<int> got = receiver.Receive(ops_sock_, /*wait=*/true);
    if (!got.ok()) {
      if (got.status().code() == absl::StatusCode::kInvalidArgument) malformed(got.status());
      break;  // else the sidecar closed the channel, or it broke: the stream says why
    }
    for (int i = 0; i < *got; ++i) {
      absl::StatusOr<bool> complete = reassembler.Add(receiver.data(i), receiver.size(i));
      if (complete.ok() && !*complete) continue;
      if (!complete.ok() || !resp.ParseFromString(reassembler.Take())) {
        malformed(complete.ok() ? absl::InvalidArgumentError("not a SessionResponse") : complete.status());
        reading = false;
        break;
      }
      Dispatch(resp);
    }
    if (receiver.closed()) break;  // the sidecar closed the channel after these
  }
  ops_done_.Notify();
}

void SessionProcessGroup::ReadLoop() {
  pb::SessionResponse resp;
  if (ops_sock_ >= 0) {
    std::thread ops_reader([this] { OpsReadLoop(); });
    while (stream_->Read(&resp)) {
    }
    // The sidecar closes the ops channel when the session ends; completions it sent before
    // are read first.
    if (!ops_done_.WaitForNotificationWithTimeout(absl::Seconds(5))) shutdown(ops_sock_, SHUT_RDWR);
    ops_reader.join();
  }
  while (stream_->Read(&resp)) Dispatch(resp);
  // What was read completes first (in order), then the rest fails.
  collective_lane_->Drain(absl::Now() + absl::Seconds(30));
  p2p_lane_->Drain(absl::Now() + absl::Seconds(30));
  grpc::Status final_status = stream_->Finish();
  absl::Status why = final_status.ok()
                         ? absl::UnavailableError("the sidecar ended the session")
                         : absl::Status(FromGrpcStatus(final_status).code(),
                                        absl::StrCat("session with the sidecar ended: ",
                                                     final_status.error_message()));
  if (final_status.error_code() == grpc::StatusCode::CANCELLED) {
    why = absl::UnavailableError(absl::StrCat("session with the sidecar was cancelled: ",
                                              final_status.error_message()));
    if (absl::Status timed_out = WriteTimeout(); !timed_out.ok()) why = timed_out;  // the write watch cancelled it
  }
  {
    absl::MutexLock lock(&write_mu_);
    broken_ = why;
  }
  FailAll(why);
  AbortRankComm(why);
  reader_done_.Notify();
}

void SessionProcessGroup::FailAll(const absl::Status& why) {
  std::map<int64_t, std::unique_ptr<Pending>> pending;
  {
    absl::MutexLock lock(&pending_mu_);
    pending.swap(pending_);
  }
  for (auto& [seq, p] : pending) {
    if (p->filled != nullptr) p->filled->WaitForNotification();  // a memcpy on the issuing thread
    ReleaseSegment(std::move(p->segment), p->collective);
    if (p->record != nullptr) RecordAnswered(*p, why);
    p->work->Complete(why);
  }
}

}  // namespace collserve::client
