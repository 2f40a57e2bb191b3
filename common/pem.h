// Checks on the PEM files (certificates, keys, CA bundles) that TLS settings name, so that a
// wrong path fails at start with a clear error instead of as failed handshakes later.
#ifndef COLLSERVE_COMMON_PEM_H_
#define COLLSERVE_COMMON_PEM_H_

#include <string>

#include "absl/status/status.h"

namespace collserve {

// OK if `path` is a readable file whose first 4 KiB hold a PEM block ("-----BEGIN ").
// INVALID_ARGUMENT naming `what` and `path` otherwise (cannot be read / not a PEM file).
// Reads the file; never logs its contents. Thread-safe.
absl::Status CheckPemFile(const std::string& what, const std::string& path);

}  // namespace collserve

#endif  // COLLSERVE_COMMON_PEM_H_
