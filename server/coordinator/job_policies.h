// Per-job policies the operator sets for every sidecar (auth.proto's JobPolicy): the
// coordinator reads them from --job_policies_file and hands each job's to a sidecar with the
// answer to Auth.Authenticate, so the limits come with the job's credentials, never from the
// job itself. The sidecar enforces them (server/sidecar/job_quotas.h).
#ifndef COLLSERVE_SERVER_COORDINATOR_JOB_POLICIES_H_
#define COLLSERVE_SERVER_COORDINATOR_JOB_POLICIES_H_

#include <string>

#include "absl/status/statusor.h"
#include "collserve/v1/auth.pb.h"

namespace collserve::server {

// Reads `path`: a JobPolicies message in protobuf's JSON mapping (auth.proto has an
// example); unknown fields are refused, so a misspelt limit is an error, not silently no
// limit. Errors: NOT_FOUND / PERMISSION_DENIED (cannot read the file, naming it),
// INVALID_ARGUMENT (not JSON of that message, a negative limit, an empty job name, or a file
// over 1 MiB), each naming the file and what is wrong. Blocks (reads a file); thread-safe.
absl::StatusOr<collserve::v1::JobPolicies> LoadJobPolicies(const std::string& path);

// The policy of `job` ("" = "default"): its entry in `policies`, else the default one.
// Thread-safe (reads only).
const collserve::v1::JobPolicy& PolicyFor(const collserve::v1::JobPolicies& policies, const std::string& job);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_JOB_POLICIES_H_
