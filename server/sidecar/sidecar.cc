#include "server/sidecar/sidecar.h"

#include <glog/logging.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <utility>
#include <thread>
#include <vector>
#include <cerrno>
#include <atomic>
#include <cstring>
#include <deque>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "backends/device.h"
#include "backends/registry.h"
#include "client/channel.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "collserve/v1/sidecar_admin.grpc.pb.h"
#include "common/fd_channel.h"
#include "common/grpc_status.h"
#include "engine/engine.h"
#include "server/common/bearer.h"
#include "server/common/daemon.h"
#include "server/common/grpc_listener.h"
#include "server/common/grpc_metrics.h"
#include "server/common/info_service.h"
#include "server/common/metrics.h"
#include "server/sidecar/coordinator_link.h"
#include "server/sidecar/fd_channel_server.h"
#include "server/sidecar/job_quotas.h"
#include "server/sidecar/metrics_observer.h"
#include "server/sidecar/translate.h"

namespace collserve::server {
namespace {

namespace pb = ::collserve::v1;

constexpr int kMaxMessageBytes = 1 << 30;
// Health: the service name of the liveness check (SERVING while the process serves), and
// how often and how patiently the coordinator's health is probed for readiness.
constexpr absl::string_view kLivenessService = "liveness";
constexpr absl::Duration kHealthProbePeriod = absl::Seconds(2);
constexpr absl::Duration kHealthProbeTimeout = absl::Seconds(2);
// How long a new session waits for the coordinator to check its credential: long enough to
// ride out a coordinator restart (the check is retried meanwhile).
constexpr absl::Duration kAuthenticateTimeout = absl::Seconds(30);

class SidecarImpl;

// One Session stream. Owned by gRPC (deleted in OnDone); the Group reaches it through a
// SessionHandle that outlives it.
class SessionReactor;

// The session's answers go over its gRPC stream, or over its ops channel once the client
// opened one (server/sidecar/fd_channel_server.h), which then also brings its requests.
class SessionHandle : public engine::Session, public OpsHandler {
 public:
  // Held back until Ready(): the client must not learn its token before the token is bound
  // to the group (the group may form before Engine::Attach returns).
  void OnAttached(const engine::AttachedInfo& info) override {
    absl::MutexLock lock(&mu_);
    if (!ready_) {
      pending_attached_ = info;
      return;
    }
    SendAttachedLocked(info);
  }
  // The session's group is known (and its token bound, for shared memory): sends a held
  // Attached.
  void Ready(std::string fd_socket, std::string token) {
    absl::MutexLock lock(&mu_);
    ready_ = true;
    fd_socket_ = std::move(fd_socket);
    token_ = std::move(token);
    if (pending_attached_.has_value()) SendAttachedLocked(*pending_attached_);
    pending_attached_.reset();
  }
  void OnCompletion(engine::Completion completion) override {
    if (Answered(completion.seq)) ReleaseInFlight(1);
    std::shared_ptr<const engine::InlineCharge> charge = std::move(completion.inline_charge);
    Send(ToProto(std::move(completion)), std::move(charge));
  }
  // Several answers (records of collectives the rank runs itself, checked back to back): over
  // the ops channel with one system call.
  void OnCompletions(std::vector<engine::Completion> completions) override;
  // Sends `response` over the ops channel (the `charge` of its inline bytes is released once
  // it is copied there; the channel's queue has its own bound) or queues it on the stream,
  // holding `charge` until it is written.
  void Send(pb::SessionResponse response, std::shared_ptr<const engine::InlineCharge> charge = nullptr);
  void Close(const absl::Status& status) override;
  void OnGroupEvent(int left_rank, const absl::Status& why) override {
    {
      // Only after Attached went out: the client reads Attached first.
      absl::MutexLock lock(&mu_);
      if (!attached_sent_) return;
    }
    pb::SessionResponse r;
    pb::GroupEvent* e = r.mutable_group_event();
    e->set_kind(left_rank >= 0 ? pb::GroupEvent::RANK_LEFT : pb::GroupEvent::GROUP_FAILED);
    e->set_rank(left_rank);
    e->set_code(static_cast<int>(why.code()));
    e->set_message(std::string(why.message()));
    Send(std::move(r));
  }
  void OnOpsOpened(std::shared_ptr<OpsLink> link) override {
    absl::MutexLock lock(&mu_);
    ops_link_ = std::move(link);
  }
  absl::Status OnOpsMessage(std::string message) override;
  void OnOpsClosed(const absl::Status& why) override { Close(why); }
  // Whether requests must come over the ops channel (it was opened).
  bool HasOpsChannel() {
    absl::MutexLock lock(&mu_);
    return ops_link_ != nullptr;
  }
  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }
  void Bind(SessionReactor* r) {
    absl::MutexLock lock(&mu_);
    reactor_ = r;
  }

  // What the session is attached to, once its (asynchronous) attach succeeded.
  struct Attachment {
    std::shared_ptr<engine::Group> group;
    int rank = -1;
    std::string fd_token;  // the shared-memory channel token, if granted
    std::string job;       // counted in the sidecar's JobQuotas until the session ends
    // Set when the job's policy has max_inflight_collectives: its requests are counted there.
    JobQuotas* quotas = nullptr;
    std::shared_ptr<const pb::JobPolicy> policy;
    // The sidecar's --max_session_requests (0 = none).
    int max_requests = 0;
  };
  // Hands a request of this session to its group. With a max_inflight_collectives policy it
  // counts in the job's quota until its completion is sent or the session ends, and one past
  // the quota goes to the group carrying its refusal (JobQuotas::AdmitCollective); records
  // of collectives the rank runs with NCCL itself (Collective.in_rank) do not count (they hold
  // no tensor and cost the data path nothing, and a refused one would end the rank's NCCL
  // communicator), only in --max_session_requests. A request
  // past a.max_requests of the session's in flight ends the session instead (a refused
  // request still waits in its group for the other ranks, so refusing would not bound what
  // the session holds): RESOURCE_EXHAUSTED naming the limit, and the rank leaves its group.
  void Submit(const Attachment& a, pb::Collective request) {
    absl::Status admitted;
    int held = 0;
    {
      absl::MutexLock lock(&mu_);
      if (ended_) return;  // the group drops requests of a closed session too
      held = requests_;
      if (a.max_requests <= 0 || held < a.max_requests) {
        ++requests_;
        if (request.in_rank()) {
          records_.insert(request.seq());
        } else if (a.quotas != nullptr) {
          ++in_flight_;
        }
        held = -1;
      }
    }
    if (held >= 0) {
      // The rank leaves its group before the client hears why (the group forgets it once:
      // the session's end does this again, as a no-op), so that no peer's later call still
      // matches this rank's queued requests.
      a.group->OnSessionClosed(a.rank);
      Close(absl::ResourceExhaustedError(absl::StrCat(
          "rank ", a.rank, " has ", held, " requests in flight on this sidecar, its limit (--max_session_requests ",
          a.max_requests, "); request seq ", request.seq(), " ends the session (wait for some before issuing more)")));
      return;
    }
    if (a.quotas != nullptr && !request.in_rank()) admitted = a.quotas->AdmitCollective(a.job, *a.policy, request.seq());
    a.group->Submit(a.rank, FromProto(std::move(request)), std::move(admitted));
  }
  // Records the attach's outcome. False when the session already ended: the caller then
  // undoes the attach itself (the group and the token would otherwise outlive the session).
  bool SetAttached(Attachment a) {
    absl::MutexLock lock(&mu_);
    if (ended_) return false;
    attachment_ = std::move(a);
    return true;
  }
  // The attachment, if any (group null before the attach succeeded).
  Attachment Attached() {
    absl::MutexLock lock(&mu_);
    return attachment_;
  }
  // The session ended (the client closed its side, or the stream is done): returns the
  // attachment to clean up, once; afterwards SetAttached refuses.
  std::optional<Attachment> End() {
    std::optional<Attachment> a;
    int in_flight = 0;
    {
      absl::MutexLock lock(&mu_);
      if (ended_) return std::nullopt;
      ended_ = true;
      in_flight = std::exchange(in_flight_, 0);
      a = std::move(attachment_);
    }
    if (a->quotas != nullptr) a->quotas->ReleaseCollectives(a->job, in_flight);
    return a;
  }

