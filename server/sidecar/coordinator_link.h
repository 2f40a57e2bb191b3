// engine::CoordinatorLink over the coordinator's gRPC services: joins and leaves through
// the Registry, backend rendezvous through the Store (client SDK).
#ifndef COLLSERVE_SERVER_SIDECAR_COORDINATOR_LINK_H_
#define COLLSERVE_SERVER_SIDECAR_COORDINATOR_LINK_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "collserve/client.h"
#include "collserve/v1/auth.grpc.pb.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "engine/interfaces.h"

namespace collserve::server {

// Thread-safe. Join's deadline is the rendezvous timeout plus 5 s; Leave's 10 s. Every call
// carries the credential it is given as the caller's bearer token (client::AddJobToken).
class GrpcCoordinatorLink : public engine::CoordinatorLink {
 public:
  // `host_id` and `host_address` are this sidecar's, as members of every group it joins.
  // `tls`: how the rendezvous store clients reach the coordinator (as `channel` does).
  GrpcCoordinatorLink(std::shared_ptr<grpc::Channel> channel, std::string coordinator_address,
                      client::TlsOptions tls, std::string host_id, std::string host_address);
  // Cancels the asynchronous calls still in flight and waits (at most kDrainTimeout) for
  // their callbacks, so that none runs on a gRPC thread after the link, or the process's
  // globals at exit, are gone (a watch is always in flight while a group across hosts runs;
  // a callback completing during exit freed memory twice under ASan).
  ~GrpcCoordinatorLink() override;
  static constexpr absl::Duration kDrainTimeout = absl::Seconds(10);
  // This sidecar's gRPC address (host:port of its TCP listener), sent with its joins as
  // Member.sidecar_address. Call before the first Join (the sidecar does, before serving).
  void set_sidecar_address(std::string address) { sidecar_address_ = std::move(address); }
  // This process's Member.incarnation (sent with every join): random, non-zero, drawn when
  // the link is made, so that a sidecar restarted with the same host id is a new host to the
  // coordinator, which takes the earlier process's ranks as lost at once.
  uint64_t incarnation() const { return incarnation_; }
  std::function<void()> Join(const JoinParams& params,
                             std::function<void(absl::StatusOr<engine::Membership>)> done) override;
  void Leave(const std::string& job, const std::string& group, int rank, int64_t generation,
             const std::string& credential) override;
  std::unique_ptr<backends::RendezvousStore> RendezvousStoreFor(const std::string& job,
                                                                const std::string& credential) override;
  // Registry.ReportProgress, asynchronous; deadline 5 s; failures are logged at VLOG(1).
  // Each report carries draining_since_unix_ms (set_draining_since).
  void ReportProgress(const engine::GroupProgress& progress, const std::string& credential) override;
  // When this sidecar started draining (Unix ms), sent with every later ledger report so
  // that diagnose and health name the drain; 0 = not draining. Thread-safe.
  void set_draining_since(int64_t unix_ms) { draining_since_unix_ms_.store(unix_ms); }
  // Registry.WatchGroup, asynchronous; the call's deadline is the wait plus 5 s, and it
  // waits for a reconnecting channel (wait_for_ready) within it.
  std::function<void()> WatchGroup(const WatchParams& params,
                                   std::function<void(absl::StatusOr<engine::GroupEvents>)> done) override;
  // Registry.DiagnoseGroup's summary.
  absl::StatusOr<std::string> Diagnose(const std::string& job, const std::string& group,
                                       const std::string& credential, absl::Duration timeout) override;

  // Asks the coordinator whether `credential` grants `job` (Auth.Authenticate); `done` runs
  // once, on a gRPC thread, with the job's policy on this sidecar (its quotas; all zero from
  // a coordinator without --job_policies_file) or the coordinator's UNAUTHENTICATED /
  // PERMISSION_DENIED (or UNAVAILABLE naming the coordinator and the attempts), within
  // `timeout`. An attempt that a coordinator restart fails (UNAVAILABLE) is retried within
  // `timeout`, as Join's are. Never blocks.
  void Authenticate(const std::string& job, const std::string& credential, absl::Duration timeout,
                    std::function<void(absl::StatusOr<collserve::v1::JobPolicy>)> done);

 private:
  std::unique_ptr<collserve::v1::Registry::Stub> registry_;
  std::unique_ptr<collserve::v1::Auth::Stub> auth_;
  const std::string coordinator_address_;
  const client::TlsOptions tls_;
  const std::string host_id_;
  const std::string host_address_;
  std::string sidecar_address_;  // set before serving, read-only afterwards
  const uint64_t incarnation_;
  std::atomic<int64_t> draining_since_unix_ms_{0};

 public:
  // The asynchronous calls in flight. Each call's Token (declared before its
  // ClientContext, so destroyed after it) counts it; Track/Untrack register its context
  // for cancellation while gRPC runs it. Thread-safe.
  class InFlightCalls {
   public:
    class Token {
     public:
      explicit Token(std::shared_ptr<InFlightCalls> calls);
      ~Token();
      Token(const Token&) = delete;
      Token& operator=(const Token&) = delete;
      void Track(grpc::ClientContext* ctx);  // before the call starts (cancelled at once if closed)
      void Untrack();                         // first thing in its callback

     private:
      std::shared_ptr<InFlightCalls> calls_;
      grpc::ClientContext* ctx_ = nullptr;  // guarded by calls_->mu_
    };
    // Cancels every tracked call, refuses later ones (cancelled as they start) and waits
    // until every token is gone; false after `timeout`.
    bool CancelAndWait(absl::Duration timeout);

   private:
    absl::Mutex mu_;
    int count_ ABSL_GUARDED_BY(mu_) = 0;
    std::set<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
    bool closed_ ABSL_GUARDED_BY(mu_) = false;
  };

 private:
  std::shared_ptr<InFlightCalls> calls_ = std::make_shared<InFlightCalls>();
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_COORDINATOR_LINK_H_
