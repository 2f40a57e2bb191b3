#include "server/coordinator/job_policies.h"

#include <google/protobuf/util/json_util.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace collserve::server {
namespace {

namespace pb = ::collserve::v1;

constexpr size_t kMaxFileBytes = 1 << 20;

absl::Status Check(const pb::JobPolicy& p, const std::string& where, const std::string& path) {
  if (p.max_sessions() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", where, ": max_sessions ", p.max_sessions(), " is negative (0 = no limit)"));
  }
  if (p.max_segment_bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", where, ": max_segment_bytes ", p.max_segment_bytes(), " is negative (0 = no limit)"));
  }
  if (p.max_inflight_collectives() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": max_inflight_collectives ",
                                                   p.max_inflight_collectives(), " is negative (0 = no limit)"));
  }
  if (p.max_inline_bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", where, ": max_inline_bytes ", p.max_inline_bytes(), " is negative (0 = no limit)"));
  }
  if (!pb::PriorityClass_IsValid(p.priority_class())) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": priority_class ", p.priority_class(),
                                                   " is not a class (PRIORITY_CLASS_LATENCY_CRITICAL, "
                                                   "PRIORITY_CLASS_DEFAULT or PRIORITY_CLASS_BULK)"));
  }
  if (p.share_weight() < 0 || p.share_weight() > 1000) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": share_weight ", p.share_weight(),
                                                   " is outside [0, 1000] (0 = 1)"));
  }
  if (p.max_data_threads() < 0 || p.max_data_threads() > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": max_data_threads ", p.max_data_threads(),
                                                   " is outside [0, 1024] (0 = no limit)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<pb::JobPolicies> LoadJobPolicies(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string why = absl::StrCat("cannot read --job_policies_file ", path, ": ", std::strerror(err));
    return err == EACCES ? absl::PermissionDeniedError(why) : absl::NotFoundError(why);
  }
  std::ostringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  if (json.size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", json.size(), " bytes, over the ", kMaxFileBytes, "-byte limit of a policies file"));
  }
  pb::JobPolicies policies;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto parsed = google::protobuf::util::JsonStringToMessage(json, &policies, options);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not a JobPolicies message in JSON (auth.proto; e.g. {\"jobs\": {\"train\": {\"max_sessions\": 8}}}): ",
        parsed.ToString()));
  }
  if (absl::Status s = Check(policies.default_policy(), "default_policy", path); !s.ok()) return s;
  for (const auto& [job, policy] : policies.jobs()) {
    if (job.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": a job with an empty name"));
    if (absl::Status s = Check(policy, absl::StrCat("job \"", job, "\""), path); !s.ok()) return s;
  }
  return policies;
}

const pb::JobPolicy& PolicyFor(const pb::JobPolicies& policies, const std::string& job) {
  auto it = policies.jobs().find(job.empty() ? "default" : job);
  return it != policies.jobs().end() ? it->second : policies.default_policy();
}

}  // namespace collserve::server
