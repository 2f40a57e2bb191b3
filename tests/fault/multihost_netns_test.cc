// Several hosts on one machine: network namespaces joined by a bridge (veth pairs), made
// and removed by the test itself (needs root; skipped otherwise). The coordinator runs in
// its own namespace, each sidecar in another with its own IP for Gloo, and ranks in their
// sidecar's namespace. Checks all_reduce across the hosts, then cuts one host off (nft drop
// rules in its namespace) in the middle of collectives: the other hosts' ranks must fail
// within the op timeout, or at once when the coordinator takes the host as lost, and can
// re-form without it and with it again once healed. In builds with MPI (issue 45), the
// MpiNetnsHosts tests run the sidecars as one MPI world under mpirun across the namespaces
// (COLLSERVE_BACKEND=mpi) for the surface suite and the same cuts.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/testing/process.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

// A sanitized build's Python module needs its runtime preloaded into python, which
// scripts/sanitizers.sh does for the Python suites only (their ranks cover reconfigure):
// the tests with Python ranks skip there (kSanitized, tests/testing/sanitizers.h).

int Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

class NetnsHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
    prefix_ = absl::StrCat("cs", getpid() % 100000);
    sw_ = prefix_ + "sw";
    if (Sh("ip netns add " + sw_) != 0) GTEST_SKIP() << "ip netns is not available here";
    made_.push_back(sw_);
    ASSERT_EQ(Sh(absl::StrCat("ip -n ", sw_, " link add br0 type bridge && ip -n ", sw_, " link set br0 up")), 0);
    // Host i (1..3) gets 10.231.<pid-derived>.i; host 3 runs the coordinator.
    subnet_ = absl::StrCat("10.231.", getpid() % 250, ".");
    for (int i = 1; i <= 3; ++i) {
      const std::string ns = Host(i);
      ASSERT_EQ(Sh("ip netns add " + ns), 0);
      made_.push_back(ns);
      ASSERT_EQ(Sh(absl::StrCat("ip link add ", prefix_, "v", i, " type veth peer name ", prefix_, "p", i,
                                " netns ", sw_)), 0);
      ASSERT_EQ(Sh(absl::StrCat("ip link set ", prefix_, "v", i, " netns ", ns)), 0);
      ASSERT_EQ(Sh(absl::StrCat("ip -n ", ns, " addr add ", Ip(i), "/24 dev ", prefix_, "v", i)), 0);
      ASSERT_EQ(Sh(absl::StrCat("ip -n ", ns, " link set ", prefix_, "v", i, " up && ip -n ", ns, " link set lo up")), 0);
      ASSERT_EQ(Sh(absl::StrCat("ip -n ", sw_, " link set ", prefix_, "p", i, " master br0 && ip -n ", sw_,
                                " link set ", prefix_, "p", i, " up")), 0);
    }
    char tmpl[] = "/tmp/collserve-netns.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }

  void TearDown() override {
    procs_.clear();  // kill before the namespaces go
    KillLeftovers();
    for (auto it = made_.rbegin(); it != made_.rend(); ++it) Sh("ip netns del " + *it);
    if (!root_link_.empty()) Sh("ip link del " + root_link_);
    if (!dir_.empty()) Sh("rm -rf " + dir_);
  }

  std::string Host(int i) const { return absl::StrCat(prefix_, "h", i); }
  std::string Ip(int i) const { return absl::StrCat(subnet_, i); }

  Process& Run(int host, std::vector<std::string> argv, std::map<std::string, std::string> env, const std::string& log) {
    argv.insert(argv.begin(), {"/usr/sbin/ip", "netns", "exec", Host(host)});
    auto p = Process::Start(argv, env, absl::StrCat(dir_, "/", log));
    EXPECT_TRUE(p.ok()) << p.status();
    procs_.push_back(std::move(*p));
    names_.push_back(log);
    return *procs_.back();
  }

  // Every process's output (the coordinator's and sidecars' logs, every rank's), the last
  // 8 KiB of each: what a failure message needs to tell where a cut went wrong.
  std::string Logs() const {
    std::string out;
    for (size_t i = 0; i < procs_.size(); ++i) {
      std::string o = procs_[i]->Output();
      if (o.size() > 8192) o = "..." + o.substr(o.size() - 8192);
      absl::StrAppend(&out, "\n=== ", names_[i], " ===\n", o);
    }
    return out;
  }

  // The last line of every process's output, one line each (a failure message's first
  // lines: CI's digest of a failed run keeps a few lines after each failure).
  std::string LastLines() const {
    std::string out;
    for (size_t i = 0; i < procs_.size(); ++i) absl::StrAppend(&out, "\n  ", names_[i], ": ", Tail(procs_[i]->Output(), 1));
    return out;
  }
  static std::string Tail(const std::string& text, int lines) {
    size_t end = text.size();
    while (end > 0 && text[end - 1] == '\n') --end;
    size_t begin = end;
    for (int n = 0; n < lines && begin > 0;) {
      if (text[--begin] == '\n') ++n;
    }
    if (begin > 0 || (begin < end && text[begin] == '\n')) ++begin;
    return text.substr(begin, end - begin);
  }

  // Coordinator on host 3, sidecars on hosts 1 .. `sidecar_hosts` (2 or 3).
  // The coordinator requires job "default"'s token (token_), which the ranks present.
  void StartService(int sidecar_hosts = 2) {
    ASSERT_EQ(mkdir(absl::StrCat(dir_, "/job-tokens").c_str(), 0700), 0);
    auto token = WriteRandomToken(absl::StrCat(dir_, "/job-tokens/default"));
    ASSERT_TRUE(token.ok()) << token.status();
    token_ = *token;
    Run(3, {CoordinatorBinary(), absl::StrCat("--listen_address=", Ip(3), ":29400"), "--metrics_address=",
            "--log_level=warning", absl::StrCat("--port_file=", dir_, "/coord.port"),
            absl::StrCat("--job_tokens_dir=", dir_, "/job-tokens")},
        {}, "coordinator.log");
    WaitFile(dir_ + "/coord.port");
    if (mpi_) {
      StartMpiSidecars(sidecar_hosts);
      return;
    }
    for (int h = 1; h <= sidecar_hosts; ++h) {
      Run(h, SidecarArgv(h), {}, absl::StrCat("sidecar", h, ".log"));
      WaitFile(absl::StrCat(dir_, "/s", h, ".port"));
    }
  }

  std::vector<std::string> SidecarArgv(int h) const {
    return {SidecarBinary(), absl::StrCat("--coordinator=", Ip(3), ":29400"),
            absl::StrCat("--unix_socket=", dir_, "/s", h, ".sock"), absl::StrCat("--gloo_hostname=", Ip(h)),
            absl::StrCat("--host_id=host", h), "--metrics_address=", "--log_level=info",
            absl::StrCat("--port_file=", dir_, "/s", h, ".port")};
  }

  // The sidecars of hosts 1 .. `hosts` as one MPI world: one mpirun in this (the root)
  // namespace starts each in its host's namespace (`ip netns exec`). Open MPI's processes
  // reach mpirun's PMIx server over TCP only, so the root namespace gets a leg on the
  // bridge (.254) that PMIx listens on; MPI's own bytes go over the bridge (btl tcp).
  void StartMpiSidecars(int hosts) {
#ifdef COLLSERVE_MPIEXEC
    root_link_ = prefix_ + "vr";
    ASSERT_EQ(Sh(absl::StrCat("ip link add ", root_link_, " type veth peer name ", prefix_, "pr netns ", sw_)), 0);
    ASSERT_EQ(Sh(absl::StrCat("ip addr add ", subnet_, "254/24 dev ", root_link_, " && ip link set ", root_link_,
                              " up && ip -n ", sw_, " link set ", prefix_, "pr master br0 && ip -n ", sw_,
                              " link set ", prefix_, "pr up")),
              0);
    const std::string net = absl::StrCat(subnet_, "0/24");
    std::vector<std::string> argv = {COLLSERVE_MPIEXEC, "--allow-run-as-root", "--oversubscribe",
                                     "--enable-recovery", "--mca", "btl", "tcp,self", "--mca",
                                     "btl_tcp_if_include", net, "--mca", "oob_tcp_if_include", net};
    for (int h = 1; h <= hosts; ++h) {
      if (h > 1) argv.push_back(":");
      for (const char* a : {"-np", "1", "/usr/sbin/ip", "netns", "exec"}) argv.push_back(a);
      argv.push_back(Host(h));
      for (std::string& a : SidecarArgv(h)) argv.push_back(std::move(a));
      argv.push_back("--mpi");
    }
    auto p = Process::Start(argv, {{"PMIX_MCA_ptl_tcp_remote_connections", "1"}, {"PMIX_MCA_ptl_tcp_if_include", net}},
                            absl::StrCat(dir_, "/mpirun.log"));
    ASSERT_TRUE(p.ok()) << p.status();
    procs_.push_back(std::move(*p));
    names_.push_back("mpirun.log");
    // Each sidecar writes its port file after MPI_Init, which waits for every process of the
    // world through mpirun's PMIx server: on a loaded 2-core CI machine once more than 20 s
    // for three of them (that run did not say why; the logs now come with the failure).
    for (int h = 1; h <= hosts; ++h) WaitFile(absl::StrCat(dir_, "/s", h, ".port"), absl::Seconds(60));
#else
    (void)hosts;
    FAIL() << "a build without MPI";
#endif
  }

  // SIGKILL to every process still running with this test's directory in its command line
  // (sidecars mpirun started, should mpirun have died first): nothing of the test outlives it.
  void KillLeftovers() const {
    if (dir_.empty()) return;
    DIR* proc = opendir("/proc");
    if (proc == nullptr) return;
    while (dirent* e = readdir(proc)) {
      pid_t pid = 0;
      if (!absl::SimpleAtoi(e->d_name, &pid) || pid == getpid()) continue;
      std::ifstream f(absl::StrCat("/proc/", pid, "/cmdline"), std::ios::binary);
      const std::string cmdline((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      if (cmdline.find(dir_ + "/") != std::string::npos) kill(pid, SIGKILL);
    }
    closedir(proc);
  }

  Process& Rank(int rank, int world, int host, std::vector<std::string> args, const std::string& op_timeout = "30") {
    args.insert(args.begin(), rank_binary_.empty() ? RankBinary() : rank_binary_);
    return Run(host, args,
               {{"RANK", absl::StrCat(rank)},
                {"WORLD_SIZE", absl::StrCat(world)},
                {"MASTER_ADDR", Ip(3)},
                {"MASTER_PORT", "29400"},
                {"COLLSERVE_SIDECAR", absl::StrCat("unix:", dir_, "/s", host, ".sock")},
                {"COLLSERVE_INIT_TIMEOUT_S", "30"},
                {"COLLSERVE_OP_TIMEOUT_S", op_timeout},
                {"COLLSERVE_TOKEN", token_},
                {"COLLSERVE_BACKEND", mpi_ ? "mpi" : ""}},
               absl::StrCat("rank", rank, "-", procs_.size(), ".log"));
  }

  // A Python rank (tests/python/elastic_worker.py) on `host` that exits after 20 iterations
  // in a re-formed group of `final_world` ranks.
  Process& PythonRank(int rank, int world, int host, const std::string& op_timeout, int final_world) {
    return Run(host, {COLLSERVE_PYTHON_EXE, SourceDir() + "/tests/python/elastic_worker.py", absl::StrCat(final_world)},
               {{"RANK", absl::StrCat(rank)},
                {"WORLD_SIZE", absl::StrCat(world)},
                {"COLLSERVE_COORDINATOR", absl::StrCat(Ip(3), ":29400")},
                {"COLLSERVE_SIDECAR", absl::StrCat("unix:", dir_, "/s", host, ".sock")},
                {"COLLSERVE_INIT_TIMEOUT_S", "30"},
                {"COLLSERVE_OP_TIMEOUT_S", op_timeout},
                {"COLLSERVE_TOKEN", token_},
                {"PYTHONPATH", BuildDir() + "/python"},
                {"PYTHONUNBUFFERED", "1"}},
               absl::StrCat("rank", rank, "-", procs_.size(), ".log"));
  }

  // Six Python ranks, two per host on hosts 1..3 (rank r on host 1 + r % 3), that have done
  // 20 all_reduces; then host 2 drops off the network (no RST, only silence). Empty if
  // skipped or failed.
  std::vector<Process*> StartPythonRanksAndCutHost2(int final_world) {
    if (access((BuildDir() + "/python/collserve/__init__.py").c_str(), F_OK) != 0) {
      ADD_FAILURE() << "no Python module in " << BuildDir() << "/python";
      return {};
    }
    StartService(/*sidecar_hosts=*/3);
    std::vector<Process*> ranks;
    for (int r = 0; r < 6; ++r) ranks.push_back(&PythonRank(r, 6, 1 + r % 3, /*op_timeout=*/"5", final_world));
    return CutHost2Once(ranks, "iter 20 ok", absl::Seconds(60));
  }

  // Two C++ ranks per host on `hosts` hosts (2 or 3; rank r on host 1 + r % hosts) in a
  // loop of all_reduces with `op_timeout`; once each did 3, host 2 drops off the network
  // (no RST reaches the others, only silence). Empty if that failed (the failure is recorded).
  std::vector<Process*> StartLoopRanksAndCutHost2(const std::string& op_timeout, int hosts = 2) {
    StartService(hosts);
    std::vector<Process*> ranks;
    for (int r = 0; r < 2 * hosts; ++r) {
      ranks.push_back(&Rank(r, 2 * hosts, 1 + r % hosts, {"--mode=loop", "--count=262144"}, op_timeout));
    }
    return CutHost2Once(ranks, "iter 2 ok", absl::Seconds(30));
  }

  // Issue 41, finding 7: cuts host 2 off (from its peers and the coordinator alike) among
  // `hosts` hosts with a 5 s op timeout and checks that every rank, on every side, fails
  // within op timeout + 1 s of its call; prints each rank's time.
  void ExpectEverySideOfACutToFailWithinTheOpTimeoutPlusOneSecond(int hosts) {
    std::vector<Process*> ranks = StartLoopRanksAndCutHost2(/*op_timeout=*/"5", hosts);
    if (ranks.empty()) return;
    const absl::Time cut = absl::Now();
    std::string times;
    int64_t worst_ms = 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      // Up to 20 s, so that a late error's time and text are in the failure message.
      auto code = ranks[r]->Wait(absl::Seconds(20) - (absl::Now() - cut));
      ASSERT_TRUE(code.ok()) << "rank " << r << " got no error within 20 s of the cut:" << LastLines() << Logs();
      EXPECT_EQ(*code, 3) << ranks[r]->Output();
      // The time from the failed call to its error, as the rank measured it ("error after N ms").
      const std::string out = ranks[r]->Output();
      const size_t at = out.rfind("error after ");
      int64_t ms = -1;
      ASSERT_NE(at, std::string::npos) << out;
      ASSERT_TRUE(absl::SimpleAtoi(out.substr(at + 12, out.find(' ', at + 12) - at - 12), &ms)) << out;
      worst_ms = std::max(worst_ms, ms);
      absl::StrAppend(&times, " rank ", r, " (host ", 1 + r % hosts, "): ", ms, " ms;");
    }
    EXPECT_LE(worst_ms, 6000) << "not every rank failed within op timeout + 1 s of its call:" << times
                              << LastLines() << Logs();
    std::printf("each rank's error after its call (%d hosts, op timeout 5 s, worst %lld ms):%s\n", hosts,
                static_cast<long long>(worst_ms), times.c_str());
  }

  // Once every rank printed `progress` (within `timeout`), cuts host 2's link and returns
  // `ranks`; empty (the failure recorded) otherwise.
  std::vector<Process*> CutHost2Once(const std::vector<Process*>& ranks, const std::string& progress,
                                     absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    for (Process* p : ranks) {
      if (!p->WaitForOutput(progress, deadline - absl::Now())) {
        ADD_FAILURE() << "no \"" << progress << "\" within " << timeout << ":" << LastLines() << Logs();
        return {};
      }
    }
    if (!CutHost2()) {
      ADD_FAILURE() << "cannot cut host 2's link";
      return {};
    }
    return ranks;
  }

  // Host 2 drops every packet in and out (nftables in its namespace: the peers see silence,
  // no RST), or, where nft is missing, its link goes down on the bridge (the same silence).
  bool CutHost2() {
    const std::string rules =
        "table inet collserve_cut { chain in { type filter hook input priority 0; policy drop; iif lo accept; }; "
        "chain out { type filter hook output priority 0; policy drop; oif lo accept; }; }";
    if (Sh(absl::StrCat("ip netns exec ", Host(2), " nft '", rules, "'")) == 0) {
      cut_by_nft_ = true;
      std::printf("host 2 cut off with nft drop rules\n");
      return true;
    }
    std::printf("nft is not usable here: host 2's link goes down instead\n");
    return Sh(absl::StrCat("ip -n ", sw_, " link set ", prefix_, "p2 down")) == 0;
  }
  bool HealHost2() {
    if (cut_by_nft_) return Sh(absl::StrCat("ip netns exec ", Host(2), " nft delete table inet collserve_cut")) == 0;
    return Sh(absl::StrCat("ip -n ", sw_, " link set ", prefix_, "p2 up")) == 0;
  }
  bool cut_by_nft_ = false;
  bool mpi_ = false;          // the sidecars run as one MPI world, the ranks ask for mpi
  std::string root_link_;     // the root namespace's leg on the bridge (MPI only)
  std::string rank_binary_;   // what Rank runs; "" = RankBinary()

  // Waits for a daemon's port file, at most `within`; the failure says what every process
  // of the test printed (a daemon that never started, or mpirun's complaint).
  void WaitFile(const std::string& path, absl::Duration within = absl::Seconds(20)) {
    WaitFor([&] { return access(path.c_str(), F_OK) == 0; }, within);
    ASSERT_EQ(access(path.c_str(), F_OK), 0)
        << path << " did not appear within " << within << LastLines() << Logs();
  }

  std::string prefix_, sw_, subnet_, dir_, token_;
  std::vector<std::string> made_;
  std::vector<std::unique_ptr<Process>> procs_;
  std::vector<std::string> names_;  // procs_[i]'s log file name
};

