// MemoryStore: the Store held in process memory, optionally made durable by a write-ahead
// log (store/wal.h) when StoreOptions::data_dir is set.
//
// Thread safety: every method may be called concurrently from any thread. One mutex guards
// the map and the waiters; it is never held across a disk write or fdatasync, except
// during a log compaction (after 64 MiB of log), which stalls the store while it writes
// the snapshot (at most half the log's size).
//
// Group commit (with a data_dir), as in PostgreSQL's WAL writer and its commit_delay: a
// write computes its result under the mutex against the latest state (the committed map
// plus the writes staged before it), appends its record to the staged batch and waits. A
// waiting writer that finds no batch being written becomes the leader (leader/follower, so
// a lone write costs no thread hand-off): it writes the staged batch and fdatasync()s it
// outside the mutex, then applies its records to the committed map, wakes the store's
// waiters and acknowledges the batch's writers. Concurrent writes therefore share one fdatasync; a write is
// acknowledged only after the fdatasync that covers it. Reads (Get, Check, MultiGet,
// NumKeys, ListKeys, waits) see only the committed map: they never wait on the disk and
// never see a write that a crash could still lose. Writes to different keys need not be
// ordered by their callers, but the log's order is the order writes took the mutex, so
// replay gives the state the writers computed. If a batch cannot be written, every write
// staged up to then fails (none is applied) and the store goes on from the committed map.
#ifndef COLLSERVE_STORE_MEMORY_STORE_H_
#define COLLSERVE_STORE_MEMORY_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "store/store.h"
#include "store/wal.h"

namespace collserve::store {

// Knobs that production leaves at their defaults; tests lower them.
struct MemoryStoreTestOptions {
  // Compact the log into a snapshot once it exceeds this many bytes (and twice the live
  // data). Default: Wal::kDefaultCompactBytes (64 MiB).
  int64_t wal_compact_bytes = Wal::kDefaultCompactBytes;
};

// An ordered map of byte strings plus a registry of pending waits. Waits hold no thread:
// WaitAsync() callbacks run on the thread whose write created the last missing key, on the
// store's one timer thread (deadlines), inline in WaitAsync()/CancelWait(), or in the
// destructor (UNAVAILABLE). Callbacks always run with no store lock held, so they may call
// back into the store.
//
// Waiting counts creations, like torch's TCPStore: a wait on {a, b} completes once a and b
// have each been written since the wait began (or existed then), even if a was deleted
// again in between. Get()/MultiGet() re-check and keep waiting in that case.
//
// Beyond store.h: every key argument (including for Get/Check/Wait/WaitAsync) must be
// non-empty and within max_key_bytes, or the call fails with INVALID_ARGUMENT (for
// WaitAsync, the callback runs inline with it). With a data_dir, a mutation whose log
// append fails returns UNAVAILABLE and is not applied.
class MemoryStore final : public Store {
 public:
  // Opens a store; NewMemoryStore() is Open(options). INVALID_ARGUMENT if max_key_bytes or
  // max_keys is not positive or max_value_bytes is negative. With options.data_dir, replays
  // the log first: UNAVAILABLE (I/O, or the dir is held by another open store) or DATA_LOSS
  // as in store.h. `test_options` exists for tests only.
  static absl::StatusOr<std::unique_ptr<MemoryStore>> Open(
      const StoreOptions& options, const MemoryStoreTestOptions& test_options = {});

  // Stops the timer thread, then runs every pending wait's callback with UNAVAILABLE (on
  // the destroying thread). REQUIRES: no other thread is using the store.
  ~MemoryStore() override;

