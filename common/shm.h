// POSIX shared-memory segments (shm_open + mmap): the tensor path between a client and
// its sidecar on one host. The client creates a segment and names it in a request; the
// sidecar opens and maps it by name.
#ifndef COLLSERVE_COMMON_SHM_H_
#define COLLSERVE_COMMON_SHM_H_

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace collserve {

// A mapped segment. Unmaps (and, if it owns the name, unlinks it) on destruction.
// Not thread-safe itself; the mapped bytes are plain memory.
class ShmSegment {
 public:
  // Creates a new segment of `bytes` (> 0) bytes under a fresh unique name
  // ("/collserve-<pid>-<counter>-<random>"), zero-filled, mode 0600, and maps it.
  // UNAVAILABLE / RESOURCE_EXHAUSTED when shm_open, ftruncate or mmap fail (errno in message).
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(size_t bytes);

  // Opens and maps an existing segment by name. `bytes` must not exceed its size
  // (INVALID_ARGUMENT otherwise); NOT_FOUND if there is no such segment (e.g. the creator
  // is on another host).
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Open(const std::string& name, size_t bytes);

  // Removes a segment's name (shm_unlink); mappings stay valid. Errors are ignored: the
  // name may already be gone.
  static void Remove(const std::string& name);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Removes the name (the mapping stays valid; the memory is freed when the last mapping
  // goes). Idempotent.
  void Unlink();

  const std::string& name() const { return name_; }
  size_t size() const { return size_; }
  char* data() const { return data_; }

 private:
  ShmSegment(std::string name, char* data, size_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), linked_(owner) {}
  std::string name_;
  char* data_;
  size_t size_;
  bool linked_;  // whether this object still has to unlink the name
};

}  // namespace collserve

#endif  // COLLSERVE_COMMON_SHM_H_
