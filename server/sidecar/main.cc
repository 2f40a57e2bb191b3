// collserve-sidecar: serves the training processes of one host and moves their tensors.
#include <glog/logging.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "backends/registry.h"
#include "common/mutex_mode.h"
#include "common/shm.h"
#include "server/common/daemon.h"
#include "server/common/tls.h"
#include "server/sidecar/sidecar.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:29400",
          "The coordinator's gRPC target: host:port, a DNS name that resolves to every coordinator replica, or a "
          "list of replicas such as ipv4:10.0.0.1:29400,10.0.0.2:29400 (calls fail over between them).");
ABSL_FLAG(std::string, unix_socket, "/run/collserve/sidecar.sock",
          "Unix-domain socket for the training processes of this host; empty to disable.");
ABSL_FLAG(std::string, unix_socket_mode, "",
          "Octal permission bits for the unix socket, e.g. 0660 (the socket's group may connect) or "
          "0666 (any local user); empty leaves what the umask gives (usually owner-only writes).");
ABSL_FLAG(std::string, admin_socket, "auto",
          "Unix socket (mode 0600: this process's user only) serving collserve.v1.SidecarAdmin, i.e. "
          "`collservectl --sidecar=unix:PATH drain`; auto = <unix_socket>.admin (none, with a warning, when that is "
          "too long for a unix socket path); empty = none.");
ABSL_FLAG(std::string, listen_address, "",
          "host:port for clients on other hosts (tensors then travel inline in messages); "
          "empty to disable; port 0 picks a free port.");
ABSL_FLAG(std::string, host_id, "",
          "This sidecar's unique id in group memberships; default <hostname>/<pid>.");
ABSL_FLAG(std::string, gloo_hostname, "127.0.0.1",
          "Address Gloo binds to and advertises to the other hosts of a group (the pod or "
          "host IP in a cluster).");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0:9465",
          "host:port serving Prometheus /metrics; empty to disable.");
ABSL_FLAG(std::string, log_level, "info", "Minimum log level: info, warning or error.");
ABSL_FLAG(int64_t, parent_pid, 0,
          "If set, the pid of the process that starts this daemon (a training process embedding it): the "
          "daemon shuts down as on SIGTERM when that process ends, and refuses to start if it already has.");
ABSL_FLAG(int, data_threads, 0,
          "Threads for local reductions and copies among this host's ranks (the executor included); "
          "0 = one per core, at most 8.");
ABSL_FLAG(std::string, allreduce_algorithm, "auto",
          "Algorithm of all_reduce across hosts (as NCCL_ALGO): direct (one all-gather of the hosts' partial "
          "results, then a local reduction), ring or bcube (Gloo's), or auto: direct while bytes x (hosts - 1) "
          "<= --direct_max_bytes, else ring from --ring_min_bytes up, else bcube. An all_reduce of at most "
          "1 KiB always travels with the argument exchange (\"fused\": one exchange per call). Completions "
          "and collserve-perf report which one ran.");
ABSL_FLAG(int64_t, direct_max_bytes, 1 << 20, "With --allreduce_algorithm=auto: the largest bytes x (hosts - 1) "
          "sent by the direct exchange.");
ABSL_FLAG(int64_t, ring_min_bytes, 1 << 20, "With --allreduce_algorithm=auto: the smallest all_reduce (bytes) "
          "that takes Gloo's ring.");
ABSL_FLAG(int64_t, ring_segment_bytes, 8 << 20, "Largest piece (bytes) Gloo's ring sends at once; 0 = Gloo's 1 MiB. "
          "Every piece costs a message round trip per ring step, so larger pieces win where latency is high.");
ABSL_FLAG(int64_t, rpc_memory_bytes, int64_t{2} << 30,
          "Memory gRPC may hold for the sessions' messages in flight, in bytes: a client that sends more (an "
          "oversized message is buffered whole before its size is checked) is cut off. Must exceed 1 GiB, the "
          "message limit.");
