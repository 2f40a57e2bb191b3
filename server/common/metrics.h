// Prometheus metrics shared by the daemons: per-method RPC counts and latencies on an
// injected registry (bounded labels only: method, code). Thread-safe.
#ifndef COLLSERVE_SERVER_COMMON_METRICS_H_
#define COLLSERVE_SERVER_COMMON_METRICS_H_

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

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

// One gauge (or, with `counter`, a counter) read at scrape time (ScrapeGauges).
struct GaugeValue {
  std::string name;
  std::string help;
  double value = 0;
  bool counter = false;
  // Labels of this series (bounded values only); series of one name form one family.
  std::map<std::string, std::string> labels = {};
};

// The process's own metrics under the Prometheus client libraries' standard names
// (process_cpu_seconds_total, process_resident_memory_bytes, process_virtual_memory_bytes,
// process_open_fds, process_max_fds, process_start_time_seconds), read from /proc/self; a
// value /proc does not give is left out. Also collserve_heap_allocated_bytes and
// collserve_heap_free_bytes from glibc's mallinfo2 (bytes), which tell a leak (allocated
// grows) from allocator retention (free grows). Thread-safe. Defined in daemon.cc.
std::vector<GaugeValue> ProcessMetrics();

// Gauges (and counters) whose values are read when Prometheus scrapes; the values of one
// name are one family wherever they come in the list, families in the order their names
// first come (prometheus-cpp's Collectable): for
// state another component owns (the store's size, the engine's in-flight collectives), so
// that it needs no updating thread. `read` runs on the exposer's thread: it must be
// thread-safe, must not block for long, and what it reads must outlive the exposer (reset
// the exposer first).
class ScrapeGauges : public prometheus::Collectable {
 public:
  explicit ScrapeGauges(std::function<std::vector<GaugeValue>()> read) : read_(std::move(read)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    // Every series of a name goes to one family, wherever it comes in the list (a second
    // family of a name is a second HELP line, which the text format forbids).
    std::map<std::string, size_t> family_of;
    for (GaugeValue& g : read_()) {
      auto [it, added] = family_of.try_emplace(g.name, out.size());
      if (added) {
        prometheus::MetricFamily f;
        f.name = std::move(g.name);
        f.help = std::move(g.help);
        f.type = g.counter ? prometheus::MetricType::Counter : prometheus::MetricType::Gauge;
        out.push_back(std::move(f));
      }
      prometheus::MetricFamily& f = out[it->second];
      prometheus::ClientMetric m;
      for (auto& [k, v] : g.labels) m.label.push_back({k, v});
      if (g.counter) {
        m.counter.value = g.value;
      } else {
        m.gauge.value = g.value;
      }
      f.metric.push_back(std::move(m));
    }
    return out;
  }

 private:
  std::function<std::vector<GaugeValue>()> read_;
};

// Registers collserve_build_info{daemon="<daemon>",version="<the build's version>"} = 1 on
// `registry`. Defined in daemon.cc (which knows the version).
void RegisterBuildInfo(prometheus::Registry& registry, const std::string& daemon);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_METRICS_H_
