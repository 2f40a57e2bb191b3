#include "server/sidecar/coordinator_link.h"

#include <glog/logging.h>

#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "collserve/client.h"
#include "common/grpc_status.h"
#include "server/common/ledger_proto.h"
#include "server/sidecar/translate.h"

namespace collserve::server {
namespace {

namespace pb = ::collserve::v1;

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

// A store whose every call fails with the connect error.
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

// One unary call to the coordinator, retried while the coordinator does not answer until
// `deadline`: a restart fails the attempt in flight with UNAVAILABLE ("Socket closed"; gRPC
// retries transparently only a call that never left the client), and the next attempt
// waits for the channel to reconnect (wait_for_ready). Only for idempotent requests. `done`
// runs once, on a gRPC thread, with OK and the response, the coordinator's error, or
// UNAVAILABLE naming the coordinator and the attempts. Thread-safe; Cancel from any thread.
template <typename Req, typename Resp>
struct RetriedCall : std::enable_shared_from_this<RetriedCall<Req, Resp>> {
  using Callback = std::function<void(grpc::Status)>;
  explicit RetriedCall(std::shared_ptr<GrpcCoordinatorLink::InFlightCalls> calls)
      : token(std::make_unique<GrpcCoordinatorLink::InFlightCalls::Token>(std::move(calls))) {}

  std::function<void(grpc::ClientContext*, const Req*, Resp*, Callback)> start;  // the stub's async method
  std::string coordinator;  // its address, for the errors
  std::string what;         // appended to "cannot reach the coordinator at ADDRESS"
  std::string credential;
  absl::Time deadline;
  Req req;
  std::function<void(absl::Status, const Resp&)> done;

  void Attempt() {
    grpc::ClientContext* attempt_ctx;
    {
      absl::MutexLock lock(&mu);
      if (!cancelled) {
        ++attempts;
        ctx = std::make_unique<grpc::ClientContext>();
        ctx->set_deadline(absl::ToChronoTime(deadline));
        ctx->set_wait_for_ready(true);
        client::AddJobToken(*ctx, credential);
      }
      attempt_ctx = cancelled ? nullptr : ctx.get();
    }
    if (attempt_ctx == nullptr) {
      done(absl::CancelledError("cancelled"), resp);
      return;
    }
    resp.Clear();
    token->Track(attempt_ctx);
    // Not under `mu`: the callback may run before start returns. A Cancel in between
    // cancels the call as it starts (ClientContext::TryCancel).
    start(attempt_ctx, &req, &resp, [self = this->shared_from_this()](grpc::Status s) { self->Finished(s); });
  }
  void Cancel() {
    absl::MutexLock lock(&mu);
    cancelled = true;
    if (ctx != nullptr) ctx->TryCancel();
  }

 private:
  void Finished(const grpc::Status& s) {
    token->Untrack();
    if (s.ok()) {
      done(absl::OkStatus(), resp);
      return;
    }
    constexpr int kMaxAttempts = 50;  // a server answering UNAVAILABLE at once must not spin
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE && absl::Now() < deadline && attempts < kMaxAttempts) {
      absl::SleepFor(absl::Milliseconds(20 * attempts));  // on a gRPC callback thread; short
      Attempt();
      return;
    }
    absl::Status st = FromGrpcStatus(s);
    // DEADLINE_EXCEEDED before `deadline` is the coordinator's answer (a rendezvous that
    // timed out), not a coordinator that stayed away.
    if (st.code() == absl::StatusCode::kUnavailable ||
        (st.code() == absl::StatusCode::kDeadlineExceeded && attempts > 1 && absl::Now() >= deadline)) {
      st = absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", coordinator, what, " (",
                                               attempts, attempts == 1 ? " attempt): " : " attempts): ",
                                               st.message()));
    }
    done(st, resp);
  }

  std::unique_ptr<GrpcCoordinatorLink::InFlightCalls::Token> token;  // while an attempt is in flight
  absl::Mutex mu;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  std::unique_ptr<grpc::ClientContext> ctx ABSL_GUARDED_BY(mu);
  Resp resp;
  int attempts = 0;
};

}  // namespace

namespace {

uint64_t DrawIncarnation() {
  std::random_device device;
  uint64_t n = 0;
  while (n == 0) n = (static_cast<uint64_t>(device()) << 32) ^ device();
  return n;
}

}  // namespace

GrpcCoordinatorLink::GrpcCoordinatorLink(std::shared_ptr<grpc::Channel> channel, std::string coordinator_address,
                                         client::TlsOptions tls, std::string host_id, std::string host_address)
    : registry_(pb::Registry::NewStub(channel)),
      auth_(pb::Auth::NewStub(channel)),
      coordinator_address_(std::move(coordinator_address)),
      tls_(std::move(tls)),
      host_id_(std::move(host_id)),
      host_address_(std::move(host_address)),
      incarnation_(DrawIncarnation()) {}

