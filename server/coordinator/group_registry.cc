#include "server/coordinator/group_registry.h"

#include <algorithm>
#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/types.h"

namespace collserve::server {

GroupRegistry::GroupRegistry(GroupRegistryLimits limits) : limits_(limits), timer_([this] { TimerLoop(); }) {}

GroupRegistry::~GroupRegistry() {
  std::vector<Completion> done;
  std::vector<WatchCallback> watches;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [key, g] : groups_) {
      for (auto& [rank, w] : g.waiters) {
        done.emplace_back(std::move(w.done), absl::UnavailableError("the coordinator is shutting down"));
      }
      g.waiters.clear();
      for (Watch& w : g.watches) watches.push_back(std::move(w.done));
      g.watches.clear();
    }
    for (auto& [id, h] : held_) {
      done.emplace_back(std::move(h.done), absl::UnavailableError("the coordinator is shutting down"));
    }
    held_.clear();
    waiter_index_.clear();
    watch_index_.clear();
  }
  timer_.join();
  for (auto& [cb, result] : done) std::move(cb)(std::move(result));
  for (auto& cb : watches) std::move(cb)(absl::UnavailableError("the coordinator is shutting down"));
}

GroupView GroupRegistry::ViewOf(const Group& g) {
  GroupView v;
  v.group = g.name;
  v.world_size = g.world_size;
  v.generation = g.generation;
  v.rendezvous_id = g.rendezvous_id;
  v.state = g.state;
  for (const auto& [rank, m] : g.members) v.members.push_back(m);
  return v;
}

std::shared_ptr<const GroupView> GroupRegistry::JoinViewOf(const Group& g) {
  auto v = std::make_shared<GroupView>(ViewOf(g));
  absl::flat_hash_map<std::string, int32_t> index;  // host id -> its index in v->hosts
  v->rank_host.reserve(v->members.size());
  for (const MemberInfo& m : v->members) {
    auto [it, added] = index.try_emplace(m.host_id, static_cast<int32_t>(v->hosts.size()));
    if (added) {
      MemberInfo host = m;
      host.rank = -1;
      v->hosts.push_back(std::move(host));
    }
    v->rank_host.push_back(it->second);
  }
  return v;
}

uint64_t GroupRegistry::JoinAsync(const std::string& job, const std::string& group, int world_size,
                                  const MemberInfo& member, absl::Time deadline, JoinCallback done,
                                  int64_t generation) {
  return JoinWithId(job, group, world_size, member, deadline, std::move(done), generation, 0);
}

