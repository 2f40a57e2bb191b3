// The shared-memory descriptor channel between a client and its sidecar on one host: a
// SOCK_SEQPACKET unix socket next to the sidecar's gRPC socket ("<socket>.fd") over which
// the client passes the memfd descriptors of its segments (SCM_RIGHTS), so that the
// sidecar maps only memory the client holds. A session proves which session it is with the
// token the sidecar gave it in collserve.v1.Attached, over that session's own stream.
//
// Messages are fixed-size structs in host byte order (both ends are on one host), one per
// datagram; every request gets one Reply:
//   client -> sidecar  Hello    {magic, kHello, token[16]}           first, once
//   client -> sidecar  Register {magic, kRegister, bytes, name} + 1 descriptor (SCM_RIGHTS)
//   client -> sidecar  Open     {magic, kOpen, owner_rank, name}     a peer's segment
//   client -> sidecar  OpsMode  {magic, kOps}                        after Hello, once
//   sidecar -> client  Reply    {magic, code, message}               code: absl::StatusCode;
//                      an Open answered OK carries the segment's read-only descriptor
// A wrong magic, an unknown op, a Register before a good Hello or without exactly one
// descriptor is answered with an error and the connection is closed. The sidecar never
// waits to send a Reply: a client must read each before its next request (one whose socket
// has no room for a Reply is closed). One session's token says Hello on at most 4
// connections (RESOURCE_EXHAUSTED), and they are closed when the session ends. An OpsMode answered OK
// switches the connection to the session's ops channel (common/ops_channel.h): from then on
// it carries that framing only, and closing it ends the session.
#ifndef COLLSERVE_COMMON_FD_CHANNEL_H_
#define COLLSERVE_COMMON_FD_CHANNEL_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace collserve::fdchannel {

inline constexpr uint32_t kMagic = 0x44465343;  // "CSFD"
inline constexpr size_t kTokenBytes = 16;
inline constexpr size_t kMaxNameBytes = 64;  // a segment name, NUL-padded
inline constexpr size_t kMaxMessageBytes = 256;

enum Op : uint32_t { kHello = 1, kRegister = 2, kOpen = 3, kOps = 4 };

struct Hello {
  uint32_t magic = kMagic;
  uint32_t op = kHello;
  char token[kTokenBytes] = {};
};

struct Register {
  uint32_t magic = kMagic;
  uint32_t op = kRegister;
  uint64_t bytes = 0;               // the segment's size as the client created it
  char name[kMaxNameBytes] = {};    // ShmSegment::name(), NUL-padded
};

// A read-only descriptor of segment `name` of local rank `owner_rank` of this session's
// group (what a Completion's peer_source names): the sidecar checks that this session's
// rank may read it (engine::Group::OpenPeerSegment).
struct Open {
  uint32_t magic = kMagic;
  uint32_t op = kOpen;
  int32_t owner_rank = -1;
  uint32_t reserved = 0;
  char name[kMaxNameBytes] = {};    // the owner's ShmSegment::name(), NUL-padded
};

// Switches the connection to the session's ops channel. Refused (FAILED_PRECONDITION) before
// Hello, for a session that already has one, or one whose sidecar does not offer it.
struct OpsMode {
  uint32_t magic = kMagic;
  uint32_t op = kOps;
};

struct Reply {
  uint32_t magic = kMagic;
  int32_t code = 0;                 // absl::StatusCode; 0 = OK
  char message[kMaxMessageBytes - 8] = {};  // NUL-terminated
};

// The channel's path for a sidecar whose gRPC socket is `grpc_socket_path`.
inline std::string PathFor(const std::string& grpc_socket_path) { return grpc_socket_path + ".fd"; }

// Waits until `sock` is ready for poll(2) `events` (POLLIN, POLLOUT) or an error, at most
// until `deadline`: OK, DEADLINE_EXCEEDED (naming `what`), UNAVAILABLE (poll failed).
absl::Status WaitFor(int sock, short events, absl::Time deadline, const char* what);

// Sends `bytes` of `data` as one datagram, with descriptor `fd` attached unless it is -1.
// Waits at most until `deadline` for room. UNAVAILABLE / DEADLINE_EXCEEDED on failure.
absl::Status SendMessage(int sock, const void* data, size_t bytes, int fd, absl::Time deadline);

// Receives one datagram into `data` (at most `capacity` bytes), waiting at most until
// `deadline`. Returns its size (0: the peer closed the connection). A descriptor that came
// with it is stored in `*fd` (else -1); descriptors beyond the first are closed. `fd` may
// be null, and then any descriptor received is closed. UNAVAILABLE / DEADLINE_EXCEEDED.
absl::StatusOr<size_t> ReceiveMessage(int sock, void* data, size_t capacity, int* fd, absl::Time deadline);

// A Reply carrying `status` (its message cut to fit).
Reply ReplyFor(const absl::Status& status);
// The status a Reply carries (UNAVAILABLE if it is not a well-formed Reply of `bytes`).
absl::Status StatusOf(const Reply& reply, size_t bytes);

// The client's end: connects to `path` and says Hello with `token`; the returned socket is
// the caller's to close. Errors: UNAVAILABLE (no such socket, refused), what the sidecar
// answered (PERMISSION_DENIED for an unknown token), DEADLINE_EXCEEDED.
absl::StatusOr<int> Connect(const std::string& path, const std::string& token, absl::Time deadline);

// Connect, then OpsMode: the returned socket (blocking; the caller's to close) is the
// session's ops channel. Errors as Connect's, and the sidecar's answer to OpsMode.
absl::StatusOr<int> ConnectOps(const std::string& path, const std::string& token, absl::Time deadline);

// Registers segment `name` of `bytes` bytes with descriptor `fd` (not closed) on a socket
// from Connect, and waits for the sidecar's answer. Not thread-safe: one request at a time.
absl::Status RegisterSegment(int sock, const std::string& name, uint64_t bytes, int fd, absl::Time deadline);

// Asks for a read-only descriptor of local rank `owner_rank`'s segment `name` (Open) and
// returns it (the caller's to close). Errors: what the sidecar answered (PERMISSION_DENIED:
// not a rank of this session's group, or no peer reads; NOT_FOUND: no such segment it can
// share), UNAVAILABLE (an OK answer without a descriptor, a closed channel),
// DEADLINE_EXCEEDED. Not thread-safe: one request at a time.
absl::StatusOr<int> OpenPeerSegment(int sock, int owner_rank, const std::string& name, absl::Time deadline);

}  // namespace collserve::fdchannel

#endif  // COLLSERVE_COMMON_FD_CHANNEL_H_
