#include "server/sidecar/job_quotas.h"

#include "absl/strings/str_cat.h"

namespace collserve::server {
namespace {

const std::string& Name(const std::string& job) {
  static const std::string* kDefault = new std::string("default");
  return job.empty() ? *kDefault : job;
}

}  // namespace

absl::Status JobQuotas::ReserveSession(const std::string& job, const collserve::v1::JobPolicy& policy) {
  absl::MutexLock lock(&mu_);
  int& n = sessions_[Name(job)];
  if (policy.max_sessions() > 0 && n >= policy.max_sessions()) {
    const int had = n;
    if (n == 0) sessions_.erase(Name(job));
    return absl::ResourceExhaustedError(absl::StrCat(
        "job \"", Name(job), "\" has ", had, " sessions on sidecar ", host_id_, ", its quota (max_sessions ",
        policy.max_sessions(), " in the coordinator's --job_policies_file); this session is refused, the job's "
        "other sessions go on"));
  }
  ++n;
  return absl::OkStatus();
}

void JobQuotas::ReleaseSession(const std::string& job) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(Name(job));
  if (it == sessions_.end()) return;
  if (--it->second <= 0) sessions_.erase(it);
}

int JobQuotas::Sessions(const std::string& job) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(Name(job));
  return it == sessions_.end() ? 0 : it->second;
}

absl::Status JobQuotas::AdmitSegment(const std::string& job, const collserve::v1::JobPolicy& policy, int64_t mapped,
                                     int64_t bytes) const {
  const int64_t limit = policy.max_segment_bytes();
  // Overflow-safe: mapped and bytes are non-negative, so compare against what is left.
  if (limit <= 0 || (bytes >= 0 && mapped >= 0 && mapped <= limit && bytes <= limit - mapped)) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "job \"", Name(job), "\" has ", mapped, " bytes of shared memory registered with sidecar ", host_id_,
      "; a segment of ", bytes, " bytes more would pass its quota (max_segment_bytes ", limit,
      " in the coordinator's --job_policies_file)"));
}

absl::Status JobQuotas::AdmitCollective(const std::string& job, const collserve::v1::JobPolicy& policy,
                                        int64_t seq) {
  absl::MutexLock lock(&mu_);
  int& n = in_flight_[Name(job)];
  const int had = n++;
  if (policy.max_inflight_collectives() <= 0 || had < policy.max_inflight_collectives()) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "job \"", Name(job), "\" has ", had, " requests in flight on sidecar ", host_id_,
      ", its quota (max_inflight_collectives ", policy.max_inflight_collectives(),
      " in the coordinator's --job_policies_file); request #", seq, " is refused, the job's others go on"));
}

void JobQuotas::ReleaseCollectives(const std::string& job, int n) {
  if (n <= 0) return;
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(Name(job));
  if (it == in_flight_.end()) return;
  it->second -= n;
  if (it->second <= 0) in_flight_.erase(it);
}

int JobQuotas::InFlight(const std::string& job) {
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(Name(job));
  return it == in_flight_.end() ? 0 : it->second;
}

}  // namespace collserve::server
