// Plumbing shared by the daemons' main(): termination signals, logging set-up, the
// Prometheus exposer. Not for libraries.
#ifndef COLLSERVE_SERVER_COMMON_DAEMON_H_
#define COLLSERVE_SERVER_COMMON_DAEMON_H_

#include <grpcpp/server_builder.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/common/metrics_server.h"

namespace collserve::server {

// Blocks SIGTERM and SIGINT in the calling thread and every thread it creates later, so
// that WaitForTerminationSignal() receives them. Call first thing in main().
void BlockTerminationSignals();

// Tells OpenSSL (libcrypto: gRPC's TLS, the coordinator's token digests) not to free its
// state in an exit handler (OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT), OpenSSL 3). That
// handler deletes the thread-local keys of OpenSSL's per-thread state (random generators,
// error queues) while gRPC's threads still run; a thread that ends after it can no longer
// free its state, and LeakSanitizer reported the orphaned blocks (about 10 KB in
// CRYPTO_zalloc, CI of 2026-11-29). The process is exiting: the kernel takes the memory
// back either way. Call first thing in main(), before anything uses OpenSSL (the first
// initialisation's choice holds for the process). Not thread-safe.
void KeepOpenSslStateUntilExit();

// Sets the daemon's usage text and absl's help output: --help and --helpshort list the
// daemon's own flags (those defined under server/ of this repository; absl's default
// matched only a file named like the binary and printed "No flags matched."), with file
// names relative to the repository rather than build paths, and --version prints
// "<program> <collserve version>" (the CMake project version). Call before
// absl::ParseCommandLine, from main only (not thread-safe).
void SetDaemonUsage(const char* program, const char* usage);
// Raises the soft limit on open descriptors to the hard limit (every connection holds one;
// running out makes accept fail). Returns the new soft limit; never fails (logs instead).
uint64_t RaiseFileLimit();

// For a daemon that a training process starts for itself (the SDK's embedded servers): asks
// the kernel for SIGTERM when the thread that started this process ends
// (prctl(PR_SET_PDEATHSIG), which exec keeps), so the daemon shuts down as on a normal
// SIGTERM even if its parent is SIGKILLed. `parent_pid` is the pid the parent says it has;
// FAILED_PRECONDITION if the parent already ended (this process's parent pid differs), so
// a daemon whose starter died before this call does not run on orphaned. 0 = not started
// by a process it should follow: does nothing. Call from main() after
// BlockTerminationSignals() (not thread-safe). Replaces setting the signal between fork and
// exec, which ran code in a forked child of a multi-threaded process and could deadlock there.
absl::Status ExitWithParent(int64_t parent_pid);

// Waits for SIGTERM or SIGINT; returns the signal number.
int WaitForTerminationSignal();

// Sends glog to stderr at `level` ("info", "warning", "error"). INVALID_ARGUMENT otherwise.
absl::Status InitLogging(const char* argv0, const std::string& level);

// Serves `registry` at http://<address>/metrics (MetricsServer: the methods, paths and
// bounds it answers are listed there). "" = no endpoint (nullptr). INVALID_ARGUMENT for an
// address that does not parse, UNAVAILABLE if it cannot be bound.
absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(
    const std::string& address, const std::shared_ptr<prometheus::Registry>& registry);

// Makes `path` free for a unix socket the daemon is about to bind, or says why it is not:
// FAILED_PRECONDITION if a live server accepts connections on it (another daemon owns it;
// it is left alone) or if it is something other than a socket; a socket nobody answers on
// (left by a daemon that died) is removed. The parent directory must be this process's
// alone (PrepareSocketDirectory: created with mode 0755 when absent; FAILED_PRECONDITION
// naming its owner and mode when another uid owns it or others may write it).
// `type`: the socket type the daemon will bind (a live server of another type counts too).
absl::Status ClaimUnixSocketPath(const std::string& path, int type = 1 /* SOCK_STREAM */);

// Identity of a filesystem object, to remove at exit only the socket this daemon created
// (not one a later daemon created at the same path). {0, 0} if `path` does not exist.
struct FileId {
  uint64_t device = 0;
  uint64_t inode = 0;
  bool operator==(const FileId& o) const { return device == o.device && inode == o.inode; }
};
FileId FileIdOf(const std::string& path);

// Bounds the memory gRPC may use for the RPCs of `builder`'s server to `bytes` (a gRPC
// ResourceQuota): a client sending an oversized message is cut off after about that much,
// instead of the server buffering the whole message before its size check (gRPC checks
// the receive-size limit only once a message is complete).
void LimitRpcMemory(grpc::ServerBuilder& builder, const std::string& name, int64_t bytes);

// Gives memory the process freed back to the system every `period` (malloc_trim): after a
// burst of large messages glibc keeps the freed heap, so a refused 1 GiB message left
// hundreds of MB resident for good. Runs on a thread of its own until destroyed.
class MemoryTrimmer {
 public:
  explicit MemoryTrimmer(absl::Duration period);
  ~MemoryTrimmer();
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

 private:
  absl::Notification stop_;
  std::thread thread_;
};

// Writes `port` to `path` atomically (temp file + rename), so a reader never sees a
// partial number. INTERNAL on I/O errors.
absl::Status WritePortFile(const std::string& path, int port);

// The collserve version this daemon was built from (the project's version, e.g. "0.3.0").
const char* CollserveVersion();

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_DAEMON_H_