uint64_t GroupRegistry::JoinWithId(const std::string& job, const std::string& group, int world_size,
                                   const MemberInfo& member, absl::Time deadline, JoinCallback done,
                                   int64_t generation, uint64_t reuse_id) {
  auto fail = [&](absl::Status s) {
    std::move(done)(std::move(s));
    return uint64_t{0};
  };
  if (absl::Status s = ValidateGroupName(group); !s.ok()) return fail(std::move(s));
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
  if (generation < 0 || generation == INT64_MAX) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("generation ", generation, " must be >= 0 and < ", INT64_MAX, " (the next one must exist)")));
  }
  std::vector<Completion> completions;
  std::vector<WatchCompletion> watches;
  // Every answer, a refusal of this join included, runs once the lock is released, after
  // those the join caused (a restarted host's generations lost, a superseded one ended).
  const uint64_t join_id = [&]() -> uint64_t {
    auto refuse = [&](absl::Status s) {
      completions.emplace_back(std::move(done), std::move(s));
      return uint64_t{0};
    };
    uint64_t id = 0;
    absl::MutexLock lock(&mu_);
    if (stopping_) return refuse(absl::UnavailableError("the coordinator is shutting down"));
    LoseRestartedHostLocked(member.host_id, member.incarnation, &completions, &watches);
    const Key key(job, group);
    auto it = groups_.find(key);
    auto last = last_generation_.find(key);
    const int64_t last_formed = last == last_generation_.end() ? 0 : last->second;
    if (generation > 0) {
      const int64_t at = it != groups_.end() ? it->second.generation : last_formed;
      if (generation < at || (it == groups_.end() && generation == at)) {
        return refuse(absl::FailedPreconditionError(absl::StrCat(
            "generation ", generation, " of group \"", group, "\" is over: the group ",
            it != groups_.end() ? "is at" : "last formed", " generation ", at, " here")));
      }
      if (it != groups_.end() && it->second.generation < generation) {
        // The first rank of a later generation ends this one for everyone still in it.
        SupersedeLocked(it, generation, &completions, &watches);
        it = groups_.end();
      }
    }
    if (auto d = desyncs_.find(key); d != desyncs_.end() && generation == 0) {
      if (absl::Now() > d->second.until || static_cast<int>(d->second.told.size()) >= d->second.world_size) {
        desyncs_.erase(d);
      } else if (d->second.told.insert(member.rank).second) {
        return refuse(d->second.status);  // a rank of the attempt the desync failed
      }
    }
    if (it == groups_.end()) {
      if (groups_.size() >= static_cast<size_t>(std::max(limits_.max_groups, 0))) {
        return refuse(absl::ResourceExhaustedError(absl::StrCat(
            "the coordinator holds ", groups_.size(), " groups, its --max_groups limit; group \"", group,
            "\" cannot be created until one ends")));
      }
      Group g;
      g.name = group;
      g.world_size = world_size;
      g.generation = std::max(last_formed + 1, generation);
      g.started = absl::Now();
      it = groups_.emplace(key, std::move(g)).first;
    }
    Group& g = it->second;
    if (g.world_size != world_size) {
      return refuse(absl::InvalidArgumentError(absl::StrCat(
          "group \"", group, "\" has world_size ", g.world_size, "; rank ", member.rank,
          " asked for world_size ", world_size)));
    }
    if (auto m = g.members.find(member.rank); m != g.members.end()) {
      const MemberInfo& old = m->second;
      const bool rejoin = member.incarnation != 0 && old.incarnation == member.incarnation && old.host_id == member.host_id;
      if (!rejoin) {
        return refuse(absl::AlreadyExistsError(absl::StrCat(
            "rank ", member.rank, " has already joined generation ", g.generation, " of group \"",
            group, "\" (from host ", old.host_id, "); duplicate rank from host ", member.host_id)));
      }
      // A sidecar attaches a rank once at a time, so its own earlier join or membership of
      // this rank is on its way out: the leave of a formed generation, or the cancel of a
      // forming one's join (or of an attempt it retried), is still in flight while the rank
      // initializes again (found with 100 destroy/init cycles at full speed). A formed
      // generation holds the new join until it ended (below); a forming one takes the new
      // join in place of the earlier, which ends CANCELLED.
      if (g.state == "FORMING") {
        if (auto w = g.waiters.find(member.rank); w != g.waiters.end()) {
          waiter_index_.erase(w->second.id);
          completions.emplace_back(std::move(w->second.done),
                                   absl::CancelledError(absl::StrCat(
                                       "rank ", member.rank, " joined group \"", group,
                                       "\" again from the same sidecar; this earlier join is replaced")));
          g.waiters.erase(w);
        }
      }
    }
    if (g.state != "FORMING") {
      bool held = false;
      for (const auto& [held_id, h] : held_) {
        held |= h.job == job && h.group == group && h.member.rank == member.rank;
      }
      if (generation > 0 || held || held_.size() >= kMaxHeldJoins) {
        return refuse(absl::FailedPreconditionError(absl::StrCat(
            "group \"", group, "\" generation ", g.generation, " is ", g.state,
            "; it can form again once every rank has left",
            held ? absl::StrCat(" (rank ", member.rank, " already waits for that)") : std::string())));
      }
      // Held until every rank has left this generation (TimerLoop), then joins the next.
      id = reuse_id != 0 ? reuse_id : next_id_++;
      held_[id] = HeldJoin{job, group, world_size, member, deadline, std::move(done), g.generation, g.state,
                           absl::Now()};
      ++changes_;  // the timer: this deadline may be the earliest
      return id;
    }
    bool desynced = false;
    if (!member.backend.empty()) {
      if (g.backend_rank >= 0 && g.members.count(g.backend_rank) == 0) {
        // The rank that named it withdrew: the next member naming one (if any) does now.
        g.backend.clear();
        g.backend_rank = -1;
        for (const auto& [rank, m] : g.members) {
          if (m.backend.empty()) continue;
          g.backend = m.backend;
          g.backend_rank = rank;
          break;
        }
      }
      if (g.backend_rank < 0) {
        g.backend = member.backend;
        g.backend_rank = member.rank;
      } else if (g.backend != member.backend) {
        const absl::Status desync = absl::InvalidArgumentError(absl::StrCat(
            "backend desync in group \"", group, "\" (generation ", g.generation, "): rank ", member.rank,
            " (host ", member.host_id, ") asked for backend ", member.backend, "; rank ", g.backend_rank, " (host ",
            g.members[g.backend_rank].host_id, ") asked for ", g.backend,
            ". Every rank of a group must ask for the same backend (init_process_group's backend, "
            "COLLSERVE_BACKEND); the forming generation is dropped"));
        Desync record{desync, g.world_size, {member.rank}, deadline};
        for (auto& [rank, w] : g.waiters) {
          waiter_index_.erase(w.id);
          record.told.insert(rank);
          record.until = std::max(record.until, w.deadline);
          completions.emplace_back(std::move(w.done), desync);
        }
        groups_.erase(it);
        const absl::Time now = absl::Now();
        for (auto d = desyncs_.begin(); d != desyncs_.end();) d = now > d->second.until ? desyncs_.erase(d) : std::next(d);
        if (desyncs_.size() >= kMaxDesyncs) {
          desyncs_.erase(std::min_element(desyncs_.begin(), desyncs_.end(), [](const auto& a, const auto& b) {
            return a.second.until < b.second.until;
          }));
        }
        desyncs_[key] = std::move(record);
        ++changes_;
        completions.emplace_back(std::move(done), desync);
        desynced = true;
      }
    }
    if (!desynced) {
      id = reuse_id != 0 ? reuse_id : next_id_++;
      g.gave_up.erase(member.rank);
      g.members[member.rank] = member;
      g.waiters[member.rank] = Waiter{id, deadline, std::move(done)};
      waiter_index_[id] = {key, member.rank};
      ++changes_;  // wake the timer: this deadline may be the earliest
      if (static_cast<int>(g.members.size()) == g.world_size) {
        g.state = "FORMED";
        g.formed_members = g.members;
        ++generations_formed_;
        if (std::all_of(g.members.begin(), g.members.end(), [](const auto& m) { return m.second.rendezvous_ids; })) {
          while (g.rendezvous_id == 0) g.rendezvous_id = absl::Uniform<uint64_t>(random_);
        }
        // Every member host holds a lease from now on (GroupRegistryLimits::adoption_lease),
        // on one host as across hosts: one that never watches is lost like one that stops.
        const absl::Time lease = absl::Now() + limits_.adoption_lease + limits_.lease_grace;
        for (const auto& [rank, m] : g.members) g.leases[m.host_id] = lease;
        ++changes_;  // the timer: the leases' ends
        std::shared_ptr<const GroupView> view = JoinViewOf(g);
        if (journal_ != nullptr) journal_->Formed(job, view);
        for (auto& [rank, w] : g.waiters) {
          waiter_index_.erase(w.id);
          completions.emplace_back(std::move(w.done), view);
        }
        g.waiters.clear();
      }
    }
    return id;
  }();
  for (auto& [cb, result] : completions) std::move(cb)(std::move(result));
  for (auto& [cb, events] : watches) std::move(cb)(std::move(events));
  return join_id;
}

