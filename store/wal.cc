// Write-ahead log and snapshot files; format and policy in wal.h.
#include "store/wal.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/errno_text.h"
#include "common/status_macros.h"

namespace collserve::store {
namespace {

constexpr char kLogName[] = "wal";
constexpr char kSnapshotName[] = "snapshot";
constexpr char kSnapshotTempName[] = "snapshot.tmp";
constexpr char kCommittedName[] = "wal.committed";
// wal.committed: fixed64 length | fixed32 CRC-32 of those 8 bytes.
constexpr size_t kCommittedBytes = 12;
constexpr size_t kHeaderBytes = 8;
// Snapshot writes are buffered up to this size before each write().
constexpr size_t kSnapshotBufferBytes = 1 << 20;
// The log is extended with zero bytes up to this much beyond the records that need room, so
// that most appends overwrite allocated blocks: their fdatasync then flushes data only,
// not the file's size (a journal commit on ext4): 100 against 150 us per fdatasync
// measured on this project's VMs. PostgreSQL pre-zeroes its WAL segments for the same
// reason. A crash leaves the zeros after the last record, which Open() drops (a zero tail
// is never a record).
constexpr int64_t kPreallocateBytes = int64_t{4} << 20;

// UNAVAILABLE, except a full disk or quota: RESOURCE_EXHAUSTED (the store is out of room,
// not unreachable; clients must not retry it as a network error).
absl::Status IoError(absl::string_view what, absl::string_view path, int err) {
  std::string message = absl::StrCat(what, " ", path, ": ", ErrnoText(err));
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(std::move(message));
  return absl::UnavailableError(std::move(message));
}

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (!dir.empty() && dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

void PutFixed32(std::string* out, uint32_t v) {
  char buf[4];
  for (int i = 0; i < 4; ++i) buf[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(buf, 4);
}

uint32_t GetFixed32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  }
  return v;
}

void PutVarint64(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

bool GetVarint64(absl::string_view* in, uint64_t* v) {
  uint64_t result = 0;
  for (int shift = 0; shift <= 63 && !in->empty(); shift += 7) {
    const uint64_t byte = static_cast<unsigned char>(in->front());
    in->remove_prefix(1);
    result |= (byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) {
      *v = result;
      return true;
    }
  }
  return false;
}

bool GetLengthPrefixed(absl::string_view* in, absl::string_view* out) {
  uint64_t len = 0;
  if (!GetVarint64(in, &len) || len > in->size()) return false;
  *out = in->substr(0, len);
  in->remove_prefix(len);
  return true;
}

uint32_t RecordCrc(const char* length_bytes, absl::string_view payload) {
  uLong crc = crc32(0L, Z_NULL, 0);
  crc = crc32(crc, reinterpret_cast<const Bytef*>(length_bytes), 4);
  // zlib takes a uInt length; feed large payloads in pieces.
  while (!payload.empty()) {
    const size_t n = std::min<size_t>(payload.size(), std::numeric_limits<uInt>::max());
    crc = crc32(crc, reinterpret_cast<const Bytef*>(payload.data()), static_cast<uInt>(n));
    payload.remove_prefix(n);
  }
  return static_cast<uint32_t>(crc);
}

void AppendOp(std::string* payload, const WalOp& op) {
  payload->push_back(static_cast<char>(op.type));
  PutVarint64(payload, op.key.size());
  payload->append(op.key.data(), op.key.size());
  if (op.type != WalOp::kDelete) {
    PutVarint64(payload, op.value.size());
    payload->append(op.value.data(), op.value.size());
  }
}

// Frames `payload` (which starts kHeaderBytes into `*record`) in place.
absl::Status FinishRecord(std::string* record) {
  const size_t payload_bytes = record->size() - kHeaderBytes;
  if (payload_bytes > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("wal record of ", payload_bytes, " bytes exceeds the 4 GiB record limit"));
  }
  std::string length;
  PutFixed32(&length, static_cast<uint32_t>(payload_bytes));
  std::string crc;
  PutFixed32(&crc, RecordCrc(length.data(), absl::string_view(*record).substr(kHeaderBytes)));
  record->replace(0, 4, length);
  record->replace(4, 4, crc);
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, absl::string_view data, absl::string_view path) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("cannot write", path, errno);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// pwrite()s all of `data` at `offset`.
absl::Status WriteAllAt(int fd, absl::string_view data, int64_t offset, absl::string_view path) {
  while (!data.empty()) {
    const ssize_t n = ::pwrite(fd, data.data(), data.size(), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("cannot write", path, errno);
    }
    data.remove_prefix(static_cast<size_t>(n));
    offset += n;
  }
  return absl::OkStatus();
}

// Reads the whole file at `fd` from offset 0.
absl::Status ReadAll(int fd, absl::string_view path, std::string* out) {
  out->clear();
  char buf[1 << 16];
  off_t offset = 0;
  for (;;) {
    const ssize_t n = ::pread(fd, buf, sizeof(buf), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("cannot read", path, errno);
    }
    if (n == 0) return absl::OkStatus();
    out->append(buf, static_cast<size_t>(n));
    offset += n;
  }
}

absl::Status SyncDir(absl::string_view dir) {
  const std::string path(dir);
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError("cannot open directory", path, errno);
  absl::Status status;
  if (::fsync(fd) != 0) status = IoError("cannot fsync directory", path, errno);
  ::close(fd);
  return status;
}

void Warn(const Wal::Options& options, const std::string& message) {
  if (options.warn) {
    options.warn(message);
  } else {
    std::fprintf(stderr, "collserve wal: %s\n", message.c_str());
  }
}

bool AllZero(absl::string_view data) {
  for (char c : data) {
    if (c != '\0') return false;
  }
  return true;
}

// Decodes a payload into ops (views into `payload`). False if malformed.
bool DecodePayload(absl::string_view payload, std::vector<WalOp>* ops) {
  ops->clear();
  if (payload.empty()) return false;
  while (!payload.empty()) {
    WalOp op;
    const uint8_t type = static_cast<uint8_t>(payload.front());
    payload.remove_prefix(1);
    if (type != WalOp::kPut && type != WalOp::kDelete && type != WalOp::kRequest) return false;
    op.type = static_cast<WalOp::Type>(type);
    if (!GetLengthPrefixed(&payload, &op.key)) return false;
    if (op.type != WalOp::kDelete && !GetLengthPrefixed(&payload, &op.value)) return false;
    ops->push_back(op);
  }
  return true;
}

// CRC bytes ValidRecordAfter may check before it gives up and answers "maybe".
constexpr size_t kResyncBudgetBytes = size_t{64} << 20;
// NextValidRecord's answers besides an offset.
constexpr size_t kNoRecord = std::numeric_limits<size_t>::max();
constexpr size_t kMaybeRecord = kNoRecord - 1;

// The offset of the first well-formed record (header, checksum and payload) that starts
// after `pos`, kNoRecord if there is none, or kMaybeRecord once it has checksummed `budget`
// bytes without an answer.
size_t NextValidRecord(absl::string_view data, size_t pos, size_t budget) {
  std::vector<WalOp> ops;
  for (size_t q = pos + 1; q + kHeaderBytes <= data.size(); ++q) {
    const uint32_t length = GetFixed32(data.data() + q);
    if (length == 0 || length > data.size() - q - kHeaderBytes) continue;
    if (length > budget) return kMaybeRecord;
    budget -= length;
    const absl::string_view payload = data.substr(q + kHeaderBytes, length);
    if (RecordCrc(data.data() + q, payload) == GetFixed32(data.data() + q + 4) && DecodePayload(payload, &ops)) {
      return q;
    }
  }
  return kNoRecord;
}

// Whether a well-formed record starts anywhere after `pos` ("maybe" counts as yes). A torn
// append leaves only a prefix of the last record, so none can follow it; one that does
// means the bad record at `pos` was damaged in place (say a flipped bit in its length
// field), and dropping everything after it would lose acknowledged writes.
bool ValidRecordAfter(absl::string_view data, size_t pos) {
  return NextValidRecord(data, pos, kResyncBudgetBytes) != kNoRecord;
}

std::string EncodeCommitted(uint64_t length) {
  std::string out;
  PutFixed32(&out, static_cast<uint32_t>(length));
  PutFixed32(&out, static_cast<uint32_t>(length >> 32));
  PutFixed32(&out, static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(out.data()), 8)));
  return out;
}

