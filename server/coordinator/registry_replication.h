// Coordinator replicas over one etcd: one replica leads the group registry, the others
// forward Registry calls to it.
//
// The store needs no leader: with --etcd_endpoints every replica reads and writes etcd
// (etcd_store.h). The group registry (group_registry.h) is a state machine held in memory,
// with long-polling joins and watches, so replicas share it by electing one replica that
// holds it (the leader) and forwarding every Registry call that reaches another replica to
// the leader, unchanged (the caller's credentials and deadline travel with it). Clients
// therefore reach any replica, e.g. through one Kubernetes Service.
//
// Election (as etcd's own concurrency/election.go and Kubernetes' leader leases do): a
// replica campaigns with a transaction that creates the leader key, holding its address,
// under an etcd lease of `lease_ttl` if the key does not exist; it leads while it keeps that
// lease alive (every lease_ttl / 3). Others read the key every `poll_interval` and campaign
// when it is gone (the leader stopped and revoked its lease, or died and its lease expired).
// A leader that cannot renew its lease for lease_ttl may already have been replaced, so it
// stops leading for good and calls `on_lost` (the coordinator binary exits, to be restarted
// as a fresh follower, as kube-controller-manager does): a replica never serves a registry
// that another replica may also be serving.
//
// A new leader restores the formed generations the registry journal recorded in etcd
// (on_elected, registry_journal.h); forming groups re-join (the sidecars retry UNAVAILABLE
// joins within their deadline), and running groups the journal missed are reported back
// by their sidecars' watches (group_registry.h, adoption).
#ifndef COLLSERVE_SERVER_COORDINATOR_REGISTRY_REPLICATION_H_
#define COLLSERVE_SERVER_COORDINATOR_REGISTRY_REPLICATION_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/channel.h"
#include "collserve/v1/registry.grpc.pb.h"

namespace collserve::server {

struct RegistryReplicationOptions {
  // The etcd key that names the leader (e.g. "<etcd prefix>registry/leader").
  std::string key;
  // host:port at which the other replicas reach this replica's gRPC API (its pod IP and
  // port in Kubernetes).
  std::string advertise_address;
  // How this replica reaches the leader's gRPC API (client::TlsOptions, collserve/client.h):
  // ca_file empty = plaintext; else TLS, verifying the leader's certificate against ca_file
  // and the name server_name (default: the host of the leader's advertise_address, which in
  // Kubernetes is a pod IP that a certificate rarely names, so set it to a DNS name the
  // replicas' certificate holds, e.g. the Service's), and presenting cert_file/key_file when
  // the leader requires client certificates (--tls_client_auth). The coordinator fills it
  // from --replica_tls_ca/--replica_tls_server_name and its own --tls_* files.
  client::TlsOptions tls;
  // The leader's etcd lease, in seconds of etcd's clock: how long a dead leader keeps the
  // registry unavailable before another replica takes over. At least 2 s.
  absl::Duration lease_ttl = absl::Seconds(5);
  // How often a follower reads the leader key.
  absl::Duration poll_interval = absl::Milliseconds(500);
  // Deadline of each call to etcd.
  absl::Duration call_timeout = absl::Seconds(2);
  // Called once, on the election thread, when this replica stops leading because its lease
  // could not be renewed (etcd unreachable or the lease expired). Default: nothing (the
  // replica then forwards like any follower and never campaigns again).
  std::function<void(const absl::Status&)> on_lost;
  // Called when this replica wins an election, before it serves as the leader (Route
  // answers UNAVAILABLE, which callers retry, until it returns): the coordinator restores
  // the registry's formed generations from etcd there (registry_journal.h). Runs on the
  // election thread (the first campaign's on Start's caller); must finish well within
  // lease_ttl, since the lease is renewed only after it. Default: nothing.
  std::function<void()> on_elected;
};

// OK if `tls` (RegistryReplicationOptions::tls) is consistent and its files exist and hold
// PEM; else INVALID_ARGUMENT naming the setting or file. Reads the files; thread-safe.
absl::Status CheckReplicaTls(const client::TlsOptions& tls);

// Thread safety: every method may be called from any thread.
class RegistryReplication {
 public:
  // Starts the election against etcd through `etcd` (a channel to its members, as
  // NewEtcdChannel makes). INVALID_ARGUMENT for an empty key or address, a lease_ttl
  // under 2 s, or TLS options that are inconsistent or name a file that is missing or not
  // PEM (checked here, so that a bad file fails the start, not the first forwarded call). The first campaign runs before Start returns (bounded by call_timeout); an
  // unreachable etcd is not an error here: the replica goes on campaigning.
  static absl::StatusOr<std::unique_ptr<RegistryReplication>> Start(std::shared_ptr<grpc::Channel> etcd,
                                                                     RegistryReplicationOptions options);
  // Stops the election; a leader revokes its lease, so another replica takes over at once
  // (within its poll_interval) instead of after lease_ttl.
  ~RegistryReplication();

  // Where a Registry call that reached this replica goes:
  //  - nullptr and OK: this replica leads, serve it here;
  //  - a stub: forward the call to the leader through it;
  //  - nullptr and UNAVAILABLE: no leader is known, or the call was already forwarded once
  //    (`forwarded`) and this replica does not lead (the sender's view is stale); the
  //    caller retries.
  absl::StatusOr<std::shared_ptr<collserve::v1::Registry::Stub>> Route(bool forwarded);

  bool leading() const;
  // The leader's address as last seen ("" = none known).
  std::string leader() const;
  // Blocks until a leader is known or `timeout` passes; true if one is.
  bool AwaitLeader(absl::Duration timeout) const;

  // Metadata key that marks a forwarded call (its value is the forwarding replica's address).
  static constexpr const char* kForwardedHeader = "collserve-forwarded-by";

 private:
  RegistryReplication(std::shared_ptr<grpc::Channel> etcd, RegistryReplicationOptions options);
  void Loop();
  void Campaign();
  void Poll();
  void KeepAlive();
  void Revoke();

  const RegistryReplicationOptions options_;
  std::shared_ptr<grpc::Channel> etcd_;
  struct Stubs;
  std::unique_ptr<Stubs> stubs_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  bool lost_ ABSL_GUARDED_BY(mu_) = false;  // led once and lost it: never campaigns again
  std::string leader_ ABSL_GUARDED_BY(mu_);
  int64_t lease_id_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time renewed_ ABSL_GUARDED_BY(mu_);  // last successful campaign or keep-alive
  std::map<std::string, std::shared_ptr<collserve::v1::Registry::Stub>> leader_stubs_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_REGISTRY_REPLICATION_H_
