// The sidecar's per-job quotas: what the operator allows one job on this host (auth.proto's
// JobPolicy, which the coordinator hands over with each session's credential check, from its
// --job_policies_file), so that one job cannot take the host's sessions, shared memory or
// engine queues from the others. A session, a segment or a request past a limit is refused
// with RESOURCE_EXHAUSTED naming the limit; the job's other sessions and every other job go on.
#ifndef COLLSERVE_SERVER_SIDECAR_JOB_QUOTAS_H_
#define COLLSERVE_SERVER_SIDECAR_JOB_QUOTAS_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "collserve/v1/auth.pb.h"

namespace collserve::server {

// Thread-safe.
class JobQuotas {
 public:
  explicit JobQuotas(std::string host_id) : host_id_(std::move(host_id)) {}

  // Counts one more session of `job` ("" = "default") on this sidecar, unless it has
  // policy.max_sessions (> 0) already: then RESOURCE_EXHAUSTED naming the limit and the
  // count. Every OK must be matched by one ReleaseSession(job) when the session ends (or
  // its attach fails). Never blocks.
  absl::Status ReserveSession(const std::string& job, const collserve::v1::JobPolicy& policy);
  void ReleaseSession(const std::string& job);
  // Sessions of `job` counted now.
  int Sessions(const std::string& job);

  // Whether `job`, which has `mapped` bytes of shared memory registered here, may register a
  // segment of `bytes` more: OK, or RESOURCE_EXHAUSTED naming policy.max_segment_bytes
  // (> 0) and the sizes. Pure.
  absl::Status AdmitSegment(const std::string& job, const collserve::v1::JobPolicy& policy, int64_t mapped,
                            int64_t bytes) const;

  // Counts one more request (a collective or a send/recv) of `job` in flight on this sidecar
  // (received, not yet completed) whether or not it is admitted, and returns OK if the job had
  // fewer than policy.max_inflight_collectives (> 0) before it, else RESOURCE_EXHAUSTED naming
  // the limit, the count and `seq` (the request's sequence number in its group). A refused
  // request still goes to its group, carrying the refusal (so the group's sequence stays whole),
  // which is why it counts until it completes. Every call must be matched by one
  // ReleaseCollectives(job, 1): when its completion is sent or its session ends. Never blocks.
  absl::Status AdmitCollective(const std::string& job, const collserve::v1::JobPolicy& policy, int64_t seq);
  void ReleaseCollectives(const std::string& job, int n);
  // Requests of `job` in flight now.
  int InFlight(const std::string& job);

 private:
  const std::string host_id_;
  absl::Mutex mu_;
  std::map<std::string, int> sessions_ ABSL_GUARDED_BY(mu_);  // jobs with at least one
  std::map<std::string, int> in_flight_ ABSL_GUARDED_BY(mu_);  // jobs with at least one
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_JOB_QUOTAS_H_
