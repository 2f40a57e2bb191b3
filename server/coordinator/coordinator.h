// The coordinator: Store + Registry gRPC services, the health service and /metrics.
// The coordinator is never on the data path (docs/architecture.md).
#ifndef COLLSERVE_SERVER_COORDINATOR_COORDINATOR_H_
#define COLLSERVE_SERVER_COORDINATOR_COORDINATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/common/tls.h"
#include "collserve/v1/auth.pb.h"
#include "server/coordinator/credentials.h"
#include "server/coordinator/etcd_store.h"
#include "server/coordinator/registry_replication.h"
#include "server/coordinator/group_registry.h"
#include "server/coordinator/tcpstore_server.h"
#include "store/store.h"

namespace collserve::server {

struct CoordinatorOptions {
  // host:port of the gRPC API; port 0 picks a free port (see Coordinator::port()).
  std::string listen_address = "0.0.0.0:29400";
  // host:port serving Prometheus /metrics; "" = none.
  std::string metrics_address;
  // Store limits and durability (data_dir "" = memory only).
  store::StoreOptions store;
  // With etcd.endpoints set, the store lives in etcd (etcd_store.h) instead of this process,
  // so that several coordinators serve one store: store.data_dir must then be empty, and
  // the store's value limit is the smaller of store.max_value_bytes and etcd.max_value_bytes
  // (the per-job and total quotas do not apply; etcd's --quota-backend-bytes does).
  EtcdStoreOptions etcd;
  // Coordinator replicas (registry_replication.h): with etcd and
  // replication.advertise_address set, the replicas elect one leader of the group registry
  // through etcd and forward Registry calls to it, so that every replica serves every job.
  // An advertise_address ending in ":0" gets the bound gRPC port. replication.key defaults
  // to etcd.prefix + "registry/leader". With tls.cert_file (TLS on the API), the replicas
  // forward to each other over TLS: replication.tls.ca_file defaults to tls.ca_file (one of
  // them must be set, else INVALID_ARGUMENT), and its cert_file/key_file to tls's, the
  // replica's own certificate, presented to a leader that requires client certificates.
  // replication.tls.ca_file without tls.cert_file (a plaintext API) is INVALID_ARGUMENT.
  RegistryReplicationOptions replication;
  // host:port of the TCPStore-compatible endpoint (tcpstore_server.h); "" = none.
  std::string tcpstore_address;
  // The job namespace of keys written through that endpoint.
  std::string tcpstore_job = "default";
  // That endpoint's connection limits and timeouts (its listen_address, job and size
  // limits are set from the fields above and `store`).
  TcpStoreOptions tcpstore;
  // Bounds on the group registry (world_size, groups held).
  GroupRegistryLimits registry;
  // Memory gRPC may hold for the RPCs in flight, in bytes (LimitRpcMemory): connections
  // sending more are cut off. Must exceed store.max_value_bytes + 1 MiB (one largest Set).
  int64_t rpc_memory_bytes = int64_t{512} << 20;
  // With store.data_dir: the threads that run the gRPC store writes, each waiting for the
  // fdatasync that covers its write, so up to this many concurrent writes share one
  // (group commit); with etcd, each waiting for etcd's answer. Unused by a memory-only store.
  int store_write_threads = 64;
  // TLS of the gRPC API (ServerTlsOptions; default plaintext). The TCPStore endpoint speaks
  // torch's plaintext protocol regardless.
  ServerTlsOptions tls;
  // Who may call for which job (credentials.h). Default: nothing configured, which Start
  // refuses: set a token source or allow_unauthenticated. The TCPStore endpoint takes no
  // credentials (torch's clients send none): it serves tcpstore_job to whoever reaches it.
  CredentialsOptions credentials;
  // Each job's limits on every sidecar (auth.proto's JobPolicy; --job_policies_file, read
  // by LoadJobPolicies), handed to the sidecars with Auth.Authenticate's answer. Default:
  // none (no limits).
  collserve::v1::JobPolicies job_policies;
};

// Thread-safe.
class Coordinator {
 public:
  // Opens the store (replaying data_dir) and starts serving. Errors: from NewMemoryStore,
  // UNAVAILABLE if an address cannot be bound (naming why), INVALID_ARGUMENT for a bad
  // tcpstore_job, an rpc_memory_bytes too small for one largest value, or credentials
  // that JobCredentials::Create refuses.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(const CoordinatorOptions& options);
  virtual ~Coordinator() = default;  // Shutdown() if still running
  // The bound gRPC port.
  virtual int port() const = 0;
  // The bound /metrics port (0 if metrics are off).
  virtual int metrics_port() const = 0;
  // The bound TCPStore endpoint port (0 if it is off).
  virtual int tcpstore_port() const = 0;
  // Stops accepting calls, fails parked waits with UNAVAILABLE/CANCELLED, waits up to
  // `grace` for in-flight calls. Idempotent.
  virtual void Shutdown(absl::Duration grace) = 0;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_COORDINATOR_H_
