// The coordinator's group registry: rendezvous of ranks into named groups. No gRPC.
//
// A group (job, name) has a world_size fixed by its first joiner. JoinAsync registers a
// rank and completes once all world_size ranks have joined (every joiner gets the same
// view and generation) or at the joiner's deadline. Generations count formations of a
// name: 1, 2, ... A rank leaving a formed group marks it BROKEN; once every rank has left,
// the next formation gets the next generation. Member hosts watch a formed generation
// (WatchAsync): the watch reports its departures (ranks that left, or were lost with a
// host) and is the host's lease; a host whose lease ends is lost, which also ends the
// generation. Every formed group has leases, one-host groups too, so that the groups of a
// sidecar that died end within its lease (about --lease_grace plus the sidecar's
// --lease_renewal; at most the adoption lease plus the grace right after formation).
//
// Thread safety: all methods are thread-safe. Callbacks run outside the registry's lock,
// on the thread whose call completed the group, on the registry's timer thread, or inline.
#ifndef COLLSERVE_SERVER_COORDINATOR_GROUP_REGISTRY_H_
#define COLLSERVE_SERVER_COORDINATOR_GROUP_REGISTRY_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/flight_record.h"

namespace collserve::server {

struct MemberInfo {
  int rank = -1;
  std::string host_id;       // the serving sidecar's id
  std::string host_address;  // informational
  std::string sidecar_address;  // informational (Member.sidecar_address)
  // The serving sidecar process (Member.incarnation): a join from host_id with another
  // one takes the earlier process as lost (GroupRegistry::JoinAsync); 0 = not compared.
  uint64_t incarnation = 0;
  // The backend its sidecar connects the group's hosts with (Member.backend); every member
  // of a generation names the same one (GroupRegistry::JoinAsync); "" = not compared.
  std::string backend;
  // Its sidecar names its connects' store keys with the generation's rendezvous id
  // (Member.rendezvous_ids).
  bool rendezvous_ids = false;
};

struct GroupView {
  std::string group;
  int world_size = 0;
  int64_t generation = 0;
  std::string state;                // "FORMING", "FORMED" or "BROKEN"
  std::vector<MemberInfo> members;  // ordered by rank
  // Drawn at random (never 0) when the generation formed here, if every member's sidecar
  // takes one (MemberInfo::rendezvous_ids); 0 otherwise, and for a generation adopted from
  // a watch or restored from the journal (its hosts connected before). JoinResponse.
  // rendezvous_id: the generation's rendezvous keys carry it (common/rendezvous.h).
  uint64_t rendezvous_id = 0;
  // In a join's answer only (JoinCallback): each member host once, in the order of its
  // lowest rank (rank -1), and for each rank 0..world_size-1 the index of its host in
  // `hosts` (the compact JoinResponse).
  std::vector<MemberInfo> hosts;
  std::vector<int32_t> rank_host;
};

// The ledger (ledger.h): what a host's sidecar reports about its ranks of a group.
// One rank, as its host reported it (collserve.v1.RankProgress).
struct RankLedger {
  int rank = 0;
  int64_t issued_seq = -1;  // its last collective submitted; -1: none
  int op = 0;               // that collective's arguments (common.proto's enums' values)
  int dtype = 0;
  int64_t count = 0;
  int root = 0;
  int reduce_op = 0;
  absl::Duration issued_age;    // at the report
  int64_t completed_seq = -1;   // its last collective answered; -1: none
  absl::Duration completed_age;
  std::string completed_status;  // "" = OK, else the error's code name
};

// One host's report of one group.
// The default straggler threshold (GroupRegistryLimits::straggler_threshold; the sidecar's
// --straggler_threshold has the same default).
inline constexpr absl::Duration kDefaultStragglerThreshold = absl::Milliseconds(100);

// Most flight records one report may carry (the sidecar sends its latest 32).
inline constexpr size_t kMaxReportedFlightRecords = 32;

struct HostLedger {
  int64_t generation = 0;
  std::string state;    // the group's state on that host: joining, connecting, ready, failed
  std::string failure;  // its error there, when failed
  std::vector<RankLedger> ranks;
  std::vector<FlightRecord> records;  // its latest flight records, with its ranks' arrivals
  int64_t draining_since_unix_ms = 0;  // its sidecar drains since then (Unix ms); 0 = not draining
  absl::Time received;  // when the coordinator got it
};

// A rank that left a formed generation (Leave) or was lost with its host (its lease ran out).
struct Departure {
  int rank = -1;
  std::string host_id;
  std::string reason;
  bool host_lost = false;
};

// What a watch of one generation answers (WatchAsync).
struct GroupEvents {
  int64_t generation = 0;
  std::string state;                 // "FORMED" or "BROKEN"
  std::vector<Departure> departures;  // every departure of the generation, in order
};

// The bounds of a watch's wait (WatchAsync clamps the asked wait to them).
inline constexpr absl::Duration kMinWatchWait = absl::Milliseconds(100);
inline constexpr absl::Duration kMaxWatchWait = absl::Seconds(60);
inline constexpr int kMaxWatchesPerHost = 4;


// Bounds on what joins may ask the registry to hold (every request is untrusted input).
struct GroupRegistryLimits {
  // Largest world_size a group may have (torch jobs reach tens of thousands of ranks).
  int max_world_size = 1 << 16;
  // Groups (forming or formed, every job together) the registry holds at once.
  int max_groups = 10000;
  // A collective whose last rank called it at least this long after its first makes that
  // rank a straggler in diagnoses and dumps (ledger.h).
  absl::Duration straggler_threshold = kDefaultStragglerThreshold;
  // A host that watches a generation (WatchAsync) holds a lease on it: it must watch again
  // within this long after each answer, or after its watch's wait ended; otherwise it is
  // lost and the generation ends (--lease_grace).
  absl::Duration lease_grace = absl::Seconds(3);
  // The member hosts of a generation (one host or many), once it formed here or was adopted from
  // a watch (WatchAsync), must watch within this plus the grace (a host cut off right after
  // the rendezvous is lost too): their sidecars watch within about a second of formation,
  // and retry about every second while the coordinator does not know the generation.
  absl::Duration adoption_lease = absl::Seconds(10);
  // Group names whose last formed generation the registry remembers after they end (so
  // that a late join of an ended generation is refused): the names that formed last, every
  // job together. Bounded, because a job forming groups of ever new names once grew it (and
  // every name's bytes) without end.
  size_t max_remembered_groups = size_t{1} << 17;
};

// How many missing ranks a rendezvous timeout names; the rest are counted.
inline constexpr int kMaxNamedMissingRanks = 32;

// Where the registry records its formed generations so that they outlive this process
// (GroupRegistry::SetJournal; with etcd, registry_journal.h writes them there and a new
// registry leader restores them with GroupRegistry::Restore). Records are hints: a
// restored generation whose hosts never watch is lost once its adoption lease ends, like
// one adopted from a watch. Both methods are called with the registry's lock held and must
// not block or call the registry (queue the work).
class RegistryJournal {
 public:
  virtual ~RegistryJournal() = default;
  // Generation view->generation of (job, view->group) formed here or was adopted from a
  // watch (not from Restore); the view is the join answer's: members, every rank ordered by
  // rank, and the compact hosts and rank_host. Shared, not copied: keep it, not a copy.
  virtual void Formed(const std::string& job, std::shared_ptr<const GroupView> view) = 0;
  // That generation is over here: superseded by a later one, left by every rank, or
  // every member host lost.
  virtual void Ended(const std::string& job, const std::string& group, int64_t generation) = 0;
};

class GroupRegistry {
 public:
  // Called once with the formed group's view, or with: INVALID_ARGUMENT (bad rank,
  // world_size, names; a world_size over limits.max_world_size names the limit),
  // RESOURCE_EXHAUSTED (a new group while limits.max_groups are held; names the limit),
  // ALREADY_EXISTS (rank taken in this generation),
  // FAILED_PRECONDITION (a generation asked for is over),
  // DEADLINE_EXCEEDED (names the first kMaxNamedMissingRanks missing ranks and counts the
  // rest), CANCELLED (CancelJoin, or the rank left),
  // UNAVAILABLE (registry destroyed).
  // Every joiner of a generation gets the same view, made once when the last rank joins:
  // forming a group of K ranks costs O(K) time and memory here, not a copy per joiner.
  using JoinCallback = absl::AnyInvocable<void(absl::StatusOr<std::shared_ptr<const GroupView>>) &&>;

