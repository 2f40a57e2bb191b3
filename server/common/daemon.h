// Plumbing shared by the daemons' main(): termination signals, logging set-up, the
// Prometheus exposer. Not for libraries.
#ifndef COLLSERVE_SERVER_COMMON_DAEMON_H_
#define COLLSERVE_SERVER_COMMON_DAEMON_H_

#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace collserve::server {

// Blocks SIGTERM and SIGINT in the calling thread and every thread it creates later, so
// that WaitForTerminationSignal() receives them. Call first thing in main().
void BlockTerminationSignals();

// Sets the daemon's usage text and absl's help output: --help and --helpshort list the
// daemon's own flags (those defined under server/ of this repository; absl's default
// matched only a file named like the binary and printed "No flags matched."), with file
// names relative to the repository rather than build paths, and --version prints
// "<program> <collserve version>" (the CMake project version). Call before
// absl::ParseCommandLine, from main only (not thread-safe).
void SetDaemonUsage(const char* program, const char* usage);
// Waits for SIGTERM or SIGINT; returns the signal number.
int WaitForTerminationSignal();

// Sends glog to stderr at `level` ("info", "warning", "error"). INVALID_ARGUMENT otherwise.
absl::Status InitLogging(const char* argv0, const std::string& level);

// Serves `registry` at http://<address>/metrics. "" = no exposer (nullptr). UNAVAILABLE
// if the address cannot be bound.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> ServeMetrics(
    const std::string& address, const std::shared_ptr<prometheus::Registry>& registry);

// Writes `port` to `path` atomically (temp file + rename), so a reader never sees a
// partial number. INTERNAL on I/O errors.
absl::Status WritePortFile(const std::string& path, int port);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_DAEMON_H_
