#include "engine/control.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace collserve::engine {

WatchOutcome DecideWatch(const absl::StatusOr<GroupEvents>& events, const Topology& topology,
                         const std::string& group, int known, bool with_members,
                         const std::set<int>& remote_departed) {
  WatchOutcome out;
  out.known = known;
  out.with_members = with_members;
  if (!events.ok() || events->generation != topology.generation) {
    // Unreachable or restarted coordinator: try again later (the data path needs it not).
    const absl::StatusCode code = events.status().code();
    if (code == absl::StatusCode::kNotFound && !with_members) {
      // A coordinator that restarted does not know the generation: again at once, with the
      // membership it can adopt the generation from.
      out.with_members = true;
      out.next = WatchOutcome::Next::kNow;
    } else if (code != absl::StatusCode::kUnimplemented) {
      // Cancelled by a channel going away, or another generation's answer; a coordinator
      // without watches (UNIMPLEMENTED) is not asked again.
      out.next = WatchOutcome::Next::kLater;
    }
    return out;
  }
  out.with_members = false;
  const auto shut_every_other_host = [&](const std::set<int>& hosts) {
    for (int h : hosts) {
      if (h != topology.host_index) out.shut_hosts.push_back(h);
    }
  };
  if (events->state != "FORMED" && events->state != "BROKEN") {
    // SUPERSEDED, DELETED or ENDED: the coordinator has done with this generation. The
    // collective in flight waits in the backend for hosts that will never answer for it
    // (or were lost: the coordinator forgets an ended group's departures): it fails now.
    out.failure = absl::UnavailableError(absl::StrCat(
        "generation ", topology.generation, " of group \"", group, "\" is over (", events->state,
        " at the coordinator: ",
        events->state == "SUPERSEDED" ? "a later generation of the group formed or forms there"
        : events->state == "DELETED"  ? "an operator deleted the group (collservectl delete-group)"
                                      : "every rank left it (or its hosts were lost)",
        "); re-form the group (reconfigure) to go on"));
    std::set<int> all_hosts;
    for (int h = 0; h < topology.num_hosts; ++h) all_hosts.insert(h);
    shut_every_other_host(all_hosts);
    return out;
  }
  std::set<int> lost_hosts;
  std::vector<int> lost_ranks;
  std::string lost_reason;
  std::set<int> departed = remote_departed;
  const std::vector<Departure>& departures = events->departures;
  for (size_t i = static_cast<size_t>(std::max(known, 0)); i < departures.size(); ++i) {
    const Departure& d = departures[i];
    if (d.rank < 0 || d.rank >= topology.world_size) continue;  // not of this generation
    if (d.host_lost) {
      lost_hosts.insert(topology.rank_host[d.rank]);
      lost_ranks.push_back(d.rank);
      lost_reason = d.reason;
    } else if (topology.local_ranks.count(d.rank) == 0 && departed.insert(d.rank).second) {
      out.left.emplace_back(d.rank, absl::StrCat("rank ", d.rank, " left group \"", group, "\" (the coordinator: ",
                                                 d.reason, ")"));
    }
  }
  out.known = static_cast<int>(departures.size());
  if (lost_ranks.empty()) {
    out.next = WatchOutcome::Next::kNow;
    return out;
  }
  const bool self_lost = lost_hosts.count(topology.host_index) != 0;
  out.failure = absl::UnavailableError(absl::StrCat(
      "generation ", topology.generation, " of group \"", group, "\" is over (", events->state,
      " at the coordinator): ranks [", absl::StrJoin(lost_ranks, ", "), "] ",
      self_lost ? "are taken as lost with this host (" : "were lost with their host (", lost_reason,
      "); re-form the group (reconfigure) to go on"));
  shut_every_other_host(lost_hosts);
  return out;
}

}  // namespace collserve::engine