  explicit GroupRegistry(GroupRegistryLimits limits = {});
  ~GroupRegistry();  // fails pending joins with UNAVAILABLE
  GroupRegistry(const GroupRegistry&) = delete;
  GroupRegistry& operator=(const GroupRegistry&) = delete;

  // Registers `member` in (job, group) and arranges for `done` to be called (see
  // JoinCallback). Never blocks. Returns an id for CancelJoin.
  // `generation` > 0 asks for that generation of the name (re-forming in place, as the
  // SDKs' reconfigure does; 0 = the one forming, or the next): the first join of a later
  // generation than the group's ends the group's (SUPERSEDED: its pending joins fail with
  // FAILED_PRECONDITION, its watches are answered with state SUPERSEDED, its remaining
  // members are dropped) and starts the new one, with its own world_size. A generation
  // that is already over here is FAILED_PRECONDITION naming the current one.
  // A `member.incarnation` (non-zero) other than the one last seen from member.host_id
  // means that host's sidecar restarted: first, every rank the earlier process serves in
  // any group departs as lost (host_lost, reason "restarted"; a forming group's waiter gets
  // UNAVAILABLE), as when its lease ends, so the new process's ranks can form again at once.
  // A `member.backend` (non-empty) other than the one the members joined so far named
  // fails the join and every pending join of the forming generation with INVALID_ARGUMENT
  // naming both ranks, their hosts and backends; the forming generation is dropped, and
  // the ranks of that generation that had not joined yet are refused the same way when they
  // come (each once; until every rank was told, or the latest deadline of the failed joins).
  // A join (generation 0) while the group's current generation is past forming (BROKEN:
  // a rank left or was lost, and its other ranks have not all left yet; a rank that
  // destroyed its group and initialized again at once gets here) is held until every rank
  // has left that generation, then joins the next one; its deadline still holds (then
  // DEADLINE_EXCEEDED naming the generation that had not ended). At most
  // kMaxHeldJoins are held (then FAILED_PRECONDITION, as before).
  uint64_t JoinAsync(const std::string& job, const std::string& group, int world_size,
                     const MemberInfo& member, absl::Time deadline, JoinCallback done, int64_t generation = 0);
  static constexpr size_t kMaxHeldJoins = 65536;
  // Withdraws a pending join (its rank leaves the forming group); `done` gets CANCELLED.
  // No-op for unknown or completed ids.
  void CancelJoin(uint64_t id);

