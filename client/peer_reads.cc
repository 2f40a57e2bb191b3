#include "client/peer_reads.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace collserve::client {

void CopyResultRange(const ResultTarget& target, const char* result, size_t from, size_t to) {
  size_t off = 0;
  for (const auto& [ptr, b] : *target.outputs) {
    if (off >= to || off + b > target.bytes) break;
    const size_t lo = std::max(off, from), hi = std::min(off + b, to);
    if (hi > lo) std::memcpy(static_cast<char*>(ptr) + (lo - off), result + lo, hi - lo);
    off += b;
  }
}

PeerReader::PeerReader(Opener open, size_t max_bytes, size_t max_segments)
    : open_(std::move(open)), max_bytes_(max_bytes), max_segments_(std::max<size_t>(1, max_segments)) {}

size_t PeerReader::mapped_bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

size_t PeerReader::mapped_segments() const {
  absl::MutexLock lock(&mu_);
  return segments_.size();
}

void PeerReader::EvictLocked(size_t incoming) {
  while (!order_.empty() && (bytes_ + incoming > max_bytes_ || order_.size() >= max_segments_)) {
    auto it = segments_.find(order_.front());
    order_.pop_front();
    if (it == segments_.end()) continue;
    bytes_ -= it->second->size();
    segments_.erase(it);
  }
}

absl::Status PeerReader::Copy(const v1::PeerSource& source, const ResultTarget& target, absl::Duration op_timeout) {
  if (source.bytes() < 0 || static_cast<uint64_t>(source.bytes()) != target.bytes || source.offset() < 0) {
    return absl::InternalError(absl::StrCat("the sidecar named a ", source.bytes(), "-byte result in rank ",
                                            source.rank(), "'s segment for a ", target.bytes, "-byte result"));
  }
  // Held through the copy: an eviction must not unmap what is being read.
  absl::MutexLock lock(&mu_);
  auto key = std::make_pair(source.rank(), source.segment());
  auto it = segments_.find(key);
  if (it == segments_.end()) {
    absl::StatusOr<int> fd = open_(source.rank(), source.segment());
    if (!fd.ok()) {
      return absl::Status(fd.status().code(),
                          absl::StrCat("reading rank ", source.rank(), "'s result segment: ", fd.status().message()));
    }
    auto mapped = ShmSegment::FromFd(source.segment(), *fd, 0, {.share = false, .read_only = true});
    if (!mapped.ok()) return mapped.status();
    EvictLocked((*mapped)->size());
    bytes_ += (*mapped)->size();
    order_.push_back(key);
    it = segments_.emplace(key, std::move(*mapped)).first;
  }
  const char* base = it->second->data();
  const size_t size = it->second->size();
  const uint64_t offset = static_cast<uint64_t>(source.offset());
  if (offset > size || target.bytes > size - offset) {
    return absl::InternalError(absl::StrCat("the sidecar named bytes [", offset, ", ", offset + target.bytes,
                                            ") of rank ", source.rank(), "'s ", size, "-byte segment"));
  }
  if (source.fill_offset() <= 0) {
    CopyResultRange(target, base + offset, 0, target.bytes);
    return absl::OkStatus();
  }
  // The owner is still writing the bytes: follow its count (PeerSource.fill_offset).
  const uint64_t at = static_cast<uint64_t>(source.fill_offset());
  if (at % sizeof(uint64_t) != 0 || size < sizeof(uint64_t) || at > size - sizeof(uint64_t) ||
      (at + sizeof(uint64_t) > offset && at < offset + target.bytes)) {
    return absl::InternalError(absl::StrCat("the sidecar named a fill count at byte ", at, " of rank ", source.rank(),
                                            "'s ", size, "-byte segment, whose result is at [", offset, ", ",
                                            offset + target.bytes, ")"));
  }
  const uint64_t* count = reinterpret_cast<const uint64_t*>(base + at);
  const absl::Time deadline = absl::Now() + op_timeout;
  size_t done = 0;
  int idle = 0;
  while (done < target.bytes) {
    const size_t avail =
        static_cast<size_t>(std::min<uint64_t>(__atomic_load_n(count, __ATOMIC_ACQUIRE), target.bytes));
    if (avail > done) {
      CopyResultRange(target, base + offset, done, avail);
      done = avail;
      idle = 0;
      continue;
    }
    // The owner copies at memory speed: yield at first, then nap (at most 1 ms).
    if (++idle < 64) {
      std::this_thread::yield();
      continue;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("rank ", source.rank(), " had written ", done, " of its ",
                                                      target.bytes, "-byte broadcast tensor within the op timeout (",
                                                      absl::FormatDuration(op_timeout), ")"));
    }
    absl::SleepFor(absl::Microseconds(std::min(idle - 63, 1000)));
  }
  return absl::OkStatus();
}

}  // namespace collserve::client
