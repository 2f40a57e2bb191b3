#include "common/fd_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errno_text.h"
#include "common/local_socket.h"
#include "common/status_macros.h"

namespace collserve::fdchannel {

absl::Status WaitFor(int sock, short events, absl::Time deadline, const char* what) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("shared-memory channel: no ", what, " in time"));
    }
    pollfd p{sock, events, 0};
    const int rc = poll(&p, 1, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30)));
    if (rc > 0) return absl::OkStatus();
    if (rc < 0 && errno != EINTR) return absl::UnavailableError(absl::StrCat("shared-memory channel: poll: ", ErrnoText(errno)));
  }
}

absl::Status SendMessage(int sock, const void* data, size_t bytes, int fd, absl::Time deadline) {
  iovec iov{const_cast<void*>(data), bytes};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  for (;;) {
    const ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(bytes)) return absl::OkStatus();
    if (n >= 0) return absl::UnavailableError("shared-memory channel: short send");
    if (errno == EINTR) continue;
    if (errno != EAGAIN) return absl::UnavailableError(absl::StrCat("shared-memory channel: send: ", ErrnoText(errno)));
    COLLSERVE_RETURN_IF_ERROR(WaitFor(sock, POLLOUT, deadline, "room to send"));
  }
}

absl::StatusOr<size_t> ReceiveMessage(int sock, void* data, size_t capacity, int* fd, absl::Time deadline) {
  if (fd != nullptr) *fd = -1;
  for (;;) {
    iovec iov{data, capacity};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN) {
        return absl::UnavailableError(absl::StrCat("shared-memory channel: receive: ", ErrnoText(errno)));
      }
      COLLSERVE_RETURN_IF_ERROR(WaitFor(sock, POLLIN, deadline, "answer"));
      continue;
    }
    // Keep at most one descriptor; close every other one the message carried.
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (fd != nullptr && *fd < 0) {
          *fd = received;
        } else {
          close(received);
        }
      }
    }
    return static_cast<size_t>(n);
  }
}

Reply ReplyFor(const absl::Status& status) {
  Reply r;
  r.code = static_cast<int32_t>(status.code());
  const size_t n = std::min(status.message().size(), sizeof(r.message) - 1);
  // An OK status's message is empty and its data() may be null: memcpy's pointers must not be.
  if (n > 0) std::memcpy(r.message, status.message().data(), n);
  return r;
}

absl::Status StatusOf(const Reply& reply, size_t bytes) {
  if (bytes != sizeof(Reply) || reply.magic != kMagic) {
    return absl::UnavailableError("shared-memory channel: malformed answer from the sidecar");
  }
  if (reply.code == 0) return absl::OkStatus();
  const size_t len = strnlen(reply.message, sizeof(reply.message));
  return absl::Status(static_cast<absl::StatusCode>(reply.code),
                      absl::StrCat("sidecar: ", std::string(reply.message, len)));
}

namespace {

absl::Status Exchange(int sock, const void* request, size_t bytes, int fd, absl::Time deadline) {
  COLLSERVE_RETURN_IF_ERROR(SendMessage(sock, request, bytes, fd, deadline));
  Reply reply;
  COLLSERVE_ASSIGN_OR_RETURN(size_t got, ReceiveMessage(sock, &reply, sizeof(reply), nullptr, deadline));
  if (got == 0) return absl::UnavailableError("shared-memory channel: the sidecar closed the connection");
  return StatusOf(reply, got);
}

}  // namespace

absl::StatusOr<int> Connect(const std::string& path, const std::string& token, absl::Time deadline) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path) || token.size() != kTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory channel path \"", path, "\" or token is malformed"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::UnavailableError(absl::StrCat("socket: ", ErrnoText(errno)));
  if (connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(sock);
    return absl::UnavailableError(absl::StrCat("cannot connect to the sidecar's shared-memory channel ", path, ": ",
                                               ErrnoText(err)));
  }
  // The token and then the segments' descriptors go to whoever serves this socket: only to
  // the expected user (SO_PEERCRED of this connection, so no race with a replaced path).
  absl::StatusOr<std::vector<uid_t>> owners = ExpectedSocketOwners();
  absl::Status peer = owners.ok() ? CheckPeerOwner(sock, absl::StrCat("the sidecar's shared-memory channel ", path), *owners)
                                  : owners.status();
  if (!peer.ok()) {
    close(sock);
    return peer;
  }
  Hello hello;
  std::memcpy(hello.token, token.data(), kTokenBytes);
  if (absl::Status s = Exchange(sock, &hello, sizeof(hello), -1, deadline); !s.ok()) {
    close(sock);
    return s;
  }
  return sock;
}

absl::StatusOr<int> ConnectOps(const std::string& path, const std::string& token, absl::Time deadline) {
  COLLSERVE_ASSIGN_OR_RETURN(int sock, Connect(path, token, deadline));
  OpsMode ops;
  if (absl::Status s = Exchange(sock, &ops, sizeof(ops), -1, deadline); !s.ok()) {
    close(sock);
    return s;
  }
  return sock;
}

absl::Status RegisterSegment(int sock, const std::string& name, uint64_t bytes, int fd, absl::Time deadline) {
  Register r;
  if (name.empty() || name.size() >= sizeof(r.name)) {
    return absl::InvalidArgumentError(absl::StrCat("segment name \"", name, "\" is empty or too long"));
  }
  r.bytes = bytes;
  std::memcpy(r.name, name.data(), name.size());
  return Exchange(sock, &r, sizeof(r), fd, deadline);
}

absl::StatusOr<int> OpenPeerSegment(int sock, int owner_rank, const std::string& name, absl::Time deadline) {
  Open o;
  if (name.empty() || name.size() >= sizeof(o.name)) {
    return absl::InvalidArgumentError(absl::StrCat("segment name \"", name, "\" is empty or too long"));
  }
  o.owner_rank = owner_rank;
  std::memcpy(o.name, name.data(), name.size());
  COLLSERVE_RETURN_IF_ERROR(SendMessage(sock, &o, sizeof(o), -1, deadline));
  Reply reply;
  int fd = -1;
  COLLSERVE_ASSIGN_OR_RETURN(size_t got, ReceiveMessage(sock, &reply, sizeof(reply), &fd, deadline));
  if (got == 0) return absl::UnavailableError("shared-memory channel: the sidecar closed the connection");
  absl::Status s = StatusOf(reply, got);
  if (!s.ok()) {
    if (fd >= 0) close(fd);
    return s;
  }
  if (fd < 0) return absl::UnavailableError("shared-memory channel: Open was answered without a descriptor");
  return fd;
}

}  // namespace collserve::fdchannel
