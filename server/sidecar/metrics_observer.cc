#include "server/sidecar/metrics_observer.h"

#include <glog/logging.h>
#include <google/protobuf/util/json_util.h>

#include "collserve/v1/registry.pb.h"
#include "server/common/ledger_proto.h"

namespace collserve::server {

static_assert(static_cast<int>(engine::CollectiveOp::kRecv) == 12, "durations_ covers the ops 1..12");

namespace {

// The size label of collserve_collective_duration_seconds: the upper bound of a rank's
// tensor bytes (the larger of input and output), as a power-of-two unit.
constexpr const char* kSizeLabels[] = {"0", "1KiB", "64KiB", "1MiB", "16MiB", "256MiB", "+Inf"};
int SizeBucket(uint64_t bytes) {
  if (bytes == 0) return 0;
  if (bytes <= (uint64_t{1} << 10)) return 1;
  if (bytes <= (uint64_t{64} << 10)) return 2;
  if (bytes <= (uint64_t{1} << 20)) return 3;
  if (bytes <= (uint64_t{16} << 20)) return 4;
  if (bytes <= (uint64_t{256} << 20)) return 5;
  return 6;
}

}  // namespace

PrometheusObserver::PrometheusObserver(prometheus::Registry& registry)
    : collectives_(prometheus::BuildCounter()
                       .Name("collserve_collectives_total")
                       .Help("Collectives completed for local ranks, by op and status code.")
                       .Register(registry)),
      algorithms_(prometheus::BuildCounter()
                      .Name("collserve_collective_algorithms_total")
                      .Help("Local ranks' successful collectives by op and the algorithm they ran with "
                            "(local, gloo_direct, ring, local+gloo_ring, nccl, ...).")
                      .Register(registry)),
      backend_errors_(prometheus::BuildCounter()
                          .Name("collserve_backend_errors_total")
                          .Help("Collectives the backend between hosts (Gloo, NCCL) failed on this sidecar, by the "
                                "peer host blamed: the group's only other host, or the one whose address the "
                                "backend's error names; \"unknown\" otherwise. Each failure fails its group.")
                          .Register(registry)),
      durations_family_(prometheus::BuildHistogram()
                            .Name("collserve_collective_duration_seconds")
                            .Help("Time from the sidecar receiving a local rank's request to its completion being "
                                  "sent (waiting for the other ranks included), seconds, by op and size (the upper "
                                  "bound of the rank's tensor bytes: 0, 1KiB, 64KiB, 1MiB, 16MiB, 256MiB, +Inf). A "
                                  "series appears once a collective of that op and size completed here.")
                            .Register(registry)),
      skew_family_(prometheus::BuildHistogram()
                       .Name("collserve_collective_arrival_skew_seconds")
                       .Help("Arrival skew of collectives: the last rank's call minus the first rank's, over every "
                             "rank of the group, seconds, by collserve_job and group. Observed once per "
                             "collective, by the sidecar of the group's rank 0; a group's series goes when the "
                             "group ends on this sidecar.")
                       .Register(registry)),
      stragglers_family_(prometheus::BuildCounter()
                             .Name("collserve_straggler_collectives_total")
                             .Help("Collectives whose last rank is on this sidecar and called at least "
                                   "--straggler_threshold after the group's first rank, by collserve_job and "
                                   "group (a persistent straggler on this host makes it grow with the group's "
                                   "collectives; collservectl diagnose names the rank). A group's series goes when "
                                   "the group ends on this sidecar.")
                             .Register(registry)) {
  static_assert(sizeof(kSizeLabels) / sizeof(kSizeLabels[0]) == kSizeBuckets, "one label per size bucket");
  auto& tensor_bytes = prometheus::BuildCounter()
                           .Name("collserve_tensor_bytes_total")
                           .Help("Bytes of local ranks' tensors (inputs and outputs) given to collectives and "
                                 "point-to-point operations, by how they reached the sidecar: arena (the "
                                 "client's AllocateShared memory, no copy), staged (copied by the SDK through a "
                                 "staging segment), inline (inside the gRPC messages).")
                           .Register(registry);
  bytes_[static_cast<int>(engine::BytePath::kArena)] = &tensor_bytes.Add({{"path", "arena"}});
  bytes_[static_cast<int>(engine::BytePath::kStaged)] = &tensor_bytes.Add({{"path", "staged"}});
  bytes_[static_cast<int>(engine::BytePath::kInline)] = &tensor_bytes.Add({{"path", "inline"}});
  exchanges_ = &prometheus::BuildCounter()
                    .Name("collserve_argument_exchanges_total")
                    .Help("Rounds between hosts in which a group's sidecars exchanged their ranks' arguments "
                          "before a collective's data step. Collectives issued back to back share one: their "
                          "arguments ride with the exchange of the first (so this grows slower than "
                          "collserve_collectives_total / local ranks).")
                    .Register(registry)
                    .Add({});
  auto& sizes = prometheus::BuildCounter()
                    .Name("collserve_collective_bytes_total")
                    .Help("Sizes of local ranks' successful collectives in nccl-tests' terms (the larger of a "
                          "rank's input and output), bytes, by op. Over collserve_collective_duration_seconds_sum: "
                          "the algorithm bandwidth (algbw).")
                    .Register(registry);
  auto& bus_bytes = prometheus::BuildCounter()
                        .Name("collserve_collective_bus_bytes_total")
                        .Help("collserve_collective_bytes_total times nccl-tests' bus bandwidth factor of the op "
                              "for the group's world size n (all_reduce 2(n-1)/n; all_gather, reduce_scatter, "
                              "all_to_all, gather, scatter (n-1)/n; broadcast, reduce 1), by op. Over "
                              "collserve_collective_duration_seconds_sum: the bus bandwidth (busbw).")
                        .Register(registry);
  for (int op = 0; op < 13; ++op) {
    const std::string name = op == 0 ? std::string("unknown") : engine::OpName(op);
    sizes_[op] = &sizes.Add({{"op", name}});
    bus_bytes_[op] = &bus_bytes.Add({{"op", name}});
  }
  groups_ = &prometheus::BuildGauge()
                 .Name("collserve_groups")
                 .Help("Groups with ranks on this sidecar (all jobs).")
                 .Register(registry)
                 .Add({});
  segments_ = &prometheus::BuildCounter()
                   .Name("collserve_segments_registered_total")
                   .Help("Shared-memory segments local ranks registered with this sidecar (staging segments for "
                         "ordinary tensors, shared buffers), which it then maps. Once a job's first steps are "
                         "done this stays flat; if it keeps growing, the ranks keep more staged bytes in flight "
                         "than they may reuse (COLLSERVE_MAX_STAGING_BYTES) and pay for new segments each step.")
                   .Register(registry)
                   .Add({});
  segment_bytes_ = &prometheus::BuildCounter()
                        .Name("collserve_segment_bytes_registered_total")
                        .Help("Bytes of the segments in collserve_segments_registered_total.")
                        .Register(registry)
                        .Add({});
}

void PrometheusObserver::OnSegmentRegistered(uint64_t bytes) {
  segments_->Increment();
  segment_bytes_->Increment(static_cast<double>(bytes));
}

PrometheusObserver::GroupSeries& PrometheusObserver::SeriesOf(const std::string& job, const std::string& group) {
  auto it = series_.find({job, group});
  if (it != series_.end()) return it->second;
  static const auto* const kSkewBuckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 5, 30, 300};
  const std::map<std::string, std::string> labels = {{"collserve_job", job}, {"group", group}};
  GroupSeries s{&skew_family_.Add(labels, *kSkewBuckets), &stragglers_family_.Add(labels)};
  return series_.emplace(std::make_pair(job, group), s).first->second;
}