  // Called once with the generation's events (state FORMED or BROKEN; SUPERSEDED when a
  // later generation of the name formed or forms, ENDED when every rank left it: answered
  // at once, the generation is over), or with: NOT_FOUND (no such group, still forming,
  // or a generation not known here), PERMISSION_DENIED (the host serves none of its ranks at
  // formation), INVALID_ARGUMENT (known < 0), UNAVAILABLE (registry destroyed).
  using WatchCallback = absl::AnyInvocable<void(absl::StatusOr<GroupEvents>) &&>;
  // Watches generation `generation` of (job, group) for member host `host_id`: `done` gets
  // the events once the generation has more than `known` departures (at once if it has
  // already), or the unchanged events after `wait` (clamped to [kMinWatchWait,
  // kMaxWatchWait]). The call renews the host's lease (GroupRegistryLimits::lease_grace):
  // a host that stops watching is taken as lost once its lease ends; each of its ranks
  // still in the group then departs with host_lost set, and the group turns BROKEN. Never
  // blocks; `done` may run inline. Memory: one pending watch per call; at most
  // kMaxWatchesPerHost pending per host and group (a host re-watches after each answer, so
  // it has one), beyond which RESOURCE_EXHAUSTED naming the limit.
  // Returns an id for CancelWatch (0 when `done` ran inline).
  // `members` (may be empty): the generation as the watching host knows it, every rank of
  // it; when the registry has no such group (it restarted after the generation formed),
  // it adopts the generation from them, FORMED, and gives every member host a lease of
  // limits.adoption_lease plus the grace to watch. Adoption is refused (NOT_FOUND, as without
  // members) when `members` is not exactly ranks 0..n-1 once each, n is over
  // max_world_size, `host_id` serves none of them, the registry holds max_groups groups, or
  // a later generation of the name already formed here.
  uint64_t WatchAsync(const std::string& job, const std::string& group, int64_t generation,
                      const std::string& host_id, int known, absl::Duration wait, WatchCallback done,
                      const std::vector<MemberInfo>& members = {});
  // Records formed generations and their end in `journal` from now on (nullptr: stop).
  // `journal` must outlive the registry or be replaced first. Thread-safe.
  void SetJournal(RegistryJournal* journal);
  // Takes in a generation recorded by a journal (a new registry leader, or a restarted
  // coordinator, over etcd): FORMED with `formed.members`, every member host holding a lease
  // of limits.adoption_lease plus the grace to watch (WatchAsync), as an adoption from a
  // watch does. INVALID_ARGUMENT when `formed` is not a generation > 0 of ranks 0..n-1 once
  // each (n <= max_world_size) on named hosts; ALREADY_EXISTS when the registry holds the
  // name at the same or a later generation, or a later one formed here;
  // RESOURCE_EXHAUSTED at max_groups. Does not record it in the journal again.
  absl::Status Restore(const std::string& job, const GroupView& formed);

