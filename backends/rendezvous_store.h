// The four store verbs a backend needs to rendezvous (exchange addresses, unique ids).
// The sidecar adapts the coordinator's Store to it; tests use an in-memory one. Backends
// never see gRPC.
#ifndef COLLSERVE_BACKENDS_RENDEZVOUS_STORE_H_
#define COLLSERVE_BACKENDS_RENDEZVOUS_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace collserve::backends {

// Implementations must be thread-safe.
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  // Stores value under key (replacing it).
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // The value of key, blocking up to `timeout` for it to exist (DEADLINE_EXCEEDED after).
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
  // Blocks until every key exists; DEADLINE_EXCEEDED after `timeout`.
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
  // Adds delta to the integer under key (missing = 0); returns the new value.
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;
};

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_RENDEZVOUS_STORE_H_
