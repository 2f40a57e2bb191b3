// The flight recorder's unit: what one host's sidecar saw of one collective of a group
// (the engine records it, the sidecar logs and publishes it, the coordinator merges every
// host's into a dump: Registry.DumpGroup, collservectl dump). Plain data; no gRPC.
//
// Times are the reporting host's wall clock (Unix time). Arrival times of ranks on other
// hosts come from those hosts (they ride with the collective's argument exchange), so an
// arrival skew across hosts includes the hosts' clock offset (NTP keeps it at about a
// millisecond, far below the skews worth reporting); on one host it is exact.
#ifndef COLLSERVE_COMMON_FLIGHT_RECORD_H_
#define COLLSERVE_COMMON_FLIGHT_RECORD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace collserve {

struct FlightRecord {
  int64_t seq = 0;       // the group's collective sequence number (ledger.h)
  int op = 0;            // a CollectiveOp value
  int dtype = 0;         // a DataType value (0 for barriers)
  int64_t count = 0;     // elements of each rank's input
  int64_t bytes = 0;     // bytes of each rank's input
  std::string algorithm; // how the data step ran ("" when it did not run)
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string error;     // the error's message (at most kMaxErrorBytes), "" when OK
  absl::Time started;    // when the executor took it up (every local rank had called it)
  absl::Time completed;  // when the local ranks were answered
  struct Arrival {
    int rank = 0;
    absl::Time arrived;  // when the rank's request reached its sidecar
  };
  // The ranks whose arrival is known, by rank: every rank once the argument exchange
  // succeeded, else this host's. A published record carries only the local ranks' (each
  // host publishes its own); the coordinator merges them.
  std::vector<Arrival> arrivals;
  std::vector<int> local_ranks;  // this host's ranks of the group, ascending
  // From every rank's arrival: the last rank to call it (-1 unknown) and how long after the
  // first it called (the arrival skew).
  int last_rank = -1;
  absl::Duration arrival_skew;
  // A record merged from several hosts' (the coordinator's dump): the hosts, sorted.
  std::vector<std::string> host_ids;

  static constexpr size_t kMaxErrorBytes = 512;
};

}  // namespace collserve

#endif  // COLLSERVE_COMMON_FLIGHT_RECORD_H_