void GroupRegistry::SupersedeLocked(std::map<Key, Group>::iterator it, int64_t generation,
                                    std::vector<Completion>* joins, std::vector<WatchCompletion>* watches) {
  Group& g = it->second;
  const absl::Status over = absl::FailedPreconditionError(absl::StrCat(
      "generation ", g.generation, " of group \"", g.name, "\" is over: a rank joined generation ", generation,
      " (the group re-forms)"));
  for (auto& [rank, w] : g.waiters) {
    waiter_index_.erase(w.id);
    joins->emplace_back(std::move(w.done), over);
  }
  g.waiters.clear();
  if (g.state != "FORMING") JournalEndedLocked(it->first, g);
  g.state = "SUPERSEDED";
  AnswerWatchesLocked(g, /*all=*/true, absl::Now(), watches);
  RememberGenerationLocked(it->first, g.generation);
  groups_.erase(it);
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
    if (auto h = held_.find(id); h != held_.end()) {
      cb = std::move(h->second.done);
      held_.erase(h);
    } else {
      auto idx = waiter_index_.find(id);
      if (idx == waiter_index_.end()) return;
      auto [key, rank] = idx->second;
      waiter_index_.erase(idx);
      auto it = groups_.find(key);
      if (it == groups_.end()) return;
      cb = std::move(it->second.waiters[rank].done);
      RemoveForming(it, rank);
    }
  }
  std::move(cb)(absl::CancelledError("join cancelled"));
}

