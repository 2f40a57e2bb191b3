// The engine's metrics (engine::EngineObserver) on the sidecar's prometheus registry:
// collserve_collectives_total{op, code}, collserve_collective_duration_seconds{op, size},
// collserve_tensor_bytes_total{path}, collserve_argument_exchanges_total,
// collserve_groups, collserve_collective_arrival_skew_seconds{collserve_job, group},
// collserve_straggler_collectives_total{collserve_job, group} (series of a group made at its
// first observation and removed when it ends here: at most one pair per group with ranks on
// this sidecar), collserve_segments_registered_total and
// collserve_segment_bytes_registered_total; flight recorder dumps go to the log (WARNING, one
// line of JSON: collserve.v1.DumpGroupResponse's mapping). The op label takes only the known ops' names ("unknown" otherwise: a
// client's op number never becomes a label).
#ifndef COLLSERVE_SERVER_SIDECAR_METRICS_OBSERVER_H_
#define COLLSERVE_SERVER_SIDECAR_METRICS_OBSERVER_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#include "engine/interfaces.h"

namespace collserve::server {

// Thread-safe (prometheus-cpp's counters are); never blocks beyond a family's label lookup.
class PrometheusObserver : public engine::EngineObserver {
 public:
  // Registers the families on `registry`, which must outlive this object.
  explicit PrometheusObserver(prometheus::Registry& registry);
  void OnCompleted(engine::CollectiveOp op, const absl::Status& status, absl::Duration latency, uint64_t bytes,
                   const char* algorithm) override;
  void OnTensorBytes(engine::BytePath path, uint64_t bytes) override;
  void OnArgumentExchange() override;
  void OnGroups(int delta) override;
  void OnSegmentRegistered(uint64_t bytes) override;
  void OnGroupEnded(const std::string& job, const std::string& group) override;
  void OnArrivalSkew(const std::string& job, const std::string& group, absl::Duration skew) override;
  void OnStraggler(const std::string& job, const std::string& group) override;
  void OnBackendError(const std::string& peer_host) override;
  void OnCollectiveBytes(engine::CollectiveOp op, uint64_t bytes, double bus_bytes) override;
  void OnFlightRecorderDump(const std::string& job, const std::string& group, int64_t generation,
                            const std::string& reason, const std::vector<FlightRecord>& records) override;

 private:
  prometheus::Family<prometheus::Counter>& collectives_;
  // By CollectiveOp value (1..kRecv; [0]: unknown ops) and size bucket (kSizeBuckets),
  // each made at its first observation (Duration): a series exists once an op of that size
  // ran, not 13 x 7 histograms of 17 series each (1,547) per sidecar in advance. At most
  // that many, bounded by the ops and sizes a sidecar's jobs use.
  static constexpr int kSizeBuckets = 7;
  prometheus::Histogram& Duration(int op, int size_bucket);
  std::atomic<prometheus::Histogram*> durations_[13][kSizeBuckets] = {};
  prometheus::Family<prometheus::Counter>& algorithms_;
  prometheus::Family<prometheus::Counter>& backend_errors_;
  prometheus::Family<prometheus::Histogram>& durations_family_;
  // By CollectiveOp value, as durations_: sizes and bus bytes (nccl-tests' algbw and busbw).
  prometheus::Counter* sizes_[13] = {};
  prometheus::Counter* bus_bytes_[13] = {};
  prometheus::Gauge* groups_;
  prometheus::Counter* exchanges_;
  prometheus::Counter* bytes_[3];  // by BytePath
  // A group's skew and straggler series, labelled {collserve_job, group} (Prometheus' own
  // "job" label is the scrape job's), made together at the first observation of either.
  struct GroupSeries {
    prometheus::Histogram* skew;
    prometheus::Counter* stragglers;
  };
  GroupSeries& SeriesOf(const std::string& job, const std::string& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(series_mu_);
  prometheus::Family<prometheus::Histogram>& skew_family_;
  prometheus::Family<prometheus::Counter>& stragglers_family_;
  absl::Mutex series_mu_;
  std::map<std::pair<std::string, std::string>, GroupSeries> series_ ABSL_GUARDED_BY(series_mu_);
  prometheus::Counter* segments_;
  prometheus::Counter* segment_bytes_;
  // The peer hosts with a series of their own in backend_errors_ (at most
  // kMaxBackendErrorPeers; later ones count under "other"): a peer's default host id holds
  // its sidecar's pid, so every restart of a failing peer was a new series, for good.
  static constexpr size_t kMaxBackendErrorPeers = 256;
  absl::Mutex peers_mu_;
  std::set<std::string> backend_error_peers_ ABSL_GUARDED_BY(peers_mu_);
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_METRICS_OBSERVER_H_
