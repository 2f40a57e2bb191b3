#include "server/common/networks.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace collserve::server {

namespace {
// Whether the first `prefix` bits of `a` and `b` agree.
bool PrefixMatches(const uint8_t* a, const uint8_t* b, int prefix) {
  const int whole = prefix / 8;
  if (std::memcmp(a, b, static_cast<size_t>(whole)) != 0) return false;
  const int rest = prefix % 8;
  if (rest == 0) return true;
  const auto mask = static_cast<uint8_t>(0xff << (8 - rest));
  return (a[whole] & mask) == (b[whole] & mask);
}
}  // namespace

absl::StatusOr<NetworkList> NetworkList::Parse(absl::string_view spec) {
  NetworkList list;
  std::vector<std::string> normalized;
  for (absl::string_view entry : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const size_t slash = entry.find('/');
    const std::string address(entry.substr(0, slash));
    Network n;
    if (inet_pton(AF_INET, address.c_str(), n.bytes.data()) == 1) {
      n.v6 = false;
    } else if (inet_pton(AF_INET6, address.c_str(), n.bytes.data()) == 1) {
      n.v6 = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("\"", entry, "\" is not an IP network (use e.g. 10.0.0.0/8)"));
    }
    const int max_prefix = n.v6 ? 128 : 32;
    n.prefix = max_prefix;
    if (slash != absl::string_view::npos &&
        (!absl::SimpleAtoi(entry.substr(slash + 1), &n.prefix) || n.prefix < 0 || n.prefix > max_prefix)) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", entry, "\": the prefix length must be 0..", max_prefix));
    }
    list.networks_.push_back(n);
    normalized.push_back(absl::StrCat(address, "/", n.prefix));
  }
  list.text_ = absl::StrJoin(normalized, ",");
  return list;
}

bool NetworkList::Contains(const sockaddr_storage& addr) const {
  uint8_t bytes[16];
  bool v6;
  if (addr.ss_family == AF_INET) {
    std::memcpy(bytes, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, 4);
    v6 = false;
  } else if (addr.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      std::memcpy(bytes, a.s6_addr + 12, 4);
      v6 = false;
    } else {
      std::memcpy(bytes, a.s6_addr, 16);
      v6 = true;
    }
  } else {
    return false;
  }
  for (const Network& n : networks_) {
    if (n.v6 == v6 && PrefixMatches(bytes, n.bytes.data(), n.prefix)) return true;
  }
  return false;
}

namespace {

// `addr`'s family and address bytes for inet_diag (IPv4-mapped IPv6 as IPv4), and its port
// in network order. False for other families.
bool DiagAddress(const sockaddr_storage& addr, int* family, uint32_t words[4], uint16_t* port) {
  std::memset(words, 0, 16);
  if (addr.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(addr);
    *family = AF_INET;
    std::memcpy(words, &a.sin_addr, 4);
    *port = a.sin_port;
    return true;
  }
  if (addr.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(addr);
    *port = a.sin6_port;
    if (IN6_IS_ADDR_V4MAPPED(&a.sin6_addr)) {
      *family = AF_INET;
      std::memcpy(words, a.sin6_addr.s6_addr + 12, 4);
    } else {
      *family = AF_INET6;
      std::memcpy(words, a.sin6_addr.s6_addr, 16);
    }
    return true;
  }
  return false;
}

}  // namespace

bool IsLoopback(const sockaddr_storage& addr) {
  int family;
  uint32_t words[4];
  uint16_t port;
  if (!DiagAddress(addr, &family, words, &port)) return false;
  const auto* bytes = reinterpret_cast<const uint8_t*>(words);
  if (family == AF_INET) return bytes[0] == 127;
  static const uint8_t kLoopback6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  return std::memcmp(bytes, kLoopback6, 16) == 0;
}

