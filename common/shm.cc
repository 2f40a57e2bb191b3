#include "common/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace collserve {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

std::string NewName() {
  static std::atomic<uint64_t> counter{0};
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrCat("/collserve-", getpid(), "-", counter.fetch_add(1), "-",
                      absl::Hex(rng() & 0xffffffffull));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("shared-memory segment of 0 bytes");
  std::string name = NewName();
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shm_open(", name, "): ", ErrnoText(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate(", name, ", ", bytes, " bytes): ", ErrnoText(err)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap(", name, ", ", bytes, " bytes): ", ErrnoText(err)));
  }
  return std::unique_ptr<ShmSegment>(new ShmSegment(name, static_cast<char*>(p), bytes, true));
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Open(const std::string& name,
                                                             size_t bytes) {
  if (name.empty() || name[0] != '/' || name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("bad shared-memory segment name \"", name, "\""));
  }
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no shared-memory segment ", name));
    }
    return absl::UnavailableError(absl::StrCat("shm_open(", name, "): ", ErrnoText(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes || bytes == 0) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared-memory segment ", name, " holds ",
                                                   st.st_size, " bytes, not ", bytes));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap(", name, ", ", bytes, " bytes): ", ErrnoText(err)));
  }
  return std::unique_ptr<ShmSegment>(new ShmSegment(name, static_cast<char*>(p), bytes, false));
}

void ShmSegment::Remove(const std::string& name) {
  if (!name.empty() && name[0] == '/' && name.find('/', 1) == std::string::npos) shm_unlink(name.c_str());
}

void ShmSegment::Unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  Unlink();
}

}  // namespace collserve
