// Write-ahead log and snapshot files that make a MemoryStore survive restarts.
//
// The log records each mutation as its resulting state (PUT key=value, or DELETE key), so
// replay needs no arithmetic and replaying a record twice is harmless. Not thread-safe: the
// owner serialises every call (MemoryStore calls it under its mutex, so log order = apply
// order).
#ifndef COLLSERVE_STORE_WAL_H_
#define COLLSERVE_STORE_WAL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace collserve::store {

// On-disk format (little-endian). Part of the persistent format: never renumber the op
// types or change the framing without a version bump.
//
//   file    := record*
//   record  := fixed32 length | fixed32 crc | payload[length]
//   crc     := CRC-32 (zlib, IEEE polynomial) of the 4 length bytes followed by the payload
//   payload := op+                       (all ops of one record are applied together)
//   op      := uint8 type | varint64 key_len | key | (type != kDelete: varint64 value_len | value)
//
// Files, inside the data directory:
//   wal       the log, appended to; started afresh after each compaction
//   wal.committed  fixed64 length | fixed32 CRC-32 of those 8 bytes: how many bytes of
//             `wal` were acknowledged. Written after each fdatasync of the log and not
//             synced itself (one pwrite; the page cache keeps it through a crash of the
//             process; after a power loss it can only be behind the log, by what was
//             acknowledged since the kernel last wrote it back, dirty_expire: ~30 s), set
//             to 0 and synced before a compaction empties the log. So it is a lower bound on
//             what was acknowledged: damage below it is lost data. Absent for a log of an
//             older build, which Open then checks as before (the log alone decides).
//   snapshot  full state (one PUT per key); replaced atomically (write snapshot.tmp, fsync,
//             rename, fsync the directory)
// The store's contents: key -> value, ordered, with heterogeneous lookup by string_view.
using KeyValueMap = std::map<std::string, std::string, std::less<>>;

struct WalOp {
  // kRequest (since issue 17) records that the write in the same record answered the
  // idempotent request `key` (a request id) with `value`; it changes no key. A log with
  // kRequest records cannot be opened by a binary older than that.
  enum Type : uint8_t { kPut = 1, kDelete = 2, kRequest = 3 };
  Type type;
  absl::string_view key;
  absl::string_view value;  // kPut and kRequest only
};

// Answers of recent idempotent writes, (request id, answer), oldest first.
using RequestLog = std::deque<std::pair<std::string, std::string>>;

class Wal {
 public:
  // Compaction threshold used unless a test overrides it: 64 MiB of log.
  static constexpr int64_t kDefaultCompactBytes = int64_t{64} << 20;

  struct Options {
    // Directory holding `wal` and `snapshot`; created (one level, mode 0755) if missing.
    std::string dir;
    // The log is compacted into a snapshot once it is larger than this many bytes AND more
    // than twice the live data. Default: kDefaultCompactBytes. Tests lower it.
    int64_t compact_bytes = kDefaultCompactBytes;
    // Open a log with damage (a bad record that is not a torn tail, or a log shorter than
    // wal.committed) by moving each damaged range, from the bad record up to the next
    // well-formed one, to "wal.damaged-<offset>" in `dir`, replaying on from that record,
    // and then writing what was recovered as a snapshot with an empty log: the writes in
    // the damaged bytes are lost, knowingly. Default: refuse (DATA_LOSS), change nothing.
    bool repair = false;
    // Where Open reports what it dropped or moved aside (a torn tail, a repair), one line
    // each. Default (empty): standard error. Called on the thread that calls Open.
    std::function<void(const std::string&)> warn;
  };

  // Opens the log in `options.dir`, replaying the snapshot and then the log into `*state`
  // (which must be empty). Holds an flock on the log until destroyed, so a second Wal on
  // the same directory fails.
  //
  // Only a torn tail is dropped: a bad record at or after wal.committed's length after
  // which no well-formed record starts anywhere (a crash mid-append leaves a prefix of one
  // record, never a record after it; the preallocated zeros and damage to them count too).
  // It is cut off the file and reported through options.warn with its offset and size
  // (not when it is all zeros). Without wal.committed (an older build's log) a torn tail
  // must also reach the end of the file or be followed by zeros only, as before. Any other
  // bad record, and a log shorter than wal.committed, is DATA_LOSS naming the offset and the
  // acknowledged length, and the files are left untouched, unless options.repair moves the
  // damage aside (above). Any bad record in the snapshot is DATA_LOSS, repair or not.
  // UNAVAILABLE: a file or the directory cannot be created, read, written or locked;
  // RESOURCE_EXHAUSTED: the disk or quota is full.
  // The kRequest records found are appended to `*requests` (oldest first) when it is not
  // null; the caller bounds what it keeps.
  static absl::StatusOr<std::unique_ptr<Wal>> Open(const Options& options, KeyValueMap* state,
                                                   RequestLog* requests = nullptr);

