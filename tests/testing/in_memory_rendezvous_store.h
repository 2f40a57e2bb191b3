// backends::RendezvousStore in one process (Gloo's HashStore with blocking gets), for
// backend tests that run every rank on a thread.
#ifndef COLLSERVE_TESTS_TESTING_IN_MEMORY_RENDEZVOUS_STORE_H_
#define COLLSERVE_TESTS_TESTING_IN_MEMORY_RENDEZVOUS_STORE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "backends/rendezvous_store.h"

namespace collserve::testing {

class InMemoryRendezvousStore : public backends::RendezvousStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override {
    absl::MutexLock lock(&mu_);
    kv_[key] = value;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    absl::Status s = Wait({key}, timeout);
    if (!s.ok()) return s;
    absl::MutexLock lock(&mu_);
    return kv_[key];
  }
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const auto& k : keys) {
        if (kv_.count(k) == 0) return false;
      }
      return true;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&all), timeout)) {
      return absl::DeadlineExceededError(absl::StrCat("keys missing after ", absl::FormatDuration(timeout)));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    absl::MutexLock lock(&mu_);
    int64_t v = 0;
    if (kv_.count(key) > 0 && !absl::SimpleAtoi(kv_[key], &v)) return absl::InvalidArgumentError("not an integer");
    v += delta;
    kv_[key] = absl::StrCat(v);
    return v;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> kv_ ABSL_GUARDED_BY(mu_);
};

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_IN_MEMORY_RENDEZVOUS_STORE_H_