  // Ends a waiting watch now: `done` gets CANCELLED. The host's lease runs on as if the
  // watch's wait had ended. No-op for unknown or answered ids.
  void CancelWatch(uint64_t id);

  // Removes `rank` from the group. NOT_FOUND if the group or the rank is unknown. A rank
  // leaving a formed group is a departure (WatchAsync) and makes it BROKEN. `generation`
  // > 0: the generation the rank leaves; OK without effect when that generation is already
  // over (superseded or left by every rank), NOT_FOUND when the group is at another.
  absl::Status Leave(const std::string& job, const std::string& group, int rank, int64_t generation = 0);
  // Deletes (job, group) now (Registry.DeleteGroup): its pending joins get ABORTED, its
  // watches are answered with state DELETED, and it is erased (the next formation of the
  // name gets the next generation). `by` names who deleted it in those errors. Returns
  // the group as it was; NOT_FOUND if unknown.
  absl::StatusOr<GroupView> Delete(const std::string& job, const std::string& group, const std::string& by);
  // NOT_FOUND if the group is unknown.
  absl::StatusOr<GroupView> Describe(const std::string& job, const std::string& group);
  std::vector<GroupView> List(const std::string& job);

  // Keeps `host_id`'s latest ledger of the group (replacing its earlier one), stamped
  // now. NOT_FOUND: no such group, or not in `ledger.generation` (a late report of an
  // ended generation); PERMISSION_DENIED: the host serves none of the group's ranks, or a
  // rank in the report is not on that host; INVALID_ARGUMENT: more ranks than the group
  // has. Memory: one ledger per member host, dropped with the group.
  absl::Status ReportProgress(const std::string& job, const std::string& group, const std::string& host_id,
                              HostLedger ledger);
  // The group's view and every host's latest ledger of its current generation, for
  // Diagnose (ledger.h). NOT_FOUND if the group is unknown.
  absl::StatusOr<std::pair<GroupView, std::map<std::string, HostLedger>>> Ledgers(const std::string& job,
                                                                                  const std::string& group);
  const GroupRegistryLimits& limits() const { return limits_; }
  // For metrics: groups held now (every job), how many of them are formed, and the
  // generations formed since the registry started.
  struct Counts {
    int64_t groups = 0;
    int64_t formed = 0;
    int64_t generations_formed = 0;
  };
  Counts GroupCounts();
  // The number of groups of each job that has any.
  std::map<std::string, int> GroupsByJob();