  ~Wal();
  Wal(const Wal&) = delete;
  Wal& operator=(const Wal&) = delete;

  // Appends `ops` as one record and fdatasync()s the log before returning, so the caller
  // may acknowledge the mutation once this returns OK. A failed write is cut back off the
  // file and leaves the log usable; after a failed fdatasync() the log refuses every later
  // append (the kernel may have dropped the dirty pages), so the store stops accepting
  // writes until restarted. RESOURCE_EXHAUSTED when the disk or quota is full (ENOSPC,
  // EDQUOT), UNAVAILABLE on other I/O errors; INVALID_ARGUMENT if the record would exceed
  // 4 GiB. Blocks on the disk.
  absl::Status Append(const std::vector<WalOp>& ops);

  // Group commit in two steps. EncodeOps appends `ops` to `*payload` (a record's payload,
  // the format above); never touches the files; any thread, no state. WriteAndSync writes
  // `payload` (the ops of `count` writes, from EncodeOps) to the log as ONE record and makes
  // it durable with one fdatasync(): a crash leaves all of a batch's writes or none (a torn
  // batch is one torn record, dropped at Open), never a batch with a hole. Errors and what
  // they leave behind as for Append(): INVALID_ARGUMENT over 4 GiB, a failed write is cut
  // off again, a failed fdatasync() breaks the log. Blocks on the disk.
  static void EncodeOps(const std::vector<WalOp>& ops, std::string* payload);
  absl::Status WriteAndSync(absl::string_view payload, int64_t count);

  // Compacts when the log is over compact_bytes and over twice `live_bytes` (the sum of key
  // and value sizes in `state`): writes `state`, then `requests` as kRequest records, as the
  // new snapshot and starts an empty log.
  // Returns OK without doing anything otherwise. After a failed compaction the old files
  // stay valid, and the next attempt waits until the log has grown by compact_bytes again.
  absl::Status MaybeCompact(const KeyValueMap& state, int64_t live_bytes, const RequestLog& requests = {});

  // Bytes of records in the log (the file may be longer: zeros preallocated for appends).
  int64_t log_bytes() const { return log_bytes_; }
  // Number of compactions completed since Open().
  int64_t compactions() const { return compactions_; }
  // fdatasync()s of the log (one per Append or WriteAndSync), the writes they made durable
  // (WriteAndSync's counts), and the time they took.
  int64_t syncs() const { return syncs_; }
  int64_t records() const { return records_; }
  // When the snapshot in use was written (InfinitePast: there is none yet).
  absl::Time last_snapshot() const { return last_snapshot_; }
  absl::Duration sync_time() const { return sync_time_; }

 private:
  Wal(Options options, int log_fd, int64_t log_bytes);

  absl::Status Compact(const KeyValueMap& state, const RequestLog& requests);
  // Extends the log file with zero bytes up to `bytes` (allocated_bytes_ follows); on any
  // failure leaves it as it was.
  void Preallocate(int64_t bytes);

  // Writes log_bytes_ to wal.committed (fdatasync'd when `sync`).
  absl::Status WriteCommitted(bool sync);

  const Options options_;
  int log_fd_;
  int committed_fd_ = -1;  // wal.committed
  int64_t log_bytes_;        // end of the last record
  int64_t allocated_bytes_ = 0;  // the file's size: log_bytes_ plus preallocated zeros
  // Do not try to compact again before the log reaches this size (set after a failure).
  int64_t next_compact_attempt_bytes_ = 0;
  int64_t compactions_ = 0;
  int64_t syncs_ = 0;
  int64_t records_ = 0;
  absl::Duration sync_time_;
  absl::Time last_snapshot_ = absl::InfinitePast();
  // Set after a failed fdatasync(); every later Append() fails with it.
  absl::Status broken_;
};

}  // namespace collserve::store

#endif  // COLLSERVE_STORE_WAL_H_