// Where replay stopped at a bad record.
struct BadRecord {
  size_t offset = 0;
  std::string reason;
  bool torn_tail = false;  // the last append, torn by a crash: nothing follows it
};

// Replays the records in `data` into `*state` and sets `*valid_bytes` to the end of the
// last good one. A bad record is reported in `*bad` (OK is returned); it is a torn tail when
// it reaches (or runs past) the end of the file or of the bytes before a zero tail (the
// preallocated space an append writes into), or is followed only by zero bytes, and no
// well-formed record follows it. A record whose checksum matches but whose payload does not
// decode is DATA_LOSS at once.
absl::Status Replay(absl::string_view data, absl::string_view path, KeyValueMap* state, RequestLog* requests,
                    size_t* valid_bytes, std::optional<BadRecord>* bad, size_t start = 0) {
  std::vector<WalOp> ops;
  size_t pos = start;
  while (pos < data.size()) {
    const size_t left = data.size() - pos;
    const char* reason = nullptr;
    bool reaches_end = false;
    uint32_t length = 0;
    if (left < kHeaderBytes) {
      reason = "short record header";
      reaches_end = true;
    } else {
      length = GetFixed32(data.data() + pos);
      const uint32_t crc = GetFixed32(data.data() + pos + 4);
      if (length > left - kHeaderBytes) {
        reason = "record runs past the end of the file";
        reaches_end = true;
      } else {
        // Only zeros after it count as the end: the log's preallocated space (kPreallocateBytes).
        reaches_end = AllZero(data.substr(pos + kHeaderBytes + length));
        const absl::string_view payload = data.substr(pos + kHeaderBytes, length);
        if (RecordCrc(data.data() + pos, payload) != crc) {
          reason = "checksum mismatch";
        } else if (!DecodePayload(payload, &ops)) {
          // The checksum matched, so this is not a torn write: never tolerated.
          return absl::DataLossError(
              absl::StrCat("malformed record at offset ", pos, " of ", path));
        }
      }
    }
    if (reason != nullptr) {
      *valid_bytes = pos;
      BadRecord b;
      b.offset = pos;
      b.reason = reason;
      b.torn_tail = (reaches_end || AllZero(data.substr(pos))) && !ValidRecordAfter(data, pos);
      *bad = std::move(b);
      return absl::OkStatus();
    }
    for (const WalOp& op : ops) {
      if (op.type == WalOp::kPut) {
        (*state)[std::string(op.key)] = std::string(op.value);
      } else if (op.type == WalOp::kDelete) {
        state->erase(std::string(op.key));
      } else if (requests != nullptr) {
        requests->emplace_back(op.key, op.value);
      }
    }
    pos += kHeaderBytes + length;
  }
  *valid_bytes = pos;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Wal>> Wal::Open(const Options& options, KeyValueMap* state, RequestLog* requests) {
  if (options.dir.empty()) return absl::InvalidArgumentError("wal directory is empty");
  if (options.compact_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("wal compact_bytes is ", options.compact_bytes, "; it must be positive"));
  }
  if (::mkdir(options.dir.c_str(), 0755) == 0) {
    // Make the new directory's own entry durable.
    const size_t slash = options.dir.find_last_of('/', options.dir.size() - 2);
    const std::string parent = slash == std::string::npos ? "." : options.dir.substr(0, slash + 1);
    COLLSERVE_RETURN_IF_ERROR(SyncDir(parent));
  } else if (errno != EEXIST) {
    return IoError("cannot create data directory", options.dir, errno);
  }
  const std::string log_path = JoinPath(options.dir, kLogName);
  // Not O_APPEND: records are written at log_bytes_ with pwrite, into preallocated zeros.
  const int log_fd = ::open(log_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (log_fd < 0) return IoError("cannot open", log_path, errno);
  // From here on the Wal owns log_fd and closes it on every return path.
  std::unique_ptr<Wal> wal(new Wal(options, log_fd, 0));
  // Two stores on one directory would interleave records and remove each other's
  // snapshot.tmp; the lock is released when the fd is closed.
  if (::flock(log_fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::UnavailableError(
          absl::StrCat("data directory ", options.dir, " is in use by another store"));
    }
    return IoError("cannot lock", log_path, errno);
  }

  // A leftover from a compaction that crashed before its rename: never part of the state.
  const std::string temp_path = JoinPath(options.dir, kSnapshotTempName);
  if (::unlink(temp_path.c_str()) != 0 && errno != ENOENT) {
    return IoError("cannot remove stale", temp_path, errno);
  }

  // Snapshot first: it was written whole and renamed into place, so any damage is real loss.
  const std::string snapshot_path = JoinPath(options.dir, kSnapshotName);
  const int snapshot_fd = ::open(snapshot_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (snapshot_fd >= 0) {
    struct stat st {};
    if (::fstat(snapshot_fd, &st) == 0) wal->last_snapshot_ = absl::FromTimeT(st.st_mtime);
    std::string data;
    absl::Status status = ReadAll(snapshot_fd, snapshot_path, &data);
    ::close(snapshot_fd);
    COLLSERVE_RETURN_IF_ERROR(status);
    size_t valid = 0;
    std::optional<BadRecord> bad;
    COLLSERVE_RETURN_IF_ERROR(Replay(data, snapshot_path, state, requests, &valid, &bad));
    if (bad.has_value()) {
      // Written whole and renamed into place: any damage is real loss, repair or not.
      return absl::DataLossError(absl::StrCat(bad->reason, " at offset ", bad->offset, " of ", snapshot_path, " (",
                                              data.size(), " bytes); the snapshot cannot be repaired"));
    }
  } else if (errno != ENOENT) {
    return IoError("cannot open", snapshot_path, errno);
  }

  std::string data;
  COLLSERVE_RETURN_IF_ERROR(ReadAll(log_fd, log_path, &data));
  // How much of the log was acknowledged (wal.committed, written after each fdatasync):
  // damage before it is lost data, never a torn tail. Absent (a log of an older build, or a
  // new one): the log alone decides, as before.
  const std::string committed_path = JoinPath(options.dir, kCommittedName);
  size_t committed = 0;
  bool have_committed = false;
  {
    const int fd = ::open(committed_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 && errno != ENOENT) return IoError("cannot open", committed_path, errno);
    if (fd >= 0) {
      std::string bytes;
      absl::Status read = ReadAll(fd, committed_path, &bytes);
      ::close(fd);
      COLLSERVE_RETURN_IF_ERROR(read);
      const uint64_t length =
          bytes.size() == kCommittedBytes
              ? GetFixed32(bytes.data()) | (static_cast<uint64_t>(GetFixed32(bytes.data() + 4)) << 32)
              : 0;
      if (bytes.size() == kCommittedBytes && EncodeCommitted(length) == bytes) {
        committed = static_cast<size_t>(std::min<uint64_t>(length, std::numeric_limits<size_t>::max()));
        have_committed = true;
      } else if (!bytes.empty()) {
        Warn(options, absl::StrCat(committed_path, " is damaged (", bytes.size(),
                                   " bytes): checking the log without the length of its acknowledged writes"));
      }
    }
  }
  const auto where = [&](size_t offset) { return absl::StrCat(" at offset ", offset, " of ", log_path); };
  const std::string acknowledged = absl::StrCat("the first ", committed, " bytes were acknowledged (", kCommittedName, ")");
  size_t valid = 0;
  size_t pos = 0;
  bool repaired = false;  // damage was moved aside: the log is rewritten below
  for (;;) {
    std::optional<BadRecord> bad;
    COLLSERVE_RETURN_IF_ERROR(Replay(data, log_path, state, requests, &valid, &bad, pos));
    if (!bad.has_value()) {
      if (valid < committed) {
        // Cut short: acknowledged records are missing from the end.
        if (!options.repair) {
          return absl::DataLossError(absl::StrCat("the log ends", where(valid), " but ", acknowledged,
                                                  ": acknowledged writes are missing; restart with repair to "
                                                  "open it with what is there"));
        }
        Warn(options, absl::StrCat("repair: the log ends", where(valid), " but ", acknowledged,
                                   "; the writes in the missing bytes are lost"));
        repaired = true;
      }
      break;
    }
    const size_t offset = bad->offset;
    const size_t tail = data.size() - offset;
    const bool was_acknowledged = offset < committed;
    const bool followed = ValidRecordAfter(data, offset);
    if (!was_acknowledged && (have_committed ? !followed : bad->torn_tail)) {
      // After the last acknowledged write with nothing well-formed after it: an append a
      // crash interrupted, the preallocated zeros, or damage to space never written.
      if (AllZero(absl::string_view(data).substr(offset))) {
        // The log's preallocated zeros after its last record: no record was there.
      } else if (have_committed) {
        Warn(options, absl::StrCat("dropping a torn last record (", bad->reason, ") of ", tail, " bytes", where(offset),
                                   ", after the acknowledged writes (", acknowledged,
                                   "): an append a crash interrupted, or damage to space not yet written; nothing "
                                   "acknowledged was in it unless the host lost power (", kCommittedName,
                                   " can then be behind by the last seconds of writes)"));
      } else {
        Warn(options, absl::StrCat("dropping a torn last record (", bad->reason, ") of ", tail, " bytes", where(offset),
                                   ": an append a crash interrupted (this log has no ", kCommittedName,
                                   ", so whether it had been acknowledged is not known)"));
      }
      break;
    }
    if (!options.repair) {
      // Never truncated: the operator decides (--wal_repair moves the damage aside).
      return absl::DataLossError(absl::StrCat(
          bad->reason, where(offset), " (", data.size(), " bytes; ",
          was_acknowledged ? acknowledged
          : followed       ? std::string("a well-formed record follows it, so it was damaged in place")
                           : std::string("it is not a torn last record"),
          "); the log is left as it is: restart with repair to move the damaged bytes aside, lose the writes in "
          "them and keep the records after them"));
    }
    // Repair: keep the damaged bytes (up to the next well-formed record) in a file of their
    // own, and replay on from that record.
    const size_t next = NextValidRecord(data, offset, kNoRecord);
    const size_t damaged_end = next == kNoRecord ? data.size() : next;
    const std::string aside = JoinPath(options.dir, absl::StrCat(kLogName, ".damaged-", offset));
    const int fd = ::open(aside.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return IoError("cannot create", aside, errno);
    absl::Status written = WriteAll(fd, absl::string_view(data).substr(offset, damaged_end - offset), aside);
    if (written.ok() && ::fsync(fd) != 0) written = IoError("cannot fsync", aside, errno);
    ::close(fd);
    COLLSERVE_RETURN_IF_ERROR(written);
    COLLSERVE_RETURN_IF_ERROR(SyncDir(options.dir));
    Warn(options, absl::StrCat("repair: ", bad->reason, where(offset), "; moved the ", damaged_end - offset,
                               " bytes up to offset ", damaged_end, " (their writes are lost) to ", aside,
                               next == kNoRecord ? "; no well-formed record follows them"
                                                 : absl::StrCat("; replaying on from the record at offset ", next)));
    repaired = true;
    if (next == kNoRecord) {
      valid = offset;
      break;
    }
    pos = next;
  }
  wal->committed_fd_ = ::open(committed_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (wal->committed_fd_ < 0) return IoError("cannot open", committed_path, errno);
  if (repaired) {
    // The log still holds the damage: write what was recovered as a snapshot and start an
    // empty log (Compact), so that the next start opens it without repair.
    wal->log_bytes_ = wal->allocated_bytes_ = static_cast<int64_t>(data.size());
    COLLSERVE_RETURN_IF_ERROR(wal->Compact(*state, requests != nullptr ? *requests : RequestLog{}));
    return wal;
  }
  if (valid < data.size()) {
    // Cut the tail off so that new records follow the last good one.
    if (::ftruncate(log_fd, static_cast<off_t>(valid)) != 0) {
      return IoError("cannot truncate the bad tail of", log_path, errno);
    }
    if (::fdatasync(log_fd) != 0) return IoError("cannot fdatasync", log_path, errno);
  }
  wal->log_bytes_ = static_cast<int64_t>(valid);
  wal->allocated_bytes_ = wal->log_bytes_;
  COLLSERVE_RETURN_IF_ERROR(wal->WriteCommitted(/*sync=*/true));
  // Makes a newly created log file's (and wal.committed's) directory entry durable.
  COLLSERVE_RETURN_IF_ERROR(SyncDir(options.dir));
  return wal;
}

Wal::Wal(Options options, int log_fd, int64_t log_bytes)
    : options_(std::move(options)), log_fd_(log_fd), log_bytes_(log_bytes) {}

Wal::~Wal() {
  // Leave the file as long as its records (best effort: Open drops a zero tail anyway).
  if (allocated_bytes_ > log_bytes_ && broken_.ok()) (void)!::ftruncate(log_fd_, static_cast<off_t>(log_bytes_));
  if (committed_fd_ >= 0) {
    if (broken_.ok()) WriteCommitted(/*sync=*/true).IgnoreError();  // best effort: it is a lower bound anyway
    ::close(committed_fd_);
  }
  ::close(log_fd_);
}

absl::Status Wal::WriteCommitted(bool sync) {
  const std::string bytes = EncodeCommitted(static_cast<uint64_t>(log_bytes_));
  const std::string path = JoinPath(options_.dir, kCommittedName);
  COLLSERVE_RETURN_IF_ERROR(WriteAllAt(committed_fd_, bytes, 0, path));
  if (sync && ::fdatasync(committed_fd_) != 0) return IoError("cannot fdatasync", path, errno);
  return absl::OkStatus();
}

void Wal::EncodeOps(const std::vector<WalOp>& ops, std::string* payload) {
  for (const WalOp& op : ops) AppendOp(payload, op);
}

absl::Status Wal::Append(const std::vector<WalOp>& ops) {
  std::string payload;
  EncodeOps(ops, &payload);
  return WriteAndSync(payload, 1);
}

void Wal::Preallocate(int64_t bytes) {
  static const std::string* const kZeros = new std::string(256 << 10, '\0');
  const std::string log_path = JoinPath(options_.dir, kLogName);
  int64_t at = allocated_bytes_;
  while (at < bytes) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(bytes - at, static_cast<int64_t>(kZeros->size())));
    if (!WriteAllAt(log_fd_, absl::string_view(*kZeros).substr(0, n), at, log_path).ok()) {
      // No room (a small or full disk): records are appended without preallocation.
      (void)!::ftruncate(log_fd_, static_cast<off_t>(allocated_bytes_));
      return;
    }
    at += static_cast<int64_t>(n);
  }
  allocated_bytes_ = bytes;
}

absl::Status Wal::WriteAndSync(absl::string_view payload, int64_t count) {
  COLLSERVE_RETURN_IF_ERROR(broken_);
  std::string records(kHeaderBytes, '\0');
  records.append(payload.data(), payload.size());
  COLLSERVE_RETURN_IF_ERROR(FinishRecord(&records));
  const std::string log_path = JoinPath(options_.dir, kLogName);
  const int64_t end = log_bytes_ + static_cast<int64_t>(records.size());
  // Grows with the log (64 KiB for a new one) up to kPreallocateBytes at a time.
  if (end > allocated_bytes_) Preallocate(end + std::clamp<int64_t>(log_bytes_, int64_t{64} << 10, kPreallocateBytes));
  if (absl::Status status = WriteAllAt(log_fd_, records, log_bytes_, log_path); !status.ok()) {
    // Remove the partial records (and the preallocated zeros) so later records do not
    // follow garbage.
    if (::ftruncate(log_fd_, static_cast<off_t>(log_bytes_)) != 0) {
      broken_ = IoError("wal is unusable: cannot truncate a failed append to", log_path, errno);
    }
    allocated_bytes_ = log_bytes_;
    return status;
  }
  allocated_bytes_ = std::max(allocated_bytes_, end);
  const absl::Time sync_start = absl::Now();
  if (::fdatasync(log_fd_) != 0) {
    broken_ = IoError("wal is unusable after a failed fdatasync of", log_path, errno);
    return broken_;
  }
  sync_time_ += absl::Now() - sync_start;
  ++syncs_;
  records_ += count;
  log_bytes_ += static_cast<int64_t>(records.size());
  // Not synced: the page cache keeps it through a crash of this process, and a power loss
  // can only leave it behind the log (it is written after the log's fdatasync), so it
  // stays a lower bound on what was acknowledged. A failure only weakens that bound.
  WriteCommitted(/*sync=*/false).IgnoreError();
  return absl::OkStatus();
}

absl::Status Wal::MaybeCompact(const KeyValueMap& state, int64_t live_bytes, const RequestLog& requests) {
  if (!broken_.ok()) return absl::OkStatus();  // Append() reports it.
  if (log_bytes_ <= options_.compact_bytes || log_bytes_ <= 2 * live_bytes ||
      log_bytes_ < next_compact_attempt_bytes_) {
    return absl::OkStatus();
  }
  absl::Status status = Compact(state, requests);
  if (!status.ok()) next_compact_attempt_bytes_ = log_bytes_ + options_.compact_bytes;
  return status;
}

absl::Status Wal::Compact(const KeyValueMap& state, const RequestLog& requests) {
  const std::string temp_path = JoinPath(options_.dir, kSnapshotTempName);
  const std::string snapshot_path = JoinPath(options_.dir, kSnapshotName);
  const std::string log_path = JoinPath(options_.dir, kLogName);
  const int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError("cannot create", temp_path, errno);
  absl::Status status;
  std::string buffer;
  std::string record;
  auto add = [&](const WalOp& op) {
    record.assign(kHeaderBytes, '\0');
    AppendOp(&record, op);
    COLLSERVE_RETURN_IF_ERROR(FinishRecord(&record));
    buffer += record;
    if (buffer.size() >= kSnapshotBufferBytes) {
      COLLSERVE_RETURN_IF_ERROR(WriteAll(fd, buffer, temp_path));
      buffer.clear();
    }
    return absl::OkStatus();
  };
  for (const auto& [key, value] : state) {
    status = add(WalOp{WalOp::kPut, key, value});
    if (!status.ok()) break;
  }
  for (auto it = requests.begin(); status.ok() && it != requests.end(); ++it) {
    status = add(WalOp{WalOp::kRequest, it->first, it->second});
  }
  if (status.ok()) status = WriteAll(fd, buffer, temp_path);
  if (status.ok() && ::fsync(fd) != 0) status = IoError("cannot fsync", temp_path, errno);
  ::close(fd);
  if (status.ok() && ::rename(temp_path.c_str(), snapshot_path.c_str()) != 0) {
    status = IoError("cannot rename snapshot into place:", temp_path, errno);
  }
  if (!status.ok()) {
    ::unlink(temp_path.c_str());
    return status;
  }
  // Until the rename is durable the old snapshot + old log are still what a restart sees;
  // both pairs replay to the same state because records are absolute, so the order of the
  // remaining steps only matters for disk space.
  COLLSERVE_RETURN_IF_ERROR(SyncDir(options_.dir));
  // wal.committed goes to 0 durably before the log is emptied, or a power loss could leave
  // an empty log with the old length acknowledged (DATA_LOSS at the next start).
  const int64_t records_end = log_bytes_;
  log_bytes_ = 0;
  if (absl::Status s = WriteCommitted(/*sync=*/true); !s.ok()) {
    log_bytes_ = records_end;
    return s;
  }
  if (::ftruncate(log_fd_, 0) != 0) return IoError("cannot truncate", log_path, errno);
  allocated_bytes_ = 0;
  if (::fdatasync(log_fd_) != 0) {
    broken_ = IoError("wal is unusable after a failed fdatasync of", log_path, errno);
    return broken_;
  }
  ++compactions_;
  last_snapshot_ = absl::Now();
  return absl::OkStatus();
}

}  // namespace collserve::store