 private:
  void SendAttachedLocked(const engine::AttachedInfo& info) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops counting `n` of this session's requests in flight (none once the session ended:
  // End released them all).
  // Request `seq` was answered: one fewer in flight on the session; whether it counted in the
  // job's collective quota (records do not).
  bool Answered(int64_t seq) {
    absl::MutexLock lock(&mu_);
    if (requests_ > 0) --requests_;
    return records_.erase(seq) == 0;
  }
  void ReleaseInFlight(int n) {
    JobQuotas* quotas = nullptr;
    std::string job;
    {
      absl::MutexLock lock(&mu_);
      n = std::min(n, in_flight_);
      if (n <= 0 || attachment_.quotas == nullptr) return;
      in_flight_ -= n;
      quotas = attachment_.quotas;
      job = attachment_.job;
    }
    quotas->ReleaseCollectives(job, n);
  }

  absl::Mutex mu_;
  SessionReactor* reactor_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  bool attached_sent_ ABSL_GUARDED_BY(mu_) = false;  // Attached went out (group events may follow)
  std::optional<engine::AttachedInfo> pending_attached_ ABSL_GUARDED_BY(mu_);
  std::string fd_socket_ ABSL_GUARDED_BY(mu_);
  std::string token_ ABSL_GUARDED_BY(mu_);
  Attachment attachment_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // requests counted in attachment_.quotas
  int requests_ ABSL_GUARDED_BY(mu_) = 0;   // requests in flight (Submit to OnCompletion)
  std::set<int64_t> records_ ABSL_GUARDED_BY(mu_);  // the seqs of in_rank records among them
  std::shared_ptr<OpsLink> ops_link_ ABSL_GUARDED_BY(mu_);
};

class SessionReactor : public grpc::ServerBidiReactor<pb::SessionRequest, pb::SessionResponse> {
 public:
  // `authorization`: the stream's "authorization" metadata value ("" when absent).
  SessionReactor(SidecarImpl* sidecar, std::string peer, absl::string_view authorization)
      : sidecar_(sidecar), peer_(std::move(peer)), handle_(std::make_shared<SessionHandle>()) {
    handle_->Bind(this);
    auto token = BearerToken(authorization);
    if (token.ok()) credential_ = std::string(*token);
    else credential_ = token.status();
    StartRead(&request_);
  }

  // The bytes of answers a session's stream may hold unwritten (their serialized size plus
  // kQueuedAnswerOverhead each) before the sidecar stops reading the session's requests,
  // until its client has read them down to kResumeReadingBytes. Without it a client that
  // sends requests and reads none of their answers (a TCP session, or COLLSERVE_OPS_CHANNEL=0)
  // grew the shared sidecar's memory without bound; now it only stalls itself (its writes
  // block on HTTP/2 flow control). The inline results among them also stay counted in the
  // inline budgets until written (engine::Completion::inline_charge). The ops channel has
  // its own bound (OpsLink::kMaxQueuedBytes).
  static constexpr size_t kMaxQueuedBytes = size_t{64} << 20;
  static constexpr size_t kResumeReadingBytes = size_t{32} << 20;
  // What a queued answer costs beyond its serialized bytes: the deque slot, the message
  // objects and their heap blocks (measured with glibc's malloc: 185 bytes of heap for an
  // answer of 13 serialized bytes).
  static constexpr size_t kQueuedAnswerOverhead = 256;

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override {
    const pb::SessionResponse* next = nullptr;
    bool finish = false;
    bool resume_reading = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      queued_bytes_ -= writing_.front().bytes;
      writing_.pop_front();  // (its inline charge comes back)
      if (!ok) {
        writing_.clear();
        queued_bytes_ = 0;
        broken_ = true;
      }
      // Reads resume once the client read its answers down (or the stream broke, or the
      // session ends: the pending read then sees the end).
      if (reading_paused_ && (queued_bytes_ <= kResumeReadingBytes || broken_ || finish_requested_)) {
        reading_paused_ = false;
        resume_reading = true;
      }
      if (!writing_.empty()) {
        next = &writing_.front().response;
      } else if (finish_requested_ && !finished_) {
        finished_ = true;
        finish = true;
        status = finish_status_;
      }
    }
    if (resume_reading) StartRead(&request_);
    if (next != nullptr) StartWrite(next);
    if (finish) Finish(status);
  }
  void OnDone() override;
  // The session is over (client hung up, stream done, protocol error): leaves its group and
  // forgets its shared-memory token, once.
  void EndSession();

