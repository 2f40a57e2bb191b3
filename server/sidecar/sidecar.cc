#include "server/sidecar/sidecar.h"

#include <glog/logging.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <prometheus/exposer.h>
#include <prometheus/registry.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "collserve/client.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "common/grpc_status.h"
#include "common/shm.h"
#include "server/common/daemon.h"
#include "server/sidecar/group.h"

namespace collserve::server {
namespace {

namespace pb = ::collserve::v1;

constexpr int kMaxMessageBytes = 1 << 30;

// backends::RendezvousStore over the coordinator's Store (client SDK).
class StoreRendezvous : public backends::RendezvousStore {
 public:
  explicit StoreRendezvous(std::unique_ptr<client::StoreClient> store) : store_(std::move(store)) {}
  absl::Status Set(const std::string& key, const std::string& value) override { return store_->Set(key, value); }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return store_->Get(key, timeout);
  }
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    return store_->Wait(keys, timeout);
  }
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override { return store_->Add(key, delta); }

 private:
  std::unique_ptr<client::StoreClient> store_;
};

class SidecarImpl;

// One Session stream. Owned by gRPC (deleted in OnDone); the Group reaches it through a
// SessionHandle that outlives it.
class SessionReactor;

class SessionHandle : public Session {
 public:
  void Send(pb::SessionResponse response) override;
  void Close(const absl::Status& status) override;
  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }
  void Bind(SessionReactor* r) {
    absl::MutexLock lock(&mu_);
    reactor_ = r;
  }

 private:
  absl::Mutex mu_;
  SessionReactor* reactor_ ABSL_GUARDED_BY(mu_) = nullptr;
};

class SessionReactor : public grpc::ServerBidiReactor<pb::SessionRequest, pb::SessionResponse> {
 public:
  SessionReactor(SidecarImpl* sidecar) : sidecar_(sidecar), handle_(std::make_shared<SessionHandle>()) {
    handle_->Bind(this);
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override {
    const pb::SessionResponse* next = nullptr;
    bool finish = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      writing_.pop_front();
      if (!ok) {
        writing_.clear();
        broken_ = true;
      }
      if (!writing_.empty()) {
        next = &writing_.front();
      } else if (finish_requested_ && !finished_) {
        finished_ = true;
        finish = true;
        status = finish_status_;
      }
    }
    if (next != nullptr) StartWrite(next);
    if (finish) Finish(status);
  }
  void OnDone() override;

  // Queues a message (called through the handle, under its lock: the reactor is alive).
  void Enqueue(pb::SessionResponse response) {
    const pb::SessionResponse* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finish_requested_ || broken_) return;
      writing_.push_back(std::move(response));
      if (writing_.size() == 1) start = &writing_.front();
    }
    if (start != nullptr) StartWrite(start);
  }
  void RequestFinish(const absl::Status& status) {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      if (finish_requested_) return;
      finish_requested_ = true;
      finish_status_ = ToGrpcStatus(status);
      if (writing_.empty()) {
        finished_ = true;
        finish = true;
      }
    }
    if (finish) Finish(finish_status_);
  }

 private:
  SidecarImpl* sidecar_;
  std::shared_ptr<SessionHandle> handle_;
  pb::SessionRequest request_;
  std::shared_ptr<Group> group_;  // set once attached
  int rank_ = -1;
  bool read_done_ = false;

  absl::Mutex mu_;
  std::deque<pb::SessionResponse> writing_ ABSL_GUARDED_BY(mu_);  // front = in flight
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_;
};