ABSL_FLAG(int64_t, max_inline_bytes, int64_t{4} << 30,
          "Bytes of inline requests (tensors carried in the messages of ranks without shared memory: input and "
          "result) the sidecar holds at once, every session together; a request past it fails with "
          "RESOURCE_EXHAUSTED naming the limit. 0 = no limit. Each job's share within it: its JobPolicy's "
          "max_inline_bytes.");
ABSL_FLAG(int, bulk_nice, 10,
          "How much nicer (0-19) the threads running bulk-class jobs' reductions and copies run than the sidecar "
          "(JobPolicy.priority_class PRIORITY_CLASS_BULK: their groups' executors and a lane of data-path workers of "
          "their own), so that the kernel gives the cores to the other classes first. 0 = bulk jobs share the "
          "other workers at the sidecar's priority.");
ABSL_FLAG(std::string, traffic_dscp, "",
          "The DSCP (0-63, RFC 2474) of each priority class's connections between hosts, as LC,DEFAULT,BULK "
          "(latency-critical, default, bulk; -1 leaves a class unmarked), e.g. 46,0,8 (EF, best effort, CS1), for "
          "switches or host qdiscs that queue by DSCP. Empty = unmarked. Gloo's connections, and the NCCL "
          "communicators of ranks with COLLSERVE_CUDA_PATH=nccl as their traffic class (InfiniBand/RoCE); MPI and "
          "the sidecar's own NCCL keep theirs.");
ABSL_FLAG(std::string, traffic_socket_priority, "",
          "The socket priority (SO_PRIORITY) of each priority class's connections between hosts, as LC,DEFAULT,BULK "
          "(-1 leaves a class as it is), e.g. 6,0,2: pfifo_fast's bands (the kernel's default queue on many links) "
          "then send a latency-critical job's packets before a bulk job's. 0-6 need no privilege, higher values "
          "(an htb class's major:minor) CAP_NET_ADMIN or CAP_NET_RAW. Empty = unmarked.");
ABSL_FLAG(int64_t, link_piece_bytes, -1,
          "While a job of a better priority class has collectives between hosts on this host, a lower class's "
          "all_reduce and broadcast between hosts go in pieces of this many bytes (at least 65536), each piece "
          "waiting until no better class has a collective between hosts running here (at most "
          "--link_max_wait_ms), so that a small collective of a better class waits behind one piece of another "
          "job's bytes, not all of them, on a link that queues in one FIFO. Hosts agree on the smallest of their "
          "proposals per collective. 0 = never cut. -1 (the default) = 524288, or 0 when --traffic_dscp or "
          "--traffic_socket_priority is set (a network that queues by class needs no pieces, and they cost the "
          "lower class bandwidth).");
ABSL_FLAG(int64_t, link_max_wait_ms, 20,
          "The longest one piece of a lower class's transfer waits for better classes (--link_piece_bytes), in "
          "milliseconds, so that no class starves.");
ABSL_FLAG(int, max_session_requests, 65536,
          "Requests (collectives and send/recv) one rank's session may have in flight on the sidecar (received, not "
          "yet answered); one more ends the session with RESOURCE_EXHAUSTED naming the limit, and the rank leaves "
          "its group. Bounds what one rank can make the sidecar hold. 0 = no limit.");
ABSL_FLAG(int64_t, max_mapped_segments, 0,
          "Shared-memory segments received from clients that the sidecar maps at once, all sessions together "
          "(each is one of the kernel's vm.max_map_count mappings per process, which threads and memory need "
          "too); a Register past it is answered RESOURCE_EXHAUSTED naming this flag. 0 = half of "
          "vm.max_map_count (32765 by default).");
ABSL_FLAG(std::string, port_file, "", "If set, the bound TCP port is written here once serving.");
ABSL_FLAG(bool, mpi, false,
          "Join the MPI world this sidecar was started in (mpirun or srun, one sidecar per host; with mpirun add "
          "--enable-recovery, or it kills every sidecar when one exits) so that groups asking for backend \"mpi\" "
          "get their communicator from it. Refuses to start when the build has no MPI or the process was not started "
          "by an MPI launcher.");