  // Queues a message, holding `charge` (its inline bytes in the inline budgets) until it is
  // written (called through the handle, under its lock: the reactor is alive).
  void Enqueue(pb::SessionResponse response, std::shared_ptr<const engine::InlineCharge> charge = nullptr) {
    const pb::SessionResponse* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finish_requested_ || broken_) return;
      const size_t bytes = response.ByteSizeLong() + kQueuedAnswerOverhead;
      writing_.push_back(Outgoing{std::move(response), std::move(charge), bytes});
      queued_bytes_ += bytes;
      if (writing_.size() == 1) start = &writing_.front().response;
    }
    if (start != nullptr) StartWrite(start);
  }
  void RequestFinish(const absl::Status& status) {
    bool finish = false;
    bool resume_reading = false;
    {
      absl::MutexLock lock(&mu_);
      if (finish_requested_) return;
      finish_requested_ = true;
      finish_status_ = ToGrpcStatus(status);
      if (writing_.empty()) {
        finished_ = true;
        finish = true;
      }
      // A read pending again notices the client's end (reads are paused only while answers
      // wait, so a session that cannot finish yet keeps one).
      resume_reading = std::exchange(reading_paused_, false);
    }
    if (resume_reading) StartRead(&request_);
    if (finish) Finish(finish_status_);
  }
  // After a request was read: whether to read the next one now (false: the answers waiting
  // passed kMaxQueuedBytes; OnWriteDone reads on once the client read them down).
  bool ReadOn() {
    size_t queued = 0, answers = 0;
    {
      absl::MutexLock lock(&mu_);
      if (queued_bytes_ <= kMaxQueuedBytes || broken_ || finish_requested_) return true;
      reading_paused_ = true;
      if (std::exchange(pause_logged_, true)) return false;
      queued = queued_bytes_;
      answers = writing_.size();
    }
    SessionHandle::Attachment a = handle_->Attached();
    LOG(WARNING) << "the session of rank " << a.rank << " of job \"" << a.job << "\" (" << peer_ << ") has "
                 << answers << " answers (" << queued << " bytes) its client has not read, past the limit of "
                 << kMaxQueuedBytes << " bytes: the sidecar reads its next request once the client reads them "
                 << "(logged once per session)";
    return false;
  }

 private:
  SidecarImpl* sidecar_;
  const std::string peer_;  // gRPC's peer string: "unix:..." on the unix socket
  std::shared_ptr<SessionHandle> handle_;  // outlives the reactor; holds the attachment
  // The client's job token ("Bearer <token>" metadata), or the error of a malformed value.
  absl::StatusOr<std::string> credential_;
  pb::SessionRequest request_;
  bool attach_started_ = false;  // reactions only (they never run concurrently)

  // An answer waiting to be written, with the charge of its inline bytes and what it counts
  // in queued_bytes_.
  struct Outgoing {
    pb::SessionResponse response;
    std::shared_ptr<const engine::InlineCharge> charge;
    size_t bytes = 0;
  };
  absl::Mutex mu_;
  std::deque<Outgoing> writing_ ABSL_GUARDED_BY(mu_);  // front = in flight
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;        // writing_'s Outgoing::bytes summed
  bool reading_paused_ ABSL_GUARDED_BY(mu_) = false;    // no read pending: see ReadOn
  bool pause_logged_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_;
};

void SessionHandle::SendAttachedLocked(const engine::AttachedInfo& info) {
  pb::SessionResponse response = ToProto(info);
  if (info.shared_memory && !token_.empty()) {
    response.mutable_attached()->set_fd_socket(fd_socket_);
    response.mutable_attached()->set_session_token(token_);
  } else {
    response.mutable_attached()->set_shared_memory(false);
  }
  attached_sent_ = true;
  if (reactor_ != nullptr) reactor_->Enqueue(std::move(response));
}

void SessionHandle::OnCompletions(std::vector<engine::Completion> completions) {
  int released = 0;
  for (const engine::Completion& c : completions) released += Answered(c.seq) ? 1 : 0;
  if (released > 0) ReleaseInFlight(released);
  absl::MutexLock lock(&mu_);
  if (ops_link_ != nullptr) {
    std::vector<std::string> messages;
    messages.reserve(completions.size());
    for (engine::Completion& c : completions) messages.push_back(ToProto(std::move(c)).SerializeAsString());
    // As Send: a failed send ends the session.
    if (absl::Status s = ops_link_->SendBatch(messages); !s.ok() && reactor_ != nullptr) reactor_->RequestFinish(s);
    return;
  }
  if (reactor_ == nullptr) return;
  for (engine::Completion& c : completions) {
    std::shared_ptr<const engine::InlineCharge> charge = std::move(c.inline_charge);
    reactor_->Enqueue(ToProto(std::move(c)), std::move(charge));
  }
}

void SessionHandle::Send(pb::SessionResponse response, std::shared_ptr<const engine::InlineCharge> charge) {
  absl::MutexLock lock(&mu_);
  if (ops_link_ != nullptr) {
    // A failed send shuts the link down; its closing ends the session (OnOpsClosed), and a
    // message over the channel's limit ends it with that error.
    if (absl::Status s = ops_link_->Send(response.SerializeAsString()); !s.ok() && reactor_ != nullptr) {
      reactor_->RequestFinish(s);
    }
    return;
  }
  if (reactor_ != nullptr) reactor_->Enqueue(std::move(response), std::move(charge));
}

absl::Status SessionHandle::OnOpsMessage(std::string message) {
  pb::SessionRequest request;
  if (!request.ParseFromString(message)) {
    return absl::InvalidArgumentError("ops channel: a message that is not a collserve.v1.SessionRequest");
  }
  Attachment a = Attached();
  if (a.group == nullptr) return absl::FailedPreconditionError("ops channel: the session is not attached");
  if (request.has_collective()) {
    const pb::Collective& c = request.collective();
    // Tensors go in shared memory here (the SDK never sends inline ones over this channel):
    // an inline result (up to 1 GiB) would be allocated and zeroed on the one thread that
    // reads every session's ops channel, and could not come back over it
    // (kMaxOpsMessageBytes).
    if (!c.in_rank() && c.buffer().segment().empty() && c.buffer().cuda_ipc_handle().empty() &&
        (c.count() > 0 || c.output_count() > 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ops channel: request seq ", c.seq(),
          " has inline tensors; they go over the session's stream, not its ops channel"));
    }
    Submit(a, std::move(*request.mutable_collective()));
  } else if (request.has_read_done()) {
    a.group->OnReadDone(a.rank, request.read_done().seq());
  } else {
    return absl::InvalidArgumentError("ops channel: only collective and read_done requests go over it");
  }
  return absl::OkStatus();
}

void SessionHandle::Close(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (reactor_ != nullptr) reactor_->RequestFinish(status);
}

class CollectivesService final : public pb::Collectives::CallbackService {
 public:
  explicit CollectivesService(SidecarImpl* sidecar) : sidecar_(sidecar) {}
  grpc::ServerBidiReactor<pb::SessionRequest, pb::SessionResponse>* Session(
      grpc::CallbackServerContext* ctx) override {
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    absl::string_view authorization;
    if (it != md.end()) authorization = absl::string_view(it->second.data(), it->second.size());
    return new SessionReactor(sidecar_, ctx->peer(), authorization);
  }

 private:
  SidecarImpl* sidecar_;
};

