// How a generation's rendezvous names its keys in the job's store.
#ifndef COLLSERVE_COMMON_RENDEZVOUS_H_
#define COLLSERVE_COMMON_RENDEZVOUS_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace collserve {

// The part of a store key that names one formation of a group: "<generation>" when
// `rendezvous_id` is 0, else "<generation>.<rendezvous_id as 16 hex digits>" (e.g.
// "3.00c0ffee12345678"). The id is the coordinator's collserve.v1.JoinResponse.rendezvous_id:
// generation numbers alone repeat once a coordinator restarts with a durable store (it
// counts a finished group's generations from 1 again), and a connect that read a key an
// earlier formation left would take a dead peer's address or NCCL id. Used by the sidecar's
// backend connects (engine/executor.cc, engine/device_step.cc) and the SDK's NCCL unique id
// (client/process_group.cc). Pure; thread-safe.
inline std::string RendezvousScope(int64_t generation, uint64_t rendezvous_id) {
  if (rendezvous_id == 0) return absl::StrCat(generation);
  return absl::StrCat(generation, ".", absl::Hex(rendezvous_id, absl::kZeroPad16));
}

}  // namespace collserve

#endif  // COLLSERVE_COMMON_RENDEZVOUS_H_