ABSL_FLAG(absl::Duration, coordinator_connect_timeout, absl::Seconds(10),
          "How long to wait for the coordinator at start before serving anyway, not ready (health "
          "NOT_SERVING) until the coordinator answers; the sidecar keeps trying and never exits for it.");
ABSL_FLAG(std::string, coordinator_tls_ca, "",
          "PEM CA bundle that the coordinator's certificate must chain to; set = TLS to the coordinator.");
ABSL_FLAG(std::string, coordinator_tls_cert, "",
          "PEM client certificate this sidecar presents to a coordinator that requires one (mutual TLS).");
ABSL_FLAG(std::string, coordinator_tls_key, "", "PEM private key of --coordinator_tls_cert.");
ABSL_FLAG(std::string, coordinator_tls_server_name, "",
          "Name the coordinator's certificate must carry when it differs from --coordinator's host.");

ABSL_FLAG(int, flight_recorder_entries, 128,
          "Collectives the flight recorder keeps per group (0 = none; collservectl dump shows the latest 32 "
          "of each host).");
ABSL_FLAG(absl::Duration, flight_recorder_log_threshold, absl::Seconds(30),
          "A collective that takes longer than this from its first rank's call to its completion, or that "
          "fails its group, has its group's flight recorder written to the log as JSON; 0 = never.");
ABSL_FLAG(absl::Duration, straggler_threshold, absl::Milliseconds(100),
          "A collective whose last rank called it at least this long after its first counts in "
          "collserve_straggler_collectives_total on the last rank's sidecar.");

ABSL_FLAG(int32_t, metrics_job_series, 32,
          "Jobs with series of their own in the per-job data-path metrics (collserve_job_data_path_*): those "
          "that used the most of the sidecar's data-path threads; the others are summed under "
          "collserve_job=\"(others)\". In [0, 1000]: it bounds the job label's values.");
ABSL_FLAG(absl::Duration, lease_renewal, absl::Seconds(2),
          "Each group spanning hosts is watched at the coordinator while it runs; the watch is this host's "
          "lease on the group. The coordinator holds one watch at most this long and the sidecar renews it at "
          "once; a host silent for this plus the coordinator's --lease_grace is taken as lost and the group's "
          "generation ends for every member. In [100ms, 60s].");
ABSL_FLAG(std::string, testing_fail_after_data_step, "",
          "Tests only: GROUP#SEQ makes collective SEQ of group GROUP (of each of its generations) fail with "
          "UNAVAILABLE on this host after "
          "its data step ran (another host completes it): a partition between the hosts' completions. "
          "Empty = off.");