TEST_F(NetnsHosts, AllReduceAcrossTwoHostsWithTwoRanksEach) {
  StartService();
  std::vector<Process*> ranks;
  for (int r = 0; r < 4; ++r) ranks.push_back(&Rank(r, 4, 1 + r % 2, {"--mode=sweep", "--counts=0,7,1048576"}));
  for (Process* p : ranks) {
    auto code = p->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.ok()) << p->Output();
    EXPECT_EQ(*code, 0) << p->Output();
    EXPECT_NE(p->Output().find("sweep done: 78 collectives, 0 wrong elements"), std::string::npos) << p->Output();
  }
}

TEST_F(NetnsHosts, CutLinkFailsTheOtherHostWithinTheOpTimeout) {
  std::vector<Process*> ranks = StartLoopRanksAndCutHost2(/*op_timeout=*/"5");
  if (ranks.empty()) return;
  const absl::Time cut = absl::Now();
  for (int r : {0, 2}) {  // the ranks on host 1
    auto code = ranks[r]->Wait(absl::Seconds(5) + absl::Seconds(3));
    ASSERT_TRUE(code.ok()) << "rank " << r << " got no error within the op timeout: " << Logs();
    EXPECT_EQ(*code, 3) << ranks[r]->Output();
    // The op timeout, or the coordinator's lease (renewed every 2 s, 3 s of grace) if it
    // ended first.
    const std::string out = ranks[r]->Output();
    EXPECT_TRUE(out.find("DEADLINE_EXCEEDED") != std::string::npos ||
                out.find("were lost with their host") != std::string::npos)
        << out;
  }
  EXPECT_LT(absl::Now() - cut, absl::Seconds(8));
}

