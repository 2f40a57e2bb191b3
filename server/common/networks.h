// An allow-list of IP networks in CIDR notation ("127.0.0.0/8", "10.1.0.0/16", "::1/128",
// a bare address = one host), for endpoints that cannot authenticate their clients (the
// TCPStore-compatible endpoint: torch's clients send no credentials).
#ifndef COLLSERVE_SERVER_COMMON_NETWORKS_H_
#define COLLSERVE_SERVER_COMMON_NETWORKS_H_

#include <sys/socket.h>
#include <sys/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace collserve::server {

class NetworkList {
 public:
  // Parses comma-separated CIDRs; "" = an empty list. INVALID_ARGUMENT naming the entry for
  // an address inet_pton does not take or a prefix beyond 32 (IPv4) / 128 (IPv6).
  static absl::StatusOr<NetworkList> Parse(absl::string_view spec);
  bool empty() const { return networks_.empty(); }
  // Whether the peer address `addr` (AF_INET or AF_INET6; an IPv4-mapped IPv6 address counts
  // as its IPv4 address) lies in one of the networks. False for other families.
  // Thread-safe (const).
  bool Contains(const sockaddr_storage& addr) const;
  // The list as given, normalized ("a/b,c/d"), for messages.
  const std::string& ToString() const { return text_; }

 private:
  struct Network {
    bool v6 = false;
    std::array<uint8_t, 16> bytes{};  // network address (IPv4: first 4 bytes)
    int prefix = 0;                   // bits
  };
  std::vector<Network> networks_;
  std::string text_;
};

// Whether `addr` (AF_INET or AF_INET6, IPv4-mapped counted as IPv4) is a loopback address
// (127.0.0.0/8 or ::1). Thread-safe.
bool IsLoopback(const sockaddr_storage& addr);

// Whether the host part of a listen address "host:port" ("127.0.0.1:0", "[::1]:29500",
// "localhost:1") can only be reached from this host: a loopback address, or "localhost".
// The wildcard and every other address are false. Thread-safe.
bool IsLoopbackListenAddress(absl::string_view host_port);

// The uid owning the other end of the TCP connection `fd` when that end is on this host
// (a loopback connection): the kernel's socket table looked up by the connection's four
// addresses over NETLINK_SOCK_DIAG (an exact inet_diag request, as `ss -e` makes; no
// privilege needed), so it names the peer socket's owner at this moment, not whoever owns a
// port later. Blocks at most 1 s (the netlink socket's receive timeout).
// Errors: NOT_FOUND (no such socket any more: the peer closed), UNAVAILABLE (getsockname,
// getpeername or netlink failed, with the errno text). Thread-safe.
absl::StatusOr<uid_t> LocalPeerUid(int fd);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_NETWORKS_H_
