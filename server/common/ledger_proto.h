// One rank's ledger entry as collserve.v1.RankProgress, from the engine's RankProgress (the
// sidecar's report) or the coordinator's RankLedger (its diagnosis): both have these fields.
#ifndef COLLSERVE_SERVER_COMMON_LEDGER_PROTO_H_
#define COLLSERVE_SERVER_COMMON_LEDGER_PROTO_H_

#include "absl/time/time.h"
#include "collserve/v1/registry.pb.h"

namespace collserve::server {

template <typename RankProgressT>
void RankProgressToProto(const RankProgressT& r, collserve::v1::RankProgress* out) {
  out->set_rank(r.rank);
  out->set_issued_seq(r.issued_seq);
  out->set_op(static_cast<collserve::v1::CollectiveOp>(r.op));
  out->set_dtype(static_cast<collserve::v1::DataType>(r.dtype));
  out->set_count(r.count);
  out->set_root(r.root);
  out->set_reduce_op(static_cast<collserve::v1::ReduceOp>(r.reduce_op));
  out->set_issued_age_ms(absl::ToInt64Milliseconds(r.issued_age));
  out->set_completed_seq(r.completed_seq);
  out->set_completed_age_ms(absl::ToInt64Milliseconds(r.completed_age));
  out->set_completed_status(r.completed_status);
}

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_LEDGER_PROTO_H_
