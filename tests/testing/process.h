// Test helpers that start real collserve processes on loopback and always stop them.
#ifndef COLLSERVE_TESTS_TESTING_PROCESS_H_
#define COLLSERVE_TESTS_TESTING_PROCESS_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace collserve::testing {

// A child process. Its stdout+stderr go to `log_path`. The destructor kills it (SIGTERM,
// then SIGKILL after 3 s) and reaps it, so a failing test never leaks processes.
class Process {
 public:
  static absl::StatusOr<std::unique_ptr<Process>> Start(const std::vector<std::string>& argv,
                                                        const std::map<std::string, std::string>& env,
                                                        const std::string& log_path);
  ~Process();
  // Waits up to `timeout` for exit. Returns the exit code (128+signal if killed);
  // DEADLINE_EXCEEDED if still running.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  void Kill(int sig);
  pid_t pid() const { return pid_; }
  // The process's output so far.
  std::string Output() const;
  // Waits up to `timeout` for `text` to appear in Output(); returns whether it did.
  bool WaitForOutput(absl::string_view text, absl::Duration timeout) const;

 private:
  Process(pid_t pid, std::string log) : pid_(pid), log_(std::move(log)) {}
  pid_t pid_;
  std::string log_;
  bool reaped_ = false;
  int exit_code_ = -1;
};

// Waits up to `timeout` for `p` to write a port (a daemon's --port_file) to `path`.
// INTERNAL (with its output) if `p` exits first, DEADLINE_EXCEEDED if no port comes.
absl::StatusOr<int> ReadPortFile(const std::string& path, Process& p, absl::Duration timeout);

// Writes a new random token (hex, 64 characters) to `path` with mode 0600 and returns it.
absl::StatusOr<std::string> WriteRandomToken(const std::string& path);

// A coordinator plus N sidecars on loopback, in a fresh temp dir, torn down on destruction.
// The coordinator requires tokens (docs/security.md): it is started with a fresh admin token
// (<dir>/admin.token) and a job token for job "default" (<dir>/job-tokens/default), which
// StartRank hands to its ranks as COLLSERVE_TOKEN (extra_env may override it). Every
// coordinator it starts has kLeaseGraceFlag (tests/testing/sanitizers.h: 20 s under a
// sanitizer) before the caller's flags; a test that measures leases passes
// kMeasuredLeaseGraceFlag.
class Cluster {
 public:
  // `sidecar_flags` are added to every sidecar's command line, then `each_sidecar_flags[i]`
  // (where given) to sidecar i's.
  static absl::StatusOr<std::unique_ptr<Cluster>> Start(
      int num_sidecars, const std::vector<std::string>& coordinator_flags = {},
      const std::vector<std::string>& sidecar_flags = {},
      const std::vector<std::vector<std::string>>& each_sidecar_flags = {});
  // The same with the sidecars started as one MPI world by `mpirun` (MPMD, one app context
  // per sidecar, each with --mpi; TCP on loopback; --enable-recovery), for groups that ask
  // for backend "mpi". The sidecars have no Process of their own (sidecar(i) must not be
  // called, nor RestartSidecar): one Process runs mpirun, and Logs() shows its output.
  static absl::StatusOr<std::unique_ptr<Cluster>> StartUnderMpirun(const std::string& mpirun, int num_sidecars,
                                                                   const std::vector<std::string>& sidecar_flags = {});
  // The pid of sidecar `i` of a cluster StartUnderMpirun made (from /proc: the sidecar
  // binary with its --unix_socket), or -1.
  pid_t MpiSidecarPid(int i) const;
  ~Cluster();
  const std::string& dir() const { return dir_; }
  // The token of job "default" and the admin token this cluster's coordinator accepts.
  const std::string& job_token() const { return job_token_; }
  const std::string& admin_token() const { return admin_token_; }
  // The coordinator flags that configure those tokens (Start and RestartCoordinator add them).
  std::vector<std::string> credential_flags() const;
  int coordinator_port() const { return coordinator_port_; }
  std::string coordinator_address() const;
  // "unix:<dir>/sidecar<i>.sock"
  std::string sidecar_address(int i) const;
  // "127.0.0.1:<port>": the sidecar's TCP listener (for clients on other hosts).
  std::string sidecar_tcp_address(int i) const;
  // Restarts the coordinator with the same port and `extra_flags` (e.g. --data_dir).
  absl::Status RestartCoordinator(const std::vector<std::string>& extra_flags);
  // Starts sidecar `i` again with its command line (same --host_id, socket and flags; a new
  // TCP port) after stopping it (SIGTERM) if it still runs, and waits until it serves.
  absl::Status RestartSidecar(int i);
  Process& sidecar(int i) { return *sidecars_[i]; }
  Process& coordinator() { return *coordinator_; }
  // Starts a rank process (the test rank binary with `args`) against sidecar `sidecar`.
  absl::StatusOr<std::unique_ptr<Process>> StartRank(int rank, int world_size, int sidecar,
                                                     const std::vector<std::string>& args,
                                                     const std::map<std::string, std::string>& extra_env = {});
  std::string Logs();  // coordinator and sidecar logs, for failure messages
  // The program StartRank runs (default: RankBinary()).
  void set_rank_binary(std::string binary) { rank_binary_ = std::move(binary); }

