#include "common/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace collserve {
namespace {

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

}  // namespace

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("shared-memory segment of 0 bytes");
  static std::atomic<uint64_t> counter{0};
  std::string name = absl::StrCat("memfd-", getpid(), "-", counter.fetch_add(1));
  const int fd = memfd_create("collserve", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("memfd_create: ", ErrnoText(errno)));
  const char* step = nullptr;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    step = "ftruncate";
  } else if (fcntl(fd, F_ADD_SEALS, kSeals) != 0) {
    step = "sealing";
  }
  void* p = step != nullptr ? MAP_FAILED : mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (step == nullptr && p == MAP_FAILED) step = "mmap";
  if (step != nullptr) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat(step, " of a ", bytes, "-byte shared-memory segment: ", ErrnoText(err)));
  }
  return std::unique_ptr<ShmSegment>(new ShmSegment(std::move(name), static_cast<char*>(p), bytes, fd));
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::FromFd(std::string name, int fd, size_t min_bytes) {
  struct stat st;
  const int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "segment \"", name, "\" is not a memfd sealed against shrinking (a file that can shrink under the mapping ",
        "is refused)"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0 || size < min_bytes) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("segment \"", name, "\" holds ", size, " bytes, not at least ", min_bytes == 0 ? 1 : min_bytes));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of segment \"", name, "\" (", size, " bytes): ", ErrnoText(err)));
  }
  return std::unique_ptr<ShmSegment>(new ShmSegment(std::move(name), static_cast<char*>(p), size, -1));
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

}  // namespace collserve
