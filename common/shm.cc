#include "common/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/errno_text.h"

namespace collserve {
namespace {


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

namespace {

// Read-only descriptors FromFd keeps (MapOptions::share), process-wide.
std::atomic<int> shared_descriptors{0};

int MaxSharedDescriptors() {
  static const int max = [] {
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
      return kMaxSharedDescriptors;
    }
    return static_cast<int>(std::min<rlim_t>(limit.rlim_cur / 2, kMaxSharedDescriptors));
  }();
  return max;
}

// A read-only descriptor of what `fd` refers to, counted; -1 past the budget or on failure.
int ReopenReadOnly(int fd) {
  if (shared_descriptors.fetch_add(1) >= MaxSharedDescriptors()) {
    shared_descriptors.fetch_sub(1);
    return -1;
  }
  const int ro = open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDONLY | O_CLOEXEC);
  if (ro < 0) shared_descriptors.fetch_sub(1);
  return ro;
}

// Mappings FromFd made that are held now, and the limit set on them (0: the default).
std::atomic<int64_t> received_mappings{0};
std::atomic<int64_t> max_received_mappings{0};

int64_t DefaultMaxReceivedMappings() {
  static const int64_t max = [] {
    int64_t count = 65530;  // the kernel's default vm.max_map_count
    std::ifstream in("/proc/sys/vm/max_map_count");
    int64_t read = 0;
    if (in >> read && read > 0) count = read;
    // Half for the process's own mappings: code, heap arenas, every thread's stack and guard.
    return std::max<int64_t>(count / 2, 1);
  }();
  return max;
}

}  // namespace

int64_t ShmSegment::MaxReceivedMappings() {
  const int64_t set = max_received_mappings.load();
  return set > 0 ? set : DefaultMaxReceivedMappings();
}

void ShmSegment::SetMaxReceivedMappings(int64_t limit) { max_received_mappings.store(std::max<int64_t>(limit, 0)); }

int64_t ShmSegment::ReceivedMappings() { return received_mappings.load(); }

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::FromFd(std::string name, int fd, size_t min_bytes,
                                                              ShmMapOptions options) {
  struct stat st;
  struct statfs fs;
  const int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || seals < 0 || (seals & F_SEAL_SHRINK) == 0 ||
      fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "segment \"", name, "\" is not a memfd sealed against shrinking (a file that can shrink under the mapping, ",
        "or a huge-page memfd, is refused)"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0 || size < min_bytes) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("segment \"", name, "\" holds ", size, " bytes, not at least ", min_bytes == 0 ? 1 : min_bytes));
  }
  const int64_t limit = MaxReceivedMappings();
  if (received_mappings.fetch_add(1) >= limit) {
    received_mappings.fetch_sub(1);
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(
        "segment \"", name, "\" refused: this process holds ", limit,
        " mapped segments received from clients, its limit (half of vm.max_map_count, or the sidecar's ",
        "--max_mapped_segments); clients must release segments first"));
  }
  void* p = mmap(nullptr, size, options.read_only ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  const int kept = p != MAP_FAILED && options.share ? ReopenReadOnly(fd) : -1;
  close(fd);
  if (p == MAP_FAILED) {
    received_mappings.fetch_sub(1);
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of segment \"", name, "\" (", size, " bytes): ", ErrnoText(err)));
  }
  return std::unique_ptr<ShmSegment>(
      new ShmSegment(std::move(name), static_cast<char*>(p), size, kept, kept >= 0, /*received=*/true));
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
  if (shared_) shared_descriptors.fetch_sub(1);
  if (received_) received_mappings.fetch_sub(1);
}

}  // namespace collserve
