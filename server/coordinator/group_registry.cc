#include "server/coordinator/group_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace collserve::server {

GroupRegistry::GroupRegistry(GroupRegistryLimits limits) : limits_(limits), timer_([this] { TimerLoop(); }) {}

GroupRegistry::~GroupRegistry() {
  std::vector<Completion> done;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [key, g] : groups_) {
      for (auto& [rank, w] : g.waiters) {
        done.emplace_back(std::move(w.done), absl::UnavailableError("the coordinator is shutting down"));
      }
      g.waiters.clear();
    }
    waiter_index_.clear();
  }
  timer_.join();
  for (auto& [cb, result] : done) std::move(cb)(std::move(result));
}

GroupView GroupRegistry::ViewOf(const Group& g) {
  GroupView v;
  v.group = g.name;
  v.world_size = g.world_size;
  v.generation = g.generation;
  v.state = g.state;
  for (const auto& [rank, m] : g.members) v.members.push_back(m);
  return v;
}

uint64_t GroupRegistry::JoinAsync(const std::string& job, const std::string& group, int world_size,
                                  const MemberInfo& member, absl::Time deadline, JoinCallback done) {
  auto fail = [&](absl::Status s) {
    std::move(done)(std::move(s));
    return uint64_t{0};
  };
  if (group.empty()) return fail(absl::InvalidArgumentError("empty group name"));
  if (world_size <= 0) {
    return fail(absl::InvalidArgumentError(absl::StrCat("world_size ", world_size, " must be > 0")));
  }
  if (world_size > limits_.max_world_size) {
    return fail(absl::InvalidArgumentError(absl::StrCat("world_size ", world_size, " exceeds the coordinator's ",
                                                        "--max_world_size of ", limits_.max_world_size)));
  }
  if (member.rank < 0 || member.rank >= world_size) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "rank ", member.rank, " is out of range for group \"", group, "\" of world_size ", world_size)));
  }
  std::vector<Completion> completions;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return fail(absl::UnavailableError("the coordinator is shutting down"));
    const Key key(job, group);
    auto it = groups_.find(key);
    if (it == groups_.end()) {
      if (groups_.size() >= static_cast<size_t>(std::max(limits_.max_groups, 0))) {
        return fail(absl::ResourceExhaustedError(absl::StrCat(
            "the coordinator holds ", groups_.size(), " groups, its --max_groups limit; group \"", group,
            "\" cannot be created until one ends")));
      }
      Group g;
      g.name = group;
      g.world_size = world_size;
      g.generation = last_generation_[key] + 1;
      g.started = absl::Now();
      it = groups_.emplace(key, std::move(g)).first;
    }
    Group& g = it->second;
    if (g.world_size != world_size) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "group \"", group, "\" has world_size ", g.world_size, "; rank ", member.rank,
          " asked for world_size ", world_size)));
    }
    if (g.members.count(member.rank) > 0) {
      const MemberInfo& old = g.members[member.rank];
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "rank ", member.rank, " has already joined generation ", g.generation, " of group \"",
          group, "\" (from host ", old.host_id, "); duplicate rank from host ", member.host_id)));
    }
    if (g.state != "FORMING") {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "group \"", group, "\" generation ", g.generation, " is ", g.state,
          "; it can form again once every rank has left")));
    }
    id = next_id_++;
    g.gave_up.erase(member.rank);
    g.members[member.rank] = member;
    g.waiters[member.rank] = Waiter{id, deadline, std::move(done)};
    waiter_index_[id] = {key, member.rank};
    ++changes_;  // wake the timer: this deadline may be the earliest
    if (static_cast<int>(g.members.size()) == g.world_size) {
      g.state = "FORMED";
      ++generations_formed_;
      GroupView view = ViewOf(g);
      for (auto& [rank, w] : g.waiters) {
        waiter_index_.erase(w.id);
        completions.emplace_back(std::move(w.done), view);
      }
      g.waiters.clear();
    }
  }
  for (auto& [cb, result] : completions) std::move(cb)(std::move(result));
  return id;
}

void GroupRegistry::RemoveForming(std::map<Key, Group>::iterator it, int rank) {
  Group& g = it->second;
  g.members.erase(rank);
  g.waiters.erase(rank);
  if (g.members.empty()) groups_.erase(it);
}

