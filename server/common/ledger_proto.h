// One rank's ledger entry as collserve.v1.RankProgress, from the engine's RankProgress (the
// sidecar's report) or the coordinator's RankLedger (its diagnosis): both have these fields.
#ifndef COLLSERVE_SERVER_COMMON_LEDGER_PROTO_H_
#define COLLSERVE_SERVER_COMMON_LEDGER_PROTO_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "collserve/v1/registry.pb.h"
#include "common/flight_record.h"

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

// A flight record as collserve.v1.FlightRecord. `hosts` (rank -> host id) fills each
// arrival's host_id where known.
inline void FlightRecordToProto(const FlightRecord& f, collserve::v1::FlightRecord* out,
                                const std::map<int, std::string>& hosts = {}) {
  out->set_seq(f.seq);
  out->set_op(static_cast<collserve::v1::CollectiveOp>(f.op));
  out->set_dtype(static_cast<collserve::v1::DataType>(f.dtype));
  out->set_count(f.count);
  out->set_bytes(f.bytes);
  out->set_algorithm(f.algorithm);
  out->set_status(absl::StatusCodeToString(f.code));
  out->set_error(f.error);
  out->set_started_unix_us(absl::ToUnixMicros(f.started));
  out->set_completed_unix_us(absl::ToUnixMicros(f.completed));
  for (const FlightRecord::Arrival& a : f.arrivals) {
    collserve::v1::RankArrival* p = out->add_arrivals();
    p->set_rank(a.rank);
    p->set_arrived_unix_us(absl::ToUnixMicros(a.arrived));
    auto h = hosts.find(a.rank);
    if (h != hosts.end()) p->set_host_id(h->second);
  }
  out->set_last_rank(f.last_rank);
  out->set_arrival_skew_us(absl::ToInt64Microseconds(f.arrival_skew));
  for (const std::string& h : f.host_ids) out->add_host_ids(h);
}

// The inverse, for a record received from a sidecar (untrusted): strings are cut to their
// bounds, an unknown status reads as UNKNOWN, a negative skew as 0. Ranks are the caller's
// to check (GroupRegistry::ReportProgress).
inline FlightRecord FlightRecordFromProto(const collserve::v1::FlightRecord& p) {
  FlightRecord f;
  f.seq = p.seq();
  f.op = p.op();
  f.dtype = p.dtype();
  f.count = p.count();
  f.bytes = p.bytes();
  f.algorithm = p.algorithm().substr(0, 64);
  f.code = absl::StatusCode::kUnknown;
  for (int c = 0; c <= 16; ++c) {
    if (p.status() == absl::StatusCodeToString(static_cast<absl::StatusCode>(c))) f.code = static_cast<absl::StatusCode>(c);
  }
  f.error = p.error().substr(0, FlightRecord::kMaxErrorBytes);
  f.started = absl::FromUnixMicros(p.started_unix_us());
  f.completed = absl::FromUnixMicros(p.completed_unix_us());
  for (const collserve::v1::RankArrival& a : p.arrivals()) {
    f.arrivals.push_back({a.rank(), absl::FromUnixMicros(a.arrived_unix_us())});
  }
  f.last_rank = p.last_rank();
  f.arrival_skew = absl::Microseconds(std::max<int64_t>(p.arrival_skew_us(), 0));
  return f;
}

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_LEDGER_PROTO_H_
