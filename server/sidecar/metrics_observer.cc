#include "server/sidecar/metrics_observer.h"

namespace collserve::server {

PrometheusObserver::PrometheusObserver(prometheus::Registry& registry)
    : collectives_(prometheus::BuildCounter()
                       .Name("collserve_collectives_total")
                       .Help("Collectives completed for local ranks, by op and status code.")
                       .Register(registry)) {
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
}

void PrometheusObserver::OnArgumentExchange() { exchanges_->Increment(); }

void PrometheusObserver::OnCompleted(engine::CollectiveOp op, const absl::Status& status) {
  collectives_.Add({{"op", engine::OpName(op)}, {"code", absl::StatusCodeToString(status.code())}}).Increment();
}

void PrometheusObserver::OnTensorBytes(engine::BytePath path, uint64_t bytes) {
  bytes_[static_cast<int>(path)]->Increment(static_cast<double>(bytes));
}

}  // namespace collserve::server