// Issue 41, finding 7: the ranks of the host that is cut off (from its peers and from the
// coordinator alike) got their error at 7.6-7.8 s with a 5 s op timeout. Every rank, on
// both sides, fails within op timeout + 1 s of the cut.
TEST_F(NetnsHosts, EverySideOfACutFailsWithinTheOpTimeoutPlusOneSecond) {
  ExpectEverySideOfACutToFailWithinTheOpTimeoutPlusOneSecond(/*hosts=*/2);
}

// The same among three hosts (the report's 12.4 s with a 10 s op timeout was a 3-host
// trial): host 2 is cut off, hosts 1 and 3 still reach each other and the coordinator.
TEST_F(NetnsHosts, EverySideOfACutAmongThreeHostsFailsWithinTheOpTimeoutPlusOneSecond) {
  ExpectEverySideOfACutToFailWithinTheOpTimeoutPlusOneSecond(/*hosts=*/3);
}

// The same cut with an op timeout of 60 s: the coordinator takes host 2 as lost once its
// sidecar stops renewing its lease on the group (a watch every 2 s, --lease_grace 3 s), ends
// the generation, and host 1's sidecar fails its ranks' collective at once, naming the lost
// ranks, and shuts its backend connections to host 2 down, so nothing waits for the op
// timeout.
TEST_F(NetnsHosts, CutHostIsTakenAsLostByTheCoordinatorLongBeforeTheOpTimeout) {
  std::vector<Process*> ranks = StartLoopRanksAndCutHost2(/*op_timeout=*/"60");
  if (ranks.empty()) return;
  const absl::Time cut = absl::Now();
  for (int r : {0, 2}) {  // the ranks on host 1
    auto code = ranks[r]->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << "rank " << r << " got no error within 20 s of the cut:" << LastLines() << Logs();
    EXPECT_EQ(*code, 3) << "rank " << r << ":" << LastLines() << "\n" << ranks[r]->Output();
    EXPECT_NE(ranks[r]->Output().find("ranks [1, 3] were lost with their host (lost with host host2"),
              std::string::npos)
        << "rank " << r << ":" << LastLines() << Logs();
  }
  const absl::Duration took = absl::Now() - cut;
  // At most one renewal interval and the grace (5 s), plus the timer and the exit (slower in
  // sanitized builds); the op timeout is 60 s.
  EXPECT_LT(took, absl::Seconds(12)) << LastLines() << Logs();
  std::printf("host 1's ranks failed %s after host 2 was cut off (op timeout 60 s)\n",
              absl::FormatDuration(took).c_str());
}