  MemoryStore(const MemoryStore&) = delete;
  MemoryStore& operator=(const MemoryStore&) = delete;

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;
  absl::StatusOr<bool> DeleteKey(absl::string_view key) override;
  absl::StatusOr<int64_t> NumKeys(absl::string_view prefix) override;
  absl::StatusOr<std::vector<std::string>> MultiGet(const std::vector<std::string>& keys,
                                                    absl::Duration timeout) override;
  absl::Status MultiSet(const std::vector<std::string>& keys,
                        const std::vector<std::string>& values) override;
  absl::Status Append(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<int64_t> AddOnce(absl::string_view key, int64_t delta, absl::string_view request_id) override;
  absl::StatusOr<std::string> CompareSetOnce(absl::string_view key, absl::string_view expected,
                                             absl::string_view desired, absl::string_view request_id) override;
  absl::Status AppendOnce(absl::string_view key, absl::string_view value, absl::string_view request_id) override;
  absl::StatusOr<bool> DeleteKeyOnce(absl::string_view key, absl::string_view request_id) override;
  WaitId WaitAsync(const std::vector<std::string>& keys, absl::Time deadline,
                   WaitCallback done) override;
  void CancelWait(WaitId id) override;
  absl::StatusOr<std::vector<std::string>> ListKeys(absl::string_view prefix, absl::string_view start_after,
                                                    int64_t limit, bool* more) override ABSL_LOCKS_EXCLUDED(mu_);
  Stats GetStats() override ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<Store::JobUsage> ListJobs() override ABSL_LOCKS_EXCLUDED(mu_);

  // Test hooks.
  // Waits registered and not yet finished.
  int64_t TEST_PendingWaits() ABSL_LOCKS_EXCLUDED(mu_);
  // Size of the log file (0 without a data_dir).
  int64_t TEST_WalBytes() ABSL_LOCKS_EXCLUDED(mu_);
  // Compactions completed since Open() (0 without a data_dir).
  int64_t TEST_WalCompactions() ABSL_LOCKS_EXCLUDED(mu_);
  // Writes staged in the batch the next commit takes (not yet taken for writing; 0 without
  // a data_dir), for tests that order writes into one batch.
  int64_t TEST_StagedWrites() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Waiter {
    std::vector<std::string> keys;  // distinct, in request order (for the timeout message)
    std::set<std::string> missing;
    absl::Time start;
    absl::Time deadline;
    WaitCallback done;
  };
  // A callback taken out of the registry, to be run once the mutex is released.
  using Ready = std::vector<std::pair<WaitCallback, absl::Status>>;

  MemoryStore(const StoreOptions& options, std::unique_ptr<Wal> wal, KeyValueMap data, RequestLog requests);

  // Registers a wait for `keys`; `start` only feeds the timeout message.
  WaitId Register(const std::vector<std::string>& keys, absl::Time start, absl::Time deadline,
                  WaitCallback done) ABSL_LOCKS_EXCLUDED(mu_);
  // WaitAsync() plus blocking until the callback ran; returns its status.
  absl::Status BlockingWait(const std::vector<std::string>& keys, absl::Time start,
                            absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  void TimerLoop() ABSL_LOCKS_EXCLUDED(mu_);
  static void RunReady(Ready& ready);

  // One write's record from staging until the fdatasync that covers it (durable stores).
  struct OwnedOp {
    WalOp::Type type;
    std::string key;
    std::string value;
  };
  struct Record {
    std::vector<OwnedOp> ops;
    bool done = false;     // its batch was written (status OK) or failed (status says why)
    absl::Status status;
  };
  // A key's latest value among the staged writes (nullopt: deleted) and the write's record.
  struct Staged {
    std::optional<std::string> value;
    std::shared_ptr<Record> record;
  };

  // Writes `ops`, the writer's whole mutation (its kRequest op included). Checks the
  // quotas against the latest state and updates the latest state's accounting. Memory-only:
  // applies them to data_ and moves the callbacks of the waits they complete into `*ready`.
  // Durable: stages one record and waits (releasing mu_) for the fdatasync that covers it;
  // its waits are woken by the batch's leader. Nothing is applied if it fails.
  absl::Status WriteLocked(const std::vector<WalOp>& ops, Ready* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Durable stores: waits (releasing mu_) while the staged batch holds
  // wal_max_staged_bytes or more. Call before reading the state a write is computed from.
  void AwaitRoomLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (releasing mu_) until `record`'s batch was written; its status. OK for null.
  absl::Status AwaitLocked(const std::shared_ptr<Record>& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The latest value of `key`, staged writes included (null: absent); `*record` (if not
  // null) is set to the staged write that gave it, or null when it is committed. The
  // pointer is valid until mu_ is released.
  const std::string* LatestLocked(absl::string_view key, std::shared_ptr<Record>* record = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies a written op to data_ (committed) and request ids; wakes waits into `*ready`.
  void ApplyCommittedLocked(WalOp::Type type, const std::string& key, const std::string& value, Ready* ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes and fdatasyncs the staged batch (after wal_commit_delay), with mu_ released
  // meanwhile, then applies it to data_ (or fails it) and runs the waits it completed (mu_
  // released again). Run by one writer at a time (syncing_), the leader.
  void CommitBatchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails `batch` and every write staged since with `status`, drops the staged state and
  // recounts the accounting from data_.
  void FailStagedLocked(const std::vector<std::shared_ptr<Record>>& batch, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Recomputes live_bytes_, jobs_ and latest_keys_ from data_.
  void RecountLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED if applying `ops` would raise the bytes held, or a job's keys or
  // bytes, past max_total_bytes, max_job_keys or max_job_bytes (a write that lowers them
  // always passes).
  absl::Status CheckQuotasLocked(const std::vector<WalOp>& ops) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED if creating `new_keys` more keys would pass max_keys.
  absl::Status CheckRoomLocked(int64_t new_keys, absl::string_view key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `key` as created for its waiters; completed ones go to `*ready`.
  void WakeLocked(const std::string& key, Ready* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes waiter `id` from every index and returns its callback.
  WaitCallback RemoveWaiterLocked(WaitId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status ValidateKey(absl::string_view key) const;
  absl::Status ValidateKeys(const std::vector<std::string>& keys) const;
  absl::Status ValidateValue(absl::string_view key, size_t value_bytes) const;

  const StoreOptions options_;

  absl::Mutex mu_;
  absl::CondVar timer_cv_;  // signalled when the earliest deadline moves or on shutdown
  KeyValueMap data_ ABSL_GUARDED_BY(mu_);
  int64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;    // sum of key and value sizes in data_
  // What each job (the part of a key before its first '/') holds.
  struct JobUsage {
    int64_t keys = 0;
    int64_t bytes = 0;
  };
  std::unordered_map<std::string, JobUsage> jobs_ ABSL_GUARDED_BY(mu_);
  // Records that `key` (of `bytes` key plus value bytes) was added (+1) or removed (-1).
  void CountLocked(absl::string_view key, int64_t bytes, int sign) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Null when memory-only. After Open only the leader (syncing_) uses it, partly with mu_
  // released; what it counts is copied to wal_counters_ under mu_ after each batch.
  std::unique_ptr<Wal> wal_;
  bool syncing_ ABSL_GUARDED_BY(mu_) = false;  // a leader is writing a batch
  struct WalCounters {
    int64_t log_bytes = 0;
    int64_t compactions = 0;
    int64_t syncs = 0;
    int64_t records = 0;
    absl::Duration sync_time;
    absl::Time last_snapshot = absl::InfinitePast();
  };
  WalCounters wal_counters_ ABSL_GUARDED_BY(mu_);
  // Latest state beyond data_: staged (not yet durable) writes by key, and their request ids.
  std::map<std::string, Staged, std::less<>> staged_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<std::string, std::pair<std::string, std::shared_ptr<Record>>> staged_requests_
      ABSL_GUARDED_BY(mu_);
  int64_t latest_keys_ ABSL_GUARDED_BY(mu_) = 0;  // keys in the latest state
  // The batch the next leader writes: its records, encoded, and their owners.
  std::string batch_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Record>> batch_records_ ABSL_GUARDED_BY(mu_);
  absl::CondVar commit_cv_;   // the leader, waiting out wal_commit_delay: a record was staged
  absl::CondVar durable_cv_;  // writers: a batch was taken or written
  // Exactly-once writes: the answers of the last options_.max_request_ids request ids,
  // oldest first, and an index into them (views of the ids held by requests_; a deque
  // keeps its elements in place on push_back and pop_front).
  RequestLog requests_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<std::string_view, const std::string*> request_index_ ABSL_GUARDED_BY(mu_);
  // The remembered answer of `request_id`, staged ones included, or null ("" is never
  // remembered); `*record` as for LatestLocked.
  const std::string* FindRequestLocked(absl::string_view request_id,
                                       std::shared_ptr<Record>* record = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remembers `answer` for `request_id`, forgetting the oldest beyond max_request_ids.
  void RememberRequestLocked(absl::string_view request_id, absl::string_view answer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  WaitId next_wait_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::unordered_map<WaitId, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<std::string, std::set<WaitId>> waiters_by_key_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<absl::Time, WaitId>> deadlines_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  std::thread timer_thread_;  // runs TimerLoop(); started last in the constructor
};

}  // namespace collserve::store

#endif  // COLLSERVE_STORE_MEMORY_STORE_H_
