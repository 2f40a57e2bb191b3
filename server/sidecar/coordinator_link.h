// engine::CoordinatorLink over the coordinator's gRPC services: joins and leaves through
// the Registry, backend rendezvous through the Store (client SDK).
#ifndef COLLSERVE_SERVER_SIDECAR_COORDINATOR_LINK_H_
#define COLLSERVE_SERVER_SIDECAR_COORDINATOR_LINK_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

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
  // This sidecar's gRPC address (host:port of its TCP listener), sent with its joins as
  // Member.sidecar_address. Call before the first Join (the sidecar does, before serving).
  void set_sidecar_address(std::string address) { sidecar_address_ = std::move(address); }
  std::function<void()> Join(const JoinParams& params,
                             std::function<void(absl::StatusOr<engine::Membership>)> done) override;
  void Leave(const std::string& job, const std::string& group, int rank, int64_t generation,
             const std::string& credential) override;
  std::unique_ptr<backends::RendezvousStore> RendezvousStoreFor(const std::string& job,
                                                                const std::string& credential) override;
  // Registry.ReportProgress, asynchronous; deadline 5 s; failures are logged at VLOG(1).
  void ReportProgress(const engine::GroupProgress& progress, const std::string& credential) override;
  // Registry.WatchGroup, asynchronous; the call's deadline is the wait plus 5 s, and it
  // waits for a reconnecting channel (wait_for_ready) within it.
  std::function<void()> WatchGroup(const WatchParams& params,
                                   std::function<void(absl::StatusOr<engine::GroupEvents>)> done) override;
  // Registry.DiagnoseGroup's summary.
  absl::StatusOr<std::string> Diagnose(const std::string& job, const std::string& group,
                                       const std::string& credential, absl::Duration timeout) override;

  // Asks the coordinator whether `credential` grants `job` (Auth.Authenticate); `done` runs
  // once, on a gRPC thread, with OK or the coordinator's UNAUTHENTICATED / PERMISSION_DENIED
  // (or UNAVAILABLE naming the coordinator), within `timeout`. Never blocks.
  void Authenticate(const std::string& job, const std::string& credential, absl::Duration timeout,
                    std::function<void(absl::Status)> done);

 private:
  std::unique_ptr<collserve::v1::Registry::Stub> registry_;
  std::unique_ptr<collserve::v1::Auth::Stub> auth_;
  const std::string coordinator_address_;
  const client::TlsOptions tls_;
  const std::string host_id_;
  const std::string host_address_;
  std::string sidecar_address_;  // set before serving, read-only afterwards
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_COORDINATOR_LINK_H_