 private:
  struct Waiter {
    uint64_t id;
    absl::Time deadline;
    JoinCallback done;
  };
  // A join held until its group's current generation has ended (JoinAsync).
  struct HeldJoin {
    std::string job;
    std::string group;
    int world_size = 0;
    MemberInfo member;
    absl::Time deadline;
    JoinCallback done;
    int64_t held_behind = 0;  // the generation it waits out
    std::string state;        // that generation's state when the join came
    absl::Time since;
  };
  // JoinAsync with the id a held join already has (0 = a new one).
  uint64_t JoinWithId(const std::string& job, const std::string& group, int world_size, const MemberInfo& member,
                      absl::Time deadline, JoinCallback done, int64_t generation, uint64_t id);
  struct Watch {
    uint64_t id = 0;
    std::string host;
    size_t known = 0;
    absl::Time deadline;
    WatchCallback done;
  };
  struct Group {
    std::string name;
    int world_size = 0;
    int64_t generation = 0;
    uint64_t rendezvous_id = 0;  // GroupView::rendezvous_id
    std::string state = "FORMING";
    absl::Time started;
    std::map<int, MemberInfo> members;
    std::map<int, Waiter> waiters;  // by rank, while FORMING
    std::set<int> gave_up;          // joined, then timed out before the group formed
    // The backend the members joined so far asked for, and the first of them that named
    // it (Member.backend; -1: none named one yet).
    std::string backend;
    int backend_rank = -1;
    std::map<std::string, HostLedger> ledgers;  // by host id, this generation's
    // Since formed: the members at formation, the departures, the watches waiting, and the
    // hosts holding a lease (by host id: when it ends).
    std::map<int, MemberInfo> formed_members;
    std::vector<Departure> departures;
    std::vector<Watch> watches;
    std::map<std::string, absl::Time> leases;
  };
  using Key = std::pair<std::string, std::string>;  // (job, group)
  using Completion = std::pair<JoinCallback, absl::StatusOr<std::shared_ptr<const GroupView>>>;
  using WatchCompletion = std::pair<WatchCallback, GroupEvents>;