void PrometheusObserver::OnArrivalSkew(const std::string& job, const std::string& group, absl::Duration skew) {
  absl::MutexLock lock(&series_mu_);
  SeriesOf(job, group).skew->Observe(absl::ToDoubleSeconds(skew));
}

void PrometheusObserver::OnStraggler(const std::string& job, const std::string& group) {
  absl::MutexLock lock(&series_mu_);
  SeriesOf(job, group).stragglers->Increment();
}

void PrometheusObserver::OnGroupEnded(const std::string& job, const std::string& group) {
  absl::MutexLock lock(&series_mu_);
  auto it = series_.find({job, group});
  if (it == series_.end()) return;
  skew_family_.Remove(it->second.skew);
  stragglers_family_.Remove(it->second.stragglers);
  series_.erase(it);
}

void PrometheusObserver::OnBackendError(const std::string& peer_host) {
  std::string label = peer_host;
  {
    absl::MutexLock lock(&peers_mu_);
    if (backend_error_peers_.count(peer_host) == 0) {
      if (backend_error_peers_.size() < kMaxBackendErrorPeers) {
        backend_error_peers_.insert(peer_host);
      } else {
        label = "other";
      }
    }
  }
  backend_errors_.Add({{"peer_host", label}}).Increment();
}

void PrometheusObserver::OnCollectiveBytes(engine::CollectiveOp op, uint64_t bytes, double bus_bytes) {
  int index = static_cast<int>(op);
  if (index < 1 || index > 12) index = 0;
  sizes_[index]->Increment(static_cast<double>(bytes));
  bus_bytes_[index]->Increment(bus_bytes);
}