 private:
  // The cluster's directory, tokens and coordinator (Start's first half).
  static absl::StatusOr<std::unique_ptr<Cluster>> StartCoordinator(const std::vector<std::string>& coordinator_flags);
  // Sidecar i's command line before the caller's flags.
  std::vector<std::string> SidecarArgv(int i) const;
  std::string dir_;
  std::string job_token_;
  std::string admin_token_;
  int coordinator_port_ = 0;
  std::unique_ptr<Process> coordinator_;
  std::vector<std::unique_ptr<Process>> sidecars_;
  std::unique_ptr<Process> mpirun_;  // StartUnderMpirun's
  std::vector<int> sidecar_ports_;
  std::vector<std::vector<std::string>> sidecar_argv_;
  int next_log_ = 0;
  std::string rank_binary_;
};

// The body of an HTTP/1.0 GET of `path` on 127.0.0.1:`port` (with headers), "" on failure;
// at most 30 s per read.
std::string HttpGet(int port, const std::string& path);

// The value of the sample `sample` (a metric's name and labels, as /metrics prints them:
// `grpc_server_started_total{grpc_method="Get",...}`) in a scrape of 127.0.0.1:`port`'s
// /metrics; -1 when the scrape has no such sample or fails.
double MetricValue(int port, const std::string& sample);

// The CPU seconds (user + system) process `pid` has used so far (/proc/<pid>/stat); -1 if it
// cannot be read.
double CpuSeconds(pid_t pid);

// A port nothing listens on now, for a server the test starts later. It is drawn below the
// kernel's ephemeral range (ip_local_port_range), so the ports other processes get from
// bind(0) and connect() in the meantime cannot take it. 0 if none was found.
int UnusedPort();

// The build tree the running test binary is in: the nearest directory above it (from
// /proc/self/exe) that holds CMakeCache.txt; and the source tree it was configured from
// (its CMakeCache.txt's CMAKE_HOME_DIRECTORY). Found at run time, not compiled in, so that
// no absolute path reaches a compile command and every clone shares the compiler cache.
// Both abort the test binary (with a message) when not found.
const std::string& BuildDir();
const std::string& SourceDir();

// Paths of the binaries under test: BuildDir() plus where CMake put them (compiled in as
// paths relative to the build tree).
std::string CoordinatorBinary();
std::string SidecarBinary();
std::string RankBinary();
std::string SurfaceRankBinary();  // tests/integration/surface_rank.cc
std::string CollservectlBinary();

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_PROCESS_H_