// Three hosts, two ranks each (Python, tests/python/elastic_worker.py). Host 2 drops off the
// network in the middle of all_reduces: the ranks of hosts 1 and 3 fail within the op
// timeout, re-form the group without it (collserve.reconfigure: 4 ranks, a join window of
// 3 s) and go on with correct sums, all within op timeout + a few seconds.
TEST_F(NetnsHosts, CutHostIsLeftBehindAndTheOthersReformWithoutIt) {
  if (kSanitized) GTEST_SKIP() << "Python ranks of a sanitized build: see kSanitized";
  std::vector<Process*> ranks = StartPythonRanksAndCutHost2(/*final_world=*/4);
  if (ranks.empty()) return;
  const absl::Time cut = absl::Now();
  for (int r : {0, 2, 3, 5}) {  // the ranks on hosts 1 and 3
    auto code = ranks[r]->Wait(absl::Seconds(40));
    ASSERT_TRUE(code.ok()) << "rank " << r << " did not finish: " << Logs();
    EXPECT_EQ(*code, 0) << ranks[r]->Output();
    EXPECT_NE(ranks[r]->Output().find(" of 4\n"), std::string::npos) << ranks[r]->Output();
  }
  const absl::Duration took = absl::Now() - cut;
  // Op timeout (5 s) + join window (3 s) + forming and 20 iterations: well under 20 s.
  EXPECT_LT(took, absl::Seconds(20)) << "re-formed and finished " << took << " after the cut";
  std::printf("re-formed without the cut host and finished 20 iterations %s after the cut\n",
              absl::FormatDuration(took).c_str());
}

