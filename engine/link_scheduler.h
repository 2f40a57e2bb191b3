// The host-wide scheduler of the steps between hosts: which group's next piece of bytes goes
// onto the network from this host, by its job's class (issue 43's "the same policies for
// the inter-host steps").
//
// A link that queues every packet in one FIFO (a tc tbf, a switch port without classes)
// makes a latency-critical job's 8-byte all_reduce wait behind whatever another job's 64
// MiB all_reduce has queued there: tens of milliseconds on a 1 Gbit/s link, whatever the
// threads on either host do. The remedy is the one a packet scheduler applies, one level
// up: large transfers between hosts are cut into pieces, and before each piece after the
// first a group of a lower class waits while a group of a better class has a collective
// between hosts running on this host (at most `max_wait` per piece, so that no class
// starves). The better class then queues behind at most one piece of the other's bytes.
//
// Cutting costs a lower class a round trip per piece, so it cuts only when it has to: a
// host proposes pieces for a class only while a better class has run a collective between
// hosts on this host within `recent` (ProposedPieceBytes). The piece size must be the same
// on every host of a group, so each host's proposal rides with the argument exchange
// (RankArgs::piece_bytes) and every host uses the smallest nonzero one (AgreedPieceBytes):
// different sidecar flags or different views of the host's jobs cannot split one transfer
// differently on two hosts.
//
// Classes are GroupParams::priority: 0 latency-critical, 1 default, 2 bulk (lower is
// better). Groups of one class never wait for each other (their share of the link is
// TCP's). Thread-safe.
#ifndef COLLSERVE_ENGINE_LINK_SCHEDULER_H_
#define COLLSERVE_ENGINE_LINK_SCHEDULER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace collserve::engine {

struct LinkSchedulerOptions {
  // The size of a piece of a transfer between hosts, in bytes, when one is cut; 0: never
  // cut (every class's transfers go whole, nothing waits).
  size_t piece_bytes = size_t{512} << 10;
  // The longest one piece waits for better classes' collectives.
  absl::Duration max_wait = absl::Milliseconds(20);
  // A better class counts as present on this host for this long after its last collective
  // between hosts ended.
  absl::Duration recent = absl::Seconds(2);
};

class LinkScheduler {
 public:
  static constexpr int kNumClasses = 3;

  // `now` (tests: a fake clock; default absl::Now) is read for `recent` only; waits are real.
  explicit LinkScheduler(LinkSchedulerOptions options, std::function<absl::Time()> now = nullptr);

  const LinkSchedulerOptions& options() const { return options_; }

  // A collective of class `priority` with steps between hosts is running on this host
  // while the returned object lives (from its argument exchange to its answer). Movable.
  class Active {
   public:
    Active() = default;
    Active(Active&& other) noexcept : scheduler_(other.scheduler_), priority_(other.priority_) {
      other.scheduler_ = nullptr;
    }
    Active& operator=(Active&& other) noexcept;
    Active(const Active&) = delete;
    Active& operator=(const Active&) = delete;
    ~Active() { End(); }
    // Ends it now (idempotent).
    void End();

   private:
    friend class LinkScheduler;
    Active(LinkScheduler* scheduler, int priority) : scheduler_(scheduler), priority_(priority) {}
    LinkScheduler* scheduler_ = nullptr;
    int priority_ = 0;
  };
  // `priority` is clamped to [0, kNumClasses).
  Active Begin(int priority);

  // The piece size, in bytes, this host proposes for a class-`priority` transfer between
  // hosts: options().piece_bytes while a better class has a collective running or ended
  // one within options().recent, else 0 (no cutting).
  size_t ProposedPieceBytes(int priority);

  // Before a piece of a class-`priority` transfer (not the first): waits until no better
  // class has a collective running, at most options().max_wait. Returns how long it waited.
  absl::Duration AwaitTurn(int priority);

  // How many calls of AwaitTurn are waiting now, and how many collectives of class
  // `priority` are running (Begin) now (tests).
  int Waiting();
  int Running(int priority);
  // Records a class-`priority` transfer cut into `pieces` pieces (more than one).
  void RecordCut(int priority, size_t pieces);

  // Per class, since the start (metrics, tests): transfers cut and their pieces; pieces
  // that found a better class running (AwaitTurn waited) and their time waited in total.
  struct Counters {
    uint64_t cut = 0;
    uint64_t pieces = 0;
    uint64_t waits = 0;
    absl::Duration waited;
  };
  Counters CountersOf(int priority);

 private:
  static int Clamp(int priority);
  // Whether a class better than `priority` has a collective running.
  bool BetterActiveLocked(int priority) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LinkSchedulerOptions options_;
  const std::function<absl::Time()> now_;
  absl::Mutex mu_;
  std::array<int, kNumClasses> active_ ABSL_GUARDED_BY(mu_){};
  std::array<absl::Time, kNumClasses> last_ended_ ABSL_GUARDED_BY(mu_);
  std::array<Counters, kNumClasses> counters_ ABSL_GUARDED_BY(mu_){};
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

// The smallest piece a group cuts a transfer into, in bytes: a smaller proposal (a peer
// host's bytes, not trusted) is raised to it, so that no host can make a transfer crawl.
inline constexpr size_t kMinPieceBytes = size_t{64} << 10;

// The piece size every host of a group uses for the transfers of the collective whose
// exchanged arguments are `piece_bytes` (each rank's host's proposal): the smallest
// positive one, at least kMinPieceBytes; 0 when no host proposed one (no cutting). Pure.
size_t AgreedPieceBytes(const std::vector<int64_t>& piece_bytes);

// The elements of each piece of a transfer of `count` elements of `element_size` bytes cut
// at `piece_bytes` (rounded down to whole elements, at least one); the last piece holds
// what is left. `count` (one piece) for piece_bytes 0 or a transfer no larger than a
// piece. Pure.
size_t ElementsPerPiece(size_t count, size_t element_size, size_t piece_bytes);

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_LINK_SCHEDULER_H_
