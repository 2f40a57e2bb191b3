#include "server/coordinator/ledger.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/types.h"

namespace collserve::server {
namespace {

// "[0, 1, 2]" for at most 32 ranks, then "and N more".
std::string RankList(const std::vector<int>& ranks) {
  constexpr size_t kNamed = 32;
  std::vector<int> named(ranks.begin(), ranks.begin() + std::min(ranks.size(), kNamed));
  std::string out = absl::StrCat("[", absl::StrJoin(named, ", "), "]");
  if (ranks.size() > kNamed) absl::StrAppend(&out, " and ", ranks.size() - kNamed, " more");
  return out;
}

// The hosts of `ranks` (in the order first seen), for "(host a, host b)".
std::string HostsOf(const std::vector<int>& ranks, const std::vector<RankDiagnosis>& all) {
  std::vector<std::string> hosts;
  for (int r : ranks) {
    const std::string& h = all[r].host_id;
    if (std::find(hosts.begin(), hosts.end(), h) == hosts.end()) hosts.push_back(h);
  }
  if (hosts.size() > 8) {
    const size_t more = hosts.size() - 8;
    hosts.resize(8);
    return absl::StrCat("hosts ", absl::StrJoin(hosts, ", "), " and ", more, " more");
  }
  return absl::StrCat(hosts.size() == 1 ? "host " : "hosts ", absl::StrJoin(hosts, ", "));
}

// "host H's sidecar is draining (collservectl drain) since T: it takes no new sessions",
// once per draining host of the reported ranks, in rank order: a job that cannot re-form
// there (reconfigure, a restarted rank) is told why.
std::vector<std::string> DrainingHosts(const std::vector<RankDiagnosis>& ranks) {
  std::vector<std::string> out, seen;
  for (const RankDiagnosis& rd : ranks) {
    if (!rd.reported || rd.host_draining_since_unix_ms <= 0) continue;
    if (std::find(seen.begin(), seen.end(), rd.host_id) != seen.end()) continue;
    seen.push_back(rd.host_id);
    out.push_back(absl::StrCat("host ", rd.host_id, "'s sidecar is draining (collservectl drain) since ",
                               absl::FormatTime("%Y-%m-%d %H:%M:%S UTC",
                                                absl::FromUnixMillis(rd.host_draining_since_unix_ms),
                                                absl::UTCTimeZone()),
                               ": it takes no new sessions"));
  }
  return out;
}

// The arguments a rank called a collective with, as a person reads them.
std::string ArgsText(const RankLedger& r) {
  std::string out = absl::StrCat(CollectiveOpName(r.op), " count=", r.count, " dtype=",
                                 DataTypeName(static_cast<DataType>(r.dtype)));
  if (r.op == 1 || r.op == 4 || r.op == 8) {  // all_reduce, reduce, reduce_scatter
    absl::StrAppend(&out, " op=", ReduceOpName(static_cast<ReduceOp>(r.reduce_op)));
  }
  if (r.op == 2 || r.op == 4 || r.op == 6 || r.op == 7) absl::StrAppend(&out, " root=", r.root);  // rooted ops
  return out;
}

// "12.3 s": `d` to a tenth of a second.
std::string Seconds(absl::Duration d) {
  return absl::StrCat(absl::ToDoubleSeconds(absl::Trunc(d, absl::Milliseconds(100))), " s");
}

// "12.3 ms" / "1.2 s": a skew as a person reads it.
std::string Skew(absl::Duration d) {
  return absl::FormatDuration(absl::Trunc(d, d < absl::Seconds(1) ? absl::Microseconds(100) : absl::Milliseconds(10)));
}

Diagnosis DiagnoseLedgers(const GroupView& group, const std::map<std::string, HostLedger>& reports, absl::Time now);

}  // namespace

GroupDump MergeFlightRecords(const GroupView& group, const std::map<std::string, HostLedger>& reports,
                             absl::Duration straggler_threshold) {
  GroupDump dump;
  dump.group = group;
  std::map<int64_t, FlightRecord> by_seq;
  for (const auto& [host, report] : reports) {
    if (report.generation != group.generation) continue;
    for (const FlightRecord& f : report.records) {
      auto [it, inserted] = by_seq.try_emplace(f.seq, f);
      FlightRecord& m = it->second;
      if (inserted) {
        m.arrivals.clear();
      } else {
        m.started = std::min(m.started, f.started);
        m.completed = std::max(m.completed, f.completed);
        if (m.code == absl::StatusCode::kOk && f.code != absl::StatusCode::kOk) {
          m.code = f.code;
          m.error = f.error;
        }
        if (m.algorithm.empty()) m.algorithm = f.algorithm;
        if (m.last_rank < 0 && f.last_rank >= 0) {
          m.last_rank = f.last_rank;
          m.arrival_skew = f.arrival_skew;
        }
      }
      m.arrivals.insert(m.arrivals.end(), f.arrivals.begin(), f.arrivals.end());
      m.host_ids.push_back(host);
    }
  }
  std::map<int, std::vector<absl::Duration>> last;  // rank -> skews of the records it was last in
  int timed = 0;
  for (auto& [seq, f] : by_seq) {
    std::sort(f.arrivals.begin(), f.arrivals.end(),
              [](const FlightRecord::Arrival& a, const FlightRecord::Arrival& b) { return a.rank < b.rank; });
    std::sort(f.host_ids.begin(), f.host_ids.end());
    f.local_ranks.clear();
    if (f.last_rank >= 0) {
      ++timed;
      if (f.arrival_skew >= straggler_threshold) last[f.last_rank].push_back(f.arrival_skew);
    }
    dump.records.push_back(std::move(f));
  }
  for (auto& [rank, skews] : last) {
    Straggler s;
    s.rank = rank;
    for (const MemberInfo& m : group.members) {
      if (m.rank == rank) s.host_id = m.host_id;
    }
    s.last_count = static_cast<int>(skews.size());
    s.records = timed;
    std::nth_element(skews.begin(), skews.begin() + static_cast<std::ptrdiff_t>(skews.size() / 2), skews.end());
    s.median_skew = skews[skews.size() / 2];
    dump.stragglers.push_back(std::move(s));
  }
  std::stable_sort(dump.stragglers.begin(), dump.stragglers.end(),
                   [](const Straggler& a, const Straggler& b) { return a.last_count > b.last_count; });
  return dump;
}

Diagnosis Diagnose(const GroupView& group, const std::map<std::string, HostLedger>& reports, absl::Time now,
                   absl::Duration straggler_threshold) {
  Diagnosis d = DiagnoseLedgers(group, reports, now);
  d.stragglers = MergeFlightRecords(group, reports, straggler_threshold).stragglers;
  // A persistent straggler: last in at least a quarter of the recent collectives.
  std::vector<std::string> named;
  for (const Straggler& s : d.stragglers) {
    if (s.records == 0 || 4 * s.last_count < s.records || named.size() == 4) continue;
    named.push_back(absl::StrCat("rank ", s.rank, " (host ", s.host_id, ") called last in ", s.last_count, " of the last ",
                                 s.records, " collectives, a median ", Skew(s.median_skew), " after the first rank"));
  }
  if (!named.empty()) absl::StrAppend(&d.summary, "; straggler: ", absl::StrJoin(named, "; "));
  return d;
}

namespace {

Diagnosis DiagnoseLedgers(const GroupView& group, const std::map<std::string, HostLedger>& reports, absl::Time now) {
  Diagnosis d;
  d.group = group;
  const int world = group.world_size;
  d.ranks.resize(static_cast<size_t>(std::max(world, 0)));
  for (int r = 0; r < world; ++r) d.ranks[r].rank = r;
  for (const MemberInfo& m : group.members) {
    if (m.rank >= 0 && m.rank < world) d.ranks[m.rank].host_id = m.host_id;
  }
  // Each rank's entry from its own host's report of this generation.
  for (RankDiagnosis& rd : d.ranks) {
    auto it = reports.find(rd.host_id);
    if (rd.host_id.empty() || it == reports.end() || it->second.generation != group.generation) continue;
    const HostLedger& host = it->second;
    for (const RankLedger& r : host.ranks) {
      if (r.rank != rd.rank) continue;
      const absl::Duration since = now - host.received;
      rd.reported = true;
      rd.report_age = since;
      rd.progress = r;
      rd.progress.issued_age += since;
      rd.progress.completed_age += since;
      rd.host_state = host.state;
      rd.host_failure = host.failure;
      rd.host_draining_since_unix_ms = host.draining_since_unix_ms;
    }
  }
  // The oldest collective not completed by every reported rank, if any reported rank has
  // issued it.
  int64_t oldest = -1;
  int64_t furthest = -1;
  bool any = false;
  for (const RankDiagnosis& rd : d.ranks) {
    if (!rd.reported) {
      d.unknown.push_back(rd.rank);
      continue;
    }
    const int64_t next = rd.progress.completed_seq + 1;
    oldest = any ? std::min(oldest, next) : next;
    furthest = std::max(furthest, rd.progress.issued_seq);
    any = true;
  }
  const std::string name = absl::StrCat("group \"", group.group, "\" (generation ", group.generation, ")");
  if (!any) {
    d.summary = absl::StrCat(name, ": no host has reported its ledger yet");
    return d;
  }
  if (furthest < oldest) {
    d.summary = absl::StrCat(name, ": no collective in flight; every reported rank completed collective #",
                             oldest - 1);
    if (!d.unknown.empty()) absl::StrAppend(&d.summary, "; no ledger from ranks ", RankList(d.unknown));
    for (const std::string& drain : DrainingHosts(d.ranks)) absl::StrAppend(&d.summary, "; ", drain);
    return d;
  }
  d.oldest_incomplete_seq = oldest;
  // Who has called it: reported ranks whose issued_seq reached it. Those that issued
  // exactly it carry its arguments; group them to find a disagreement.
  std::map<std::tuple<int, int, int64_t, int, int>, std::vector<int>> by_args;
  std::map<std::tuple<int, int, int64_t, int, int>, const RankLedger*> sample;
  absl::Duration first_arrival = absl::ZeroDuration();
  bool timed = false;
  for (const RankDiagnosis& rd : d.ranks) {
    if (!rd.reported) continue;
    const RankLedger& p = rd.progress;
    if (p.issued_seq < oldest) {
      d.missing.push_back(rd.rank);
      continue;
    }
    d.arrived.push_back(rd.rank);
    if (p.issued_seq == oldest) {
      auto key = std::make_tuple(p.op, p.dtype, p.count, p.root, p.reduce_op);
      by_args[key].push_back(rd.rank);
      sample[key] = &p;
      if (!timed || p.issued_age > first_arrival) first_arrival = p.issued_age;
      timed = true;
    }
  }
  d.waiting = first_arrival;
  if (!sample.empty()) d.oldest_incomplete_op = sample.begin()->second->op;
  if (by_args.size() > 1) {
    std::vector<std::string> parts;
    for (const auto& [key, ranks] : by_args) {
      parts.push_back(absl::StrCat(ArgsText(*sample[key]), " on ranks ", RankList(ranks)));
    }
    d.disagreement = absl::StrJoin(parts, " but ");
  }
  const std::string what = absl::StrCat(sample.empty() ? "collective" : CollectiveOpName(d.oldest_incomplete_op),
                                        " #", oldest, " of ", name);
  std::vector<std::string> parts;
  if (!d.missing.empty()) {
    parts.push_back(absl::StrCat("ranks ", RankList(d.missing), " (", HostsOf(d.missing, d.ranks),
                                 ") have not called it"));
  }
  parts.push_back(absl::StrCat("ranks ", RankList(d.arrived), " have",
                               timed ? absl::StrCat(", the first ", Seconds(d.waiting), " ago") : ""));
  if (!d.disagreement.empty()) parts.push_back(absl::StrCat("they disagree: ", d.disagreement));
  // Unknown: members whose host sent no report of this generation, and ranks that are no
  // members any more (they left: no host to name).
  std::vector<int> silent, left;
  for (int r : d.unknown) (d.ranks[r].host_id.empty() ? left : silent).push_back(r);
  if (!silent.empty()) {
    parts.push_back(absl::StrCat("no ledger from ranks ", RankList(silent), " (", HostsOf(silent, d.ranks), ")"));
  }
  if (!left.empty()) parts.push_back(absl::StrCat("ranks ", RankList(left), " have left the group"));
  for (const RankDiagnosis& rd : d.ranks) {
    if (rd.reported && rd.host_state == "failed") {
      parts.push_back(absl::StrCat("host ", rd.host_id, " failed the group: ", rd.host_failure));
      break;
    }
  }
  for (std::string& drain : DrainingHosts(d.ranks)) parts.push_back(std::move(drain));
  d.summary = absl::StrCat(what, ": ", absl::StrJoin(parts, "; "));
  return d;
}

}  // namespace

}  // namespace collserve::server
