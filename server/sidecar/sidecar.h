// The sidecar: serves the training processes of one host (docs/architecture.md). This is
// its RPC layer: Session streams become calls on the collective engine (engine/engine.h).
//
// Clients attach a Session stream per (group, rank). The sidecar joins the group at the
// coordinator on each rank's behalf, learns which ranks live on which host, connects a
// Gloo communicator among the group's sidecars (rendezvous through the coordinator's
// store), and then runs each collective hierarchically: local ranks are reduced in shared
// memory, the result is all-reduced across hosts, and copied back to every local rank.
// Before any data moves, the hosts exchange every rank's arguments (op, dtype, count,
// reduce op, root), so ranks that disagree get INVALID_ARGUMENT naming them instead of a
// hang or silent corruption.
#ifndef COLLSERVE_SERVER_SIDECAR_SIDECAR_H_
#define COLLSERVE_SERVER_SIDECAR_SIDECAR_H_

#include <array>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collserve/client.h"
#include "server/common/tls.h"

namespace collserve::server {

struct SidecarOptions {
  // Unix-domain socket for clients on this host; "" = none.
  std::string unix_socket = "/run/collserve/sidecar.sock";
  // Permission bits set on the unix socket after it is created (e.g. 0660 to admit the
  // socket's group, 0666 for any local user); -1 = leave what the umask gives. A client
  // needs write permission on the socket to connect.
  int unix_socket_mode = -1;
  // The admin socket (collserve.v1.SidecarAdmin: drain), mode 0600: only this process's
  // user may connect. "auto" = <unix_socket>.admin (none without a unix socket, or when that
  // path is too long for a unix socket: a warning); "" = none.
  std::string admin_socket = "auto";
  // host:port for clients on other hosts (tensor bytes then travel inline); "" = none;
  // port 0 picks a free port.
  std::string listen_address;
  // The coordinator, host:port. Required.
  std::string coordinator_address;
  // This sidecar's unique id in group memberships. "" = "<hostname>/<pid>".
  std::string host_id;
  // Address the Gloo pairs bind to and advertise to other hosts.
  std::string gloo_hostname = "127.0.0.1";
  // host:port serving Prometheus /metrics; "" = none.
  std::string metrics_address;
  // Threads for the intra-host data path (local reductions and copies), the calling
  // executor included; <= 0 = the number of cores (at most 8).
  int data_threads = 0;
  // All-reduce across hosts: "auto", "direct", "ring" or "bcube" (see
  // --allreduce_algorithm), the largest bytes x (hosts - 1) "auto" sends directly, the size
  // from which "auto" takes the ring, and the ring's largest piece (0 = Gloo's 1 MiB; 8 MiB measured faster in bench/RESULTS.md).
  std::string allreduce_algorithm = "auto";
  size_t direct_max_bytes = 1 << 20;
  size_t ring_min_bytes = 1 << 20;
  size_t ring_segment_bytes = 8 << 20;
  // The flight recorder and straggler signal (engine::EngineOptions' fields of the same names).
  int flight_recorder_entries = 128;
  absl::Duration flight_recorder_log_threshold = absl::Seconds(30);
  absl::Duration straggler_threshold = absl::Milliseconds(100);
  // Jobs with series of their own in the per-job data-path metrics (collserve_job_data_path_*),
  // those that used the most thread time; the others are summed under collserve_job="(others)".
  int metrics_job_series = 32;
  // How long the coordinator may hold one watch of a group spanning hosts, which the sidecar
  // renews at once (engine::EngineOptions::lease_renewal).
  absl::Duration lease_renewal = absl::Seconds(2);
  // Tests only (--testing_fail_after_data_step): engine::EngineOptions' fields of the same names.
  std::string fail_after_data_step_group;
  int64_t fail_after_data_step_seq = -1;
  // Memory gRPC may hold for the sessions' messages in flight, in bytes (LimitRpcMemory);
  // a client sending more is cut off. Must exceed the 1 GiB message limit (inline tensors
  // of remote clients).
  int64_t rpc_memory_bytes = int64_t{2} << 30;
  // Bytes of inline requests the engine holds at once (engine::EngineOptions::max_inline_bytes).
  int64_t max_inline_bytes = int64_t{4} << 30;
  // Requests (collectives and send/recv) one session may have in flight (received, not yet
  // answered); one more ends the session with RESOURCE_EXHAUSTED naming the limit. 0 = none.
  int max_session_requests = 65536;
  // How much nicer bulk-class jobs' data-path threads run (engine::EngineOptions::bulk_nice).
  int bulk_nice = 10;
  // The DSCP and socket priority of each priority class's connections between hosts
  // (latency-critical, default, bulk; -1 = unmarked): engine::EngineOptions::traffic_marks.
  std::array<int, 3> traffic_dscp{-1, -1, -1};
  std::array<int, 3> traffic_socket_priority{-1, -1, -1};
  // The host's scheduler of steps between hosts (engine::EngineOptions::link): pieces of a
  // lower class's transfers while a better class is busy (0 = never cut), and the longest
  // one piece waits.
  size_t link_piece_bytes = size_t{512} << 10;
  absl::Duration link_max_wait = absl::Milliseconds(20);
  // How long Start waits for the coordinator's channel to connect. After it, the sidecar
  // serves anyway, not ready (below), and keeps trying.
  absl::Duration coordinator_connect_timeout = absl::Seconds(10);
  // TLS of the TCP listener (listen_address; the unix socket stays plaintext) and of the
  // channels to the coordinator (ca_file set = TLS; cert_file/key_file = this sidecar's
  // client certificate for a coordinator that requires one).
  ServerTlsOptions tls;
  client::TlsOptions coordinator_tls;
};

// Health (grpc.health.v1, with gRPC server reflection on): service "liveness" is SERVING
// while the sidecar serves; "" and "collserve.v1.Collectives" (readiness) are SERVING only
// while the coordinator answers its own health check, probed every 2 s (2 s deadline), and
// the sidecar is not draining (SidecarAdmin.Drain: no new sessions; those attached run on).
// Thread-safe.
class Sidecar {
 public:
  // Starts serving, connected to the coordinator when it answers within
  // coordinator_connect_timeout, else not ready until it does. Errors: INVALID_ARGUMENT (no
  // coordinator address, bad options or TLS files), UNAVAILABLE (cannot bind).
  static absl::StatusOr<std::unique_ptr<Sidecar>> Start(const SidecarOptions& options);
  virtual ~Sidecar() = default;
  // The bound TCP port (0 if no listen_address).
  virtual int port() const = 0;
  virtual const std::string& host_id() const = 0;
  // Fails every session with UNAVAILABLE and stops. Idempotent.
  virtual void Shutdown(absl::Duration grace) = 0;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_SIDECAR_H_
