// The coordinator's key-value engine: torch.distributed TCPStore semantics, no gRPC.
//
// Semantics follow torch.distributed's Store/TCPStore (see "Distributed Key-Value Store" in
// https://pytorch.org/docs/stable/distributed.html, and torch/csrc/distributed/c10d/
// TCPStore.cpp):
//   - values are raw bytes;
//   - Add() keeps the counter as ASCII decimal text, so Get() of a counter returns e.g. "3";
//   - CompareSet() on a missing key with a non-empty `expected` stores nothing and returns
//     `expected` (torch's documented behaviour);
//   - Get()/Wait()/MultiGet() block until the keys exist or the timeout passes.
// Keys are opaque byte strings; namespacing (per job) is done by callers with a prefix,
// and NumKeys(prefix) counts one namespace.
//
// Thread safety: every method may be called concurrently from any thread.
#ifndef COLLSERVE_STORE_STORE_H_
#define COLLSERVE_STORE_STORE_H_

#include <cstdint>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace collserve::store {

// Most keys one request names (Check, Wait, MultiGet, MultiSet): torch 2.x's libuv TCPStore
// server's limit. More get INVALID_ARGUMENT naming it (each key costs the store a waiter's
// entry and time under its lock: 11 million keys of one Wait once held it 52 s).
inline constexpr int64_t kMaxKeysPerRequest = 128 * 1024;

// Most bytes of values one MultiGet returns: what one answer can carry (the coordinator
// sends messages of at most 256 MiB), less room for framing. The values are summed before
// any is copied, so a request naming one large key many times (a few bytes a name, the
// value's size each) is refused, RESOURCE_EXHAUSTED naming the limit, instead of building
// an answer of terabytes.
inline constexpr uint64_t kMaxMultiGetBytes = uint64_t{255} << 20;

// INVALID_ARGUMENT past kMaxKeysPerRequest (`what`: the request's name), else OK.
inline absl::Status CheckKeyCount(size_t keys, absl::string_view what) {
  if (keys <= static_cast<size_t>(kMaxKeysPerRequest)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " of ", keys, " keys: the limit is ", kMaxKeysPerRequest,
                                                 " keys per request"));
}

// The RESOURCE_EXHAUSTED of a MultiGet of `keys` keys whose values hold `bytes` bytes, over
// kMaxMultiGetBytes.
inline absl::Status MultiGetTooLarge(size_t keys, uint64_t bytes) {
  return absl::ResourceExhaustedError(absl::StrCat("multi_get of ", keys, " keys would return ", bytes,
                                                   " bytes of values, over the limit of one answer (",
                                                   kMaxMultiGetBytes, " bytes); ask for fewer keys at once"));
}

struct StoreOptions {
  // Largest key accepted, in bytes. Longer keys get INVALID_ARGUMENT.
  int64_t max_key_bytes = 4096;
  // Largest value accepted (after an Append, too), in bytes. Larger gets INVALID_ARGUMENT.
  int64_t max_value_bytes = 64 << 20;
  // Most keys held at once. A write that would create one more gets RESOURCE_EXHAUSTED.
  int64_t max_keys = 1 << 20;
  // Most bytes (keys plus values) held at once, all jobs together. A write that would
  // hold more gets RESOURCE_EXHAUSTED naming the limit; one that holds less never does.
  int64_t max_total_bytes = int64_t{1} << 30;
  // Per job, where a key's job is the part before its first '/' (the coordinator stores
  // job J's key k as "J/k"; a key without '/' is in job ""): most keys and most bytes
  // (keys plus values) one job holds. Same rules as max_keys and max_total_bytes.
  int64_t max_job_keys = int64_t{1} << 18;
  int64_t max_job_bytes = int64_t{256} << 20;
  // Directory for the write-ahead log and snapshots. Empty = memory only (nothing survives
  // a restart). When set, every mutation is appended to the log and fdatasync'ed before
  // the call returns, so an acknowledged write survives a crash of the process or machine.
  // Concurrent writes share fdatasyncs (group commit, memory_store.h).
  std::string data_dir;
  // Group commit, with data_dir. The writer that writes a batch (its leader) first waits up
  // to wal_commit_delay for more writes to join it (0: it does not wait; writes staged while
  // an fdatasync runs share the next one), unless wal_batch_bytes or more are staged.
  // Writers wait before staging while wal_max_staged_bytes or more are staged and not yet
  // being written, which bounds the memory the staged batch holds (at least one record is
  // always admitted).
  absl::Duration wal_commit_delay = absl::ZeroDuration();
  int64_t wal_batch_bytes = int64_t{1} << 20;
  int64_t wal_max_staged_bytes = int64_t{64} << 20;
  // With data_dir: open a log damaged anywhere but in a torn last record by moving the
  // damaged tail aside (Wal::Options::repair; its writes are lost). Default: refuse with
  // DATA_LOSS and leave the files as they are.
  bool wal_repair = false;
  // How many request ids of exactly-once writes (AddOnce etc.) are remembered, all jobs
  // together; the oldest is forgotten first. A retry is applied once as long as fewer
  // than this many other exactly-once writes landed in between. About 100 bytes each.
  int64_t max_request_ids = 1 << 16;
  // Where opening the log reports what it dropped or moved aside, one line each (default:
  // standard error).
  std::function<void(const std::string&)> log_warning;
};

