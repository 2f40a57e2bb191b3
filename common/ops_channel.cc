#include "common/ops_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errno_text.h"
#include "common/fd_channel.h"
#include "common/status_macros.h"

namespace collserve::opschannel {

namespace {

// INVALID_ARGUMENT naming the limit for a message longer than kMaxOpsMessageBytes.
absl::Status CheckMessageSize(size_t bytes) {
  if (bytes <= kMaxOpsMessageBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("an ops channel message of ", bytes, " bytes exceeds the limit of ", kMaxOpsMessageBytes, " bytes"));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> Fragment(absl::string_view message) {
  COLLSERVE_RETURN_IF_ERROR(CheckMessageSize(message.size()));
  std::vector<std::string> out;
  size_t off = 0;
  do {
    const size_t n = std::min(kMaxFragmentPayload, message.size() - off);
    FragmentHeader h;
    h.flags = off + n < message.size() ? kMore : 0;
    std::string d(sizeof(h) + n, '\0');
    std::memcpy(d.data(), &h, sizeof(h));
    if (n > 0) std::memcpy(d.data() + sizeof(h), message.data() + off, n);
    out.push_back(std::move(d));
    off += n;
  } while (off < message.size());
  return out;
}

absl::Status SendOpsMessage(int sock, absl::string_view message, absl::Time deadline) {
  if (message.size() <= kMaxFragmentPayload) {
    // The common case: one datagram, no copy of a fragment list.
    char buf[kMaxDatagramBytes];
    FragmentHeader h;
    std::memcpy(buf, &h, sizeof(h));
    if (!message.empty()) std::memcpy(buf + sizeof(h), message.data(), message.size());
    return fdchannel::SendMessage(sock, buf, sizeof(h) + message.size(), -1, deadline);
  }
  // Several fragments: SendOpsMessages cuts them (one copy of the message, as Fragment made).
  COLLSERVE_RETURN_IF_ERROR(CheckMessageSize(message.size()));
  return SendOpsMessages(sock, {std::string(message)}, deadline);
}

namespace {

// Every datagram of some messages as two pieces, its header and its slice of the message
// (no copies), ready for sendmmsg.
struct Datagrams {
  std::vector<FragmentHeader> headers;
  std::vector<iovec> iov;
  std::vector<mmsghdr> msgs;
};

absl::Status BuildDatagrams(const std::vector<std::string>& messages, Datagrams* out) {
  size_t datagrams = 0;
  for (const std::string& m : messages) {
    COLLSERVE_RETURN_IF_ERROR(CheckMessageSize(m.size()));
    datagrams += m.empty() ? 1 : (m.size() + kMaxFragmentPayload - 1) / kMaxFragmentPayload;
  }
  out->headers.assign(datagrams, FragmentHeader{});
  out->iov.resize(2 * datagrams);
  out->msgs.assign(datagrams, mmsghdr{});
  size_t d = 0;
  for (const std::string& m : messages) {
    size_t off = 0;
    do {
      const size_t n = std::min(kMaxFragmentPayload, m.size() - off);
      out->headers[d].flags = off + n < m.size() ? kMore : 0;
      out->iov[2 * d] = {&out->headers[d], sizeof(FragmentHeader)};
      out->iov[2 * d + 1] = {const_cast<char*>(m.data()) + off, n};
      out->msgs[d].msg_hdr.msg_iov = &out->iov[2 * d];
      out->msgs[d].msg_hdr.msg_iovlen = n > 0 ? 2 : 1;
      off += n;
      ++d;
    } while (off < m.size());
  }
  return absl::OkStatus();
}

// Sends the datagrams from *sent on while the socket takes them, without waiting; advances
// *sent. OK when all went or the socket is full (EAGAIN), else UNAVAILABLE.
absl::Status SendSome(int sock, Datagrams& d, size_t* sent) {
  while (*sent < d.msgs.size()) {
    // sendmmsg takes at most UIO_MAXIOV (1024) messages a call.
    const unsigned int batch = static_cast<unsigned int>(std::min<size_t>(d.msgs.size() - *sent, 1024));
    const int n = sendmmsg(sock, &d.msgs[*sent], batch, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      // A datagram goes whole or not at all on a SOCK_SEQPACKET socket.
      *sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat("shared-memory channel: send: ", n == 0 ? "no datagram sent" : ErrnoText(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SendOpsMessages(int sock, const std::vector<std::string>& messages, absl::Time deadline) {
  Datagrams d;
  COLLSERVE_RETURN_IF_ERROR(BuildDatagrams(messages, &d));
  size_t sent = 0;
  for (;;) {
    COLLSERVE_RETURN_IF_ERROR(SendSome(sock, d, &sent));
    if (sent == d.msgs.size()) return absl::OkStatus();
    COLLSERVE_RETURN_IF_ERROR(fdchannel::WaitFor(sock, POLLOUT, deadline, "room to send"));
  }
}

absl::StatusOr<size_t> TrySendOpsMessages(int sock, const std::vector<std::string>& messages) {
  Datagrams d;
  COLLSERVE_RETURN_IF_ERROR(BuildDatagrams(messages, &d));
  size_t sent = 0;
  COLLSERVE_RETURN_IF_ERROR(SendSome(sock, d, &sent));
  return sent;
}

BatchReceiver::BatchReceiver(int batch)
    : buffers_(static_cast<size_t>(std::clamp(batch, 1, 64)) * kMaxDatagramBytes),
      sizes_(static_cast<size_t>(std::clamp(batch, 1, 64))),
      iov_(sizes_.size()),
      msgs_(sizes_.size()) {
  for (size_t i = 0; i < sizes_.size(); ++i) iov_[i] = {buffers_.data() + i * kMaxDatagramBytes, kMaxDatagramBytes};
}

absl::StatusOr<int> BatchReceiver::Receive(int sock, bool wait) {
  closed_ = false;
  const size_t batch = sizes_.size();
  std::vector<mmsghdr>& msgs = msgs_;
  for (size_t i = 0; i < batch; ++i) {
    msgs[i] = {};  // recvmmsg writes the lengths and flags
    msgs[i].msg_hdr.msg_iov = &iov_[i];
    msgs[i].msg_hdr.msg_iovlen = 1;
  }
  int n;
  do {
    // MSG_TRUNC: a datagram's real size, to refuse one longer than its buffer by its size.
    n = recvmmsg(sock, msgs.data(), static_cast<unsigned int>(batch),
                 MSG_TRUNC | (wait ? MSG_WAITFORONE : MSG_DONTWAIT), nullptr);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (!wait && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    return absl::UnavailableError(absl::StrCat("ops channel: receive: ", ErrnoText(errno)));
  }
  for (int i = 0; i < n; ++i) {
    // A zero-length datagram is the end of a SOCK_SEQPACKET connection (every ops datagram
    // has a header, so a peer that sends an empty one ends it too): what came before it is
    // returned, with closed() set.
    if (msgs[i].msg_len == 0) {
      closed_ = true;
      if (i == 0) return absl::UnavailableError("ops channel: the peer closed the connection");
      return i;
    }
    if ((msgs[i].msg_hdr.msg_flags & MSG_TRUNC) != 0 || msgs[i].msg_len > kMaxDatagramBytes) {
      return absl::InvalidArgumentError(absl::StrCat("ops channel: a datagram of ", msgs[i].msg_len,
                                                     " bytes exceeds the limit of ", kMaxDatagramBytes, " bytes"));
    }
    sizes_[static_cast<size_t>(i)] = msgs[i].msg_len;
  }
  if (n == 0) {  // not seen from recvmmsg; treated as the end
    closed_ = true;
    return absl::UnavailableError("ops channel: the peer closed the connection");
  }
  return n;
}

absl::StatusOr<bool> Reassembler::Add(const char* datagram, size_t bytes) {
  if (complete_) {
    message_.clear();
    complete_ = false;
  }
  FragmentHeader h;
  if (bytes < sizeof(h)) {
    return absl::InvalidArgumentError(absl::StrCat("ops channel: a datagram of ", bytes, " bytes has no header"));
  }
  std::memcpy(&h, datagram, sizeof(h));
  if (h.magic != kFragmentMagic) return absl::InvalidArgumentError("ops channel: bad magic");
  if ((h.flags & ~kMore) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ops channel: unknown flags ", h.flags));
  }
  const size_t payload = bytes - sizeof(h);
  if (payload > kMaxFragmentPayload) {
    return absl::InvalidArgumentError(absl::StrCat("ops channel: a fragment of ", payload,
                                                   " bytes exceeds the limit of ", kMaxFragmentPayload, " bytes"));
  }
  if ((h.flags & kMore) != 0 && payload == 0) {
    return absl::InvalidArgumentError("ops channel: an empty fragment that is not a message's last");
  }
  if (payload > kMaxOpsMessageBytes - message_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ops channel: a message over the limit of ",
                                                   kMaxOpsMessageBytes, " bytes"));
  }
  message_.append(datagram + sizeof(h), payload);
  if ((h.flags & kMore) != 0) return false;
  complete_ = true;
  return true;
}

std::string Reassembler::Take() {
  complete_ = false;
  std::string out = std::move(message_);
  message_.clear();
  return out;
}

}  // namespace collserve::opschannel
