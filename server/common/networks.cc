#include "server/common/networks.h"

#include <arpa/inet.h>
#include <netinet/in.h>

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

}  // namespace collserve::server