absl::Status GroupRegistry::Leave(const std::string& job, const std::string& group, int rank, int64_t generation) {
  JoinCallback cb;
  std::vector<WatchCompletion> watches;
  {
    absl::MutexLock lock(&mu_);
    const Key key(job, group);
    auto it = groups_.find(key);
    if (generation > 0) {
      // A late leave of an ended generation (superseded, or left by every rank): nothing to do.
      auto last = last_generation_.find(key);
      if (last != last_generation_.end() && generation <= last->second) return absl::OkStatus();
      if (it != groups_.end() && it->second.generation != generation) {
        return absl::NotFoundError(absl::StrCat("group \"", group, "\" is at generation ", it->second.generation,
                                                ", not ", generation));
      }
    }
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
      const std::string host = g.members[rank].host_id;
      g.departures.push_back(Departure{rank, host,
                                       absl::StrCat("left: its sidecar on host ", host,
                                                    " reported that its session ended (it destroyed the group, "
                                                    "exited or died)"),
                                       false});
      g.members.erase(rank);
      AnswerWatchesLocked(g, /*all=*/true, absl::Now(), &watches);
      if (g.members.empty()) {
        JournalEndedLocked(key, g);
        RememberGenerationLocked(key, g.generation);
        groups_.erase(it);
        if (!held_.empty()) ++changes_;  // the timer: a held join may go on
      }
    }
  }
  if (cb) std::move(cb)(absl::CancelledError(absl::StrCat("rank ", rank, " left the group")));
  for (auto& [done, events] : watches) std::move(done)(std::move(events));
  return absl::OkStatus();
}

GroupEvents GroupRegistry::EventsOf(const Group& g) {
  GroupEvents e;
  e.generation = g.generation;
  e.state = g.state;
  e.departures = g.departures;
  return e;
}

void GroupRegistry::AnswerWatchesLocked(Group& g, bool all, absl::Time now, std::vector<WatchCompletion>* out) {
  for (auto w = g.watches.begin(); w != g.watches.end();) {
    if (!all && w->deadline > now) {
      ++w;
      continue;
    }
    auto lease = g.leases.find(w->host);
    if (lease != g.leases.end()) lease->second = now + limits_.lease_grace;
    out->emplace_back(std::move(w->done), EventsOf(g));
    watch_index_.erase(w->id);
    w = g.watches.erase(w);
  }
}

