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

// How ShmSegment::FromFd maps a descriptor.
struct ShmMapOptions {
  // Also keep a read-only descriptor of the segment (reopened through /proc/self/fd) as
  // fd(), for a peer of the owner to map (the sidecar's peer reads). Read-only only against
  // mistakes: a memfd's inode is mode 0777, so whoever holds the descriptor can reopen it
  // writable through its own /proc/self/fd (the peers are ranks of the owner's group, one
  // job's code). Kept only while the process holds fewer than
  // kMaxSharedDescriptors of them (and at most half its RLIMIT_NOFILE); else fd() is -1.
  bool share = false;
  // Map it for reading only (a peer's segment).
  bool read_only = false;
};
inline constexpr int kMaxSharedDescriptors = 65536;

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
  // tmpfs file sealed against shrinking (a memfd from Create): a file that can shrink under
  // the mapping would make the receiver fault (SIGBUS) when it touches the lost pages, and
  // so would a hugetlbfs memfd (MFD_HUGETLB) whose owner punched a hole and used up the
  // huge-page pool (a hole in tmpfs is refilled with zeros). INVALID_ARGUMENT if it holds
  // fewer than `min_bytes` bytes or none; RESOURCE_EXHAUSTED if mmap fails or the process
  // already holds MaxReceivedMappings() mappings made here.
  //
  // `options`: ShmMapOptions.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> FromFd(std::string name, int fd, size_t min_bytes,
                                                           ShmMapOptions options = {});

  // Most mappings made by FromFd that the process holds at once (each is one of the kernel's
  // vm.max_map_count mappings per process; past that limit mmap, thread creation and large
  // mallocs fail, which a daemon does not survive). Set by SetMaxReceivedMappings, else half
  // of vm.max_map_count (read from /proc/sys/vm/max_map_count; 32765 by default). Thread-safe.
  static int64_t MaxReceivedMappings();
  // Sets MaxReceivedMappings (> 0; 0 restores the default). Thread-safe.
  static void SetMaxReceivedMappings(int64_t limit);
  // Mappings made by FromFd held now, process-wide. Thread-safe.
  static int64_t ReceivedMappings();

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  const std::string& name() const { return name_; }
  size_t size() const { return size_; }
  char* data() const { return data_; }
  // The descriptor of a segment made by Create (to pass it), the read-only one FromFd kept
  // (MapOptions::share), else -1.
  int fd() const { return fd_; }

 private:
  ShmSegment(std::string name, char* data, size_t size, int fd, bool shared = false, bool received = false)
      : name_(std::move(name)), data_(data), size_(size), fd_(fd), shared_(shared), received_(received) {}
  std::string name_;
  char* data_;
  size_t size_;
  int fd_;
  bool shared_;    // fd_ counts against the process's shared descriptors
  bool received_;  // made by FromFd: counts against MaxReceivedMappings
};

}  // namespace collserve

#endif  // COLLSERVE_COMMON_SHM_H_