void PrometheusObserver::OnFlightRecorderDump(const std::string& job, const std::string& group, int64_t generation,
                                              const std::string& reason, const std::vector<FlightRecord>& records) {
  collserve::v1::DumpGroupResponse dump;
  dump.mutable_group()->set_group(group);
  dump.mutable_group()->set_generation(generation);
  for (const FlightRecord& f : records) FlightRecordToProto(f, dump.add_records());
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(dump, &json, options);
  LOG(WARNING) << "flight recorder of group \"" << group << "\" of job \"" << job << "\" (" << reason
               << "): " << json;
}

void PrometheusObserver::OnGroups(int delta) { groups_->Increment(delta); }

void PrometheusObserver::OnArgumentExchange() { exchanges_->Increment(); }

prometheus::Histogram& PrometheusObserver::Duration(int op, int size_bucket) {
  prometheus::Histogram* h = durations_[op][size_bucket].load(std::memory_order_acquire);
  if (h != nullptr) return *h;
  // Never destroyed: a collective that completes while exit() runs must still find them.
  static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
      0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300};
  // Family::Add returns the one series of these labels, also to threads racing here.
  h = &durations_family_.Add({{"op", op == 0 ? std::string("unknown") : engine::OpName(op)},
                              {"size", kSizeLabels[size_bucket]}},
                             *kBuckets);
  durations_[op][size_bucket].store(h, std::memory_order_release);
  return *h;
}

void PrometheusObserver::OnCompleted(engine::CollectiveOp op, const absl::Status& status, absl::Duration latency,
                                     uint64_t bytes, const char* algorithm) {
  int index = static_cast<int>(op);
  if (index < 1 || index > 12) index = 0;
  collectives_.Add({{"op", index == 0 ? std::string("unknown") : engine::OpName(op)},
                    {"code", absl::StatusCodeToString(status.code())}})
      .Increment();
  Duration(index, SizeBucket(bytes)).Observe(absl::ToDoubleSeconds(latency));
  if (algorithm != nullptr && *algorithm != '\0') {
    algorithms_.Add({{"op", index == 0 ? std::string("unknown") : engine::OpName(op)}, {"algorithm", algorithm}})
        .Increment();
  }
}

void PrometheusObserver::OnTensorBytes(engine::BytePath path, uint64_t bytes) {
  bytes_[static_cast<int>(path)]->Increment(static_cast<double>(bytes));
}

}  // namespace collserve::server