void GroupRegistry::CancelWatch(uint64_t id) {
  WatchCallback done;
  {
    absl::MutexLock lock(&mu_);
    auto idx = watch_index_.find(id);
    if (idx == watch_index_.end()) return;
    auto it = groups_.find(idx->second);
    watch_index_.erase(idx);
    if (it == groups_.end()) return;
    auto& watches = it->second.watches;
    for (auto w = watches.begin(); w != watches.end(); ++w) {
      if (w->id != id) continue;
      done = std::move(w->done);
      watches.erase(w);
      break;
    }
  }
  if (done) std::move(done)(absl::CancelledError("watch cancelled"));
}

uint64_t GroupRegistry::WatchAsync(const std::string& job, const std::string& group, int64_t generation,
                                   const std::string& host_id, int known, absl::Duration wait, WatchCallback done,
                                   const std::vector<MemberInfo>& members) {
  absl::StatusOr<GroupEvents> now_answer = absl::UnknownError("");
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(Key(job, group));
    auto last = last_generation_.find(Key(job, group));
    const bool ended = (it != groups_.end() && it->second.generation > generation) ||
                       (it == groups_.end() && last != last_generation_.end() && generation <= last->second);
    if (it == groups_.end() && !stopping_ && !members.empty() && !ended) {
      it = AdoptLocked(job, group, generation, host_id, members);
    }
    if (stopping_) {
      now_answer = absl::UnavailableError("the coordinator is shutting down");
    } else if (ended && generation > 0) {
      // The generation is over here: a later one formed or forms (SUPERSEDED), or every rank
      // left it (ENDED). Its members' sidecars end it too.
      GroupEvents e;
      e.generation = generation;
      e.state = it != groups_.end() ? "SUPERSEDED" : "ENDED";
      now_answer = std::move(e);
    } else if (it == groups_.end() || it->second.state == "FORMING" || it->second.generation != generation) {
      now_answer = absl::NotFoundError(
          absl::StrCat("no generation ", generation, " of group \"", group, "\" in job \"", job, "\""));
    } else if (known < 0) {
      now_answer = absl::InvalidArgumentError(absl::StrCat("known departures ", known, " must be >= 0"));
    } else {
      Group& g = it->second;
      bool serves_one = false;
      for (const auto& [rank, m] : g.formed_members) serves_one |= m.host_id == host_id;
      int pending = 0;
      for (const Watch& w : g.watches) pending += w.host == host_id ? 1 : 0;
      const absl::Time now = absl::Now();
      if (!serves_one) {
        now_answer = absl::PermissionDeniedError(
            absl::StrCat("host \"", host_id, "\" serves no rank of group \"", group, "\""));
      } else if (pending >= kMaxWatchesPerHost) {
        now_answer = absl::ResourceExhaustedError(absl::StrCat("host \"", host_id, "\" has ", pending,
                                                               " watches of group \"", group,
                                                               "\" waiting, the most one host may have"));
      } else if (g.departures.size() > static_cast<size_t>(known)) {
        g.leases[host_id] = now + limits_.lease_grace;
        now_answer = EventsOf(g);
      } else {
        const absl::Time deadline = now + std::clamp(wait, kMinWatchWait, kMaxWatchWait);
        g.leases[host_id] = deadline + limits_.lease_grace;
        const uint64_t id = next_id_++;
        g.watches.push_back(Watch{id, host_id, static_cast<size_t>(known), deadline, std::move(done)});
        watch_index_[id] = it->first;
        ++changes_;  // wake the timer: this deadline may be the earliest
        return id;
      }
    }
  }
  std::move(done)(std::move(now_answer));
  return 0;
}

