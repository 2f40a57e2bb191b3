// Job names: the namespace of a job's keys, groups and credentials on the coordinator.
#ifndef COLLSERVE_SERVER_COORDINATOR_JOBS_H_
#define COLLSERVE_SERVER_COORDINATOR_JOBS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace collserve::server {

// OK for a valid job name: 0 to 128 characters from [A-Za-z0-9._-] ("" = "default");
// else INVALID_ARGUMENT naming the rule. No '/' (keys of job J are stored as "J/<key>", so
// namespaces never overlap) and no '#' (the coordinator's own keys start with it).
inline absl::Status ValidateJob(absl::string_view job) {
  if (job.size() > 128) return absl::InvalidArgumentError("job name longer than 128 characters");
  for (char c : job) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return absl::InvalidArgumentError(
          absl::StrCat("job name \"", absl::CHexEscape(job), "\" may only hold letters, digits, '.', '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

// The job a request names: "" means "default".
inline std::string JobOf(absl::string_view job) { return job.empty() ? "default" : std::string(job); }

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_JOBS_H_