void GroupRegistry::CancelJoin(uint64_t id) {
  JoinCallback cb;
  {
    absl::MutexLock lock(&mu_);
    auto idx = waiter_index_.find(id);
    if (idx == waiter_index_.end()) return;
    auto [key, rank] = idx->second;
    waiter_index_.erase(idx);
    auto it = groups_.find(key);
    if (it == groups_.end()) return;
    cb = std::move(it->second.waiters[rank].done);
    RemoveForming(it, rank);
  }
  std::move(cb)(absl::CancelledError("join cancelled"));
}

absl::Status GroupRegistry::Leave(const std::string& job, const std::string& group, int rank) {
  JoinCallback cb;
  {
    absl::MutexLock lock(&mu_);
    const Key key(job, group);
    auto it = groups_.find(key);
    if (it == groups_.end()) {
      return absl::NotFoundError(absl::StrCat("no group \"", group, "\" in job \"", job, "\""));
    }
    Group& g = it->second;
    if (g.members.count(rank) == 0) {
      return absl::NotFoundError(absl::StrCat("rank ", rank, " is not a member of group \"", group, "\""));
    }
    if (g.state == "FORMING") {
      auto w = g.waiters.find(rank);
      if (w != g.waiters.end()) {
        waiter_index_.erase(w->second.id);
        cb = std::move(w->second.done);
      }
      RemoveForming(it, rank);
    } else {
      g.state = "BROKEN";
      g.members.erase(rank);
      if (g.members.empty()) {
        last_generation_[key] = g.generation;
        groups_.erase(it);
      }
    }
  }
  if (cb) std::move(cb)(absl::CancelledError(absl::StrCat("rank ", rank, " left the group")));
  return absl::OkStatus();
}

absl::StatusOr<GroupView> GroupRegistry::Describe(const std::string& job, const std::string& group) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(Key(job, group));
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("no group \"", group, "\" in job \"", job, "\""));
  }
  return ViewOf(it->second);
}

absl::Status GroupRegistry::ReportProgress(const std::string& job, const std::string& group, const std::string& host_id,
                                           HostLedger ledger) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(Key(job, group));
  if (it == groups_.end() || it->second.state == "FORMING" || it->second.generation != ledger.generation) {
    return absl::NotFoundError(absl::StrCat("no generation ", ledger.generation, " of group \"", group,
                                            "\" in job \"", job, "\""));
  }
  Group& g = it->second;
  if (static_cast<int64_t>(ledger.ranks.size()) > g.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("a ledger of ", ledger.ranks.size(), " ranks for group \"", group,
                                                   "\" of world_size ", g.world_size));
  }
  bool serves_one = false;
  for (const auto& [rank, m] : g.members) serves_one |= m.host_id == host_id;
  if (!serves_one) {
    return absl::PermissionDeniedError(
        absl::StrCat("host \"", host_id, "\" serves no rank of group \"", group, "\""));
  }
  for (const RankLedger& r : ledger.ranks) {
    auto m = g.members.find(r.rank);
    if (m != g.members.end() && m->second.host_id != host_id) {
      return absl::PermissionDeniedError(absl::StrCat("rank ", r.rank, " of group \"", group, "\" is not on host \"",
                                                      host_id, "\""));
    }
  }
  if (ledger.records.size() > kMaxReportedFlightRecords) {
    return absl::InvalidArgumentError(absl::StrCat("a ledger of ", ledger.records.size(),
                                                   " flight records; the most one report may carry is ",
                                                   kMaxReportedFlightRecords));
  }
  for (const FlightRecord& f : ledger.records) {
    if (f.last_rank < -1 || f.last_rank >= g.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("flight record #", f.seq, " names last rank ", f.last_rank,
                                                     " outside world_size ", g.world_size));
    }
    if (static_cast<int64_t>(f.arrivals.size()) > g.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("flight record #", f.seq, " has ", f.arrivals.size(),
                                                     " arrivals for world_size ", g.world_size));
    }
    for (const FlightRecord::Arrival& a : f.arrivals) {
      auto m = g.members.find(a.rank);
      if (m == g.members.end() || m->second.host_id != host_id) {
        return absl::PermissionDeniedError(absl::StrCat("flight record #", f.seq, " of group \"", group,
                                                        "\" has an arrival of rank ", a.rank,
                                                        ", which is not on host \"", host_id, "\""));
      }
    }
  }
  ledger.received = absl::Now();
  g.ledgers[host_id] = std::move(ledger);
  return absl::OkStatus();
}