  static GroupEvents EventsOf(const Group& g);
  // Answers the group's watches (all of them, or those whose wait ended by `now`) into
  // `out`, renewing their hosts' leases from `now`.
  void AnswerWatchesLocked(Group& g, bool all, absl::Time now, std::vector<WatchCompletion>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adopts generation `generation` of (job, group) from a member host's watch (WatchAsync;
  // `host_id` must serve one of `members`) or from a journal (Restore; `host_id` empty);
  // end() when refused, with the reason in *why when given.
  std::map<Key, Group>::iterator AdoptLocked(const std::string& job, const std::string& group, int64_t generation,
                                             const std::string& host_id, const std::vector<MemberInfo>& members,
                                             absl::Status* why = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the journal (if any) that the formed generation `g` of `key` is over.
  void JournalEndedLocked(const Key& key, const Group& g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The timer's lease pass: answers ended waits, takes hosts whose lease ended as lost
  // (erasing groups left with no member), and lowers *next to the next deadline.
  void ExpireLeasesLocked(absl::Time now, absl::Time* next, std::vector<WatchCompletion>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A join from `host_id` with `incarnation` (JoinAsync): when it differs from the one last
  // seen from that host, takes the earlier process as lost in every group. Memory: one entry
  // per host id with a group here (pruned as groups end).
  void LoseRestartedHostLocked(const std::string& host_id, uint64_t incarnation, std::vector<Completion>* joins,
                               std::vector<WatchCompletion>* watches) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes every rank of host `host` in `g` as lost (departures with host_lost and `reason`),
  // ends its lease and answers the group's watches; true when one was. Leaves erasing an
  // emptied group to the caller.
  bool LoseHostLocked(Group& g, const std::string& host, const std::string& reason, absl::Time now,
                      std::vector<WatchCompletion>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Ends the group `it` for generation `generation` of its name (JoinAsync): fails its
  // pending joins, answers its watches with state SUPERSEDED and erases it.
  void SupersedeLocked(std::map<Key, Group>::iterator it, int64_t generation, std::vector<Completion>* joins,
                       std::vector<WatchCompletion>* watches) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static GroupView ViewOf(const Group& g);
  // ViewOf with the join answer's hosts and rank_host (a formed group: ranks 0..n-1).
  static std::shared_ptr<const GroupView> JoinViewOf(const Group& g);
  void TimerLoop();
  // Removes a forming member (and its waiter) after a timeout/cancel; erases empty groups.
  void RemoveForming(std::map<Key, Group>::iterator it, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const GroupRegistryLimits limits_;
  absl::Mutex mu_;
  std::map<Key, Group> groups_ ABSL_GUARDED_BY(mu_);
  int64_t generations_formed_ ABSL_GUARDED_BY(mu_) = 0;
  // The last generation formed of each group (a join of an older one is refused), for the
  // limits_.max_remembered_groups names that formed last; remembered_order_ holds the names
  // in the order first remembered.
  std::map<Key, int64_t> last_generation_ ABSL_GUARDED_BY(mu_);
  std::deque<Key> remembered_order_ ABSL_GUARDED_BY(mu_);
  // Sets the last generation formed of `key`, forgetting the oldest names past the bound.
  void RememberGenerationLocked(const Key& key, int64_t generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<uint64_t, std::pair<Key, int>> waiter_index_ ABSL_GUARDED_BY(mu_);  // id -> (group, rank)
  std::map<uint64_t, Key> watch_index_ ABSL_GUARDED_BY(mu_);  // waiting watches: id -> group
  std::map<uint64_t, HeldJoin> held_ ABSL_GUARDED_BY(mu_);    // id -> a join held (JoinAsync)
  // A forming generation dropped by a backend desync: the ranks of that attempt still to
  // come are refused with the same error (not left to wait out their init timeout alone),
  // each once, until every rank was told or the latest deadline of the joins it failed.
  struct Desync {
    absl::Status status;
    int world_size = 0;
    std::set<int> told;
    absl::Time until;
  };
  std::map<Key, Desync> desyncs_ ABSL_GUARDED_BY(mu_);
  static constexpr size_t kMaxDesyncs = 1024;  // past it the oldest is forgotten
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t changes_ ABSL_GUARDED_BY(mu_) = 0;  // bumped when a waiter is added
  RegistryJournal* journal_ ABSL_GUARDED_BY(mu_) = nullptr;
  // host id -> the incarnation of its sidecar last seen in a join (LoseRestartedHostLocked).
  std::map<std::string, uint64_t> incarnations_ ABSL_GUARDED_BY(mu_);
  absl::BitGen random_ ABSL_GUARDED_BY(mu_);  // rendezvous ids
  size_t incarnations_pruned_at_ ABSL_GUARDED_BY(mu_) = 0;  // its size after the last prune
  std::thread timer_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_GROUP_REGISTRY_H_