// collserve.v1.SidecarAdmin on the admin socket (its mode is the authorization).
class AdminService final : public pb::SidecarAdmin::CallbackService {
 public:
  explicit AdminService(SidecarImpl* sidecar) : sidecar_(sidecar) {}
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const pb::DrainRequest* req,
                                  pb::DrainResponse* resp) override;

 private:
  SidecarImpl* sidecar_;
};

class SidecarImpl : public Sidecar {
 public:
  explicit SidecarImpl(SidecarOptions options) : options_(std::move(options)) {
    if (options_.host_id.empty()) {
      char host[256] = {0};
      gethostname(host, sizeof(host) - 1);
      options_.host_id = absl::StrCat(host, "/", getpid());
    }
  }

  ~SidecarImpl() override { Shutdown(absl::Seconds(5)); }

  absl::Status Init() {
    if (options_.coordinator_address.empty()) {
      return absl::InvalidArgumentError("the sidecar needs --coordinator=host:port");
    }
    if (absl::Status s = engine::ValidateAllReduceAlgorithm(options_.allreduce_algorithm); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--allreduce_algorithm: ", s.message()));
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    auto channel = client::CreateChannel(options_.coordinator_address, options_.coordinator_tls, args);
    if (!channel.ok()) return channel.status();
    channel_ = std::move(*channel);
    if (!channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + options_.coordinator_connect_timeout))) {
      // Serve anyway, not ready (health NOT_SERVING) until the coordinator answers: a
      // sidecar started before its coordinator (a Helm install) waits instead of exiting.
      LOG(WARNING) << "the coordinator at " << options_.coordinator_address << " is not reachable after "
                   << absl::FormatDuration(options_.coordinator_connect_timeout)
                   << "; serving NOT_SERVING until it is (sessions fail to join meanwhile)";
    }
    coordinator_ = std::make_unique<GrpcCoordinatorLink>(channel_, options_.coordinator_address,
                                                         options_.coordinator_tls, options_.host_id,
                                                         options_.gloo_hostname);
    if (absl::Status s = backends::AddBuiltinBackends(backends_); !s.ok()) return s;
    metrics_ = std::make_shared<prometheus::Registry>();
    observer_ = std::make_unique<PrometheusObserver>(*metrics_);
    RegisterBuildInfo(*metrics_, "sidecar");
    grpc_metrics_ = std::make_unique<GrpcServerMetrics>(*metrics_);
    engine::EngineOptions eo;
    eo.host_id = options_.host_id;
    eo.hostname = options_.gloo_hostname;
    eo.data_threads = options_.data_threads;
    eo.algorithms.allreduce_algorithm = options_.allreduce_algorithm;
    eo.algorithms.direct_max_bytes = options_.direct_max_bytes;
    eo.algorithms.ring_min_bytes = options_.ring_min_bytes;
    eo.ring_segment_bytes = options_.ring_segment_bytes;
    eo.flight_recorder_entries = options_.flight_recorder_entries;
    eo.flight_recorder_log_threshold = options_.flight_recorder_log_threshold;
    eo.straggler_threshold = options_.straggler_threshold;
    eo.lease_renewal = options_.lease_renewal;
    eo.max_inline_bytes = options_.max_inline_bytes;
    eo.bulk_nice = options_.bulk_nice;
    for (size_t c = 0; c < eo.traffic_marks.size(); ++c) {
      eo.traffic_marks[c].dscp = options_.traffic_dscp[c];
      eo.traffic_marks[c].socket_priority = options_.traffic_socket_priority[c];
    }
    eo.link.piece_bytes = options_.link_piece_bytes;
    eo.link.max_wait = options_.link_max_wait;
    eo.fail_after_data_step_group = options_.fail_after_data_step_group;
    eo.fail_after_data_step_seq = options_.fail_after_data_step_seq;
    if (!eo.fail_after_data_step_group.empty()) {
      LOG(WARNING) << "testing: collective #" << eo.fail_after_data_step_seq << " of group \""
                   << eo.fail_after_data_step_group << "\" fails here after its data step";
    }
    // CUDA tensors of local clients (docs/gpu.md), when this build and host have CUDA.
    std::string no_device;
    device_ = backends::NewDeviceRuntime(&no_device);
    if (device_ != nullptr) {
      LOG(INFO) << "CUDA tensors: on (CUDA IPC from local clients)";
    } else {
      VLOG(1) << "CUDA tensors: off: " << no_device;
      eo.device_unavailable = no_device;
    }
    eo.device = device_.get();
    auto created = engine::Engine::Create(std::move(eo), coordinator_.get(), &backends_, observer_.get());
    if (!created.ok()) return created.status();
    engine_ = std::move(*created);
    quotas_ = std::make_unique<JobQuotas>(engine_->host_id());