absl::StatusOr<std::pair<GroupView, std::map<std::string, HostLedger>>> GroupRegistry::Ledgers(
    const std::string& job, const std::string& group) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(Key(job, group));
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("no group \"", group, "\" in job \"", job, "\""));
  }
  return std::make_pair(ViewOf(it->second), it->second.ledgers);
}

GroupRegistry::Counts GroupRegistry::GroupCounts() {
  absl::MutexLock lock(&mu_);
  Counts c;
  c.groups = static_cast<int64_t>(groups_.size());
  for (const auto& [key, g] : groups_) c.formed += g.state == "FORMED" ? 1 : 0;
  c.generations_formed = generations_formed_;
  return c;
}

std::map<std::string, int> GroupRegistry::GroupsByJob() {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int> out;
  for (const auto& [key, g] : groups_) ++out[key.first];
  return out;
}

std::vector<GroupView> GroupRegistry::List(const std::string& job) {
  absl::MutexLock lock(&mu_);
  std::vector<GroupView> out;
  for (auto it = groups_.lower_bound(Key(job, "")); it != groups_.end() && it->first.first == job; ++it) {
    out.push_back(ViewOf(it->second));
  }
  return out;
}

void GroupRegistry::TimerLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    const absl::Time now = absl::Now();
    absl::Time next = now + absl::Seconds(1);
    std::vector<Completion> expired;
    for (auto it = groups_.begin(); it != groups_.end();) {
      Group& g = it->second;
      std::vector<int> late;
      for (const auto& [rank, w] : g.waiters) {
        if (w.deadline <= now) late.push_back(rank);
        else next = std::min(next, w.deadline);
      }
      if (late.empty()) {
        ++it;
        continue;
      }
      // Missing: never joined. Ranks that joined but gave up earlier are named apart.
      std::vector<int> missing;  // the first kMaxNamedMissingRanks
      int missing_count = 0;
      for (int r = 0; r < g.world_size; ++r) {
        if (g.members.count(r) != 0 || g.gave_up.count(r) != 0) continue;
        if (++missing_count <= kMaxNamedMissingRanks) missing.push_back(r);
      }
      const std::string more =
          missing_count > kMaxNamedMissingRanks ? absl::StrCat(" and ", missing_count - kMaxNamedMissingRanks, " more")
                                                : std::string();
      std::string gave_up;
      if (!g.gave_up.empty()) {
        std::vector<int> named;
        for (int r : g.gave_up) {
          if (named.size() == static_cast<size_t>(kMaxNamedMissingRanks)) break;
          named.push_back(r);
        }
        gave_up = absl::StrCat("; ranks [", absl::StrJoin(named, ", "), "]",
                               g.gave_up.size() > named.size()
                                   ? absl::StrCat(" and ", g.gave_up.size() - named.size(), " more")
                                   : std::string(),
                               " joined but timed out earlier");
      }
      const int joined = static_cast<int>(g.members.size() + g.gave_up.size());
      for (int rank : late) {
        Waiter& w = g.waiters[rank];
        waiter_index_.erase(w.id);
        expired.emplace_back(
            std::move(w.done),
            absl::DeadlineExceededError(absl::StrCat(
                "rendezvous of group \"", g.name, "\" timed out after ",
                absl::FormatDuration(absl::Trunc(now - g.started, absl::Milliseconds(1))), ": ",
                joined, " of ", g.world_size, " ranks joined; missing ranks: [",
                absl::StrJoin(missing, ", "), "]", more, gave_up)));
      }
      auto next_it = std::next(it);
      for (int rank : late) {
        g.members.erase(rank);
        g.waiters.erase(rank);
        g.gave_up.insert(rank);
      }
      if (g.members.empty()) groups_.erase(it);
      it = next_it;
    }
    if (!expired.empty()) {
      mu_.Unlock();
      for (auto& [cb, result] : expired) std::move(cb)(std::move(result));
      mu_.Lock();
      continue;
    }
    const uint64_t seen = changes_;
    auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || changes_ != seen;
    };
    mu_.AwaitWithDeadline(absl::Condition(&changed), next);
  }
}

}  // namespace collserve::server