GrpcCoordinatorLink::~GrpcCoordinatorLink() {
  if (!calls_->CancelAndWait(kDrainTimeout)) {
    LOG(WARNING) << "coordinator calls still in flight after " << absl::FormatDuration(kDrainTimeout);
  }
}

void GrpcCoordinatorLink::InFlightCalls::Token::Track(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&calls_->mu_);
  ctx_ = ctx;
  calls_->contexts_.insert(ctx);
  if (calls_->closed_) ctx->TryCancel();
}

void GrpcCoordinatorLink::InFlightCalls::Token::Untrack() {
  absl::MutexLock lock(&calls_->mu_);
  if (ctx_ != nullptr) calls_->contexts_.erase(ctx_);
  ctx_ = nullptr;
}

GrpcCoordinatorLink::InFlightCalls::Token::Token(std::shared_ptr<InFlightCalls> calls) : calls_(std::move(calls)) {
  absl::MutexLock lock(&calls_->mu_);
  ++calls_->count_;
}

GrpcCoordinatorLink::InFlightCalls::Token::~Token() {
  absl::MutexLock lock(&calls_->mu_);
  if (ctx_ != nullptr) calls_->contexts_.erase(ctx_);
  --calls_->count_;
}

bool GrpcCoordinatorLink::InFlightCalls::CancelAndWait(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  for (grpc::ClientContext* ctx : contexts_) ctx->TryCancel();
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&drained), timeout);
}

std::function<void()> GrpcCoordinatorLink::Join(const JoinParams& params,
                                                std::function<void(absl::StatusOr<engine::Membership>)> done) {
  // A restarted coordinator has no record of the first attempt, so a retry joins afresh;
  // one that did record it treats the same rank joining again from the same host as that
  // rank's join.
  auto join = std::make_shared<RetriedCall<pb::JoinRequest, pb::JoinResponse>>(calls_);
  join->start = [stub = registry_.get()](grpc::ClientContext* ctx, const pb::JoinRequest* req,
                                         pb::JoinResponse* resp, std::function<void(grpc::Status)> cb) {
    stub->async()->Join(ctx, req, resp, std::move(cb));
  };
  join->coordinator = coordinator_address_;
  join->credential = params.credential;
  join->deadline = absl::Now() + params.timeout + absl::Seconds(5);
  join->done = [done = std::move(done)](absl::Status s, const pb::JoinResponse& resp) {
    if (!s.ok()) {
      done(std::move(s));
    } else {
      done(FromProto(resp));
    }
  };
  join->req.set_job(params.job);
  join->req.set_group(params.group);
  join->req.set_world_size(params.world_size);
  join->req.mutable_member()->set_rank(params.rank);
  join->req.mutable_member()->set_host_id(host_id_);
  join->req.mutable_member()->set_host_address(host_address_);
  join->req.mutable_member()->set_sidecar_address(sidecar_address_);
  join->req.mutable_member()->set_incarnation(incarnation_);
  join->req.mutable_member()->set_backend(params.backend);
  join->req.mutable_member()->set_rendezvous_ids(true);  // engine/executor.cc names its keys with it
  join->req.set_timeout_ms(absl::ToInt64Milliseconds(params.timeout));
  join->req.set_generation(params.generation);
  join->req.set_compact(true);
  join->Attempt();
  return [join] { join->Cancel(); };
}

void GrpcCoordinatorLink::Leave(const std::string& job, const std::string& group, int rank, int64_t generation,
                                const std::string& credential) {
  struct Call {
    explicit Call(std::shared_ptr<InFlightCalls> calls) : token(std::move(calls)) {}
    InFlightCalls::Token token;  // first: it outlives the context
    grpc::ClientContext ctx;
    pb::LeaveRequest req;
    pb::LeaveResponse resp;
  };
  auto call = std::make_shared<Call>(calls_);
  call->req.set_job(job);
  call->req.set_group(group);
  call->req.set_rank(rank);
  call->req.set_generation(generation);
  call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  call->ctx.set_wait_for_ready(true);  // across a coordinator restart
  client::AddJobToken(call->ctx, credential);
  call->token.Track(&call->ctx);
  registry_->async()->Leave(&call->ctx, &call->req, &call->resp, [call](grpc::Status s) {
    call->token.Untrack();
    if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) {
      LOG(WARNING) << "leave of rank " << call->req.rank() << " from group " << call->req.group()
                   << " failed: " << s.error_message();
    }
  });
}

std::unique_ptr<backends::RendezvousStore> GrpcCoordinatorLink::RendezvousStoreFor(const std::string& job,
                                                                                   const std::string& credential) {
  client::StoreClientOptions so;
  so.job = job;
  so.token = credential;
  so.connect_timeout = absl::Seconds(10);
  so.tls = tls_;
  auto store = client::StoreClient::Connect(coordinator_address_, so);
  if (!store.ok()) return std::make_unique<UnreachableStore>(store.status());
  return std::make_unique<StoreRendezvous>(std::move(*store));
}