    service_ = std::make_unique<CollectivesService>(this);
    grpc::EnableDefaultHealthCheckService(true);
    if (options_.rpc_memory_bytes <= kMaxMessageBytes) {
      return absl::InvalidArgumentError(absl::StrCat("rpc_memory_bytes (", options_.rpc_memory_bytes,
                                                     ") must exceed the ", kMaxMessageBytes, "-byte message limit"));
    }
    trimmer_ = std::make_unique<MemoryTrimmer>(absl::Seconds(2));
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();  // grpc_cli / grpcurl can list and call
    grpc::ServerBuilder builder;
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(InterceptorFactory(grpc_metrics_.get()));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    LimitRpcMemory(builder, "collserve-sidecar", options_.rpc_memory_bytes);
    if (!options_.unix_socket.empty()) {
      // Never take over a socket another sidecar serves; a dead one's is removed.
      if (absl::Status s = ClaimUnixSocketPath(options_.unix_socket); !s.ok()) return s;
      // Local clients pass their shared memory as descriptors on a socket next to it.
      const std::string fd_path = fdchannel::PathFor(options_.unix_socket);
      if (absl::Status s = ClaimUnixSocketPath(fd_path, SOCK_SEQPACKET); !s.ok()) return s;
      auto fd_channel = FdChannelServer::Start(fd_path, options_.unix_socket_mode);
      if (!fd_channel.ok()) return fd_channel.status();
      fd_channel_ = std::move(*fd_channel);
      auto listener = GrpcListener::Bind(absl::StrCat("unix:", options_.unix_socket));
      if (!listener.ok()) return listener.status();
      listeners_.push_back(std::move(*listener));
    }
    if (!options_.listen_address.empty()) {
      auto listener = GrpcListener::Bind(options_.listen_address);
      if (!listener.ok()) return listener.status();
      port_ = (*listener)->port();
      const std::string& h = options_.gloo_hostname;
      coordinator_->set_sidecar_address(
          absl::StrCat(h.find(':') != std::string::npos ? absl::StrCat("[", h, "]") : h, ":", port_));
      listeners_.push_back(std::move(*listener));
    }
    auto tcp_credentials = ServerCredentialsFor(options_.tls);
    if (!tcp_credentials.ok()) return tcp_credentials.status();
    for (size_t i = 0; i < listeners_.size(); ++i) {
      // The unix socket (first, when there is one) is local and plaintext.
      const bool unix_listener = i == 0 && !options_.unix_socket.empty();
      listeners_[i]->RegisterWith(builder, unix_listener ? grpc::InsecureServerCredentials() : *tcp_credentials);
    }
    builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    builder.SetMaxSendMessageSize(kMaxMessageBytes);
    // The SDK's keepalive pings (InitOptions::keepalive_timeout: at least 1 s apart) are
    // welcome; a client pinging faster still gets gRPC's strikes and GOAWAY.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    builder.RegisterService(service_.get());
    info_service_ = std::make_unique<InfoService>("sidecar", options_.host_id);
    builder.RegisterService(info_service_.get());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) return absl::InternalError("the gRPC server did not start");
    for (auto& l : listeners_) l->Start();
    if (!options_.unix_socket.empty() && options_.unix_socket_mode >= 0 &&
        chmod(options_.unix_socket.c_str(), static_cast<mode_t>(options_.unix_socket_mode)) != 0) {
      return absl::UnavailableError(absl::StrCat("chmod ", options_.unix_socket, ": ", std::strerror(errno)));
    }
    if (options_.admin_socket == "auto") {
      options_.admin_socket = options_.unix_socket.empty() ? "" : absl::StrCat(options_.unix_socket, ".admin");
      if (options_.admin_socket.size() >= sizeof(sockaddr_un::sun_path)) {
        LOG(WARNING) << "no admin socket (drain): " << options_.admin_socket << " is longer than a unix socket path "
                     << "may be (" << sizeof(sockaddr_un::sun_path) - 1 << " bytes); set --admin_socket";
        options_.admin_socket.clear();
      }
    }
    if (!options_.admin_socket.empty()) {
      if (absl::Status s = ClaimUnixSocketPath(options_.admin_socket); !s.ok()) return s;
      auto listener = GrpcListener::Bind(absl::StrCat("unix:", options_.admin_socket));
      if (!listener.ok()) return listener.status();
      // Owner-only before the first connection can come (accepting starts below).
      if (chmod(options_.admin_socket.c_str(), 0600) != 0) {
        return absl::UnavailableError(absl::StrCat("chmod ", options_.admin_socket, ": ", std::strerror(errno)));
      }
      admin_listener_ = std::move(*listener);
      admin_service_ = std::make_unique<AdminService>(this);
      grpc::ServerBuilder admin;
      admin_listener_->RegisterWith(admin, grpc::InsecureServerCredentials());
      admin.RegisterService(admin_service_.get());
      admin_server_ = admin.BuildAndStart();
      if (admin_server_ == nullptr) return absl::InternalError("the admin gRPC server did not start");
      admin_listener_->Start();
    }
    // Health: "liveness" is SERVING while the process serves; "" and
    // "collserve.v1.Collectives" (readiness) follow the coordinator's own health, and are
    // NOT_SERVING while draining.
    server_->GetHealthCheckService()->SetServingStatus(std::string(kLivenessService), true);
    SetReady(CoordinatorServing());
    health_thread_ = std::thread([this] { WatchCoordinator(); });
    auto exposer = ServeMetrics(options_.metrics_address, metrics_);
    if (!exposer.ok()) return exposer.status();
    exposer_ = std::move(*exposer);
    if (exposer_ != nullptr) {
      gauges_ = std::make_shared<ScrapeGauges>([this] { return Gauges(); });
      exposer_->RegisterCollectable(gauges_);
    }
    return absl::OkStatus();
  }

  // The engine's state and the coordinator connection, read at each scrape.
  std::vector<GaugeValue> Gauges() {
    const engine::Engine::Stats s = engine_->GetStats();
    std::vector<GaugeValue> g = {
        {"collserve_sessions", "Local ranks attached to this sidecar (every group).", static_cast<double>(s.ranks)},
        {"collserve_collectives_in_flight",
         "Local ranks' collectives submitted and not yet answered (waiting for other ranks or running).",
         static_cast<double>(s.in_flight)},
        {"collserve_oldest_collective_age_seconds",
         "How long the oldest collective in flight on this sidecar has waited, seconds (0 when none): a hung "
         "collective grows it until its timeout.",
         absl::ToDoubleSeconds(s.oldest)},
        {"collserve_coordinator_connected",
         "1 while the sidecar's coordinator answers its health check (the sidecar's readiness), else 0.",
         connected_.load() ? 1.0 : 0.0},
        {"collserve_staging_bytes", "Bytes of shared memory local ranks have registered with the sidecar and it "
         "holds mapped (their arenas and staging segments).", static_cast<double>(s.mapped_bytes)},
        {"collserve_inline_bytes", "Bytes of inline requests (remote ranks' tensors carried in the messages, input "
         "and result; results until their answers are written to the client) the sidecar holds, every job "
         "together; at --max_inline_bytes more are refused.",
         static_cast<double>(s.inline_bytes)},
    };
    for (GaugeValue& p : ProcessMetrics()) g.push_back(std::move(p));
    for (GaugeValue& j : JobDataPathMetrics()) g.push_back(std::move(j));
    for (GaugeValue& j : JobStageMetrics()) g.push_back(std::move(j));
    for (GaugeValue& l : LinkMetrics()) g.push_back(std::move(l));
    return g;
  }

  // The scheduler of steps between hosts (engine::LinkScheduler), per priority_class.
  std::vector<GaugeValue> LinkMetrics() {
    static constexpr const char* kClass[] = {"latency_critical", "default", "bulk"};
    std::vector<GaugeValue> out;
    for (int c = 0; c < engine::LinkScheduler::kNumClasses; ++c) {
      const engine::LinkScheduler::Counters k = engine_->link().CountersOf(c);
      const std::map<std::string, std::string> labels = {{"priority_class", kClass[c]}};
      out.push_back(GaugeValue{"collserve_link_cut_transfers_total",
                               "Transfers between hosts (all_reduce, broadcast) of the class this sidecar cut into "
                               "pieces because a better class had collectives between hosts here "
                               "(--link_piece_bytes).",
                               static_cast<double>(k.cut), /*counter=*/true, labels});
      out.push_back(GaugeValue{"collserve_link_pieces_total", "The pieces of those transfers.",
                               static_cast<double>(k.pieces), /*counter=*/true, labels});
      out.push_back(GaugeValue{"collserve_link_waits_total",
                               "Pieces of the class that waited for a better class's collective between hosts "
                               "before going (each at most --link_max_wait_ms).",
                               static_cast<double>(k.waits), /*counter=*/true, labels});
      out.push_back(GaugeValue{"collserve_link_wait_seconds_total", "Their time waited, seconds.",
                               absl::ToDoubleSeconds(k.waited), /*counter=*/true, labels});
    }
    return out;
  }

  // The collserve_job and priority_class labels of a job's per-job series: its name for the
  // first options_.metrics_job_series jobs asked (`*named` counts them; callers ask in order
  // of use, most first), "(others)" for the rest, so that the label stays bounded.
  std::pair<std::string, std::string> JobSeriesLabels(const std::string& job, int priority, int* named) const {
    static constexpr const char* kClass[] = {"latency_critical", "default", "bulk"};
    const bool own = *named < options_.metrics_job_series && job != "(others)";
    if (own) ++*named;
    return {own ? job : "(others)", kClass[std::clamp(priority, 0, 2)]};
  }

  // Each job's use of the data-path threads (engine::Engine::DataPathUsage), as counters
  // labelled by collserve_job and priority_class: the options_.metrics_job_series jobs that
  // used the most thread time by name, the others summed under "(others)".
  std::vector<GaugeValue> JobDataPathMetrics() {
    std::vector<backends::ThreadPool::TenantUsage> usage = engine_->DataPathUsage();
    std::sort(usage.begin(), usage.end(), [](const auto& a, const auto& b) { return a.used_ns > b.used_ns; });
    std::map<std::pair<std::string, std::string>, backends::ThreadPool::TenantUsage> series;
    int named = 0;
    for (const auto& u : usage) {
      if (u.name.empty()) continue;  // work of no job
      auto& sum = series[JobSeriesLabels(u.name, u.priority, &named)];
      sum.used_ns += u.used_ns;
      sum.chunks += u.chunks;
      sum.loops += u.loops;
      sum.wait_ns += u.wait_ns;
    }
    struct Family {
      const char* name;
      const char* help;
      double (*value)(const backends::ThreadPool::TenantUsage&);
    };
    static constexpr Family kFamilies[] = {
        {"collserve_job_data_path_seconds_total",
         "Seconds of the sidecar's data-path threads (reductions and copies among local ranks) the job's "
         "collectives used, by collserve_job and priority_class (the operator's JobPolicy).",
         [](const backends::ThreadPool::TenantUsage& u) { return static_cast<double>(u.used_ns) / 1e9; }},
        {"collserve_job_data_path_chunks_total",
         "Pieces of work (64 KiB chunks) of the job's collectives the data-path threads ran.",
         [](const backends::ThreadPool::TenantUsage& u) { return static_cast<double>(u.chunks); }},
        {"collserve_job_data_path_loops_total",
         "Reductions and copies of the job spread over the data-path threads (those that waited for them).",
         [](const backends::ThreadPool::TenantUsage& u) { return static_cast<double>(u.loops); }},
        {"collserve_job_data_path_wait_seconds_total",
         "Seconds the job's reductions and copies waited for the data-path threads (other jobs' chunks "
         "held them), summed; divided by collserve_job_data_path_loops_total: the mean wait.",
         [](const backends::ThreadPool::TenantUsage& u) { return static_cast<double>(u.wait_ns) / 1e9; }},
    };
    std::vector<GaugeValue> out;
    for (const Family& f : kFamilies) {
      for (const auto& [key, u] : series) {
        out.push_back(GaugeValue{f.name, f.help, f.value(u), /*counter=*/true,
                                 {{"collserve_job", key.first}, {"priority_class", key.second}}});
      }
    }
    return out;
  }

  // Each job's collectives and the time they spent in each stage of the engine's data plane
  // (engine::Engine::JobStages), as counters labelled by collserve_job and priority_class
  // (stage too for the seconds): the options_.metrics_job_series jobs with the most stage
  // time by name, the others summed under "(others)".
  std::vector<GaugeValue> JobStageMetrics() {
    std::vector<engine::JobStageTable::Usage> usage = engine_->JobStages();
    auto total = [](const engine::JobStageTable::Usage& u) {
      absl::Duration t;
      for (const absl::Duration& d : u.times) t += d;
      return t;
    };
    std::sort(usage.begin(), usage.end(), [&](const auto& a, const auto& b) { return total(a) > total(b); });
    std::map<std::pair<std::string, std::string>, engine::JobStageTable::Usage> series;
    int named = 0;
    for (const auto& u : usage) {
      auto& sum = series[JobSeriesLabels(u.job, u.priority, &named)];
      sum.collectives += u.collectives;
      sum.bytes += u.bytes;
      for (int s = 0; s < engine::kNumStages; ++s) sum.times[s] += u.times[s];
    }
    std::vector<GaugeValue> out;
    for (const auto& [key, u] : series) {
      const std::map<std::string, std::string> labels = {{"collserve_job", key.first},
                                                         {"priority_class", key.second}};
      out.push_back(GaugeValue{"collserve_job_collectives_total",
                               "Collectives of the job this sidecar ran (each once per host, whatever its local "
                               "ranks), by collserve_job and priority_class (the operator's JobPolicy).",
                               static_cast<double>(u.collectives), /*counter=*/true, labels});
      out.push_back(GaugeValue{"collserve_job_collective_bytes_total",
                               "Bytes of the job's collectives on this host: each local rank's larger of input and "
                               "output, summed.",
                               static_cast<double>(u.bytes), /*counter=*/true, labels});
      for (int s = 0; s < engine::kNumStages; ++s) {
        auto with_stage = labels;
        with_stage["stage"] = engine::StageName(static_cast<engine::Stage>(s));
        out.push_back(GaugeValue{
            "collserve_job_stage_seconds_total",
            "Seconds the job's collectives spent in each stage of the sidecar's data plane, summed: queued (every "
            "local rank had called it; it waited for the group's previous collective), agree (the argument "
            "exchange between hosts and the checks), execute (the data step), complete (answering the ranks). "
            "Divided by collserve_job_collectives_total: the mean per collective.",
            absl::ToDoubleSeconds(u.times[s]), /*counter=*/true, with_stage});
      }
    }
    return out;
  }

  int port() const override { return port_; }
  const std::string& host_id() const override { return options_.host_id; }

  // Whether the coordinator answers grpc.health.v1.Health/Check with SERVING within
  // kHealthProbeTimeout (an empty request: the server's overall status).
  bool CoordinatorServing() {
    return client::CheckHealth(channel_, "", kHealthProbeTimeout) == "SERVING";  // the server's overall status
  }

  // Readiness: the coordinator answers and the sidecar is not draining.
  void SetReady(bool coordinator_ready) {
    absl::MutexLock lock(&ready_mu_);
    const bool ready = coordinator_ready && !draining_.load();
    for (const char* service : {"", "collserve.v1.Collectives"}) {
      server_->GetHealthCheckService()->SetServingStatus(service, ready);
    }
    if (coordinator_ready != coordinator_ready_) {
      if (coordinator_ready) {
        LOG(INFO) << "the coordinator at " << options_.coordinator_address << " serves"
                  << (ready ? ": ready" : " (not ready while draining)");
      } else {
        LOG(WARNING) << "the coordinator at " << options_.coordinator_address
                     << " does not answer its health check: not ready (NOT_SERVING)";
      }
    }
    coordinator_ready_ = coordinator_ready;
    connected_.store(coordinator_ready);
  }

  // SidecarAdmin.Drain: starts (or stops) draining and reports what is attached.
  void Drain(bool undrain, pb::DrainResponse* resp) {
    if (draining_.load() == undrain) {  // the state changes
      draining_since_.store(undrain ? 0 : absl::ToUnixMillis(absl::Now()));
      draining_.store(!undrain);
      // The coordinator hears of it with the next ledger report of each group here (within
      // the progress interval), so that diagnose and health name the drain.
      if (coordinator_ != nullptr) coordinator_->set_draining_since(draining_since_.load());
      if (engine_ != nullptr) engine_->RepublishProgress();
      LOG(WARNING) << "sidecar " << options_.host_id
                   << (undrain ? ": undrained, accepting sessions again"
                               : ": draining (collservectl drain): no new sessions; those attached run on");
      SetReady(connected_.load());
    }
    resp->set_draining(draining_.load());
    resp->set_draining_since_unix_ms(draining_since_.load());
    resp->set_host_id(options_.host_id);
    int sessions = 0;
    for (const engine::GroupProgress& p : engine_->Attached()) {
      pb::AttachedGroup* g = resp->add_groups();
      g->set_job(p.job);
      g->set_group(p.group);
      g->set_generation(p.generation);
      g->set_state(p.state);
      for (const engine::RankProgress& r : p.ranks) g->add_ranks(r.rank);
      sessions += static_cast<int>(p.ranks.size());
    }
    resp->set_sessions(sessions);
  }

  // Re-checks the coordinator every kHealthProbePeriod until Shutdown.
  void WatchCoordinator() {
    while (!stop_health_.WaitForNotificationWithTimeout(kHealthProbePeriod)) SetReady(CoordinatorServing());
  }

  void Shutdown(absl::Duration grace) override {
    if (health_thread_.joinable()) {
      stop_health_.Notify();
      health_thread_.join();
    }
    if (admin_server_ != nullptr) {
      admin_listener_.reset();  // (removes the socket)
      admin_server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
      admin_server_->Wait();
      admin_server_.reset();
    }
    if (server_ != nullptr) {
      listeners_.clear();  // no new sessions (and the unix socket is removed if still ours)
      // Fails every session with UNAVAILABLE (the streams then finish), then drains.
      if (engine_ != nullptr) engine_->Shutdown();
      server_->GetHealthCheckService()->Shutdown();
      server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
      server_->Wait();
      server_.reset();
    }
    {
      // Attaches whose credential check or attach is still in flight (no new ones start: the
      // server is down) use the engine, the descriptor channel and the coordinator link: let
      // them finish (each is bounded by kAuthenticateTimeout; the engine refuses them now,
      // and one it holds stops waiting within 200 ms of engine_->Shutdown()).
      absl::MutexLock lock(&attach_mu_);
      auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(attach_mu_) { return attaching_ == 0; };
      attach_mu_.AwaitWithTimeout(absl::Condition(&done), kAuthenticateTimeout + absl::Seconds(1));
    }
    listeners_.clear();
    exposer_.reset();  // before the engine its gauges read
    {
      // After the sessions (they forget their tokens when they end). Server::Wait returned
      // after every session reactor's last callback, but that ordering is inside gRPC core;
      // the lock makes it explicit (SessionEnded takes it too).
      absl::MutexLock lock(&attach_mu_);
      fd_channel_.reset();
    }
    engine_.reset();
  }

  // Handles the first message of a session from `peer`, asynchronously: asks the
  // coordinator whether `credential` grants the session's job (the sidecar serves no
  // session its coordinator does not accept), then attaches it to its group and records
  // the attachment in `session`. Any failure closes the session with the reason. The
  // reactor may be gone by then (the client hung up): `session` outlives it.
  void AttachSession(const pb::Attach& attach, const std::string& credential, const std::string& peer,
                     std::shared_ptr<SessionHandle> session) {
    if (draining_.load()) {
      session->Close(absl::UnavailableError(absl::StrCat(
          "sidecar ", options_.host_id, " is draining (collservectl drain, since ",
          absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixMillis(draining_since_.load()), absl::UTCTimeZone()),
          "): it accepts no new sessions; the node is being upgraded or taken out of service. Start the rank on "
          "another node, or wait for the sidecar to come back")));
      return;
    }
    {
      absl::MutexLock lock(&attach_mu_);
      ++attaching_;
    }
    coordinator_->Authenticate(
        attach.job(), credential, kAuthenticateTimeout,
        [this, attach, credential, peer, session](absl::StatusOr<pb::JobPolicy> policy) {
          if (!policy.ok()) {
            const absl::Status& s = policy.status();
            session->Close(absl::Status(
                s.code(), absl::StrCat("the sidecar serves a session only with a credential its coordinator accepts "
                                       "for the job: ",
                                       s.message())));
            absl::MutexLock lock(&attach_mu_);
            --attaching_;
            return;
          }
          // On a thread of its own, not this one (the coordinator link's): the engine holds a
          // rank that attaches again while this host's ranks are still leaving its group's
          // previous generation (Engine::Attach), and those departures need the link.
          std::thread([this, attach, credential, peer, session, policy = *std::move(policy)] {
            Attach(attach, credential, peer, session, policy);
            absl::MutexLock lock(&attach_mu_);
            --attaching_;
          }).detach();
        });
  }
  // The attach itself, once the credential was accepted and `policy` came with it: the
  // job's quotas on this sidecar (JobQuotas), checked first.
  void Attach(const pb::Attach& attach, const std::string& credential, const std::string& peer,
              std::shared_ptr<SessionHandle> session, const pb::JobPolicy& policy) {
    if (absl::Status s = quotas_->ReserveSession(attach.job(), policy); !s.ok()) {
      session->Close(s);
      return;
    }
    engine::AttachRequest request = FromProto(attach);
    request.credential = credential;
    // The job's class and weight come from the operator's policy, never from the job.
    request.priority = PoolPriority(policy.priority_class());
    request.share_weight = std::max(policy.share_weight(), 1);
    request.max_data_threads = policy.max_data_threads();
    request.max_inline_bytes = policy.max_inline_bytes();
    request.shared_memory = attach.shared_memory() && fd_channel_ != nullptr && absl::StartsWith(peer, "unix:");
    request.peer_reads = request.shared_memory && attach.peer_reads();
    std::string token;
    if (request.shared_memory) token = fd_channel_->NewToken();
    auto group = engine_->Attach(request, session);
    if (!group.ok()) {
      if (!token.empty()) fd_channel_->Forget(token);
      quotas_->ReleaseSession(attach.job());
      session->Close(group.status());
      return;
    }
    if (!token.empty()) {
      FdChannelServer::SegmentAdmission admit;
      if (policy.max_segment_bytes() > 0) {
        admit = [this, job = attach.job(), policy](int64_t bytes) {
          return quotas_->AdmitSegment(job, policy, engine_->JobStats(job).mapped_bytes, bytes);
        };
      }
      fd_channel_->Bind(token, *group, attach.rank(), session, std::move(admit));
    }
    // With a max_inflight_collectives policy, the session's requests count in JobQuotas.
    const bool counted = policy.max_inflight_collectives() > 0;
    SessionHandle::Attachment attachment{*group,
                                         attach.rank(),
                                         token,
                                         attach.job(),
                                         counted ? quotas_.get() : nullptr,
                                         counted ? std::make_shared<const pb::JobPolicy>(policy) : nullptr,
                                         options_.max_session_requests};
    if (!session->SetAttached(std::move(attachment))) {
      // The client hung up while this attach ran.
      (*group)->OnSessionClosed(attach.rank());
      SessionEnded(token, attach.job());
      return;
    }
    session->Ready(fd_channel_ != nullptr ? fd_channel_->path() : "", token);
  }
  // A session that was attached ended: forgets its shared-memory token and stops counting
  // it against its job's quota.
  void SessionEnded(const std::string& token, const std::string& job) {
    quotas_->ReleaseSession(job);
    if (token.empty()) return;
    absl::MutexLock lock(&attach_mu_);  // against Shutdown's reset of fd_channel_
    if (fd_channel_ != nullptr) fd_channel_->Forget(token);
  }

 private:
  SidecarOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::thread health_thread_;  // WatchCoordinator
  absl::Notification stop_health_;
  absl::Mutex ready_mu_;  // SetReady: the health thread and Drain
  bool coordinator_ready_ ABSL_GUARDED_BY(ready_mu_) = false;  // last probe's answer
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> draining_since_{0};  // Unix ms; 0 when not draining
  std::unique_ptr<AdminService> admin_service_;  // outlives admin_server_
  std::unique_ptr<GrpcListener> admin_listener_;
  std::unique_ptr<grpc::Server> admin_server_;
  std::atomic<bool> connected_{false};  // coordinator_ready_, for the metrics thread and Drain
  std::shared_ptr<ScrapeGauges> gauges_;  // Gauges(), registered with exposer_
  std::unique_ptr<GrpcCoordinatorLink> coordinator_;
  backends::BackendRegistry backends_;
  std::unique_ptr<backends::DeviceRuntime> device_;  // CUDA tensors; null without CUDA
  std::shared_ptr<prometheus::Registry> metrics_;
  std::unique_ptr<GrpcServerMetrics> grpc_metrics_;  // outlives server_
  std::unique_ptr<InfoService> info_service_;  // outlives server_
  std::unique_ptr<PrometheusObserver> observer_;
  std::unique_ptr<JobQuotas> quotas_;  // what each job holds here against its policy
  std::unique_ptr<engine::Engine> engine_;  // destroyed before what it points to
  std::unique_ptr<CollectivesService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsServer> exposer_;
  std::unique_ptr<MemoryTrimmer> trimmer_;
  std::unique_ptr<FdChannelServer> fd_channel_;  // with a unix socket
  std::vector<std::unique_ptr<GrpcListener>> listeners_;  // unix socket, TCP: hand connections to server_
  int port_ = 0;
  absl::Mutex attach_mu_;
  int attaching_ ABSL_GUARDED_BY(attach_mu_) = 0;  // AttachSession calls in flight

  friend class SessionReactor;
};

