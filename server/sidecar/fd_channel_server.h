// The sidecar's end of the shared-memory descriptor channel (common/fd_channel.h): a
// SOCK_SEQPACKET unix socket next to the gRPC socket on which local clients pass the memfd
// descriptors of their segments. A connection says Hello with its session's token (handed
// out in collserve.v1.Attached over that session's stream, only to unix-socket sessions);
// each Register maps the descriptor (common/shm.h refuses files that can shrink) and adds
// the segment to that session's table in the engine (engine::Group::AddSegment). The
// sidecar never opens a segment by name.
//
// A session may also switch one connection to its ops channel (fdchannel::OpsMode,
// common/ops_channel.h): its collective requests then arrive there (handed to the
// session's OpsHandler on this server's thread) and its completions leave there (OpsLink).
//
// Thread safety: every public method may be called from any thread. One thread serves
// every connection (each request is a few syscalls: poll, recvmsg, fstat, mmap, sendmsg).
#ifndef COLLSERVE_SERVER_SIDECAR_FD_CHANNEL_SERVER_H_
#define COLLSERVE_SERVER_SIDECAR_FD_CHANNEL_SERVER_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/ops_channel.h"
#include "engine/group.h"
#include "server/common/daemon.h"

namespace collserve::server {

// The sidecar's end of one session's ops channel. Thread-safe.
class OpsLink {
 public:
  // Most bytes of messages waiting for room in the socket; past it the link is shut down
  // (a client that stopped reading its completions). Each waiting datagram counts its bytes
  // and kQueuedDatagramOverhead: what holding it in the queue costs beyond them (its slot
  // and its string's heap block: 54 bytes for a 28-byte answer, 58 for a 40-byte one,
  // measured with glibc's malloc), so that the limit bounds the memory a session's queue
  // takes, whatever the answers' sizes.
  static constexpr size_t kMaxQueuedBytes = 64u << 20;
  static constexpr size_t kQueuedDatagramOverhead = 64;

  OpsLink(int fd, int wake_fd) : fd_(fd), wake_fd_(wake_fd) {}
  // Sends one message without blocking: what the socket has no room for now waits in a
  // queue that the channel's thread sends. INVALID_ARGUMENT (over kMaxOpsMessageBytes),
  // RESOURCE_EXHAUSTED (the queue would pass kMaxQueuedBytes: the link is shut down),
  // UNAVAILABLE (the link is closed or broke).
  absl::Status Send(absl::string_view message) ABSL_LOCKS_EXCLUDED(mu_);
  // Sends `messages` in order, as Send would one by one, with several datagrams per system
  // call (opschannel::TrySendOpsMessages) while the socket has room. The same errors; after
  // an error the messages before the failing one may have been sent.
  absl::Status SendBatch(const std::vector<std::string>& messages) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the connection; the channel's thread then closes it and tells the session's
  // OpsHandler (OnOpsClosed).
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class FdChannelServer;
  friend class OpsLinkTestPeer;  // tests/server/ops_link_test.cc: stands in for the channel thread
  // Channel thread: whether queued messages wait for POLLOUT.
  bool WantsWrite() ABSL_LOCKS_EXCLUDED(mu_);
  // Channel thread: sends what the socket takes; false if the connection broke.
  bool Flush() ABSL_LOCKS_EXCLUDED(mu_);
  // Channel thread, before it closes the descriptor: later sends fail.
  void Detach() ABSL_LOCKS_EXCLUDED(mu_);
  // Sends the queue's front datagrams until the socket is full: OK, or the send's error.
  absl::Status SendQueuedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `datagrams` after what waits (RESOURCE_EXHAUSTED past kMaxQueuedBytes: the link
  // is shut down), sends what the socket takes, and has the channel's thread poll for room.
  absl::Status QueueLocked(std::vector<std::string> datagrams) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_);
  const int wake_fd_;  // the channel thread's eventfd: it polls for POLLOUT after a write to it
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);  // datagrams, in order
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// A session's side of its ops channel (implemented by the sidecar's session).
class OpsHandler {
 public:
  virtual ~OpsHandler() = default;
  // The session's ops connection is open: from now on its answers go to `link`.
  virtual void OnOpsOpened(std::shared_ptr<OpsLink> link) = 0;
  // One message from the client (serialized collserve.v1.SessionRequest), on the channel's
  // thread: must not block. An error closes the connection (and so ends the session).
  virtual absl::Status OnOpsMessage(std::string message) = 0;
  // The ops connection closed, for `why`: the session ends.
  virtual void OnOpsClosed(const absl::Status& why) = 0;
};

struct FdChannelOptions {
  // Most connections open at once. When they are all open, a new one takes the place of the
  // oldest that has not said a good Hello yet (so that connections that never authenticate
  // cannot keep sessions out); with none of those it is closed at accept.
  int max_connections = 1024;
  // Most connections one session (its token) may have said Hello on at once: the SDK opens
  // two (descriptors, ops channel). A further Hello is answered RESOURCE_EXHAUSTED and its
  // connection closed.
  int max_connections_per_session = 4;
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
  // Whether a segment of `bytes` may be registered (the job's quota, JobQuotas): OK or the
  // error the Register is answered with. Runs on the server's thread; must not block.
  using SegmentAdmission = std::function<absl::Status(int64_t bytes)>;
  // Segments registered with `token` go to `rank` of `group` from now on, each once `admit`
  // (when set) accepts it; its ops channel (if the client opens one) goes to `ops` (null:
  // none is offered).
  void Bind(const std::string& token, std::weak_ptr<engine::Group> group, int rank,
            std::weak_ptr<OpsHandler> ops = {}, SegmentAdmission admit = nullptr);
  // The session ended: its token is refused from now on, its connections are closed (soon,
  // by the server's thread) and its ops channel is shut down.
  void Forget(const std::string& token);

