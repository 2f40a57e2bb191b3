#include "server/common/daemon.h"

#include <prometheus/gauge.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <glog/logging.h>
#include <grpcpp/resource_quota.h>
#include <malloc.h>
#include <netdb.h>
#include <openssl/crypto.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/errno_text.h"
#include "common/local_socket.h"
#include "server/common/metrics.h"

namespace collserve::server {

void KeepOpenSslStateUntilExit() { OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr); }

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a peer that went away is an error status, not a crash
}

namespace {
// The part of a flag's source path from the repository's server/ folder on ("server/...").
absl::string_view RepositoryPath(absl::string_view path) {
  const size_t at = path.rfind("server/");
  return at == absl::string_view::npos ? path : path.substr(at);
}
}  // namespace

void SetDaemonUsage(const char* program, const char* usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  const auto ours = [](absl::string_view path) { return absl::StrContains(path, "server/"); };
  config.contains_helpshort_flags = ours;
  config.contains_help_flags = ours;
  config.normalize_filename = [](absl::string_view path) { return std::string(RepositoryPath(path)); };
  const std::string version = absl::StrCat(program, " ", COLLSERVE_VERSION, "\n");
  config.version_string = [version] { return version; };
  absl::SetFlagsUsageConfig(config);
}

absl::Status ExitWithParent(int64_t parent_pid) {
  if (parent_pid == 0) return absl::OkStatus();
  if (parent_pid < 0) return absl::InvalidArgumentError(absl::StrCat("--parent_pid=", parent_pid, ": use a pid, or 0"));
  if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) {
    return absl::InternalError(absl::StrCat("prctl(PR_SET_PDEATHSIG): ", std::strerror(errno)));
  }
  // Checked after the request: a parent that ends later sends the signal.
  if (static_cast<int64_t>(getppid()) != parent_pid) {
    return absl::FailedPreconditionError(absl::StrCat("--parent_pid=", parent_pid,
                                                      ": that process, which started this daemon, has already ended"));
  }
  return absl::OkStatus();
}

int WaitForTerminationSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}

absl::Status InitLogging(const char* argv0, const std::string& level) {
  int min_level;
  if (level == "info") min_level = google::GLOG_INFO;
  else if (level == "warning") min_level = google::GLOG_WARNING;
  else if (level == "error") min_level = google::GLOG_ERROR;
  else return absl::InvalidArgumentError(absl::StrCat("--log_level=", level, ": use info, warning or error"));
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = min_level;
  google::InitGoogleLogging(argv0);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(
    const std::string& address, const std::shared_ptr<prometheus::Registry>& registry) {
  if (address.empty()) return std::unique_ptr<MetricsServer>();
  MetricsServer::Options options;
  options.address = address;
  auto server = MetricsServer::Start(options);
  if (!server.ok()) return server.status();
  (*server)->RegisterCollectable(registry);
  return server;
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  FILE* f = fopen(tmp.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  fprintf(f, "%d\n", port);
  if (fclose(f) != 0 || rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

namespace {

std::string ErrnoMessage(int err) { return ErrnoText(err); }

// A unix socket address for `path`; false if it does not fit sun_path.
bool UnixAddress(const std::string& path, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr->sun_path)) return false;
  std::memcpy(addr->sun_path, path.data(), path.size());
  return true;
}

}  // namespace

uint64_t RaiseFileLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
      limit = raised;
    } else {
      LOG(WARNING) << "cannot raise the open-file limit from " << limit.rlim_cur << ": " << ErrnoMessage(errno);
    }
  }
  return limit.rlim_cur;
}

absl::Status ClaimUnixSocketPath(const std::string& path, int type) {
  sockaddr_un addr;
  if (!UnixAddress(path, &addr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unix socket path \"", path, "\" is empty or longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  // The directory: this daemon's alone (created 0755 when absent), or whoever can write it
  // could replace the socket and collect the tokens ranks send (common/local_socket.h).
  const size_t slash = path.rfind('/');
  if (absl::Status s = PrepareSocketDirectory(slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash));
      !s.ok()) {
    return s;
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return absl::OkStatus();  // free
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " exists and is not a socket; refusing to replace it (choose another --unix_socket)"));
  }
  const int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket(): ", ErrnoMessage(errno)));
  const bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  const int err = errno;
  ::close(fd);
  if (live || (err != ECONNREFUSED && err != ENOENT)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "another server is ", live ? "serving" : "holding", " unix:", path, live ? "" : absl::StrCat(" (", ErrnoMessage(err), ")"),
        "; stop it first or choose another --unix_socket"));
  }
  // Nobody listens: left behind by a daemon that died.
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(absl::StrCat("cannot remove the stale socket ", path, ": ", ErrnoMessage(errno)));
  }
  LOG(WARNING) << "removed the stale socket " << path << " (nothing was listening on it)";
  return absl::OkStatus();
}