void SessionReactor::OnReadDone(bool ok) {
  if (!ok) {
    EndSession();
    RequestFinish(absl::OkStatus());
    return;
  }
  if (!attach_started_) {
    if (!request_.has_attach()) {
      RequestFinish(absl::FailedPreconditionError("the first message of a session must be attach"));
      return;
    }
    if (!credential_.ok()) {
      RequestFinish(absl::Status(credential_.status().code(),
                                 absl::StrCat("the sidecar serves a session only with a credential its coordinator "
                                              "accepts for the job: ",
                                              credential_.status().message())));
      return;
    }
    // Attached asynchronously (the coordinator checks the credential first); the reads go
    // on meanwhile, so that a client that hangs up is noticed (the client sends nothing
    // else before its Attached answer).
    attach_started_ = true;
    sidecar_->AttachSession(request_.attach(), *credential_, peer_, handle_);
  } else if ((request_.has_collective() || request_.has_read_done()) && handle_->HasOpsChannel()) {
    // One path for a session's requests, so that their order is the order they were sent.
    RequestFinish(absl::FailedPreconditionError(
        "a request on the session's stream after it opened its ops channel (requests go over the ops channel)"));
    EndSession();
    return;
  } else if (request_.has_collective()) {
    SessionHandle::Attachment a = handle_->Attached();
    if (a.group == nullptr) {
      RequestFinish(absl::FailedPreconditionError("collective sent before the session was attached"));
      return;
    }
    handle_->Submit(a, std::move(*request_.mutable_collective()));
  } else if (request_.has_read_done()) {
    SessionHandle::Attachment a = handle_->Attached();
    if (a.group == nullptr) {
      RequestFinish(absl::FailedPreconditionError("read_done sent before the session was attached"));
      return;
    }
    a.group->OnReadDone(a.rank, request_.read_done().seq());
  } else {
    RequestFinish(absl::FailedPreconditionError("attach sent twice on one session"));
    EndSession();
    return;
  }
  request_.Clear();
  if (ReadOn()) StartRead(&request_);
}

grpc::ServerUnaryReactor* AdminService::Drain(grpc::CallbackServerContext* ctx, const pb::DrainRequest* req,
                                              pb::DrainResponse* resp) {
  sidecar_->Drain(req->undrain(), resp);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void SessionReactor::EndSession() {
  std::optional<SessionHandle::Attachment> a = handle_->End();
  if (!a.has_value()) return;
  if (a->group == nullptr) return;  // never attached: nothing counted, no token bound
  a->group->OnSessionClosed(a->rank);
  sidecar_->SessionEnded(a->fd_token, a->job);
}

void SessionReactor::OnDone() {
  EndSession();
  handle_->Detach();
  delete this;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Sidecar>> Sidecar::Start(const SidecarOptions& options) {
  auto s = std::make_unique<SidecarImpl>(options);
  if (absl::Status st = s->Init(); !st.ok()) return st;
  return std::unique_ptr<Sidecar>(std::move(s));
}

}  // namespace collserve::server
