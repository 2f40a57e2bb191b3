// The token in a gRPC "authorization" metadata value (RFC 6750 §2.1: "Bearer <token>"), as
// the coordinator checks it and the sidecar forwards it (docs/security.md).
#ifndef COLLSERVE_SERVER_COMMON_BEARER_H_
#define COLLSERVE_SERVER_COMMON_BEARER_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace collserve::server {

// The largest token accepted from a caller or a file, in bytes.
inline constexpr size_t kMaxTokenBytes = 4096;

// "" when `authorization` is empty (no token presented); the token, without surrounding
// whitespace, for "Bearer <token>" (the scheme in any case); UNAUTHENTICATED for anything
// else or a token of more than kMaxTokenBytes. The result views `authorization`.
inline absl::StatusOr<absl::string_view> BearerToken(absl::string_view authorization) {
  if (authorization.empty()) return absl::string_view();
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size() || !absl::StartsWithIgnoreCase(authorization, kScheme)) {
    return absl::UnauthenticatedError("malformed authorization metadata: expected \"Bearer <token>\"");
  }
  absl::string_view token = absl::StripAsciiWhitespace(authorization.substr(kScheme.size()));
  if (token.empty() || token.size() > kMaxTokenBytes) {
    return absl::UnauthenticatedError(
        absl::StrCat("malformed authorization metadata: a token has 1 to ", kMaxTokenBytes, " bytes"));
  }
  return token;
}

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_BEARER_H_