// As above, then the link heals once the others re-formed: host 2's ranks, taken for lost,
// join the next generation (reconfigure turns a late rank into a joiner; the others admit
// it through should_reconfigure every 20 iterations), and all six finish in a group of 6.
TEST_F(NetnsHosts, CutHostRejoinsAtTheNextGenerationOnceTheLinkHeals) {
  if (kSanitized) GTEST_SKIP() << "Python ranks of a sanitized build: see kSanitized";
  std::vector<Process*> ranks = StartPythonRanksAndCutHost2(/*final_world=*/6);
  if (ranks.empty()) return;
  const absl::Time deadline = absl::Now() + absl::Seconds(40);
  for (int r : {0, 2, 3, 5}) {
    ranks[r]->WaitForOutput(" of 4\n", deadline - absl::Now());
    ASSERT_NE(ranks[r]->Output().find(" of 4\n"), std::string::npos) << ranks[r]->Output();
  }
  ASSERT_TRUE(HealHost2());
  const absl::Time healed = absl::Now();
  for (int r = 0; r < 6; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << "rank " << r << " did not finish: " << Logs();
    EXPECT_EQ(*code, 0) << ranks[r]->Output();
    EXPECT_NE(ranks[r]->Output().find(" of 6\n"), std::string::npos) << ranks[r]->Output();
  }
  std::printf("host 2 rejoined and all six finished %s after the link healed\n",
              absl::FormatDuration(absl::Now() - healed).c_str());
}

