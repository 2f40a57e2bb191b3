// store::Store over etcd (the etcd v3 API over gRPC: KV, Txn, Watch, Lease), so that
// several coordinator replicas serve one store and a replica that dies loses nothing
// (issue 18). The C++ client is generated from etcd's published .proto files
// (proto/etcd/, vendored by scripts/vendor_etcd_protos.py).
//
// Semantics are store::Store's (store/store.h; the conformance suite runs over both
// stores). How each call maps onto etcd:
//   - Set: Put. MultiSet: one Txn of Puts (atomic), at most kMaxTxnOps keys.
//   - Get, MultiGet, Check, NumKeys, ListKeys: linearizable Range reads.
//   - Add, Append, CompareSet and DeleteKeyOnce: read the key, compute the new value here,
//     then a Txn that writes it only if the key's mod_revision (create_revision 0 when it
//     was missing) is still the one read; retried on a conflict until the call's deadline.
//     This is etcd's documented optimistic concurrency (the STM pattern of clientv3/concurrency).
//   - The *Once writes put the request id's answer under <prefix>req/<id> in the same Txn
//     (compared to be absent), attached to a lease of request_id_ttl; a retry finds it and
//     returns the first answer. Ids are remembered for between half and all of
//     request_id_ttl (StoreOptions::max_request_ids does not apply).
//   - Wait, WaitAsync and the waits of Get / MultiGet: one etcd Watch stream over the
//     store's prefix, from the store's creation on; a wait is registered before the keys
//     are read, so no Put between the read and the watch is missed. A broken stream is
//     created again (backoff 50 ms doubling to 1 s) and every pending wait then reads its
//     keys again, so no Put made meanwhile is missed either. The stream asks for a leader
//     ("hasleader" metadata, as etcd's clientv3 WithRequireLeader), so that a member cut
//     off from the cluster ends it.
// Keys live under <prefix>kv/ (the store's keys; NumKeys("") counts them). Key and value
// size limits are checked here; etcd's own --max-request-bytes (1.5 MiB by default) bounds
// a value further. The per-job and total quotas of store::StoreOptions are not enforced by
// this store: etcd's --quota-backend-bytes bounds it (RESOURCE_EXHAUSTED "database space
// exceeded").
//
// Errors: INVALID_ARGUMENT (keys, values, sizes, as store.h), UNAVAILABLE naming the etcd
// endpoints when etcd cannot be reached or does not answer within call_timeout (each etcd
// call has that deadline), ABORTED when a read-modify-write kept conflicting with other
// writers until its deadline, and etcd's own errors with their gRPC codes.
// Thread safety: every method may be called concurrently from any thread.
#ifndef COLLSERVE_SERVER_COORDINATOR_ETCD_STORE_H_
#define COLLSERVE_SERVER_COORDINATOR_ETCD_STORE_H_

#include <grpcpp/channel.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "store/store.h"

namespace collserve::server {

struct EtcdStoreOptions {
  // The etcd members' client addresses, host:port each. IPv4 literals are balanced by gRPC
  // (pick_first over the list: a member that dies is replaced by the next); otherwise the
  // first is used as a gRPC target (a DNS name resolving to every member, such as a
  // Kubernetes Service, fails over the same way).
  std::vector<std::string> endpoints;
  // Every key this store writes starts with it (several stores may share one etcd).
  std::string prefix = "collserve/";
  // Each etcd call's deadline (a read-modify-write's retries share one).
  absl::Duration call_timeout = absl::Seconds(10);
  int64_t max_key_bytes = 4096;
  // etcd refuses requests over its --max-request-bytes (1.5 MiB by default).
  int64_t max_value_bytes = 1 << 20;
  absl::Duration request_id_ttl = absl::Hours(1);
  // TLS to etcd (its https client URLs): set ca_file to verify the members' certificates
  // against it (they must name the endpoint's host), and cert_file with key_file to present
  // a client certificate (etcd's --client-cert-auth). PEM files, read once at start.
  // Default: plaintext.
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
};

// etcd's default --max-txn-ops: the most keys one MultiSet may write.
inline constexpr int kMaxTxnOps = 128;

// Connects (waits up to options.call_timeout for etcd to answer) and starts the watch.
// INVALID_ARGUMENT: no endpoints, a non-positive limit, a TLS file that cannot be read or
// is not PEM (naming it), a certificate without its key or either without a CA;
// UNAVAILABLE: etcd does not answer (a failed TLS handshake included).
absl::StatusOr<std::unique_ptr<store::Store>> NewEtcdStore(const EtcdStoreOptions& options);

// The smallest key greater than every key that starts with `prefix`: etcd's range_end for
// a prefix ("\0", every key, when the prefix is empty or all 0xff bytes).
std::string EtcdPrefixEnd(absl::string_view prefix);

// The gRPC channel NewEtcdStore talks to etcd through (endpoints, TLS files and keep-alive
// as above), for other users of the same etcd (registry_replication.h). Does not connect.
// INVALID_ARGUMENT: no endpoint, or the TLS files as above.
absl::StatusOr<std::shared_ptr<grpc::Channel>> NewEtcdChannel(const EtcdStoreOptions& options);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_ETCD_STORE_H_