void GrpcCoordinatorLink::ReportProgress(const engine::GroupProgress& progress, const std::string& credential) {
  struct Call {
    explicit Call(std::shared_ptr<InFlightCalls> calls) : token(std::move(calls)) {}
    InFlightCalls::Token token;  // first: it outlives the context
    grpc::ClientContext ctx;
    pb::ReportProgressRequest req;
    pb::ReportProgressResponse resp;
  };
  auto call = std::make_shared<Call>(calls_);
  call->req.set_job(progress.job);
  call->req.set_group(progress.group);
  call->req.set_generation(progress.generation);
  call->req.set_host_id(host_id_);
  call->req.set_state(progress.state);
  call->req.set_failure(progress.failure);
  call->req.set_draining_since_unix_ms(draining_since_unix_ms_.load());
  for (const engine::RankProgress& r : progress.ranks) RankProgressToProto(r, call->req.add_ranks());
  for (const FlightRecord& f : progress.records) FlightRecordToProto(f, call->req.add_records());
  call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  client::AddJobToken(call->ctx, credential);
  call->token.Track(&call->ctx);
  registry_->async()->ReportProgress(&call->ctx, &call->req, &call->resp, [call](grpc::Status s) {
    call->token.Untrack();
    if (!s.ok()) VLOG(1) << "ledger report of group " << call->req.group() << " failed: " << s.error_message();
  });
}

std::function<void()> GrpcCoordinatorLink::WatchGroup(
    const WatchParams& params, std::function<void(absl::StatusOr<engine::GroupEvents>)> done) {
  struct Call {
    explicit Call(std::shared_ptr<InFlightCalls> calls) : token(std::move(calls)) {}
    InFlightCalls::Token token;  // first: it outlives the context
    grpc::ClientContext ctx;
    pb::WatchGroupRequest req;
    pb::WatchGroupResponse resp;
  };
  auto call = std::make_shared<Call>(calls_);
  call->req.set_job(params.job);
  call->req.set_group(params.group);
  call->req.set_generation(params.generation);
  call->req.set_host_id(host_id_);
  call->req.set_known(params.known);
  call->req.set_wait_ms(absl::ToInt64Milliseconds(params.wait));
  call->req.set_world_size(static_cast<int32_t>(params.members.size()));
  for (const engine::Member& m : params.members) {
    pb::Member* out = call->req.add_members();
    out->set_rank(m.rank);
    out->set_host_id(m.host_id);
    out->set_host_address(m.host_address);
  }
  call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + params.wait + absl::Seconds(5)));
  call->ctx.set_wait_for_ready(true);
  client::AddJobToken(call->ctx, params.credential);
  call->token.Track(&call->ctx);
  registry_->async()->WatchGroup(&call->ctx, &call->req, &call->resp,
                                 [call, done = std::move(done)](grpc::Status s) {
                                   call->token.Untrack();
                                   if (!s.ok()) {
                                     done(FromGrpcStatus(s));
                                     return;
                                   }
                                   engine::GroupEvents events;
                                   events.generation = call->resp.generation();
                                   events.state = call->resp.state();
                                   for (const pb::Departure& d : call->resp.departures()) {
                                     events.departures.push_back(
                                         engine::Departure{d.rank(), d.host_id(), d.reason(), d.host_lost()});
                                   }
                                   done(std::move(events));
                                 });
  std::weak_ptr<Call> weak = call;
  return [weak] {
    if (auto c = weak.lock()) c->ctx.TryCancel();
  };
}

absl::StatusOr<std::string> GrpcCoordinatorLink::Diagnose(const std::string& job, const std::string& group,
                                                          const std::string& credential, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  client::AddJobToken(ctx, credential);
  pb::DiagnoseGroupRequest req;
  req.set_job(job);
  req.set_group(group);
  pb::DiagnoseGroupResponse resp;
  grpc::Status s = registry_->DiagnoseGroup(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp.summary();
}

void GrpcCoordinatorLink::Authenticate(const std::string& job, const std::string& credential, absl::Duration timeout,
                                       std::function<void(absl::StatusOr<pb::JobPolicy>)> done) {
  auto call = std::make_shared<RetriedCall<pb::AuthenticateRequest, pb::AuthenticateResponse>>(calls_);
  call->start = [stub = auth_.get()](grpc::ClientContext* ctx, const pb::AuthenticateRequest* req,
                                     pb::AuthenticateResponse* resp, std::function<void(grpc::Status)> cb) {
    stub->async()->Authenticate(ctx, req, resp, std::move(cb));
  };
  call->coordinator = coordinator_address_;
  call->what = " to check the job token";
  call->credential = credential;
  call->deadline = absl::Now() + timeout;
  call->done = [done = std::move(done)](absl::Status s, const pb::AuthenticateResponse& resp) {
    if (!s.ok()) {
      done(std::move(s));
      return;
    }
    done(resp.policy());
  };
  call->req.set_job(job);
  call->Attempt();
}

}  // namespace collserve::server