// A pipeline whose first stage finished first: the two ranks of host 1 leave at once (their
// processes end) while the four ranks of hosts 2 and 3 pass a ring of point-to-point
// messages among themselves for 2,000 rounds (~3 s), every element checked, then leave.
// torch.distributed's semantics: a rank that leaves fails only what needs it. Before the
// fix, host 1's sidecar closed its connections before telling the others its ranks had
// left, so when the survivors finished, their hosts announced their own departures to host
// 1, found its connection closed, and failed the group under the survivors' last calls.
// Now host 1 sends its departures before it closes (PointToPoint::Stop), and no host
// announces to one whose ranks the coordinator already said left; each alone passed this
// test 3 of 3 times.
TEST_F(NetnsHosts, PointToPointAmongTheOtherHostsGoesOnAfterEveryRankOfOneHostLeft) {
  StartService(/*sidecar_hosts=*/3);
  rank_binary_ = SurfaceRankBinary();
  std::vector<Process*> ranks;
  for (int r = 0; r < 6; ++r) {
    ranks.push_back(&Rank(r, 6, 1 + r % 3, {"--mode=p2p_after_leave", "--leavers=0,3", "--iters=2000"}, "20"));
  }
  for (int r = 0; r < 6; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(90));
    ASSERT_TRUE(code.ok()) << "rank " << r << " hung:" << LastLines() << Logs();
    EXPECT_EQ(*code, 0) << "rank " << r << ":\n" << ranks[r]->Output() << LastLines();
    if (r % 3 != 0) {
      EXPECT_NE(ranks[r]->Output().find("p2p_after_leave done: 6000 checked, 0 wrong"), std::string::npos)
          << ranks[r]->Output();
    }
  }
}