 private:
  struct Binding {
    std::weak_ptr<engine::Group> group;
    int rank = -1;
    bool bound = false;
    std::weak_ptr<OpsHandler> ops;
    std::weak_ptr<OpsLink> ops_link;  // once the session opened its ops channel
    SegmentAdmission admit;           // null: every segment
  };
  struct Connection {
    int fd = -1;
    std::string token;  // after a good Hello
    absl::Time accepted;
    // In ops mode:
    std::shared_ptr<OpsLink> ops;
    std::weak_ptr<OpsHandler> handler;
    std::unique_ptr<opschannel::Reassembler> reassembler;
    absl::Status why_closed;
  };

  FdChannelServer(std::string path, int listen_fd, int wake_fd, FileId socket_id, FdChannelOptions options);
  void Loop();
  // Serves one datagram of `conn`; false if the connection must be closed.
  bool Serve(Connection& conn);
  // The group and rank the session holding `token` is bound to: FAILED_PRECONDITION when
  // the session ended, UNAVAILABLE when it is not attached (yet or any more).
  absl::StatusOr<std::shared_ptr<engine::Group>> GroupOf(const std::string& token, int* rank,
                                                          SegmentAdmission* admit = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Answers an Open (a peer's segment, read-only) of `conn`, the datagram in `buf`;
  // false if the connection must be closed.
  bool ServeOpen(Connection& conn, const char* buf, absl::Time deadline);
  // Answers an OpsMode; false if the connection must be closed.
  bool ServeOpsMode(Connection& conn, absl::Time deadline);
  // Reads an ops connection's datagrams (those waiting); false if it must be closed.
  bool ServeOps(Connection& conn);
  // The datagrams ServeOps takes per system call.
  static constexpr int kOpsReceiveBatch = 16;
  // Closes `conn` (telling its session's OpsHandler, in ops mode). Server's thread.
  void CloseConnection(Connection& conn);

  const std::string path_;
  const int listen_fd_;
  const int wake_fd_;  // an eventfd: written to stop the loop
  const FdChannelOptions options_;
  const FileId socket_id_;

  absl::Mutex mu_;
  std::map<std::string, Binding> tokens_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Tokens Forget took since the server's thread last looked: it closes their connections.
  std::vector<std::string> forgotten_ ABSL_GUARDED_BY(mu_);
  // Server's thread only: the connections that said a good Hello, per token.
  std::map<std::string, int> connections_of_;
  // The channel thread's buffers for ServeOps (kOpsReceiveBatch datagrams, 512 KiB).
  opschannel::BatchReceiver ops_receiver_{kOpsReceiveBatch};

  std::thread thread_;  // last: starts after every member it uses
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_FD_CHANNEL_SERVER_H_
