// The coordinator's view of the collective ledger: what each host's sidecar last reported
// about its local ranks of a group (Registry.ReportProgress), and the diagnosis merged from
// every host's report (Registry.DiagnoseGroup). No gRPC.
//
// Sequence numbers count a group's collectives from 0 in issue order (point-to-point ops
// are not counted); every rank of a group issues collective N as its N-th collective. Ages
// are measured on the reporting host and aged here by the time since the report arrived,
// so the hosts' clocks never need to agree.
#ifndef COLLSERVE_SERVER_COORDINATOR_LEDGER_H_
#define COLLSERVE_SERVER_COORDINATOR_LEDGER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/flight_record.h"
#include "server/coordinator/group_registry.h"

namespace collserve::server {

// A rank in a diagnosis.
struct RankDiagnosis {
  int rank = 0;
  std::string host_id;
  bool reported = false;       // false: its host sent no report for this generation
  absl::Duration report_age;   // how old that report is
  RankLedger progress;         // ages as of the diagnosis
  std::string host_state, host_failure;
  int64_t host_draining_since_unix_ms = 0;  // its host's sidecar drains since then (Unix ms); 0 = not
};

// A rank that called collectives last (Registry's StragglerStats).
struct Straggler {
  int rank = 0;
  std::string host_id;
  int last_count = 0;  // records it called last in, at least the threshold after the first rank
  int records = 0;     // records with a known arrival skew (the window)
  absl::Duration median_skew;  // over the records it was last in
};

// The group's flight records merged from every host's report (Registry.DumpGroup).
struct GroupDump {
  GroupView group;
  // By seq, oldest first: arrivals from every host (each publishes its own ranks'), the
  // earliest start, the latest completion, the first error, the publishing hosts.
  std::vector<FlightRecord> records;
  std::vector<Straggler> stragglers;  // most often last first; ties by rank
};

// Merges the flight records of `reports` (those of other generations are ignored). A
// record's last rank counts as a straggler when its arrival skew is at least
// `straggler_threshold`. Pure; thread-safe.
GroupDump MergeFlightRecords(const GroupView& group, const std::map<std::string, HostLedger>& reports,
                             absl::Duration straggler_threshold);

struct Diagnosis {
  GroupView group;
  // The oldest collective some rank issued that not every rank has completed; -1 when no
  // collective is in flight.
  int64_t oldest_incomplete_seq = -1;
  int oldest_incomplete_op = 0;
  std::vector<int> arrived;   // ranks that called it
  std::vector<int> missing;   // ranks that have not (reported, issued_seq < it)
  std::vector<int> unknown;   // ranks whose host sent no report
  absl::Duration waiting;     // since the first of `arrived` called it (when known)
  std::string disagreement;   // "" or which ranks called it with which arguments
  std::vector<RankDiagnosis> ranks;  // every member, by rank
  std::string summary;        // one line: the above for a person (the stragglers, each draining host)
  std::vector<Straggler> stragglers;  // as MergeFlightRecords finds them
};

// Merges `reports` (by host id; those of other generations are ignored) into a diagnosis of
// `group` (a formed or broken group's view, members by rank) as of `now`. Pure; thread-safe.
Diagnosis Diagnose(const GroupView& group, const std::map<std::string, HostLedger>& reports, absl::Time now,
                   absl::Duration straggler_threshold = kDefaultStragglerThreshold);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_LEDGER_H_