int main(int argc, char** argv) {
  collserve::server::KeepOpenSslStateUntilExit();
  collserve::server::BlockTerminationSignals();
  collserve::server::SetDaemonUsage(
      "collserve-sidecar", "collserve sidecar: runs the collectives of the training processes on this host.");
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
  collserve::server::SidecarOptions options;
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  options.unix_socket = absl::GetFlag(FLAGS_unix_socket);
  options.listen_address = absl::GetFlag(FLAGS_listen_address);
  options.admin_socket = absl::GetFlag(FLAGS_admin_socket);
  if (const std::string mode = absl::GetFlag(FLAGS_unix_socket_mode); !mode.empty()) {
    char* end = nullptr;
    const long bits = std::strtol(mode.c_str(), &end, 8);
    if (*end != '\0' || bits < 0 || bits > 0777) {
      std::cerr << "--unix_socket_mode=" << mode << ": use octal permission bits such as 0660\n";
      return 2;
    }
    options.unix_socket_mode = static_cast<int>(bits);
  }
  options.host_id = absl::GetFlag(FLAGS_host_id);
  options.gloo_hostname = absl::GetFlag(FLAGS_gloo_hostname);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.data_threads = absl::GetFlag(FLAGS_data_threads);
  options.rpc_memory_bytes = absl::GetFlag(FLAGS_rpc_memory_bytes);
  if (absl::GetFlag(FLAGS_max_inline_bytes) < 0) {
    std::cerr << "--max_inline_bytes must be >= 0 (0 = no limit)\n";
    return 2;
  }
  options.max_inline_bytes = absl::GetFlag(FLAGS_max_inline_bytes);
  if (absl::GetFlag(FLAGS_max_session_requests) < 0) {
    std::cerr << "--max_session_requests must be >= 0 (0 = no limit)\n";
    return 2;
  }
  options.max_session_requests = absl::GetFlag(FLAGS_max_session_requests);
  if (absl::GetFlag(FLAGS_max_mapped_segments) < 0) {
    std::cerr << "--max_mapped_segments must be >= 0 (0 = half of vm.max_map_count)\n";
    return 2;
  }
  collserve::ShmSegment::SetMaxReceivedMappings(absl::GetFlag(FLAGS_max_mapped_segments));
  if (absl::GetFlag(FLAGS_bulk_nice) < 0 || absl::GetFlag(FLAGS_bulk_nice) > 19) {
    std::cerr << "--bulk_nice must be in [0, 19]\n";
    return 2;
  }
  options.bulk_nice = absl::GetFlag(FLAGS_bulk_nice);
  // LC,DEFAULT,BULK: three integers, each -1 or in [0, max].
  const auto parse_marks = [](const std::string& flag, const std::string& value, int64_t max,
                              std::array<int, 3>* out) {
    if (value.empty()) return true;
    const std::vector<std::string> parts = absl::StrSplit(value, ',');
    bool ok = parts.size() == out->size();
    for (size_t c = 0; ok && c < parts.size(); ++c) {
      int64_t v = 0;
      ok = absl::SimpleAtoi(parts[c], &v) && (v == -1 || (v >= 0 && v <= max));
      (*out)[c] = static_cast<int>(v);
    }
    if (!ok) {
      std::cerr << "--" << flag << "=" << value << ": expected LC,DEFAULT,BULK, three integers each -1 or in [0, "
                << max << "]\n";
    }
    return ok;
  };
  if (!parse_marks("traffic_dscp", absl::GetFlag(FLAGS_traffic_dscp), 63, &options.traffic_dscp) ||
      !parse_marks("traffic_socket_priority", absl::GetFlag(FLAGS_traffic_socket_priority), INT32_MAX,
                   &options.traffic_socket_priority)) {
    return 2;
  }
  int64_t link_piece_bytes = absl::GetFlag(FLAGS_link_piece_bytes);
  if (link_piece_bytes != -1 && link_piece_bytes != 0 &&
      (link_piece_bytes < 65536 || link_piece_bytes > (int64_t{1} << 40))) {
    std::cerr << "--link_piece_bytes must be -1 (auto), 0 (never cut) or in [65536, 2^40]\n";
    return 2;
  }
  if (link_piece_bytes == -1) {
    const bool marked =
        !absl::GetFlag(FLAGS_traffic_dscp).empty() || !absl::GetFlag(FLAGS_traffic_socket_priority).empty();
    link_piece_bytes = marked ? 0 : int64_t{512} << 10;
  }
  const int64_t link_max_wait_ms = absl::GetFlag(FLAGS_link_max_wait_ms);
  if (link_max_wait_ms < 0 || link_max_wait_ms > 60000) {
    std::cerr << "--link_max_wait_ms must be in [0, 60000]\n";
    return 2;
  }
  options.link_piece_bytes = static_cast<size_t>(link_piece_bytes);
  options.link_max_wait = absl::Milliseconds(link_max_wait_ms);
  options.allreduce_algorithm = absl::GetFlag(FLAGS_allreduce_algorithm);
  if (absl::GetFlag(FLAGS_ring_min_bytes) < 0 || absl::GetFlag(FLAGS_ring_segment_bytes) < 0 ||
      absl::GetFlag(FLAGS_direct_max_bytes) < 0) {
    std::cerr << "--direct_max_bytes, --ring_min_bytes and --ring_segment_bytes must be >= 0\n";
    return 2;
  }
  options.direct_max_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_direct_max_bytes));
  options.ring_min_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_ring_min_bytes));
  options.ring_segment_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_ring_segment_bytes));
  if (absl::GetFlag(FLAGS_flight_recorder_entries) < 0 || absl::GetFlag(FLAGS_flight_recorder_entries) > 100000) {
    std::cerr << "--flight_recorder_entries must be in [0, 100000]\n";
    return 2;
  }
  options.flight_recorder_entries = absl::GetFlag(FLAGS_flight_recorder_entries);
  options.flight_recorder_log_threshold = absl::GetFlag(FLAGS_flight_recorder_log_threshold);
  options.straggler_threshold = absl::GetFlag(FLAGS_straggler_threshold);
  if (absl::GetFlag(FLAGS_metrics_job_series) < 0 || absl::GetFlag(FLAGS_metrics_job_series) > 1000) {
    std::cerr << "--metrics_job_series must be in [0, 1000]\n";
    return 2;
  }
  options.metrics_job_series = absl::GetFlag(FLAGS_metrics_job_series);
  options.lease_renewal = absl::GetFlag(FLAGS_lease_renewal);
  if (options.lease_renewal < absl::Milliseconds(100) || options.lease_renewal > absl::Seconds(60)) {
    std::cerr << "--lease_renewal must be in [100ms, 60s]\n";
    return 2;
  }
  if (const std::string fault = absl::GetFlag(FLAGS_testing_fail_after_data_step); !fault.empty()) {
    const size_t hash = fault.rfind('#');
    if (hash == std::string::npos || hash == 0 ||
        !absl::SimpleAtoi(fault.substr(hash + 1), &options.fail_after_data_step_seq) ||
        options.fail_after_data_step_seq < 0) {
      std::cerr << "--testing_fail_after_data_step=" << fault << ": expected GROUP#SEQ (SEQ >= 0)\n";
      return 2;
    }
    options.fail_after_data_step_group = fault.substr(0, hash);
  }
  options.tls = collserve::server::ServerTlsOptionsFromFlags();
  options.coordinator_connect_timeout = absl::GetFlag(FLAGS_coordinator_connect_timeout);
  options.coordinator_tls.ca_file = absl::GetFlag(FLAGS_coordinator_tls_ca);
  options.coordinator_tls.cert_file = absl::GetFlag(FLAGS_coordinator_tls_cert);
  options.coordinator_tls.key_file = absl::GetFlag(FLAGS_coordinator_tls_key);
  options.coordinator_tls.server_name = absl::GetFlag(FLAGS_coordinator_tls_server_name);

  // Before the sidecar's threads: MPI_Init_thread, and the world's salt (every sidecar of the world).
  if (absl::GetFlag(FLAGS_mpi)) {
    if (absl::Status s = collserve::backends::StartMpiWorld(); !s.ok()) {
      LOG(ERROR) << s;
      return 1;
    }
  }
  auto sidecar = collserve::server::Sidecar::Start(options);
  if (!sidecar.ok()) {
    LOG(ERROR) << "sidecar failed to start: " << sidecar.status();
    return 1;
  }
  LOG(INFO) << "collserve-sidecar " << (*sidecar)->host_id() << " serving on " << options.unix_socket
            << ((*sidecar)->port() != 0 ? " and port " + std::to_string((*sidecar)->port()) : "");
  LOG(INFO) << "steps between hosts: "
            << (options.link_piece_bytes == 0
                    ? std::string("lower classes' transfers go whole (--link_piece_bytes=0, or traffic marks set)")
                    : absl::StrCat("lower classes' transfers in pieces of ", options.link_piece_bytes,
                                   " bytes while a better class runs, each waiting at most ",
                                   absl::FormatDuration(options.link_max_wait)));
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    if (absl::Status s = collserve::server::WritePortFile(pf, (*sidecar)->port()); !s.ok()) {
      LOG(ERROR) << s;
      return 1;
    }
  }
  int sig = collserve::server::WaitForTerminationSignal();
  LOG(INFO) << "signal " << sig << ": shutting down";
  (*sidecar)->Shutdown(absl::Seconds(5));
  collserve::backends::StopMpiWorld(absl::Seconds(5));
  return 0;
}
