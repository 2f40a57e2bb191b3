#include "tests/testing/process.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {

namespace {

[[noreturn]] void NoTree(const std::string& why) {
  std::fprintf(stderr, "collserve tests: %s\n", why.c_str());
  std::abort();
}

std::string FindBuildDir() {
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) NoTree("cannot read /proc/self/exe");
  const std::string path(exe, static_cast<size_t>(n));
  std::string dir = path;
  for (size_t slash = dir.rfind('/'); slash != std::string::npos && slash > 0; slash = dir.rfind('/')) {
    dir.resize(slash);
    if (access((dir + "/CMakeCache.txt").c_str(), F_OK) == 0) return dir;
  }
  NoTree(absl::StrCat("no CMakeCache.txt in a directory above ", path));
}

std::string FindSourceDir() {
  std::ifstream cache(BuildDir() + "/CMakeCache.txt");
  std::string line;
  constexpr absl::string_view kKey = "CMAKE_HOME_DIRECTORY:INTERNAL=";
  while (std::getline(cache, line)) {
    if (absl::StartsWith(line, kKey)) return line.substr(kKey.size());
  }
  NoTree(absl::StrCat("no CMAKE_HOME_DIRECTORY in ", BuildDir(), "/CMakeCache.txt"));
}

}  // namespace

const std::string& BuildDir() {
  static const std::string* const dir = new std::string(FindBuildDir());
  return *dir;
}

const std::string& SourceDir() {
  static const std::string* const dir = new std::string(FindSourceDir());
  return *dir;
}

std::string CoordinatorBinary() { return absl::StrCat(BuildDir(), "/", COLLSERVE_COORDINATOR_BIN); }
std::string SidecarBinary() { return absl::StrCat(BuildDir(), "/", COLLSERVE_SIDECAR_BIN); }
std::string RankBinary() { return absl::StrCat(BuildDir(), "/", COLLSERVE_RANK_BIN); }
std::string SurfaceRankBinary() { return absl::StrCat(BuildDir(), "/", COLLSERVE_SURFACE_RANK_BIN); }
std::string CollservectlBinary() { return absl::StrCat(BuildDir(), "/", COLLSERVE_CTL_BIN); }

absl::StatusOr<std::unique_ptr<Process>> Process::Start(const std::vector<std::string>& argv,
                                                        const std::map<std::string, std::string>& env,
                                                        const std::string& log_path) {
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    const std::string key = kv.substr(0, kv.find('='));
    if (env.count(key) == 0) envs.push_back(kv);
  }
  for (const auto& [k, v] : env) envs.push_back(absl::StrCat(k, "=", v));
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    // Child: own process group (so kills reach helpers it spawns), output to the log.
    setpgid(0, 0);
    int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(cargv[0], cargv.data(), cenv.data());
    _exit(127);
  }
  return std::unique_ptr<Process>(new Process(pid, log_path));
}

Process::~Process() {
  if (reaped_) return;
  Kill(SIGTERM);
  if (!Wait(absl::Seconds(3)).ok()) {
    Kill(SIGKILL);
    (void)Wait(absl::Seconds(10));
  }
}

void Process::Kill(int sig) {
  if (!reaped_) kill(pid_, sig);
}

absl::StatusOr<int> Process::Wait(absl::Duration timeout) {
  if (reaped_) return exit_code_;
  const bool exited = WaitFor(
      [&] {
        int status = 0;
        if (waitpid(pid_, &status, WNOHANG) != pid_) return false;
        reaped_ = true;
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return true;
      },
      timeout);
  if (!exited) {
    return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " still running after ",
                                                    absl::FormatDuration(timeout)));
  }
  return exit_code_;
}

bool Process::WaitForOutput(absl::string_view text, absl::Duration timeout) const {
  return WaitFor([&] { return absl::StrContains(Output(), text); }, timeout, absl::Milliseconds(20));
}