void SessionHandle::Send(pb::SessionResponse response) {
  absl::MutexLock lock(&mu_);
  if (reactor_ != nullptr) reactor_->Enqueue(std::move(response));
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
    return new SessionReactor(sidecar_);
  }

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
    if (options_.allreduce_algorithm != "auto" && options_.allreduce_algorithm != "direct" &&
        options_.allreduce_algorithm != "ring" && options_.allreduce_algorithm != "bcube") {
      return absl::InvalidArgumentError(absl::StrCat("--allreduce_algorithm=", options_.allreduce_algorithm,
                                                     ": use auto, direct, ring or bcube"));
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    channel_ = grpc::CreateCustomChannel(options_.coordinator_address, grpc::InsecureChannelCredentials(), args);
    if (!channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + options_.coordinator_connect_timeout))) {
      return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", options_.coordinator_address));
    }
    registry_ = pb::Registry::NewStub(channel_);
    int threads = options_.data_threads;
    if (threads <= 0) threads = static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
    pool_ = std::make_unique<backends::ThreadPool>(threads);
    metrics_ = std::make_shared<prometheus::Registry>();
    collectives_ = &prometheus::BuildCounter()
                        .Name("collserve_collectives_total")
                        .Help("Collectives completed for local ranks, by op and status code.")
                        .Register(*metrics_);
    auto& tensor_bytes = prometheus::BuildCounter()
                             .Name("collserve_tensor_bytes_total")
                             .Help("Bytes of local ranks' tensors (inputs and outputs) given to collectives and "
                                   "point-to-point operations, by how they reached the sidecar: arena (the "
                                   "client's AllocateShared memory, no copy), staged (copied by the SDK through a "
                                   "staging segment), inline (inside the gRPC messages).")
                             .Register(*metrics_);
    bytes_arena_ = &tensor_bytes.Add({{"path", "arena"}});
    bytes_staged_ = &tensor_bytes.Add({{"path", "staged"}});
    bytes_inline_ = &tensor_bytes.Add({{"path", "inline"}});
    janitor_ = std::thread([this] { JanitorMain(); });

    service_ = std::make_unique<CollectivesService>(this);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    if (!options_.unix_socket.empty()) {
      const std::string dir = options_.unix_socket.substr(0, options_.unix_socket.rfind('/'));
      if (!dir.empty()) mkdir(dir.c_str(), 0755);
      unlink(options_.unix_socket.c_str());  // a stale socket from a dead sidecar
      builder.AddListeningPort(absl::StrCat("unix:", options_.unix_socket), grpc::InsecureServerCredentials());
    }
    if (!options_.listen_address.empty()) {
      builder.AddListeningPort(options_.listen_address, grpc::InsecureServerCredentials(), &port_);
    }
    builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    builder.SetMaxSendMessageSize(kMaxMessageBytes);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || (!options_.listen_address.empty() && port_ == 0)) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.unix_socket, " / ",
                                                 options_.listen_address));
    }
    if (!options_.unix_socket.empty() && options_.unix_socket_mode >= 0 &&
        chmod(options_.unix_socket.c_str(), static_cast<mode_t>(options_.unix_socket_mode)) != 0) {
      return absl::UnavailableError(absl::StrCat("chmod ", options_.unix_socket, ": ", std::strerror(errno)));
    }
    server_->GetHealthCheckService()->SetServingStatus("collserve.v1.Collectives", true);
    auto exposer = ServeMetrics(options_.metrics_address, metrics_);
    if (!exposer.ok()) return exposer.status();
    exposer_ = std::move(*exposer);
    return absl::OkStatus();
  }

  int port() const override { return port_; }
  const std::string& host_id() const override { return options_.host_id; }

  void Shutdown(absl::Duration grace) override {
    if (server_ == nullptr) return;
    std::vector<std::shared_ptr<Group>> groups;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [key, g] : groups_) groups.push_back(g);
    }
    for (auto& g : groups) g->Stop();
    server_->GetHealthCheckService()->Shutdown();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
    server_.reset();
    std::map<std::pair<std::string, std::string>, std::shared_ptr<Group>> doomed;
    {
      absl::MutexLock lock(&mu_);
      doomed.swap(groups_);
      stopping_ = true;
    }
    groups.clear();
    doomed.clear();  // outside mu_: a group's destructor joins its executor
    janitor_cv_.notify_all();
    if (janitor_.joinable()) janitor_.join();
    exposer_.reset();
    if (!options_.unix_socket.empty()) unlink(options_.unix_socket.c_str());
  }

  // Handles the first message of a session. Returns the group on success.
  absl::StatusOr<std::shared_ptr<Group>> Attach(const pb::Attach& attach, std::shared_ptr<Session> session) {
    if (attach.group().empty()) return absl::InvalidArgumentError("empty group name");
    if (attach.world_size() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("world_size ", attach.world_size(), " must be > 0"));
    }
    if (attach.rank() < 0 || attach.rank() >= attach.world_size()) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", attach.rank(), " is out of range for group \"",
                                                     attach.group(), "\" of world_size ", attach.world_size()));
    }
    bool shm = false;
    if (!attach.probe_segment().empty() && attach.probe_nonce().size() == 16) {
      auto probe = ShmSegment::Open(attach.probe_segment(), 16);
      shm = probe.ok() && std::memcmp((*probe)->data(), attach.probe_nonce().data(), 16) == 0;
      if (shm) ShmSegment::Remove(attach.probe_segment());
    }
    GroupParams params;
    params.job = attach.job().empty() ? "default" : attach.job();
    params.name = attach.group();
    params.world_size = attach.world_size();
    params.init_timeout = attach.init_timeout_ms() > 0 ? absl::Milliseconds(attach.init_timeout_ms())
                                                       : absl::Seconds(300);
    params.op_timeout = attach.op_timeout_ms() > 0 ? absl::Milliseconds(attach.op_timeout_ms())
                                                   : absl::Seconds(300);
    for (;;) {
      std::shared_ptr<Group> group = GetOrCreate(params);
      absl::Status s = group->AddLocal(attach.rank(), attach.world_size(), session, shm);
      if (s.code() == absl::StatusCode::kAborted) {
        // It was emptied between lookup and AddLocal: make a fresh one.
        absl::MutexLock lock(&mu_);
        auto it = groups_.find({params.job, params.name});
        if (it != groups_.end() && it->second == group) groups_.erase(it);
        continue;
      }
      if (!s.ok()) return s;
      StartJoin(group, params, attach.rank());
      return group;
    }
  }

 private:
  std::shared_ptr<Group> GetOrCreate(const GroupParams& params) {
    absl::MutexLock lock(&mu_);
    auto& slot = groups_[{params.job, params.name}];
    if (slot == nullptr) {
      GroupEnv env;
      env.host_id = options_.host_id;
      env.gloo_hostname = options_.gloo_hostname;
      env.collectives = collectives_;
      env.bytes_arena = bytes_arena_;
      env.bytes_staged = bytes_staged_;
      env.bytes_inline = bytes_inline_;
      env.pool = pool_.get();
      env.allreduce_algorithm = options_.allreduce_algorithm;
      env.ring_min_bytes = options_.ring_min_bytes;
      env.direct_max_bytes = options_.direct_max_bytes;
      env.ring_segment_bytes = options_.ring_segment_bytes;
      env.rendezvous = [this](const std::string& job) -> std::unique_ptr<backends::RendezvousStore> {
        client::StoreClientOptions so;
        so.job = job;
        so.connect_timeout = absl::Seconds(10);
        auto store = client::StoreClient::Connect(options_.coordinator_address, so);
        if (!store.ok()) return std::make_unique<UnreachableStore>(store.status());
        return std::make_unique<StoreRendezvous>(std::move(*store));
      };
      env.leave = [this](const std::string& job, const std::string& group, int rank) { Leave(job, group, rank); };
      env.on_empty = [this](const std::string& job, const std::string& group) { Remove(job, group); };
      slot = std::make_shared<Group>(std::move(env), params);
    }
    return slot;
  }

  void Remove(const std::string& job, const std::string& group) {
    {
      std::lock_guard<std::mutex> jl(janitor_mu_);
      absl::MutexLock lock(&mu_);
      auto it = groups_.find({job, group});
      if (it == groups_.end()) return;
      graveyard_.push_back(std::move(it->second));
      groups_.erase(it);
    }
    janitor_cv_.notify_all();
  }

  // Destroys removed groups (joining their executors) off the gRPC threads.
  void JanitorMain() {
    std::unique_lock<std::mutex> lock(janitor_mu_);
    for (;;) {
      janitor_cv_.wait(lock, [this] {
        absl::MutexLock l(&mu_);
        return stopping_ || !graveyard_.empty();
      });
      std::vector<std::shared_ptr<Group>> dead;
      bool stopping;
      {
        absl::MutexLock l(&mu_);
        dead.swap(graveyard_);
        stopping = stopping_;
      }
      lock.unlock();
      dead.clear();
      lock.lock();
      if (stopping) return;
    }
  }

  void StartJoin(const std::shared_ptr<Group>& group, const GroupParams& params, int rank) {
    struct Call {
      grpc::ClientContext ctx;
      pb::JoinRequest req;
      pb::JoinResponse resp;
    };
    auto call = std::make_shared<Call>();
    call->req.set_job(params.job);
    call->req.set_group(params.name);
    call->req.set_world_size(params.world_size);
    call->req.mutable_member()->set_rank(rank);
    call->req.mutable_member()->set_host_id(options_.host_id);
    call->req.mutable_member()->set_host_address(options_.gloo_hostname);
    call->req.set_timeout_ms(absl::ToInt64Milliseconds(params.init_timeout));
    call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + params.init_timeout + absl::Seconds(5)));
    const std::string coordinator = options_.coordinator_address;
    group->SetJoinCanceller(rank, [call] { call->ctx.TryCancel(); });
    registry_->async()->Join(&call->ctx, &call->req, &call->resp, [group, rank, call, coordinator](grpc::Status s) {
      if (s.ok()) {
        group->OnJoined(rank, call->resp);
        return;
      }
      absl::Status st = FromGrpcStatus(s);
      if (st.code() == absl::StatusCode::kUnavailable) {
        st = absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", coordinator, ": ", st.message()));
      }
      group->OnJoined(rank, st);
    });
  }

  void Leave(const std::string& job, const std::string& group, int rank) {
    struct Call {
      grpc::ClientContext ctx;
      pb::LeaveRequest req;
      pb::LeaveResponse resp;
    };
    auto call = std::make_shared<Call>();
    call->req.set_job(job);
    call->req.set_group(group);
    call->req.set_rank(rank);
    call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    registry_->async()->Leave(&call->ctx, &call->req, &call->resp, [call](grpc::Status s) {
      if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) {
        LOG(WARNING) << "leave of rank " << call->req.rank() << " from group " << call->req.group()
                     << " failed: " << s.error_message();
      }
    });
  }

  class UnreachableStore : public backends::RendezvousStore {
   public:
    explicit UnreachableStore(absl::Status s) : s_(std::move(s)) {}
    absl::Status Set(const std::string&, const std::string&) override { return s_; }
    absl::StatusOr<std::string> Get(const std::string&, absl::Duration) override { return s_; }
    absl::Status Wait(const std::vector<std::string>&, absl::Duration) override { return s_; }
    absl::StatusOr<int64_t> Add(const std::string&, int64_t) override { return s_; }

   private:
    absl::Status s_;
  };

  SidecarOptions options_;
  std::unique_ptr<backends::ThreadPool> pool_;  // outlives the groups (declared before them)
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Registry::Stub> registry_;
  std::shared_ptr<prometheus::Registry> metrics_;
  prometheus::Family<prometheus::Counter>* collectives_ = nullptr;
  prometheus::Counter* bytes_arena_ = nullptr;
  prometheus::Counter* bytes_staged_ = nullptr;
  prometheus::Counter* bytes_inline_ = nullptr;
  std::unique_ptr<CollectivesService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;

  absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Group>> graveyard_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::mutex janitor_mu_;
  std::condition_variable janitor_cv_;
  std::thread janitor_;

  friend class SessionReactor;
};