// Identifies a pending WaitAsync() so it can be cancelled.
using WaitId = uint64_t;

class Store {
 public:
  // Called exactly once: OK when every key exists, DEADLINE_EXCEEDED (message lists the
  // keys still missing) when the deadline passes first, CANCELLED after CancelWait(), or
  // UNAVAILABLE when the store shuts down. It runs on the thread that set the last key,
  // on the store's timer thread, or inline in WaitAsync() if the keys already exist; it
  // must not block and must not call back into the store under its own locks.
  using WaitCallback = absl::AnyInvocable<void(absl::Status) &&>;

  virtual ~Store() = default;

  // Stores `value` under `key`, replacing any old value; wakes waiters on `key`.
  // INVALID_ARGUMENT: empty key, key or value over the limit. RESOURCE_EXHAUSTED: too many keys.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;

  // Returns the value of `key`, waiting up to `timeout` for it to be created.
  // timeout <= 0 means do not wait. DEADLINE_EXCEEDED if it still does not exist then.
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;

  // Adds `delta` to the integer stored under `key` (missing = 0) and returns the new value.
  // The value is stored as ASCII decimal. INVALID_ARGUMENT if the existing value is not an
  // integer, or on int64 overflow.
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;

  // torch's compare_set: if `key` is missing and `expected` is empty, stores `desired`;
  // if `key` exists and equals `expected`, stores `desired`. Returns the value of `key`
  // after the call, except that a missing key with non-empty `expected` returns `expected`
  // (and stores nothing).
  virtual absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                                 absl::string_view desired) = 0;

  // True if every key exists now. Never blocks. An empty list is true.
  virtual absl::StatusOr<bool> Check(const std::vector<std::string>& keys) = 0;

  // Blocks until every key exists. DEADLINE_EXCEEDED after `timeout`, naming missing keys.
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;

  // Deletes `key`. Returns true if it existed.
  virtual absl::StatusOr<bool> DeleteKey(absl::string_view key) = 0;

  // Number of keys that start with `prefix` ("" = all keys).
  virtual absl::StatusOr<int64_t> NumKeys(absl::string_view prefix) = 0;

  // Values of `keys`, in order, waiting up to `timeout` for all of them to exist.
  // RESOURCE_EXHAUSTED (MultiGetTooLarge) when they would hold more than kMaxMultiGetBytes.
  virtual absl::StatusOr<std::vector<std::string>> MultiGet(const std::vector<std::string>& keys,
                                                            absl::Duration timeout) = 0;

  // Sets keys[i] = values[i] for all i, atomically with respect to readers and waiters.
  // INVALID_ARGUMENT if the sizes differ.
  virtual absl::Status MultiSet(const std::vector<std::string>& keys,
                                const std::vector<std::string>& values) = 0;

  // Appends `value` to the value of `key` (creating it if missing); wakes waiters.
  virtual absl::Status Append(absl::string_view key, absl::string_view value) = 0;

  // Exactly-once forms of the four writes that are not idempotent, for clients that retry
  // a write whose answer they lost (a coordinator restart, a broken connection).
  // `request_id` names the write; "" = none (the plain form). When a write with the same
  // id was already applied and is still remembered, nothing is applied again and its
  // first answer is returned (for CompareSetOnce: `desired`; for DeleteKeyOnce: true). A
  // write that was not applied (an error, a compare that did not match, deleting a missing
  // key) is not remembered, so its retry is evaluated afresh. A durable store logs the id
  // in the same record as the write, so a restart remembers it. The default forwards to
  // the plain form (no deduplication). Remembered: the last StoreOptions::max_request_ids
  // ids of all jobs together. Thread-safe like the rest.
  virtual absl::StatusOr<int64_t> AddOnce(absl::string_view key, int64_t delta, absl::string_view request_id) {
    (void)request_id;
    return Add(key, delta);
  }
  virtual absl::StatusOr<std::string> CompareSetOnce(absl::string_view key, absl::string_view expected,
                                                     absl::string_view desired, absl::string_view request_id) {
    (void)request_id;
    return CompareSet(key, expected, desired);
  }
  virtual absl::Status AppendOnce(absl::string_view key, absl::string_view value, absl::string_view request_id) {
    (void)request_id;
    return Append(key, value);
  }
  virtual absl::StatusOr<bool> DeleteKeyOnce(absl::string_view key, absl::string_view request_id) {
    (void)request_id;
    return DeleteKey(key);
  }

  // Non-blocking wait: arranges for `done` to be called once (see WaitCallback). Holds no
  // thread while waiting. Returns an id for CancelWait().
  virtual WaitId WaitAsync(const std::vector<std::string>& keys, absl::Time deadline,
                           WaitCallback done) = 0;

  // Cancels a pending WaitAsync(): its callback runs with CANCELLED (inline, before this
  // returns) unless it already ran. Unknown or finished ids are ignored.
  virtual void CancelWait(WaitId id) = 0;

  // Whether reads (Get, MultiGet, Check) make network calls that can take seconds (the
  // etcd store): a WaitCallback must then not make them itself (it runs on a thread that
  // wakes every other waiter), but hand them to a thread of its own. Default: false.
  virtual bool ReadsMayBlock() const { return false; }

  // Up to `limit` keys that start with `prefix`, in byte order, each after `start_after`
  // ("" = from the first); `*more` is set when further keys match (ask again with the last
  // key returned as start_after). INVALID_ARGUMENT unless 1 <= limit <= kMaxListKeys.
  // Never waits. Default: UNIMPLEMENTED.
  static constexpr int64_t kMaxListKeys = 10000;
  virtual absl::StatusOr<std::vector<std::string>> ListKeys(absl::string_view prefix, absl::string_view start_after,
                                                            int64_t limit, bool* more) {
    return absl::UnimplementedError("this store cannot list its keys");
  }

  // What each job's namespace (the part of a key before its first '/') holds, by job.
  struct JobUsage {
    std::string job;
    int64_t keys = 0;
    int64_t bytes = 0;
  };
  virtual std::vector<JobUsage> ListJobs() { return {}; }

  // What the store holds now, for metrics (every job together).
  struct Stats {
    int64_t keys = 0;
    int64_t bytes = 0;          // keys plus values
    int64_t max_keys = 0;       // StoreOptions' limits; 0 = unknown
    int64_t max_bytes = 0;
    int64_t wal_bytes = -1;     // the write-ahead log's size; -1 = not durable
    int64_t wal_compactions = 0;  // snapshots written since the store opened
    int64_t wal_syncs = 0;        // fdatasyncs of the log since it opened (one per batch of writes)
    int64_t wal_writes = 0;       // writes those fdatasyncs made durable (>= wal_syncs: group commit)
    double wal_sync_seconds = 0;  // the time those fdatasyncs took
    double snapshot_unix_s = 0;   // when the snapshot in use was written (Unix seconds); 0 = none
    int64_t pending_waits = 0;  // waits registered and not yet finished
  };
  // A consistent snapshot of the above; never blocks on the disk. Default: all zero.
  virtual Stats GetStats() { return {}; }
};

// Creates the in-memory store (with its write-ahead log when options.data_dir is set,
// replaying the log first). INTERNAL / UNAVAILABLE when the data dir cannot be read or written;
// DATA_LOSS when the log is corrupt before its last record (a torn last record is dropped).
absl::StatusOr<std::unique_ptr<Store>> NewMemoryStore(const StoreOptions& options);

}  // namespace collserve::store

#endif  // COLLSERVE_STORE_STORE_H_
