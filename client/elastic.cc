// collserve/elastic.h: the same protocol and store keys as the Python SDK's reconfigure
// (python/collserve/distributed_c10d.py: _quorum, _join_running, should_reconfigure).
#include "collserve/elastic.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace collserve::client {
namespace {

// How often a rank looks at a member list that is still open, and at which old ranks the
// coordinator saw leave.
constexpr absl::Duration kPoll = absl::Milliseconds(50);
constexpr absl::Duration kLeftPoll = absl::Milliseconds(200);

struct Context {
  std::unique_ptr<StoreClient> store;
  std::unique_ptr<GroupMembership> membership;
  std::string prefix;  // "collserve/reconfigure/<run_id>/<group>/"
  absl::Duration timeout;
};

absl::StatusOr<Context> Open(const InitOptions& init, const ReconfigureOptions& options) {
  if (init.coordinator_address.empty()) {
    return absl::FailedPreconditionError(
        "re-forming a group needs the coordinator's store: InitOptions has no coordinator_address");
  }
  Context c;
  c.timeout = options.timeout > absl::ZeroDuration() ? options.timeout : init.init_timeout;
  std::string run_id = options.run_id;
  if (run_id.empty()) {
    const char* env = std::getenv("COLLSERVE_RUN_ID");
    if (env != nullptr) run_id = env;
  }
  c.prefix = absl::StrCat("collserve/reconfigure/", run_id, "/", init.group, "/");
  StoreClientOptions so;
  so.job = init.job.empty() ? "default" : init.job;
  so.timeout = c.timeout;
  so.tls = init.tls;
  so.token = init.token;
  auto store = StoreClient::Connect(init.coordinator_address, so);
  if (!store.ok()) return store.status();
  c.store = std::move(*store);
  auto membership = GroupMembership::Connect(init.coordinator_address, so);
  if (!membership.ok()) return membership.status();
  c.membership = std::move(*membership);
  return c;
}

std::vector<std::string> Split(absl::string_view list) {
  return absl::StrSplit(list, ',', absl::SkipEmpty());
}

// Current members (their ranks, as text) by rank, then joiners ("j...") in arrival order;
// each once.
std::vector<std::string> Order(const std::vector<std::string>& appended) {
  std::set<int64_t> ranks;
  std::vector<std::string> joiners;
  std::set<std::string> seen;
  for (const std::string& m : appended) {
    if (!seen.insert(m).second) continue;
    int64_t r = 0;
    if (!m.empty() && m[0] == 'j') {
      joiners.push_back(m);
    } else if (absl::SimpleAtoi(m, &r)) {
      ranks.insert(r);
    }
  }
  std::vector<std::string> out;
  for (int64_t r : ranks) out.push_back(absl::StrCat(r));
  out.insert(out.end(), joiners.begin(), joiners.end());
  return out;
}

int IndexOf(const std::vector<std::string>& members, const std::string& me) {
  auto it = std::find(members.begin(), members.end(), me);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

// The members of generation `generation`, agreed through the store (this rank, `me` of an
// old group of `world` ranks at the coordinator's generation `registry`, among them unless
// it came after the list closed). The list closes once every old rank is on it or has left
// generation `registry` at the coordinator, else after the join window. Records this rank's `completed_seq` (its group's
// last_completed_seq) before it appends itself, and the new group's coordinator
// generation for the joiners.
absl::StatusOr<std::vector<std::string>> Quorum(Context& c, const std::string& group, int64_t generation,
                                                const std::string& me, int world, int64_t registry,
                                                int64_t completed_seq, const ReconfigureOptions& options) {
  const std::string p = absl::StrCat(c.prefix, generation, "/");
  // Before joining the list: whoever reads the closed list finds every member's seq.
  if (absl::Status s = c.store->Set(p + "completed/" + me, absl::StrCat(completed_seq)); !s.ok()) return s;
  if (absl::Status s = c.store->Append(p + "members", me + ","); !s.ok()) return s;
  const absl::Time start = absl::Now();
  std::string closed;
  std::set<int> left;  // old ranks the coordinator saw leave generation `registry`
  absl::Time next_left_check = start;
  for (;;) {
    auto done = c.store->Check({p + "closed"});
    if (!done.ok()) return done.status();
    if (*done) {
      auto got = c.store->Get(p + "closed");
      if (!got.ok()) return got.status();
      closed = *got;
      break;
    }
    auto appended = c.store->Get(p + "members");
    if (!appended.ok()) return appended.status();
    const std::vector<std::string> members = Order(Split(*appended));
    if (absl::Now() >= next_left_check) {
      // An error leaves the list to the join window, as without this check.
      auto gone = c.membership->LeftRanks(group, registry, world);
      if (gone.ok()) left = std::set<int>(gone->begin(), gone->end());
      next_left_check = absl::Now() + kLeftPoll;
    }
    bool everyone = true;
    for (int r = 0; r < world && everyone; ++r) {
      everyone = IndexOf(members, absl::StrCat(r)) >= 0 || left.count(r) > 0;
    }
    const absl::Duration waited = absl::Now() - start;
    if (everyone ||
        (waited >= options.join_window && static_cast<int>(members.size()) >= options.min_world_size)) {
      auto swapped = c.store->CompareSet(p + "closed", "", absl::StrJoin(members, ","));
      if (!swapped.ok()) return swapped.status();
      closed = *swapped;
      break;
    }
    if (waited >= options.join_window + c.timeout) {
      return absl::DeadlineExceededError(absl::StrCat("reconfigure: only ", members.size(), " of at least ",
                                                      options.min_world_size, " ranks joined generation ", generation,
                                                      " of group \"", group, "\": [", absl::StrJoin(members, ", "),
                                                      "]"));
    }
    absl::SleepFor(kPoll);
  }
  std::vector<std::string> members = Split(closed);
  if (IndexOf(members, me) < 0) return members;  // too late: the members may be at a later generation
  // The new group's coordinator generation, for the joiners on the list.
  if (absl::Status s = c.store->Set(p + "registry", absl::StrCat(registry + 1)); !s.ok()) return s;
  if (absl::Status s = c.store->Set(c.prefix + "current", absl::StrCat(generation)); !s.ok()) return s;
  if (IndexOf(members, me) >= 0 && static_cast<int>(members.size()) < options.min_world_size) {
    return absl::AbortedError(absl::StrCat("reconfigure: generation ", generation, " of group \"", group, "\" has ",
                                           members.size(), " ranks ([", absl::StrJoin(members, ", "),
                                           "]), fewer than min_world_size ", options.min_world_size));
  }
  return members;
}

// The smallest completed seq the old members of the closed list `members` recorded (each
// before it appended itself, so every one is there); joiners have none. -1 when none.
absl::StatusOr<int64_t> LastCommonSeq(Context& c, int64_t generation, const std::vector<std::string>& members) {
  const std::string p = absl::StrCat(c.prefix, generation, "/completed/");
  std::vector<std::string> keys;
  for (const std::string& m : members) {
    if (!m.empty() && m[0] != 'j') keys.push_back(p + m);
  }
  if (keys.empty()) return int64_t{-1};
  auto values = c.store->MultiGet(keys, c.timeout);
  if (!values.ok()) return values.status();
  int64_t common = std::numeric_limits<int64_t>::max();
  for (size_t i = 0; i < keys.size() && i < values->size(); ++i) {
    int64_t seq = 0;
    if (!absl::SimpleAtoi((*values)[i], &seq) || seq < -1) {
      return absl::DataLossError(absl::StrCat("the store's ", keys[i], " holds \"", (*values)[i],
                                              "\", not a collective seq"));
    }
    common = std::min(common, seq);
  }
  return common;
}

struct Admission {
  int rank = 0;
  int size = 0;
  int64_t generation = 0;
  int64_t registry = 0;  // the coordinator's generation of the name to form (0 = any)
};

// A joiner's wait: appends its id to the next generation's list until a closed list has it.
absl::StatusOr<Admission> JoinRunning(Context& c, const InitOptions& init) {
  const std::string me = absl::StrCat("j", std::max(init.rank, 0), ".", getpid(), ".",
                                      absl::ToUnixNanos(absl::Now()) % 1000000);
  int64_t generation = 1;
  auto known = c.store->Check({c.prefix + "current"});
  if (!known.ok()) return known.status();
  if (*known) {
    auto current = c.store->Get(c.prefix + "current");
    if (!current.ok()) return current.status();
    int64_t g = 0;
    if (!absl::SimpleAtoi(*current, &g) || g < 0) {
      return absl::DataLossError(absl::StrCat("the store's ", c.prefix, "current holds \"", *current,
                                              "\", not a generation"));
    }
    generation = g + 1;
  }
  const absl::Time deadline = absl::Now() + c.timeout;
  for (;; ++generation) {
    const std::string p = absl::StrCat(c.prefix, generation, "/");
    if (absl::Status s = c.store->Append(p + "members", me + ","); !s.ok()) return s;
    const absl::Duration left = deadline - absl::Now();
    absl::Status waited = left > absl::ZeroDuration() ? c.store->Wait({p + "closed"}, left)
                                                      : absl::DeadlineExceededError("");
    if (absl::IsDeadlineExceeded(waited)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "not admitted to group \"", init.group, "\" within ", absl::FormatDuration(c.timeout),
          " (the running ranks admit joiners when they call reconfigure)"));
    }
    if (!waited.ok()) return waited;
    auto closed = c.store->Get(p + "closed");
    if (!closed.ok()) return closed.status();
    const std::vector<std::string> members = Split(*closed);
    const int index = IndexOf(members, me);
    if (index < 0) continue;
    // The members write the group's coordinator generation right after the list closed.
    const absl::Duration rest = deadline - absl::Now();
    absl::Status noted = rest > absl::ZeroDuration() ? c.store->Wait({p + "registry"}, rest)
                                                     : absl::DeadlineExceededError("admission timed out");
    if (!noted.ok()) return noted;
    auto registry = c.store->Get(p + "registry");
    if (!registry.ok()) return registry.status();
    int64_t r = 0;
    if (!absl::SimpleAtoi(*registry, &r) || r < 1) {
      return absl::DataLossError(absl::StrCat("the store's ", p, "registry holds \"", *registry,
                                              "\", not a generation"));
    }
    return Admission{index, static_cast<int>(members.size()), generation, r};
  }
}

