// The coordinator's gRPC services: a thin layer of request -> validate -> authorize ->
// store/registry -> status (STYLE.md §1). Every call is authorized for the job it names
// by the bearer token in its "authorization" metadata (credentials.h, auth.proto).
// Waiting calls (Get, Wait, MultiGet, Join) use the callback API and hold no server thread
// while parked.
#ifndef COLLSERVE_SERVER_COORDINATOR_SERVICES_H_
#define COLLSERVE_SERVER_COORDINATOR_SERVICES_H_

#include <memory>

#include "absl/time/time.h"
#include "collserve/v1/auth.grpc.pb.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "collserve/v1/store.grpc.pb.h"
#include "absl/functional/any_invocable.h"
#include "server/common/blocking_pool.h"
#include "server/common/metrics.h"
#include "server/coordinator/credentials.h"
#include "server/coordinator/group_registry.h"
#include "server/coordinator/jobs.h"
#include "server/coordinator/registry_replication.h"
#include "store/store.h"

namespace collserve::server {

// Timeout used when a request's timeout_ms is 0 (as torch's default store timeout is 300 s).
inline constexpr absl::Duration kDefaultWaitTimeout = absl::Seconds(300);

class StoreService final : public collserve::v1::Store::CallbackService {
 public:
  // `store`, `credentials` and `metrics` must outlive the service. `write_threads` > 0 runs
  // writes on that many threads of the service's own (BlockingPool), so that writes to a
  // durable store, which wait for their fdatasync, hold no gRPC thread and share
  // fdatasyncs; 0 runs them on gRPC's thread (a memory-only store never waits).
  StoreService(store::Store& store, const JobCredentials& credentials, RpcMetrics& metrics, int write_threads = 0)
      : store_(store),
        credentials_(credentials),
        metrics_(metrics),
        writes_(write_threads > 0 ? std::make_unique<BlockingPool>(write_threads) : nullptr) {}

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx, const collserve::v1::SetRequest* req,
                                collserve::v1::SetResponse* resp) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const collserve::v1::GetRequest* req,
                                collserve::v1::GetResponse* resp) override;
  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* ctx, const collserve::v1::AddRequest* req,
                                collserve::v1::AddResponse* resp) override;
  grpc::ServerUnaryReactor* CompareSet(grpc::CallbackServerContext* ctx,
                                       const collserve::v1::CompareSetRequest* req,
                                       collserve::v1::CompareSetResponse* resp) override;
  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const collserve::v1::CheckRequest* req,
                                  collserve::v1::CheckResponse* resp) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* ctx, const collserve::v1::WaitRequest* req,
                                 collserve::v1::WaitResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteKey(grpc::CallbackServerContext* ctx,
                                      const collserve::v1::DeleteKeyRequest* req,
                                      collserve::v1::DeleteKeyResponse* resp) override;
  grpc::ServerUnaryReactor* NumKeys(grpc::CallbackServerContext* ctx, const collserve::v1::NumKeysRequest* req,
                                    collserve::v1::NumKeysResponse* resp) override;
  grpc::ServerUnaryReactor* ListKeys(grpc::CallbackServerContext* ctx, const collserve::v1::ListKeysRequest* req,
                                     collserve::v1::ListKeysResponse* resp) override;
  grpc::ServerUnaryReactor* MultiGet(grpc::CallbackServerContext* ctx,
                                     const collserve::v1::MultiGetRequest* req,
                                     collserve::v1::MultiGetResponse* resp) override;
  grpc::ServerUnaryReactor* MultiSet(grpc::CallbackServerContext* ctx,
                                     const collserve::v1::MultiSetRequest* req,
                                     collserve::v1::MultiSetResponse* resp) override;
  grpc::ServerUnaryReactor* Append(grpc::CallbackServerContext* ctx, const collserve::v1::AppendRequest* req,
                                   collserve::v1::AppendResponse* resp) override;

 private:
  // Waits (without a thread) for `keys` of `job`, then runs `then` and finishes with its status.
  // `then` runs on writes_ when the store's reads may block (Store::ReadsMayBlock: etcd), else
  // on the thread that completed the wait.
  grpc::ServerUnaryReactor* WaitThen(grpc::CallbackServerContext* ctx, const char* method,
                                     const std::string& job, const std::vector<std::string>& keys,
                                     int64_t timeout_ms, std::function<absl::Status()> then);
  grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const char* method,
                                 absl::Time start, const absl::Status& status);
  // Runs `write` (a store write; its status names keys with the job's prefix) on writes_
  // (inline without one) and finishes the call with its status.
  grpc::ServerUnaryReactor* Write(grpc::CallbackServerContext* ctx, const char* method, absl::Time start,
                                  const std::string& job, absl::AnyInvocable<absl::Status() &&> write);

  store::Store& store_;
  const JobCredentials& credentials_;
  RpcMetrics& metrics_;
  std::unique_ptr<BlockingPool> writes_;  // null: writes run on gRPC's threads
};

