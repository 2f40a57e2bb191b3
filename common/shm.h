// Shared memory between a client and its sidecar on one host: anonymous memfd segments whose
// file descriptors the client passes to the sidecar over a unix socket (SCM_RIGHTS,
// common/fd_channel.h). Nothing has a name in /dev/shm, so nothing is left behind when a
// process dies, and the sidecar maps only memory a client provably holds (it sent the
// descriptor), never a segment some other process named.
#ifndef COLLSERVE_COMMON_SHM_H_
#define COLLSERVE_COMMON_SHM_H_

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace collserve {

// A mapped segment. Unmaps (and closes its descriptor) on destruction. Not thread-safe
// itself; the mapped bytes are plain memory.
class ShmSegment {
 public:
  // Creates a zero-filled segment of `bytes` (> 0) bytes with memfd_create, seals its size
  // (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL: a receiver may rely on it never shrinking
  // under its mapping) and maps it. Keeps the descriptor for passing (fd()). The segment's
  // name() is an id unique in this process ("memfd-<pid>-<counter>"), by which requests refer
  // to it once registered. RESOURCE_EXHAUSTED / UNAVAILABLE when memfd_create, ftruncate,
  // fcntl or mmap fail (errno in the message).
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(size_t bytes);

  // Maps a segment received as descriptor `fd` (taken over: closed on every path) under the
  // client's `name`. The whole file is mapped. PERMISSION_DENIED unless `fd` is a regular
  // file sealed against shrinking (a memfd from Create): a file that can shrink under the
  // mapping would make the receiver fault (SIGBUS) when it touches the lost pages.
  // INVALID_ARGUMENT if it holds fewer than `min_bytes` bytes or none; RESOURCE_EXHAUSTED if
  // mmap fails.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> FromFd(std::string name, int fd, size_t min_bytes);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& name() const { return name_; }
  size_t size() const { return size_; }
  char* data() const { return data_; }
  // The descriptor of a segment made by Create (to pass it); -1 for one from FromFd.
  int fd() const { return fd_; }

 private:
  ShmSegment(std::string name, char* data, size_t size, int fd)
      : name_(std::move(name)), data_(data), size_(size), fd_(fd) {}
  std::string name_;
  char* data_;
  size_t size_;
  int fd_;
};

}  // namespace collserve

#endif  // COLLSERVE_COMMON_SHM_H_