absl::StatusOr<ElasticGroup> Form(const InitOptions& init, const Admission& a, absl::Duration timeout) {
  InitOptions o = init;
  o.generation = a.registry;
  o.rank = a.rank;
  o.world_size = a.size;
  o.init_timeout = timeout;
  auto group = InitProcessGroup(o);
  if (!group.ok()) return group.status();
  return ElasticGroup{std::move(*group), a.generation};
}

}  // namespace

absl::StatusOr<ElasticGroup> Reconfigure(ElasticGroup current, const InitOptions& init,
                                         const ReconfigureOptions& options) {
  if (current.group == nullptr) return absl::InvalidArgumentError("Reconfigure of no group");
  auto c = Open(init, options);
  if (!c.ok()) return c.status();
  const int64_t generation = current.generation + 1;
  const std::string me = absl::StrCat(current.group->GetRank());
  const int64_t registry = current.group->generation();
  auto members = Quorum(*c, init.group, generation, me, current.group->GetWorldSize(), registry,
                        current.group->last_completed_seq(), options);
  if (!members.ok()) return members.status();
  current.group.reset();  // its session ends: the sidecar drops the old generation's state
  const int index = IndexOf(*members, me);
  if (index < 0) {
    // Too late for this generation: join the next one as a newcomer.
    auto admitted = JoinRunning(*c, init);
    if (!admitted.ok()) return admitted.status();
    return Form(init, *admitted, c->timeout);
  }
  auto common = LastCommonSeq(*c, generation, *members);
  if (!common.ok()) return common.status();
  auto formed = Form(init, Admission{index, static_cast<int>(members->size()), generation, registry + 1}, c->timeout);
  if (formed.ok()) formed->last_common_seq = *common;
  return formed;
}

absl::StatusOr<bool> ShouldReconfigure(const ElasticGroup& current, const InitOptions& init,
                                       const ReconfigureOptions& options) {
  if (current.group == nullptr) return absl::InvalidArgumentError("ShouldReconfigure of no group");
  std::vector<int64_t> flag = {0};
  if (current.group->GetRank() == 0) {
    auto c = Open(init, options);
    if (!c.ok()) return c.status();
    const std::string key = absl::StrCat(c->prefix, current.generation + 1, "/members");
    auto present = c->store->Check({key});
    if (!present.ok()) return present.status();
    if (*present) {
      auto list = c->store->Get(key);
      if (!list.ok()) return list.status();
      flag[0] = list->empty() ? 0 : 1;
    }
  }
  if (absl::Status s = current.group->Broadcast(flag, 0)->Wait(); !s.ok()) return s;
  return flag[0] != 0;
}

absl::StatusOr<ElasticGroup> JoinRunningGroup(const InitOptions& init, const ReconfigureOptions& options) {
  auto c = Open(init, options);
  if (!c.ok()) return c.status();
  auto admitted = JoinRunning(*c, init);
  if (!admitted.ok()) return admitted.status();
  return Form(init, *admitted, c->timeout);
}

}  // namespace collserve::client
