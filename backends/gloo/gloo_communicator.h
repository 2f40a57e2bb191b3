// Gloo (CPU, TCP transport) implementation of backends::Communicator.
// Rendezvous follows gloo::rendezvous::Context::connectFullMesh (Debian libgloo 0.5.0,
// gloo/rendezvous/context.cc) over a RendezvousStore under a key prefix.
#ifndef COLLSERVE_BACKENDS_GLOO_GLOO_COMMUNICATOR_H_
#define COLLSERVE_BACKENDS_GLOO_GLOO_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backends/communicator.h"
#include "backends/rendezvous_store.h"

namespace collserve::backends {

struct GlooOptions {
  // Address (IP or hostname) this host's Gloo pairs bind to and advertise. Must be
  // reachable from the other hosts of the group.
  std::string hostname = "127.0.0.1";
  // Timeout of the full-mesh connect (including waiting for peers' addresses).
  absl::Duration connect_timeout = absl::Seconds(300);
  // Largest piece Gloo's ring all_reduce sends at once (two are in flight); 0 = Gloo's
  // default (1 MiB). Each piece costs one message latency per ring step, so where that
  // latency is high (virtual machines, network namespaces) larger pieces are faster.
  size_t ring_segment_bytes = 0;
};

// Connects host `rank` of `size` to its peers. Every host must call it with the same
// `prefix` (unique per group generation) and `size`. Blocks until all pairs are
// connected and every host's connect has completed (a one-element all_reduce ends it, so
// a host that returns and closes at once cannot fail a slower peer's connect). Errors: INVALID_ARGUMENT (rank/size), DEADLINE_EXCEEDED (a peer did not show
// up within connect_timeout), UNAVAILABLE (connect/bind failure). Thread-safe with respect
// to other connects.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(RendezvousStore& store,
                                                           const std::string& prefix, int rank,
                                                           int size, const GlooOptions& options);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_GLOO_GLOO_COMMUNICATOR_H_
