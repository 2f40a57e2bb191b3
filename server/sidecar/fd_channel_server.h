// The sidecar's end of the shared-memory descriptor channel (common/fd_channel.h): a
// SOCK_SEQPACKET unix socket next to the gRPC socket on which local clients pass the memfd
// descriptors of their segments. A connection says Hello with its session's token (handed
// out in collserve.v1.Attached over that session's stream, only to unix-socket sessions);
// each Register maps the descriptor (common/shm.h refuses files that can shrink) and adds
// the segment to that session's table in the engine (engine::Group::AddSegment). The
// sidecar never opens a segment by name.
//
// Thread safety: every public method may be called from any thread. One thread serves
// every connection (each request is a few syscalls: poll, recvmsg, fstat, mmap, sendmsg).
#ifndef COLLSERVE_SERVER_SIDECAR_FD_CHANNEL_SERVER_H_
#define COLLSERVE_SERVER_SIDECAR_FD_CHANNEL_SERVER_H_

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/group.h"
#include "server/common/daemon.h"

namespace collserve::server {

struct FdChannelOptions {
  // Most connections open at once; more are closed at accept.
  int max_connections = 1024;
  // A connection that has not said a good Hello by then is closed.
  absl::Duration hello_timeout = absl::Seconds(10);
};

class FdChannelServer {
 public:
  // Listens on `path` (which must be free, see ClaimUnixSocketPath) with permission bits
  // `mode` (-1: the umask's) and starts serving. UNAVAILABLE if it cannot be bound.
  static absl::StatusOr<std::unique_ptr<FdChannelServer>> Start(const std::string& path, int mode,
                                                                FdChannelOptions options = {});
  // Stops the thread, closes every connection and removes the socket (if it is still this
  // server's).
  ~FdChannelServer();
  FdChannelServer(const FdChannelServer&) = delete;
  FdChannelServer& operator=(const FdChannelServer&) = delete;

  const std::string& path() const { return path_; }

  // A fresh random token (fdchannel::kTokenBytes) for a session; Register requests made
  // with it fail until Bind.
  std::string NewToken();
  // Segments registered with `token` go to `rank` of `group` from now on.
  void Bind(const std::string& token, std::weak_ptr<engine::Group> group, int rank);
  // The session ended: its token is refused from now on (and a connection that uses it
  // again is closed).
  void Forget(const std::string& token);

 private:
  struct Binding {
    std::weak_ptr<engine::Group> group;
    int rank = -1;
    bool bound = false;
  };
  struct Connection {
    int fd = -1;
    std::string token;  // after a good Hello
    absl::Time accepted;
  };

  FdChannelServer(std::string path, int listen_fd, int wake_fd, FileId socket_id, FdChannelOptions options);
  void Loop();
  // Serves one datagram of `conn`; false if the connection must be closed.
  bool Serve(Connection& conn);
  // The group and rank the session holding `token` is bound to: FAILED_PRECONDITION when
  // the session ended, UNAVAILABLE when it is not attached (yet or any more).
  absl::StatusOr<std::shared_ptr<engine::Group>> GroupOf(const std::string& token, int* rank)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Answers an Open (a peer's segment, read-only) of `conn`, the datagram in `buf`;
  // false if the connection must be closed.
  bool ServeOpen(Connection& conn, const char* buf, absl::Time deadline);

  const std::string path_;
  const int listen_fd_;
  const int wake_fd_;  // an eventfd: written to stop the loop
  const FdChannelOptions options_;
  const FileId socket_id_;

  absl::Mutex mu_;
  std::map<std::string, Binding> tokens_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  std::thread thread_;  // last: starts after every member it uses
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_FD_CHANNEL_SERVER_H_