// With `replication` (coordinator replicas over etcd, registry_replication.h), a call that
// reaches a replica which does not lead the registry is forwarded to the leader unchanged:
// the same request, the caller's authorization and deadline; the leader's answer or error is
// the answer. UNAVAILABLE (retryable) while no leader is known.
class RegistryService final : public collserve::v1::Registry::CallbackService {
 public:
  // `store` (for ListJobs' key counts) and `replication` (null = this coordinator alone
  // holds the registry) must outlive the service.
  RegistryService(GroupRegistry& registry, store::Store& store, const JobCredentials& credentials, RpcMetrics& metrics,
                  RegistryReplication* replication = nullptr)
      : registry_(registry), store_(store), credentials_(credentials), metrics_(metrics), replication_(replication) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const collserve::v1::JoinRequest* req,
                                 collserve::v1::JoinResponse* resp) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const collserve::v1::LeaveRequest* req,
                                  collserve::v1::LeaveResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteGroup(grpc::CallbackServerContext* ctx,
                                        const collserve::v1::DeleteGroupRequest* req,
                                        collserve::v1::DeleteGroupResponse* resp) override;
  grpc::ServerUnaryReactor* Describe(grpc::CallbackServerContext* ctx,
                                     const collserve::v1::DescribeRequest* req,
                                     collserve::v1::DescribeResponse* resp) override;
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx, const collserve::v1::ListRequest* req,
                                 collserve::v1::ListResponse* resp) override;
  grpc::ServerUnaryReactor* ReportProgress(grpc::CallbackServerContext* ctx,
                                           const collserve::v1::ReportProgressRequest* req,
                                           collserve::v1::ReportProgressResponse* resp) override;
  grpc::ServerUnaryReactor* WatchGroup(grpc::CallbackServerContext* ctx, const collserve::v1::WatchGroupRequest* req,
                                       collserve::v1::WatchGroupResponse* resp) override;
  grpc::ServerUnaryReactor* DiagnoseGroup(grpc::CallbackServerContext* ctx,
                                          const collserve::v1::DiagnoseGroupRequest* req,
                                          collserve::v1::DiagnoseGroupResponse* resp) override;
  grpc::ServerUnaryReactor* DumpGroup(grpc::CallbackServerContext* ctx, const collserve::v1::DumpGroupRequest* req,
                                      collserve::v1::DumpGroupResponse* resp) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx, const collserve::v1::ListJobsRequest* req,
                                     collserve::v1::ListJobsResponse* resp) override;

 private:
  GroupRegistry& registry_;
  store::Store& store_;
  const JobCredentials& credentials_;
  RpcMetrics& metrics_;
  RegistryReplication* const replication_;

  // The async stub method a call is forwarded through.
  template <typename Req, typename Resp>
  using ForwardCall = void (collserve::v1::Registry::StubInterface::async_interface::*)(
      grpc::ClientContext*, const Req*, Resp*, std::function<void(grpc::Status)>);
  // Null when this replica serves the call itself; otherwise the reactor of the call,
  // forwarded to the leader (or refused: no leader known).
  template <typename Req, typename Resp>
  grpc::ServerUnaryReactor* Forwarded(grpc::CallbackServerContext* ctx, const char* method, const Req* req,
                                      Resp* resp, ForwardCall<Req, Resp> call);
};

// Authenticate, MintJobToken, RevokeJobTokens (auth.proto).
class AuthService final : public collserve::v1::Auth::CallbackService {
 public:
  // `policies`: each job's limits on the sidecars (job_policies.h), sent with every
  // Authenticate answer; it must outlive the service.
  AuthService(JobCredentials& credentials, RpcMetrics& metrics, const collserve::v1::JobPolicies& policies)
      : credentials_(credentials), metrics_(metrics), policies_(policies) {}

  grpc::ServerUnaryReactor* Authenticate(grpc::CallbackServerContext* ctx,
                                         const collserve::v1::AuthenticateRequest* req,
                                         collserve::v1::AuthenticateResponse* resp) override;
  grpc::ServerUnaryReactor* MintJobToken(grpc::CallbackServerContext* ctx,
                                         const collserve::v1::MintJobTokenRequest* req,
                                         collserve::v1::MintJobTokenResponse* resp) override;
  grpc::ServerUnaryReactor* RevokeJobTokens(grpc::CallbackServerContext* ctx,
                                            const collserve::v1::RevokeJobTokensRequest* req,
                                            collserve::v1::RevokeJobTokensResponse* resp) override;

 private:
  JobCredentials& credentials_;
  RpcMetrics& metrics_;
  const collserve::v1::JobPolicies& policies_;
};

// The value of the call's "authorization" metadata ("" when absent).
std::string AuthorizationOf(const grpc::CallbackServerContext& ctx);

// ValidateJob, then whether the call's token grants `job` (JobCredentials::Authorize).
absl::Status AuthorizeJob(const grpc::CallbackServerContext& ctx, const JobCredentials& credentials,
                          const std::string& job);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_SERVICES_H_
