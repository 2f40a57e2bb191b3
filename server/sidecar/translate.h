// The sidecar's RPC layer <-> the engine: collserve.v1 messages to and from engine types
// (engine/types.h). Enumerations are tied by static_asserts in translate.cc.
#ifndef COLLSERVE_SERVER_SIDECAR_TRANSLATE_H_
#define COLLSERVE_SERVER_SIDECAR_TRANSLATE_H_

#include "absl/status/statusor.h"
#include "collserve/v1/auth.pb.h"
#include "collserve/v1/collectives.pb.h"
#include "collserve/v1/registry.pb.h"
#include "engine/collective_args.h"
#include "engine/types.h"

namespace collserve::server {

// Moves the request out of `c` (its inline bytes are moved, not copied). Never fails: the
// engine validates every field.
engine::Request FromProto(collserve::v1::Collective&& c);
// The attach as the engine takes it (init/op timeouts of 0 become 300 s).
engine::AttachRequest FromProto(const collserve::v1::Attach& a);
// The data-path class of a job's policy (AttachRequest::priority, backends::PoolTenant):
// LATENCY_CRITICAL 0, DEFAULT and UNSPECIFIED 1, BULK 2 (any other value: 1).
int PoolPriority(collserve::v1::PriorityClass c);
// Either form of the answer (members, or the compact hosts and rank_host). INVALID_ARGUMENT
// when a rank_host index is outside `hosts` (the engine checks the rest: Topology).
absl::StatusOr<engine::Membership> FromProto(const collserve::v1::JoinResponse& r);

// Moves the completion's inline bytes into the message.
collserve::v1::SessionResponse ToProto(engine::Completion&& c);
collserve::v1::SessionResponse ToProto(const engine::AttachedInfo& a);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_TRANSLATE_H_
