// The ops channel: a session's collective requests and their completions between a client
// and its sidecar on one host, over a SOCK_SEQPACKET connection of the descriptor channel
// (common/fd_channel.h) switched to ops mode. It carries the same messages as the
// session's gRPC stream (collserve.v1.SessionRequest from the client, SessionResponse from
// the sidecar, serialized protobuf) with one datagram per message in the common case,
// where a stream round trip costs about three times the context switches
// (bench/control_rtt.cc). Attach, Attached and the session's end stay on the gRPC stream.
//
// Framing: every datagram starts with a FragmentHeader {magic, flags}; a message longer
// than kMaxFragmentPayload is cut into fragments, each but the last flagged kMore, sent
// back to back on one connection (a sender never interleaves two messages' fragments). A
// message is at most kMaxOpsMessageBytes; a receiver refuses anything longer, a wrong
// magic, unknown flags, or an empty fragment, and closes the connection.
//
// Thread safety: Reassembler is not thread-safe (one per connection, used by its reader);
// the free functions are.
#ifndef COLLSERVE_COMMON_OPS_CHANNEL_H_
#define COLLSERVE_COMMON_OPS_CHANNEL_H_

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace collserve::opschannel {

inline constexpr uint32_t kFragmentMagic = 0x4f505343;  // "CSPO"
inline constexpr uint32_t kMore = 1;                    // more fragments of this message follow

struct FragmentHeader {
  uint32_t magic = kFragmentMagic;
  uint32_t flags = 0;
};

// Payload bytes of one datagram (it fits in a unix socket's default send buffer).
inline constexpr size_t kMaxFragmentPayload = 32 * 1024;
inline constexpr size_t kMaxDatagramBytes = sizeof(FragmentHeader) + kMaxFragmentPayload;
// A whole message, in bytes: requests and completions name segments, they do not carry
// tensors (an ops session always has shared memory), so this bounds splits and error texts.
inline constexpr size_t kMaxOpsMessageBytes = 16u << 20;

// The datagrams that carry `message`, in order. INVALID_ARGUMENT (naming the limit) if it
// is longer than kMaxOpsMessageBytes.
absl::StatusOr<std::vector<std::string>> Fragment(absl::string_view message);

// Sends `message` on `sock` (Fragment, then one datagram each), waiting at most until
// `deadline` for room. INVALID_ARGUMENT (too long), UNAVAILABLE (the connection broke),
// DEADLINE_EXCEEDED. Callers serialize their sends on one socket.
absl::Status SendOpsMessage(int sock, absl::string_view message, absl::Time deadline);

// Sends `messages` in order on `sock`, as SendOpsMessage would one by one, with several
// datagrams per system call (sendmmsg(2)); what `messages` hold is not copied. Waits at
// most until `deadline` for room. INVALID_ARGUMENT if one is longer than
// kMaxOpsMessageBytes (then nothing is sent), UNAVAILABLE (the connection broke: the
// messages before the failure may have been sent), DEADLINE_EXCEEDED. Callers serialize
// their sends on one socket.
absl::Status SendOpsMessages(int sock, const std::vector<std::string>& messages, absl::Time deadline);

// Sends the datagrams of `messages` (as SendOpsMessages cuts them) that `sock` has room for
// now, in order, without waiting; what the caller does with the rest is its own (the
// sidecar queues it: Fragment(message) gives the same datagrams). Returns how many
// datagrams went, of all of them (a message of n bytes is max(1, ceil(n /
// kMaxFragmentPayload)) datagrams). INVALID_ARGUMENT if one message is longer than
// kMaxOpsMessageBytes (then nothing is sent), UNAVAILABLE (the connection broke).
absl::StatusOr<size_t> TrySendOpsMessages(int sock, const std::vector<std::string>& messages);

// Receives the datagrams queued on a connection, up to a batch per system call
// (recvmmsg(2)), into buffers of its own (batch * kMaxDatagramBytes bytes), which the next
// Receive reuses. Keeps no state of a connection between calls: one reader may use it for
// several. Not thread-safe.
class BatchReceiver {
 public:
  // `batch` in [1, 64]: the most datagrams one Receive returns.
  explicit BatchReceiver(int batch);
  // Receives up to the batch: with `wait`, blocks until at least one datagram came (then
  // takes what else is queued, without waiting); without, returns 0 at once if none is
  // queued. Returns how many datagrams were received (1 or more), or 0 (nothing queued,
  // without `wait`). When the connection ended after some datagrams, those are returned and
  // closed() is true: the caller handles them, then ends the connection (the end is a
  // zero-length datagram, which a peer can also send on purpose: what it sent after one is
  // not read). UNAVAILABLE when it ended before any (closed() true) or receiving failed;
  // INVALID_ARGUMENT for a datagram longer than kMaxDatagramBytes (the connection must then
  // be closed; what came with it in this call is dropped).
  absl::StatusOr<int> Receive(int sock, bool wait);
  // Datagram `i` (< the last Receive's count) of the last Receive.
  const char* data(int i) const { return buffers_.data() + static_cast<size_t>(i) * kMaxDatagramBytes; }
  size_t size(int i) const { return sizes_[static_cast<size_t>(i)]; }
  // Whether the last Receive found the end of the connection (a zero-length datagram).
  bool closed() const { return closed_; }

 private:
  std::vector<char> buffers_;
  std::vector<size_t> sizes_;
  std::vector<iovec> iov_;     // one per buffer
  std::vector<mmsghdr> msgs_;  // recvmmsg's, one per buffer
  bool closed_ = false;
};

// Rebuilds messages from datagrams, one connection's worth.
class Reassembler {
 public:
  // Adds one received datagram. Returns true when it completed a message (then Take() it),
  // false when more fragments are due. INVALID_ARGUMENT for a malformed datagram or a
  // message over kMaxOpsMessageBytes: the connection must then be closed.
  absl::StatusOr<bool> Add(const char* datagram, size_t bytes);
  // The completed message (valid after Add returned true; the next Add starts afresh).
  std::string Take();

 private:
  std::string message_;
  bool complete_ = false;
};

}  // namespace collserve::opschannel

#endif  // COLLSERVE_COMMON_OPS_CHANNEL_H_