std::string Process::Output() const {
  std::ifstream in(log_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<int> ReadPortFile(const std::string& path, Process& p, absl::Duration timeout) {
  int port = 0;
  bool exited = false;
  WaitFor(
      [&] {
        std::ifstream in(path);
        std::string s;
        if (in >> s && absl::SimpleAtoi(s, &port) && port > 0) return true;
        port = 0;
        exited = p.Wait(absl::ZeroDuration()).ok();
        return exited;
      },
      timeout, absl::Milliseconds(20));
  if (port > 0) return port;
  if (exited) return absl::InternalError(absl::StrCat("process exited before serving: ", p.Output()));
  return absl::DeadlineExceededError(absl::StrCat("no port in ", path));
}

absl::StatusOr<std::string> WriteRandomToken(const std::string& path) {
  std::ifstream random("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  if (!random.read(reinterpret_cast<char*>(bytes), sizeof bytes)) return absl::InternalError("no /dev/urandom");
  std::string token;
  for (unsigned char b : bytes) absl::StrAppend(&token, absl::Hex(b, absl::kZeroPad2));
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  const std::string line = token + "\n";
  const bool written = write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  close(fd);
  if (!written) return absl::InternalError(absl::StrCat("write ", path));
  return token;
}

std::vector<std::string> Cluster::credential_flags() const {
  return {absl::StrCat("--admin_token_file=", dir_, "/admin.token"),
          absl::StrCat("--job_tokens_dir=", dir_, "/job-tokens")};
}

namespace {
// The daemons a Cluster starts itself exit with the test process (--parent_pid: the kernel's
// parent-death signal), so that a test binary killed before its destructors ran (ctest's
// timeout, a crash, a developer's ^C) leaves none of them running. Not for sidecars under
// mpirun (their parent is mpirun).
std::string ParentPidFlag() { return absl::StrCat("--parent_pid=", getpid()); }

// How long a daemon of a Cluster may take to serve (a daemon that exits ends the wait at
// once). A TSan sidecar on a CI machine loaded by the other test steps and builds took more
// than 20 s to write its port file.
constexpr absl::Duration kDaemonStartTimeout = UnderSanitizer(absl::Seconds(30), absl::Seconds(90));
}  // namespace

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::StartCoordinator(const std::vector<std::string>& coordinator_flags) {
  auto c = std::make_unique<Cluster>();
  char tmpl[] = "/tmp/collserve-test.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  c->dir_ = tmpl;
  if (mkdir(absl::StrCat(c->dir_, "/job-tokens").c_str(), 0700) != 0) return absl::InternalError("mkdir failed");
  auto job_token = WriteRandomToken(absl::StrCat(c->dir_, "/job-tokens/default"));
  if (!job_token.ok()) return job_token.status();
  c->job_token_ = *job_token;
  auto admin_token = WriteRandomToken(absl::StrCat(c->dir_, "/admin.token"));
  if (!admin_token.ok()) return admin_token.status();
  c->admin_token_ = *admin_token;
  // A port below the kernel's ephemeral range (UnusedPort), not port 0: RestartCoordinator
  // binds the same port again, and a port from the ephemeral range may meanwhile be the source
  // port of some other test's connection (a restart failed with "Address already in use" once,
  // beside tests that open hundreds of connections). Another test may draw the same port
  // between UnusedPort's check and the bind: then another port is tried.
  for (int attempt = 0;; ++attempt) {
    const int chosen = UnusedPort();
    std::vector<std::string> argv = {CoordinatorBinary(), absl::StrCat("--listen_address=127.0.0.1:", chosen),
                                     absl::StrCat("--port_file=", c->dir_, "/coordinator.port"),
                                     "--metrics_address=", "--log_level=warning", kLeaseGraceFlag, ParentPidFlag()};
    for (const std::string& f : c->credential_flags()) argv.push_back(f);
    argv.insert(argv.end(), coordinator_flags.begin(), coordinator_flags.end());
    auto coord = Process::Start(argv, {}, absl::StrCat(c->dir_, "/coordinator.log"));
    if (!coord.ok()) return coord.status();
    c->coordinator_ = std::move(*coord);
    auto port = ReadPortFile(absl::StrCat(c->dir_, "/coordinator.port"), *c->coordinator_, kDaemonStartTimeout);
    if (port.ok()) {
      c->coordinator_port_ = *port;
      return c;
    }
    if (attempt >= 2 || !absl::StrContains(c->coordinator_->Output(), "Address already in use")) return port.status();
    c->coordinator_.reset();
  }
}

std::vector<std::string> Cluster::SidecarArgv(int i) const {
  return {SidecarBinary(),
          absl::StrCat("--coordinator=", coordinator_address()),
          absl::StrCat("--unix_socket=", dir_, "/sidecar", i, ".sock"),
          absl::StrCat("--host_id=host", i),
          "--metrics_address=",
          "--log_level=warning",
          "--listen_address=127.0.0.1:0",
          absl::StrCat("--port_file=", dir_, "/sidecar", i, ".port")};
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(int num_sidecars,
                                                        const std::vector<std::string>& coordinator_flags,
                                                        const std::vector<std::string>& sidecar_flags,
                                                        const std::vector<std::vector<std::string>>& each_sidecar_flags) {
  auto started = StartCoordinator(coordinator_flags);
  if (!started.ok()) return started.status();
  std::unique_ptr<Cluster> c = std::move(*started);
  for (int i = 0; i < num_sidecars; ++i) {
    std::vector<std::string> argv = c->SidecarArgv(i);
    argv.push_back(ParentPidFlag());
    argv.insert(argv.end(), sidecar_flags.begin(), sidecar_flags.end());
    if (static_cast<size_t>(i) < each_sidecar_flags.size()) {
      argv.insert(argv.end(), each_sidecar_flags[i].begin(), each_sidecar_flags[i].end());
    }
    auto sc = Process::Start(argv, {}, absl::StrCat(c->dir_, "/sidecar", i, ".log"));
    if (!sc.ok()) return sc.status();
    c->sidecars_.push_back(std::move(*sc));
    c->sidecar_argv_.push_back(std::move(argv));
  }
  for (int i = 0; i < num_sidecars; ++i) {
    // The port file is written once the sidecar serves.
    auto sp = ReadPortFile(absl::StrCat(c->dir_, "/sidecar", i, ".port"), *c->sidecars_[i], kDaemonStartTimeout);
    if (!sp.ok()) return sp.status();
    c->sidecar_ports_.push_back(*sp);
  }
  return c;
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::StartUnderMpirun(const std::string& mpirun, int num_sidecars,
                                                                   const std::vector<std::string>& sidecar_flags) {
  auto started = StartCoordinator({});
  if (!started.ok()) return started.status();
  std::unique_ptr<Cluster> c = std::move(*started);
  std::vector<std::string> argv = {mpirun,         "--allow-run-as-root", "--oversubscribe", "--enable-recovery",
                                   "--mca",        "btl",                 "tcp,self",        "--mca",
                                   "btl_tcp_if_include", "lo",            "--mca",           "oob_tcp_if_include",
                                   "lo"};
  for (int i = 0; i < num_sidecars; ++i) {
    if (i > 0) argv.push_back(":");
    argv.push_back("-np");
    argv.push_back("1");
    for (std::string& a : c->SidecarArgv(i)) argv.push_back(std::move(a));
    argv.push_back("--mpi");
    argv.insert(argv.end(), sidecar_flags.begin(), sidecar_flags.end());
  }
  auto run = Process::Start(argv, {}, absl::StrCat(c->dir_, "/mpirun.log"));
  if (!run.ok()) return run.status();
  c->mpirun_ = std::move(*run);
  for (int i = 0; i < num_sidecars; ++i) {
    auto sp = ReadPortFile(absl::StrCat(c->dir_, "/sidecar", i, ".port"), *c->mpirun_, kDaemonStartTimeout);
    if (!sp.ok()) return absl::Status(sp.status().code(), absl::StrCat(sp.status().message(), "\n", c->mpirun_->Output()));
    c->sidecar_ports_.push_back(*sp);
  }
  return c;
}

pid_t Cluster::MpiSidecarPid(int i) const {
  const std::string socket = absl::StrCat("--unix_socket=", dir_, "/sidecar", i, ".sock");
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return -1;
  pid_t found = -1;
  while (dirent* e = readdir(proc)) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid)) continue;
    std::ifstream f(absl::StrCat("/proc/", pid, "/cmdline"), std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::vector<std::string> argv = absl::StrSplit(cmdline, '\0');
    if (argv.empty() || argv[0] != SidecarBinary()) continue;
    if (std::find(argv.begin(), argv.end(), socket) != argv.end()) {
      found = pid;
      break;
    }
  }
  closedir(proc);
  return found;
}

Cluster::~Cluster() {
  mpirun_.reset();  // SIGTERM: mpirun passes it to every sidecar of its world
  sidecars_.clear();
  coordinator_.reset();
  if (!dir_.empty() && std::getenv("COLLSERVE_KEEP_TEST_DIRS") == nullptr) {
    std::string cmd = absl::StrCat("rm -rf '", dir_, "'");
    (void)std::system(cmd.c_str());
  }
}

std::string Cluster::coordinator_address() const { return absl::StrCat("127.0.0.1:", coordinator_port_); }

std::string Cluster::sidecar_tcp_address(int i) const { return absl::StrCat("127.0.0.1:", sidecar_ports_[i]); }

absl::Status Cluster::RestartCoordinator(const std::vector<std::string>& extra_flags) {
  coordinator_.reset();  // SIGTERM, reaped
  const std::string pf = absl::StrCat(dir_, "/coordinator.port");
  std::remove(pf.c_str());
  std::vector<std::string> argv = {CoordinatorBinary(), absl::StrCat("--listen_address=127.0.0.1:", coordinator_port_),
                                   absl::StrCat("--port_file=", pf), "--metrics_address=", "--log_level=warning",
                                   kLeaseGraceFlag, ParentPidFlag()};
  for (const std::string& f : credential_flags()) argv.push_back(f);
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  auto coord = Process::Start(argv, {}, absl::StrCat(dir_, "/coordinator-", next_log_++, ".log"));
  if (!coord.ok()) return coord.status();
  coordinator_ = std::move(*coord);
  auto port = ReadPortFile(pf, *coordinator_, kDaemonStartTimeout);
  return port.status();
}

absl::Status Cluster::RestartSidecar(int i) {
  sidecars_[i].reset();  // SIGTERM (a no-op for one that died), reaped
  const std::string pf = absl::StrCat(dir_, "/sidecar", i, ".port");
  std::remove(pf.c_str());
  auto sc = Process::Start(sidecar_argv_[i], {}, absl::StrCat(dir_, "/sidecar", i, "-", next_log_++, ".log"));
  if (!sc.ok()) return sc.status();
  sidecars_[i] = std::move(*sc);
  auto port = ReadPortFile(pf, *sidecars_[i], kDaemonStartTimeout);
  if (!port.ok()) return port.status();
  sidecar_ports_[i] = *port;
  return absl::OkStatus();
}

std::string Cluster::sidecar_address(int i) const { return absl::StrCat("unix:", dir_, "/sidecar", i, ".sock"); }

absl::StatusOr<std::unique_ptr<Process>> Cluster::StartRank(int rank, int world_size, int sidecar,
                                                            const std::vector<std::string>& args,
                                                            const std::map<std::string, std::string>& extra_env) {
  std::vector<std::string> argv = {rank_binary_.empty() ? RankBinary() : rank_binary_};
  argv.insert(argv.end(), args.begin(), args.end());
  std::map<std::string, std::string> env = {
      {"RANK", absl::StrCat(rank)},
      {"WORLD_SIZE", absl::StrCat(world_size)},
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", absl::StrCat(coordinator_port_)},
      {"COLLSERVE_SIDECAR", sidecar_address(sidecar)},
      {"COLLSERVE_INIT_TIMEOUT_S", "30"},
      {"COLLSERVE_OP_TIMEOUT_S", "30"},
      {"COLLSERVE_TOKEN", job_token_},
  };
  for (const auto& [k, v] : extra_env) env[k] = v;
  return Process::Start(argv, env, absl::StrCat(dir_, "/rank", rank, "-", next_log_++, ".log"));
}

std::string Cluster::Logs() {
  std::string out = absl::StrCat("--- coordinator ---\n", coordinator_->Output());
  for (size_t i = 0; i < sidecars_.size(); ++i) {
    absl::StrAppend(&out, "--- sidecar ", i, " ---\n", sidecars_[i]->Output());
  }
  if (mpirun_ != nullptr) absl::StrAppend(&out, "--- mpirun (every sidecar) ---\n", mpirun_->Output());
  return out;
}

double MetricValue(int port, const std::string& sample) {
  const std::string line = absl::StrCat("\n", sample, " ");
  const std::string body = HttpGet(port, "/metrics");
  const size_t at = body.find(line);
  if (at == std::string::npos) return -1;
  const size_t from = at + line.size();
  double n = -1;
  return absl::SimpleAtod(body.substr(from, body.find('\n', from) - from), &n) ? n : -1;
}

std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string body;
  // 30 s: a sanitized daemon on a loaded CI machine once took more than 5 s to answer.
  timeval tv{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: localhost\r\n\r\n");
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) body.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return body;
}

double CpuSeconds(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return -1;
  // Fields after the command (which may hold spaces) in parentheses: state is field 3,
  // utime and stime fields 14 and 15.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(line.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int UnusedPort() {
  int low = 32768;
  if (FILE* f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (fscanf(f, "%d", &low) != 1) low = 32768;
    fclose(f);
  }
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(std::max(1024, low - 12000), low - 1);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = pick(rng);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) return port;
  }
  return 0;
}

}  // namespace collserve::testing
