// collserve-coordinator: the key-value store and group registry of a cluster or job.
#include <glog/logging.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/mutex_mode.h"
#include "server/common/daemon.h"
#include "server/common/tls.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/job_policies.h"

ABSL_FLAG(std::string, listen_address, "0.0.0.0:29400",
          "host:port for the gRPC API (Store, Registry, health); port 0 picks a free port.");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0:9464",
          "host:port serving Prometheus /metrics; empty to disable.");
ABSL_FLAG(std::string, data_dir, "",
          "Directory for the store's write-ahead log and snapshots; empty keeps the store in "
          "memory only (lost on restart).");
ABSL_FLAG(std::vector<std::string>, etcd_endpoints, {},
          "Keep the store in etcd (host:port of each member's client URL, comma-separated) instead of this "
          "process, so that several coordinators serve one store (docs/operations.md). Not with --data_dir.");
ABSL_FLAG(std::string, etcd_prefix, "collserve/", "With --etcd_endpoints: every key the store writes starts with it.");
ABSL_FLAG(absl::Duration, etcd_call_timeout, absl::Seconds(10),
          "With --etcd_endpoints: the deadline of each call to etcd (an unanswered one is UNAVAILABLE).");
ABSL_FLAG(std::string, etcd_ca_file, "",
          "With --etcd_endpoints: TLS to etcd, verifying the members' certificates against this CA (PEM).");
ABSL_FLAG(std::string, etcd_cert_file, "",
          "With --etcd_ca_file: the client certificate (PEM) presented to etcd (its --client-cert-auth).");
ABSL_FLAG(std::string, etcd_key_file, "", "The key of --etcd_cert_file (PEM).");
ABSL_FLAG(std::string, advertise_address, "",
          "With --etcd_endpoints: run as one of several coordinator replicas. host:port at which the other "
          "replicas reach this one's gRPC API (in Kubernetes, the pod IP and the API port; port 0 = the bound "
          "port). The replicas elect one leader of the group registry through etcd and forward Registry calls "
          "to it, so clients may reach any replica. Empty: this coordinator alone holds the registry.");
ABSL_FLAG(std::string, replica_tls_ca, "",
          "With --advertise_address and --tls_cert: the CA (PEM) that signed the other replicas' certificates, "
          "which this replica verifies when it forwards registry calls to the leader over TLS (default: "
          "--tls_ca). It presents its own --tls_cert/--tls_key to a leader that requires client certificates.");
ABSL_FLAG(std::string, replica_tls_server_name, "",
          "With --replica_tls_ca or --tls_ca: the name the leader's certificate must carry when it does not name "
          "the host of the leader's --advertise_address (in Kubernetes a pod IP): e.g. the Service's DNS name.");
ABSL_FLAG(absl::Duration, registry_lease_ttl, absl::Seconds(5),
          "With --advertise_address: the registry leader's etcd lease; a dead leader is replaced within about "
          "this long (at least 2s).");
ABSL_FLAG(std::string, log_level, "info", "Minimum log level: info, warning or error.");
ABSL_FLAG(int64_t, parent_pid, 0,
          "If set, the pid of the process that starts this daemon (a training process embedding it): the "
          "daemon shuts down as on SIGTERM when that process ends, and refuses to start if it already has.");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound gRPC port is written to this file once serving (for tests and "
          "launchers that use port 0).");
ABSL_FLAG(std::string, tcpstore_address, "",
          "host:port for a TCPStore-compatible endpoint (torch 1.13 and >= 2.2 wire protocols), so that "
          "torch's own TCPStore clients use this store; empty = off; port 0 picks a free port.");
ABSL_FLAG(std::string, tcpstore_job, "default", "The job namespace of keys written through --tcpstore_address.");
ABSL_FLAG(int, tcpstore_max_connections, 4096,
          "Most TCPStore connections open at once (at most half the descriptor limit).");
ABSL_FLAG(int, tcpstore_max_connections_per_peer, 256, "Most TCPStore connections from one peer address.");
ABSL_FLAG(absl::Duration, tcpstore_frame_timeout, absl::Seconds(30),
          "A TCPStore request must arrive whole, and a reply be read, within this; else the connection is closed.");
ABSL_FLAG(absl::Duration, tcpstore_idle_timeout, absl::ZeroDuration(),
          "Close TCPStore connections idle (no request, no pending WAIT) this long; 0 = never (torch's clients "
          "keep one connection for the whole job and do not reconnect).");
