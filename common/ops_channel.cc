#include "common/ops_channel.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fd_channel.h"
#include "common/status_macros.h"

namespace collserve::opschannel {

absl::StatusOr<std::vector<std::string>> Fragment(absl::string_view message) {
  if (message.size() > kMaxOpsMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("an ops channel message of ", message.size(),
                                                   " bytes exceeds the limit of ", kMaxOpsMessageBytes, " bytes"));
  }
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
  COLLSERVE_ASSIGN_OR_RETURN(std::vector<std::string> fragments, Fragment(message));
  for (const std::string& d : fragments) {
    COLLSERVE_RETURN_IF_ERROR(fdchannel::SendMessage(sock, d.data(), d.size(), -1, deadline));
  }
  return absl::OkStatus();
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