bool IsLoopbackListenAddress(absl::string_view host_port) {
  const size_t colon = host_port.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? host_port : host_port.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  if (host == "localhost") return true;
  const std::string h(host);
  sockaddr_storage addr{};
  if (inet_pton(AF_INET, h.c_str(), &reinterpret_cast<sockaddr_in&>(addr).sin_addr) == 1) {
    addr.ss_family = AF_INET;
  } else if (inet_pton(AF_INET6, h.c_str(), &reinterpret_cast<sockaddr_in6&>(addr).sin6_addr) == 1) {
    addr.ss_family = AF_INET6;
  } else {
    return false;
  }
  return IsLoopback(addr);
}

absl::StatusOr<uid_t> LocalPeerUid(int fd) {
  sockaddr_storage local{}, peer{};
  socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
    return absl::UnavailableError(absl::StrCat("getsockname/getpeername: ", std::strerror(errno)));
  }
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } message{};
  int local_family, peer_family;
  // The peer's socket: its own end (idiag_src) is our peer address, its far end ours.
  if (!DiagAddress(peer, &peer_family, message.request.id.idiag_src, &message.request.id.idiag_sport) ||
      !DiagAddress(local, &local_family, message.request.id.idiag_dst, &message.request.id.idiag_dport) ||
      local_family != peer_family) {
    return absl::UnavailableError("the connection is not TCP over IPv4 or IPv6");
  }
  message.header.nlmsg_len = sizeof(message);
  message.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  message.header.nlmsg_flags = NLM_F_REQUEST;
  message.header.nlmsg_seq = 1;
  message.request.sdiag_family = static_cast<uint8_t>(peer_family);
  message.request.sdiag_protocol = IPPROTO_TCP;
  message.request.idiag_states = ~0u;
  message.request.id.idiag_cookie[0] = message.request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  const int nl = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (nl < 0) return absl::UnavailableError(absl::StrCat("netlink socket (sock_diag): ", std::strerror(errno)));
  timeval timeout{1, 0};
  setsockopt(nl, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (sendto(nl, &message, sizeof(message), 0, reinterpret_cast<sockaddr*>(&kernel), sizeof(kernel)) !=
      static_cast<ssize_t>(sizeof(message))) {
    const int err = errno;
    close(nl);
    return absl::UnavailableError(absl::StrCat("sock_diag request: ", std::strerror(err)));
  }
  alignas(nlmsghdr) char reply[8192];
  const ssize_t n = recv(nl, reply, sizeof(reply), 0);
  const int err = errno;
  close(nl);
  if (n < 0) return absl::UnavailableError(absl::StrCat("sock_diag reply: ", std::strerror(err)));
  int remaining = static_cast<int>(n);
  // NLMSG_OK compares the header's __u32 length with the int it is given (clang's
  // -Wsign-compare); `remaining` stays an int so that NLMSG_NEXT's subtraction cannot wrap.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
  for (auto* h = reinterpret_cast<nlmsghdr*>(reply); NLMSG_OK(h, remaining); h = NLMSG_NEXT(h, remaining)) {
    if (h->nlmsg_type == NLMSG_ERROR) {
      if (h->nlmsg_len < NLMSG_LENGTH(sizeof(nlmsgerr))) break;
      const int code = -static_cast<const nlmsgerr*>(NLMSG_DATA(h))->error;
      if (code == ENOENT) return absl::NotFoundError("the peer's socket is gone");
      return absl::UnavailableError(absl::StrCat("sock_diag: ", std::strerror(code)));
    }
    if (h->nlmsg_type == SOCK_DIAG_BY_FAMILY && h->nlmsg_len >= NLMSG_LENGTH(sizeof(inet_diag_msg))) {
      return static_cast<uid_t>(static_cast<const inet_diag_msg*>(NLMSG_DATA(h))->idiag_uid);
    }
  }
#pragma GCC diagnostic pop
  return absl::UnavailableError("sock_diag: no answer about the peer's socket");
}

}  // namespace collserve::server