ABSL_FLAG(std::string, tcpstore_allow, "",
          "Peers allowed on the TCPStore endpoint: comma-separated IP networks (CIDR, e.g. "
          "127.0.0.0/8,10.4.0.0/16); empty = any, allowed only on a loopback --tcpstore_address (0.0.0.0/0,::/0 "
          "admits anyone). torch's TCPStore clients send no credentials, so this and --tcpstore_address are what "
          "keep other hosts off the job's keys.");
ABSL_FLAG(std::string, tcpstore_local_uids, "",
          "Who may reach the TCPStore endpoint from this host: comma-separated uids that must own the other end of "
          "a loopback connection (the kernel's socket table); empty = root and this coordinator's uid; \"any\" = "
          "no check. Other local users are closed at accept, so they cannot read or write the job's keys.");
ABSL_FLAG(std::string, tcpstore_port_file, "", "If set, the bound TCPStore port is written here once serving.");
ABSL_FLAG(int64_t, max_value_bytes, 64 << 20, "Largest value one key may hold, in bytes.");
ABSL_FLAG(int64_t, max_keys, 1 << 20, "Most keys the store holds, all jobs together.");
ABSL_FLAG(int64_t, max_store_bytes, int64_t{1} << 30,
          "Most bytes (keys plus values) the store holds, all jobs together; a write past it is RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, max_job_keys, int64_t{1} << 18, "Most keys one job's namespace holds.");
ABSL_FLAG(int64_t, max_job_bytes, int64_t{256} << 20, "Most bytes (keys plus values) one job's namespace holds.");
ABSL_FLAG(int64_t, store_max_request_ids, int64_t{1} << 16,
          "Request ids of exactly-once store writes (add, compare_set, append, delete_key retried by the SDK "
          "after a lost answer) remembered, all jobs together, oldest forgotten first; about 100 bytes each.");
ABSL_FLAG(int64_t, rpc_memory_bytes, int64_t{512} << 20,
          "Memory gRPC may hold for the RPCs in flight, in bytes: a client that sends more (an oversized message "
          "is buffered whole before its size is checked) is cut off. Must exceed --max_value_bytes + 1 MiB.");
ABSL_FLAG(absl::Duration, wal_commit_delay, absl::ZeroDuration(),
          "With --data_dir (group commit): how long the store waits after a write for more writes to share its "
          "fdatasync (like PostgreSQL's commit_delay); 0 = no wait: writes that arrive while an fdatasync runs "
          "share the next one. Every write is acknowledged only after the fdatasync that covers it.");
ABSL_FLAG(int64_t, wal_batch_bytes, int64_t{1} << 20,
          "With --data_dir: stop waiting for --wal_commit_delay once this many bytes of writes are staged.");
ABSL_FLAG(int64_t, wal_max_staged_bytes, int64_t{64} << 20,
          "With --data_dir: writers wait while this many bytes of writes are staged and not yet being written.");
ABSL_FLAG(int, store_write_threads, 64,
          "With --data_dir: threads that run gRPC store writes while they wait for their fdatasync; up to this "
          "many concurrent writes share one (group commit).");
ABSL_FLAG(bool, wal_repair, false,
          "Start even if --data_dir's log is damaged where it was acknowledged (wal.committed) or before a "
          "well-formed record: move each damaged range, up to the next well-formed record, to "
          "wal.damaged-<offset> in --data_dir, lose the writes in it, replay the records after it, and rewrite "
          "the store as a snapshot. Without it such a log is refused (DATA_LOSS naming the offset) and left "
          "untouched; a torn last record after the acknowledged length is always dropped and logged.");
ABSL_FLAG(int, max_world_size, 1 << 16,
          "Largest world_size a group may have; a join asking for more is INVALID_ARGUMENT naming this limit.");
ABSL_FLAG(absl::Duration, straggler_threshold, absl::Milliseconds(100),
          "A collective whose last rank called it at least this long after its first makes that rank a "
          "straggler in DiagnoseGroup and DumpGroup (collservectl diagnose, dump).");
ABSL_FLAG(absl::Duration, lease_grace, absl::Seconds(3),
          "How long a member sidecar of a multi-host group may go without renewing its lease on the group "
          "(Registry.WatchGroup) after its last watch ended before the coordinator takes its host as lost and "
          "ends the group's generation for every member (> 0)");
ABSL_FLAG(int, max_groups, 10000,
          "Groups (forming or formed, all jobs together) held at once; a join that would create one more is "
          "RESOURCE_EXHAUSTED naming this limit.");
ABSL_FLAG(bool, allow_unauthenticated, false,
          "Let calls that present no token use any job (a token that is presented is still checked). Off by "
          "default: every Store, Registry and Auth call and every sidecar session needs a job or admin token. "
          "For a trusted, isolated network only.");
ABSL_FLAG(std::string, admin_token_file, "",
          "File holding the admin token (grants every job, and MintJobToken/RevokeJobTokens); re-read every "
          "--token_refresh_interval. At least 16 bytes.");
ABSL_FLAG(std::string, job_tokens_dir, "",
          "Directory of job tokens: the file named <job> holds that job's token (a Kubernetes Secret mounted "
          "whole has this shape); re-read every --token_refresh_interval. At least 16 bytes each.");
ABSL_FLAG(std::string, job_policies_file, "",
          "JSON file of each job's limits on every sidecar (max_sessions, max_segment_bytes, "
          "max_inflight_collectives, max_inline_bytes; classes and weights; auth.proto's "
          "JobPolicies, docs/operations.md \"Per-job quotas\"); read at start. Default: no limits.");
ABSL_FLAG(absl::Duration, token_refresh_interval, absl::Seconds(10),
          "How often --admin_token_file and --job_tokens_dir are re-read (a rotated Secret needs no restart).");

int main(int argc, char** argv) {
  collserve::server::KeepOpenSslStateUntilExit();
  collserve::server::BlockTerminationSignals();
  collserve::server::SetDaemonUsage(
      "collserve-coordinator", "collserve coordinator: key-value store + group registry for rendezvous.");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = collserve::server::InitLogging(argv[0], absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    std::cerr << s << "\n";
    return 2;
  }
  if (absl::Status s = collserve::ApplyMutexDeadlockDetectionMode(); !s.ok()) {
    std::cerr << s << "\n";
    return 2;
  }
  if (absl::Status s = collserve::server::ExitWithParent(absl::GetFlag(FLAGS_parent_pid)); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  collserve::server::RaiseFileLimit();

  collserve::server::CoordinatorOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen_address);
  options.registry.max_world_size = absl::GetFlag(FLAGS_max_world_size);
  options.registry.max_groups = absl::GetFlag(FLAGS_max_groups);
  options.registry.straggler_threshold = absl::GetFlag(FLAGS_straggler_threshold);
  options.registry.lease_grace = absl::GetFlag(FLAGS_lease_grace);
  if (options.registry.lease_grace <= absl::ZeroDuration()) {
    std::cerr << "--lease_grace must be > 0\n";
    return 2;
  }
  if (options.registry.max_world_size < 1 || options.registry.max_groups < 1) {
    std::cerr << "--max_world_size and --max_groups must be >= 1\n";
    return 2;
  }
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.store.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.etcd.endpoints = absl::GetFlag(FLAGS_etcd_endpoints);
  options.etcd.prefix = absl::GetFlag(FLAGS_etcd_prefix);
  options.etcd.call_timeout = absl::GetFlag(FLAGS_etcd_call_timeout);
  options.etcd.ca_file = absl::GetFlag(FLAGS_etcd_ca_file);
  options.etcd.cert_file = absl::GetFlag(FLAGS_etcd_cert_file);
  options.etcd.key_file = absl::GetFlag(FLAGS_etcd_key_file);
  options.replication.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  options.replication.lease_ttl = absl::GetFlag(FLAGS_registry_lease_ttl);
  options.replication.tls.ca_file = absl::GetFlag(FLAGS_replica_tls_ca);
  options.replication.tls.server_name = absl::GetFlag(FLAGS_replica_tls_server_name);
  // A leader that lost its lease may already have a successor: exit, to be restarted as a
  // follower, rather than serve a registry another replica serves too.
  options.replication.on_lost = [](const absl::Status& why) {
    LOG(ERROR) << "exiting: " << why;
    google::FlushLogFiles(google::GLOG_INFO);
    std::_Exit(3);
  };
  options.store.max_value_bytes = absl::GetFlag(FLAGS_max_value_bytes);
  options.store.max_keys = absl::GetFlag(FLAGS_max_keys);
  options.store.max_total_bytes = absl::GetFlag(FLAGS_max_store_bytes);
  options.store.max_job_keys = absl::GetFlag(FLAGS_max_job_keys);
  options.store.max_job_bytes = absl::GetFlag(FLAGS_max_job_bytes);
  options.store.max_request_ids = absl::GetFlag(FLAGS_store_max_request_ids);
  options.store.wal_repair = absl::GetFlag(FLAGS_wal_repair);
  options.store.wal_commit_delay = absl::GetFlag(FLAGS_wal_commit_delay);
  options.store.wal_batch_bytes = absl::GetFlag(FLAGS_wal_batch_bytes);
  options.store.wal_max_staged_bytes = absl::GetFlag(FLAGS_wal_max_staged_bytes);
  options.store_write_threads = absl::GetFlag(FLAGS_store_write_threads);
  if (options.store_write_threads < 1) {
    std::cerr << "--store_write_threads must be >= 1\n";
    return 2;
  }
  options.rpc_memory_bytes = absl::GetFlag(FLAGS_rpc_memory_bytes);
  options.tls = collserve::server::ServerTlsOptionsFromFlags();
  options.credentials.allow_unauthenticated = absl::GetFlag(FLAGS_allow_unauthenticated);
  options.credentials.admin_token_file = absl::GetFlag(FLAGS_admin_token_file);
  options.credentials.job_tokens_dir = absl::GetFlag(FLAGS_job_tokens_dir);
  options.credentials.refresh_interval = absl::GetFlag(FLAGS_token_refresh_interval);
  if (const std::string file = absl::GetFlag(FLAGS_job_policies_file); !file.empty()) {
    auto policies = collserve::server::LoadJobPolicies(file);
    if (!policies.ok()) {
      LOG(ERROR) << "coordinator failed to start: " << policies.status();
      return 1;
    }
    options.job_policies = std::move(*policies);
  }
  options.store.log_warning = [](const std::string& line) { LOG(WARNING) << line; };
  options.tcpstore_address = absl::GetFlag(FLAGS_tcpstore_address);
  options.tcpstore_job = absl::GetFlag(FLAGS_tcpstore_job);
  options.tcpstore.max_connections = absl::GetFlag(FLAGS_tcpstore_max_connections);
  options.tcpstore.max_connections_per_peer = absl::GetFlag(FLAGS_tcpstore_max_connections_per_peer);
  options.tcpstore.frame_timeout = absl::GetFlag(FLAGS_tcpstore_frame_timeout);
  options.tcpstore.idle_timeout = absl::GetFlag(FLAGS_tcpstore_idle_timeout);
  options.tcpstore.allowed_networks = absl::GetFlag(FLAGS_tcpstore_allow);
  options.tcpstore.local_uids = absl::GetFlag(FLAGS_tcpstore_local_uids);

  auto coordinator = collserve::server::Coordinator::Start(options);
  if (!coordinator.ok()) {
    LOG(ERROR) << "coordinator failed to start: " << coordinator.status();
    return 1;
  }
  LOG(INFO) << "collserve-coordinator serving on port " << (*coordinator)->port()
            << (!options.etcd.endpoints.empty()
                    ? " (store in etcd at " + absl::StrJoin(options.etcd.endpoints, ",") + ")"
                    : options.store.data_dir.empty() ? " (memory-only store)"
                                                     : " (store in " + options.store.data_dir + ")")
            << (options.credentials.allow_unauthenticated ? "; calls without a token are allowed"
                                                          : "; every call needs a token");
  // The TCPStore port file first: a launcher that waits for --port_file then finds both.
  if (const std::string pf = absl::GetFlag(FLAGS_tcpstore_port_file); !pf.empty()) {
    if (absl::Status s = collserve::server::WritePortFile(pf, (*coordinator)->tcpstore_port()); !s.ok()) {
      LOG(ERROR) << s;
      return 1;
    }
  }
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    if (absl::Status s = collserve::server::WritePortFile(pf, (*coordinator)->port()); !s.ok()) {
      LOG(ERROR) << s;
      return 1;
    }
  }
  if ((*coordinator)->tcpstore_port() != 0) {
    LOG(INFO) << "TCPStore endpoint on port " << (*coordinator)->tcpstore_port() << " (job "
              << options.tcpstore_job << ")";
  }
  int sig = collserve::server::WaitForTerminationSignal();
  LOG(INFO) << "signal " << sig << ": shutting down";
  (*coordinator)->Shutdown(absl::Seconds(5));
  return 0;
}