#ifdef COLLSERVE_MPIEXEC
// The sidecars as one MPI world under mpirun, each in its host's namespace, and every group
// asking for mpi (issue 45): the hosts' step runs over Open MPI's TCP transport across the
// bridge. Only in builds with MPI (the sanitizer presets have none).
class MpiNetnsHosts : public NetnsHosts {
 protected:
  void SetUp() override {
    NetnsHosts::SetUp();
    mpi_ = true;
  }

  // The surface suite's collectives (every dtype and size, arena tensors too) and
  // point-to-point calls on `hosts` hosts, 2 ranks each (rank r on host 1 + r % hosts).
  void ExpectSurface(int hosts) {
    StartService(hosts);
    rank_binary_ = SurfaceRankBinary();
    const std::vector<std::pair<std::vector<std::string>, std::string>> modes = {
        {{"--mode=collectives", "--arena"}, " checked, 0 wrong"}, {{"--mode=p2p"}, " 0 wrong"}};
    for (const auto& [args, expect] : modes) {
      const std::string& mode = args[0];
      std::vector<Process*> ranks;
      for (int r = 0; r < 2 * hosts; ++r) ranks.push_back(&Rank(r, 2 * hosts, 1 + r % hosts, args, "20"));
      for (size_t r = 0; r < ranks.size(); ++r) {
        auto code = ranks[r]->Wait(absl::Seconds(120));
        ASSERT_TRUE(code.ok()) << "rank " << r << " (" << mode << ") hung:" << LastLines() << Logs();
        EXPECT_EQ(*code, 0) << ranks[r]->Output() << Logs();
        EXPECT_NE(ranks[r]->Output().find(expect), std::string::npos) << ranks[r]->Output();
      }
    }
    // The hosts' step ran over MPI.
    EXPECT_NE(Logs().find(absl::StrCat(" of ", hosts, " (mpi)")), std::string::npos) << Logs();
  }
};

TEST_F(MpiNetnsHosts, SurfaceSuiteOverMpiOnTwoHosts) { ExpectSurface(2); }
TEST_F(MpiNetnsHosts, SurfaceSuiteOverMpiOnThreeHosts) { ExpectSurface(3); }

// A cut link under MPI (MPI reports no failure of a peer): every rank on every side fails
// within op timeout + 1 s of its call, as over Gloo.
TEST_F(MpiNetnsHosts, EverySideOfACutFailsWithinTheOpTimeoutPlusOneSecond) {
  ExpectEverySideOfACutToFailWithinTheOpTimeoutPlusOneSecond(/*hosts=*/2);
}
TEST_F(MpiNetnsHosts, EverySideOfACutAmongThreeHostsFailsWithinTheOpTimeoutPlusOneSecond) {
  ExpectEverySideOfACutToFailWithinTheOpTimeoutPlusOneSecond(/*hosts=*/3);
}
#endif

}  // namespace
}  // namespace collserve::testing