std::map<GroupRegistry::Key, GroupRegistry::Group>::iterator GroupRegistry::AdoptLocked(
    const std::string& job, const std::string& group, int64_t generation, const std::string& host_id,
    const std::vector<MemberInfo>& members, absl::Status* why) {
  const Key key(job, group);
  const int world = static_cast<int>(members.size());
  auto refuse = [&](absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (why != nullptr) *why = std::move(s);
    return groups_.end();
  };
  const std::string what = absl::StrCat("generation ", generation, " of group \"", group, "\" in job \"", job, "\"");
  if (!ValidateGroupName(group).ok() || generation <= 0 || generation == INT64_MAX || world == 0 ||
      world > limits_.max_world_size) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(what, ": ", world, " members (at most ",
                                                          limits_.max_world_size, ") or a bad name or generation")));
  }
  if (auto last = last_generation_.find(key); last != last_generation_.end() && generation <= last->second) {
    return refuse(absl::AlreadyExistsError(absl::StrCat(what, ": generation ", last->second, " already formed here")));
  }
  if (groups_.size() >= static_cast<size_t>(std::max(limits_.max_groups, 0))) {
    return refuse(absl::ResourceExhaustedError(
        absl::StrCat(what, ": the registry holds ", groups_.size(), " groups, its --max_groups limit")));
  }
  Group g;
  g.name = group;
  g.world_size = world;
  g.generation = generation;
  g.state = "FORMED";
  g.started = absl::Now();
  bool serves_one = host_id.empty();
  for (const MemberInfo& m : members) {
    if (m.rank < 0 || m.rank >= world || m.host_id.empty() || g.members.count(m.rank) != 0) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat(what, ": rank ", m.rank, " is out of range, repeated or on no host")));
    }
    g.members[m.rank] = m;
    serves_one |= m.host_id == host_id;
  }
  if (!serves_one) {
    return refuse(absl::PermissionDeniedError(absl::StrCat(what, ": host \"", host_id, "\" serves none of its ranks")));
  }
  g.formed_members = g.members;
  // Leases as at formation.
  const absl::Time lease = absl::Now() + limits_.adoption_lease + limits_.lease_grace;
  for (const auto& [rank, m] : g.members) g.leases[m.host_id] = lease;
  ++generations_formed_;
  ++changes_;  // the timer: the new leases' ends
  auto it = groups_.emplace(key, std::move(g)).first;
  if (journal_ != nullptr && !host_id.empty()) journal_->Formed(job, JoinViewOf(it->second));
  return it;
}

bool GroupRegistry::LoseHostLocked(Group& g, const std::string& host, const std::string& reason, absl::Time now,
                                   std::vector<WatchCompletion>* out) {
  bool lost_one = false;
  for (auto m = g.members.begin(); m != g.members.end();) {
    if (m->second.host_id != host) {
      ++m;
      continue;
    }
    g.departures.push_back(Departure{m->first, host, reason, true});
    m = g.members.erase(m);
    lost_one = true;
  }
  g.leases.erase(host);
  if (lost_one) {
    g.state = "BROKEN";
    AnswerWatchesLocked(g, /*all=*/true, now, out);
  }
  return lost_one;
}