void SessionReactor::OnReadDone(bool ok) {
  if (!ok) {
    read_done_ = true;
    if (group_ != nullptr) group_->OnSessionClosed(rank_);
    RequestFinish(absl::OkStatus());
    return;
  }
  if (group_ == nullptr) {
    if (!request_.has_attach()) {
      RequestFinish(absl::FailedPreconditionError("the first message of a session must be attach"));
      return;
    }
    auto group = sidecar_->Attach(request_.attach(), handle_);
    if (!group.ok()) {
      RequestFinish(group.status());
      return;
    }
    group_ = std::move(*group);
    rank_ = request_.attach().rank();
  } else if (request_.has_collective()) {
    group_->Submit(rank_, std::move(*request_.mutable_collective()));
  } else {
    RequestFinish(absl::FailedPreconditionError("attach sent twice on one session"));
    group_->OnSessionClosed(rank_);
    return;
  }
  request_.Clear();
  StartRead(&request_);
}

void SessionReactor::OnDone() {
  handle_->Detach();
  if (group_ != nullptr && !read_done_) group_->OnSessionClosed(rank_);
  delete this;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Sidecar>> Sidecar::Start(const SidecarOptions& options) {
  auto s = std::make_unique<SidecarImpl>(options);
  if (absl::Status st = s->Init(); !st.ok()) return st;
  return std::unique_ptr<Sidecar>(std::move(s));
}

}  // namespace collserve::server