FileId FileIdOf(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return {};
  return FileId{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

void LimitRpcMemory(grpc::ServerBuilder& builder, const std::string& name, int64_t bytes) {
  grpc::ResourceQuota quota(name);
  quota.Resize(static_cast<size_t>(bytes));
  builder.SetResourceQuota(quota);
}

MemoryTrimmer::MemoryTrimmer(absl::Duration period)
    : thread_([this, period] {
        while (!stop_.WaitForNotificationWithTimeout(period)) ::malloc_trim(0);
      }) {}

MemoryTrimmer::~MemoryTrimmer() {
  stop_.Notify();
  thread_.join();
}

void RegisterBuildInfo(prometheus::Registry& registry, const std::string& daemon) {
  prometheus::BuildGauge()
      .Name("collserve_build_info")
      .Help("1, labelled with the daemon and the collserve version it was built from.")
      .Register(registry)
      .Add({{"daemon", daemon}, {"version", COLLSERVE_VERSION}})
      .Set(1);
}

const char* CollserveVersion() { return COLLSERVE_VERSION; }

std::vector<GaugeValue> ProcessMetrics() {
  std::vector<GaugeValue> out;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  // /proc/self/stat: the fields after the command's closing parenthesis, from field 3.
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren != std::string::npos && ticks > 0) {
    std::vector<std::string> f = absl::StrSplit(stat.substr(paren + 2), ' ', absl::SkipEmpty());
    // f[0] is field 3 (state): utime 14, stime 15, starttime 22, vsize 23, rss 24.
    double utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
    if (f.size() > 21 && absl::SimpleAtod(f[11], &utime) && absl::SimpleAtod(f[12], &stime) &&
        absl::SimpleAtod(f[19], &start) && absl::SimpleAtod(f[20], &vsize) && absl::SimpleAtod(f[21], &rss)) {
      out.push_back({"process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                     (utime + stime) / ticks, true});
      out.push_back({"process_virtual_memory_bytes", "Virtual memory size in bytes.", vsize});
      out.push_back({"process_resident_memory_bytes", "Resident memory size in bytes.", rss * page});
      // Boot time (btime in /proc/stat) plus the start in ticks since boot.
      std::ifstream boot_file("/proc/stat");
      for (std::string line; std::getline(boot_file, line);) {
        double btime = 0;
        if (absl::StartsWith(line, "btime ") && absl::SimpleAtod(line.substr(6), &btime)) {
          out.push_back({"process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                         btime + start / ticks});
        }
      }
    }
  }
  int fds = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) fds += e->d_name[0] != '.' ? 1 : 0;
    closedir(d);
    out.push_back({"process_open_fds", "Number of open file descriptors.", static_cast<double>(fds - 1)});  // the listing's
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    out.push_back({"process_max_fds", "Maximum number of open file descriptors.", static_cast<double>(limit.rlim_cur)});
  }
  // glibc's allocator (mallinfo2): what the process holds in live allocations against what
  // the allocator keeps mapped but free. A resident size that grows while the first stays
  // flat is the allocator's fragmentation or caching, not a leak of ours. Under a sanitizer
  // (its own allocator) these read the unused glibc arena.
  const struct mallinfo2 heap = ::mallinfo2();
  out.push_back({"collserve_heap_allocated_bytes",
                 "Bytes in live heap allocations (glibc mallinfo2 uordblks + hblkhd).",
                 static_cast<double>(heap.uordblks + heap.hblkhd)});
  out.push_back({"collserve_heap_free_bytes",
                 "Bytes the heap allocator holds mapped but free (glibc mallinfo2 fordblks); "
                 "malloc_trim gives the trimmable part back every 2 s.",
                 static_cast<double>(heap.fordblks)});
  return out;
}

}  // namespace collserve::server