void GroupRegistry::LoseRestartedHostLocked(const std::string& host_id, uint64_t incarnation,
                                            std::vector<Completion>* joins, std::vector<WatchCompletion>* watches) {
  if (incarnation == 0 || host_id.empty()) return;
  auto [seen, added] = incarnations_.try_emplace(host_id, incarnation);
  if (!added && seen->second != incarnation) {
    const uint64_t earlier = seen->second;
    seen->second = incarnation;
    const absl::Time now = absl::Now();
    const std::string reason = absl::StrCat("lost with host ", host_id,
                                            ": its sidecar restarted (a new sidecar process joined with that host id)");
    for (auto it = groups_.begin(); it != groups_.end();) {
      Group& g = it->second;
      if (g.state == "FORMING") {
        for (auto m = g.members.begin(); m != g.members.end();) {
          if (m->second.host_id != host_id || m->second.incarnation != earlier) {
            ++m;
            continue;
          }
          auto w = g.waiters.find(m->first);
          if (w != g.waiters.end()) {
            waiter_index_.erase(w->second.id);
            joins->emplace_back(std::move(w->second.done), absl::UnavailableError(reason));
            g.waiters.erase(w);
          }
          m = g.members.erase(m);
        }
      } else {
        bool held = false;
        for (const auto& [rank, m] : g.members) held |= m.host_id == host_id && m.incarnation == earlier;
        if (held) LoseHostLocked(g, host_id, reason, now, watches);
      }
      if (g.members.empty()) {
        if (g.state != "FORMING") {
          JournalEndedLocked(it->first, g);
          RememberGenerationLocked(it->first, g.generation);
        }
        it = groups_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Bounded: the hosts of the groups held now, rebuilt whenever the map doubled.
  if (incarnations_.size() > std::max<size_t>(1024, 2 * incarnations_pruned_at_)) {
    std::map<std::string, uint64_t> held;
    for (const auto& [key, g] : groups_) {
      for (const auto& [rank, m] : g.members) {
        auto at = incarnations_.find(m.host_id);
        if (at != incarnations_.end()) held.insert(*at);
      }
    }
    held.insert_or_assign(host_id, incarnation);
    incarnations_ = std::move(held);
    incarnations_pruned_at_ = incarnations_.size();
  }
}

void GroupRegistry::JournalEndedLocked(const Key& key, const Group& g) {
  if (journal_ != nullptr) journal_->Ended(key.first, key.second, g.generation);
}

void GroupRegistry::SetJournal(RegistryJournal* journal) {
  absl::MutexLock lock(&mu_);
  journal_ = journal;
}

absl::Status GroupRegistry::Restore(const std::string& job, const GroupView& formed) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
  auto held = groups_.find(Key(job, formed.group));
  if (held != groups_.end()) {  // (a later or the same generation, or one forming: it is what runs now)
    return absl::AlreadyExistsError(absl::StrCat("group \"", formed.group, "\" in job \"", job,
                                                 "\" is held here at generation ", held->second.generation,
                                                 ": its recorded generation ", formed.generation, " is not restored"));
  }
  absl::Status why;
  if (AdoptLocked(job, formed.group, formed.generation, /*host_id=*/"", formed.members, &why) == groups_.end()) {
    return why;
  }
  return absl::OkStatus();
}

void GroupRegistry::ExpireLeasesLocked(absl::Time now, absl::Time* next, std::vector<WatchCompletion>* out) {
  for (auto it = groups_.begin(); it != groups_.end();) {
    Group& g = it->second;
    AnswerWatchesLocked(g, /*all=*/false, now, out);
    for (auto lease = g.leases.begin(); lease != g.leases.end();) {
      const std::string& host = lease->first;
      bool waiting = false;
      for (const Watch& w : g.watches) waiting |= w.host == host;
      if (waiting || lease->second > now) {
        if (!waiting) *next = std::min(*next, lease->second);
        ++lease;
        continue;
      }
      // The host neither watches nor renewed in time: it is gone (crashed, cut off, or its
      // ranks all left and it stopped watching: then nothing of it is left to lose).
      const std::string lost = host;
      ++lease;  // LoseHostLocked erases the lease
      LoseHostLocked(g, lost,
                     absl::StrCat("lost with host ", lost, ": its sidecar stopped renewing its lease on the group (",
                                  absl::FormatDuration(limits_.lease_grace), " grace); it crashed or was cut off"),
                     now, out);
    }
    for (const Watch& w : g.watches) *next = std::min(*next, w.deadline);
    if (g.state != "FORMING" && g.members.empty()) {
      AnswerWatchesLocked(g, /*all=*/true, now, out);
      JournalEndedLocked(it->first, g);
      RememberGenerationLocked(it->first, g.generation);
      it = groups_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<GroupView> GroupRegistry::Delete(const std::string& job, const std::string& group,
                                                const std::string& by) {
  std::vector<Completion> joins;
  std::vector<WatchCompletion> watches;
  GroupView was;
  {
    absl::MutexLock lock(&mu_);
    const Key key(job, group);
    auto it = groups_.find(key);
    if (it == groups_.end()) {
      return absl::NotFoundError(absl::StrCat("no group \"", group, "\" in job \"", job, "\""));
    }
    Group& g = it->second;
    was = ViewOf(g);
    const absl::Status deleted = absl::AbortedError(
        absl::StrCat("group \"", group, "\" generation ", g.generation, " was deleted by ", by));
    for (auto& [rank, w] : g.waiters) {
      waiter_index_.erase(w.id);
      joins.emplace_back(std::move(w.done), deleted);
    }
    g.waiters.clear();
    if (g.state != "FORMING") {
      JournalEndedLocked(key, g);
      RememberGenerationLocked(key, g.generation);
    }
    g.state = "DELETED";
    AnswerWatchesLocked(g, /*all=*/true, absl::Now(), &watches);
    groups_.erase(it);
  }
  for (auto& [cb, result] : joins) std::move(cb)(std::move(result));
  for (auto& [cb, events] : watches) std::move(cb)(std::move(events));
  return was;
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
    std::vector<WatchCompletion> answered;
    ExpireLeasesLocked(now, &next, &answered);
    if (!answered.empty()) {
      mu_.Unlock();
      for (auto& [done, events] : answered) std::move(done)(std::move(events));
      mu_.Lock();
      continue;
    }
    // Held joins (JoinAsync): those whose generation ended join now; late ones fail.
    std::vector<std::pair<uint64_t, HeldJoin>> go_on;
    std::vector<Completion> held_late;
    for (auto h = held_.begin(); h != held_.end();) {
      auto g = groups_.find(Key(h->second.job, h->second.group));
      const bool ended = g == groups_.end() || g->second.generation != h->second.held_behind ||
                         g->second.state == "FORMING";
      if (ended) {
        go_on.emplace_back(h->first, std::move(h->second));
        h = held_.erase(h);
      } else if (h->second.deadline <= now) {
        std::vector<int> still;
        for (const auto& [rank, m] : g->second.members) still.push_back(rank);
        held_late.emplace_back(
            std::move(h->second.done),
            absl::DeadlineExceededError(absl::StrCat(
                "rendezvous of group \"", h->second.group, "\" timed out after ",
                absl::FormatDuration(absl::Trunc(now - h->second.since, absl::Milliseconds(1))),
                ": rank ", h->second.member.rank, " waited for generation ", h->second.held_behind, " (",
                h->second.state, ") to end, but ranks [", absl::StrJoin(still, ", "), "] had not left it")));
        h = held_.erase(h);
      } else {
        next = std::min(next, h->second.deadline);
        ++h;
      }
    }
    if (!go_on.empty() || !held_late.empty()) {
      mu_.Unlock();
      for (auto& [cb, result] : held_late) std::move(cb)(std::move(result));
      for (auto& [id, h] : go_on) {
        JoinWithId(h.job, h.group, h.world_size, h.member, h.deadline, std::move(h.done), 0, id);
      }
      mu_.Lock();
      continue;
    }
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

void GroupRegistry::RememberGenerationLocked(const Key& key, int64_t generation) {
  auto [it, inserted] = last_generation_.insert_or_assign(key, generation);
  if (!inserted) return;
  remembered_order_.push_back(key);
  // The oldest names go first, past the bound; a group still held keeps its entry (it goes
  // to the back of the line).
  for (size_t scanned = 0; last_generation_.size() > std::max<size_t>(limits_.max_remembered_groups, 1) && scanned < remembered_order_.size();
       ++scanned) {
    Key oldest = std::move(remembered_order_.front());
    remembered_order_.pop_front();
    if (groups_.count(oldest) != 0) {
      remembered_order_.push_back(std::move(oldest));
    } else {
      last_generation_.erase(oldest);
    }
  }
}

}  // namespace collserve::server
