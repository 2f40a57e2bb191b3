#include "common/mutex_mode.h"

#include <cstdlib>
#include <string>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace collserve {

absl::Status ApplyMutexDeadlockDetectionMode() {
  static absl::once_flag once;
  static absl::Status* result = nullptr;  // leaked: read by any thread until exit
  absl::call_once(once, [] {
    const char* env = std::getenv(kMutexDeadlockDetectionEnv);
    const std::string value = env == nullptr ? "" : env;
    absl::Status status;
    if (value.empty() || value == "ignore") {
      absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
    } else if (value == "report") {
      absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kReport);
    } else if (value == "abort") {
      absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
    } else {
      status = absl::InvalidArgumentError(absl::StrCat(kMutexDeadlockDetectionEnv, "=\"", value,
                                                       "\": use ignore (the default), report or abort"));
    }
    result = new absl::Status(std::move(status));
  });
  return *result;
}

}  // namespace collserve
