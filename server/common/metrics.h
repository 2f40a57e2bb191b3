// Prometheus metrics shared by the daemons: per-method RPC counts and latencies on an
// injected registry (bounded labels only: method, code). Thread-safe.
#ifndef COLLSERVE_SERVER_COMMON_METRICS_H_
#define COLLSERVE_SERVER_COMMON_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace collserve::server {

class RpcMetrics {
 public:
  explicit RpcMetrics(prometheus::Registry& registry)
      : requests_(prometheus::BuildCounter()
                      .Name("collserve_rpc_requests_total")
                      .Help("RPCs handled, by method and status code.")
                      .Register(registry)),
        duration_(prometheus::BuildHistogram()
                      .Name("collserve_rpc_duration_seconds")
                      .Help("Time to handle an RPC (including time parked waiting), by method.")
                      .Register(registry)) {}

  void Record(absl::string_view method, const absl::Status& status, absl::Duration elapsed) {
    requests_.Add({{"method", std::string(method)}, {"code", absl::StatusCodeToString(status.code())}})
        .Increment();
    duration_.Add({{"method", std::string(method)}}, Buckets()).Observe(absl::ToDoubleSeconds(elapsed));
  }

 private:
  static const prometheus::Histogram::BucketBoundaries& Buckets() {
    // Never destroyed: an RPC that finishes while exit() runs must still find it.
    static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
        0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300};
    return *kBuckets;
  }
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& duration_;
};

// Registers collserve_build_info{daemon="<daemon>",version="<the build's version>"} = 1 on
// `registry`. Defined in daemon.cc (which knows the version).
void RegisterBuildInfo(prometheus::Registry& registry, const std::string& daemon);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_METRICS_H_
