#include "tests/testing/etcd_cluster.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <dirent.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

// The inode of the socket listening on 127.0.0.1:`port` (/proc/net/tcp), 0 if none.
unsigned long ListeningInode(int port) {
  FILE* f = std::fopen("/proc/net/tcp", "r");
  if (f == nullptr) return 0;
  char line[512];
  unsigned long found = 0;
  const std::string local = absl::StrFormat("0100007F:%04X", port);
  while (found == 0 && std::fgets(line, sizeof line, f) != nullptr) {
    char addr[64], state[8];
    unsigned long inode = 0;
    // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
    if (std::sscanf(line, " %*s %63s %*s %7s %*s %*s %*s %*s %*s %lu", addr, state, &inode) == 3 &&
        local == addr && std::string(state) == "0A") {
      found = inode;
    }
  }
  std::fclose(f);
  return found;
}

// Whether process `pid` holds socket `inode`.
bool HoldsSocket(pid_t pid, unsigned long inode) {
  const std::string dir = absl::StrCat("/proc/", pid, "/fd");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return false;
  const std::string want = absl::StrCat("socket:[", inode, "]");
  bool held = false;
  while (dirent* e = readdir(d)) {
    char target[64];
    const ssize_t n = readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
    if (n > 0 && want == std::string(target, static_cast<size_t>(n))) held = true;
  }
  closedir(d);
  return held;
}

}  // namespace

std::string EtcdBinary() {
  for (const char* path : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(int members, const EtcdTls& tls) {
  if (EtcdBinary().empty()) return absl::FailedPreconditionError("etcd is not installed (Debian's etcd-server)");
  std::unique_ptr<EtcdCluster> c(new EtcdCluster());
  char tmpl[] = "/tmp/collserve-etcd.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  c->dir_ = tmpl;
  c->tls_ = tls;
  // A port found free may be taken (by another test's process) before etcd binds it: then
  // the cluster starts again on other ports, up to 5 times.
  for (int attempt = 1;; ++attempt) {
    std::set<int> ports;
    for (int pick = 0; pick < 100 && ports.size() < static_cast<size_t>(2 * members); ++pick) {
      if (const int p = UnusedPort(); p > 0) ports.insert(p);
    }
    if (ports.size() < static_cast<size_t>(2 * members)) {
      return absl::UnavailableError(absl::StrCat("no ", 2 * members, " distinct free loopback ports for etcd"));
    }
    auto port = ports.begin();
    c->client_ports_.clear();
    c->peer_ports_.clear();
    for (int i = 0; i < members; ++i) {
      c->client_ports_.push_back(*port++);
      c->peer_ports_.push_back(*port++);
    }
    c->members_.clear();
    c->members_.resize(members);
    std::error_code ignored;
    for (int i = 0; i < members; ++i) std::filesystem::remove_all(absl::StrCat(c->dir_, "/m", i), ignored);
    for (int i = 0; i < members; ++i) {
      if (absl::Status s = c->StartMember(i, /*fresh=*/true); !s.ok()) return s;
    }
    absl::Status listening = c->WaitListening(absl::Seconds(20));
    if (listening.ok()) return c;
    if (attempt == 5 || c->Logs().find("address already in use") == std::string::npos) return listening;
  }
}

absl::Status EtcdCluster::WaitListening(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t i = 0; i < members_.size(); ++i) {
    bool exited = false;
    const bool listening = WaitFor(
        [&] {
          exited = members_[i]->Wait(absl::ZeroDuration()).ok();
          const unsigned long inode = exited ? 0 : ListeningInode(client_ports_[i]);
          return exited || (inode != 0 && HoldsSocket(members_[i]->pid(), inode));
        },
        deadline - absl::Now(), absl::Milliseconds(20));
    if (exited) return absl::UnavailableError(absl::StrCat("etcd member ", i, " exited at start:\n", Logs()));
    if (!listening) {
      return absl::DeadlineExceededError(absl::StrCat("etcd member ", i, " did not listen on 127.0.0.1:",
                                                      client_ports_[i], " within ", absl::FormatDuration(timeout),
                                                      ":\n", Logs()));
    }
  }
  return absl::OkStatus();
}

absl::Status EtcdCluster::StartMember(int i, bool fresh) {
  std::vector<std::string> cluster;
  for (size_t m = 0; m < peer_ports_.size(); ++m) {
    cluster.push_back(absl::StrCat("m", m, "=http://127.0.0.1:", peer_ports_[m]));
  }
  const std::string client =
      absl::StrCat(tls_.cert.empty() ? "http" : "https", "://127.0.0.1:", client_ports_[i]);
  const std::string peer = absl::StrCat("http://127.0.0.1:", peer_ports_[i]);
  std::vector<std::string> argv = {
      EtcdBinary(), absl::StrCat("--name=m", i), absl::StrCat("--data-dir=", dir_, "/m", i),
      absl::StrCat("--listen-client-urls=", client), absl::StrCat("--advertise-client-urls=", client),
      absl::StrCat("--listen-peer-urls=", peer), absl::StrCat("--initial-advertise-peer-urls=", peer),
      absl::StrCat("--initial-cluster=", absl::StrJoin(cluster, ",")),
      absl::StrCat("--initial-cluster-state=", fresh ? "new" : "existing"), "--initial-cluster-token=collserve-test",
      // Fast elections on loopback (the defaults are 100 ms / 1 s).
      "--heartbeat-interval=50", "--election-timeout=500", "--logger=zap", "--log-level=warn"};
  if (!tls_.cert.empty()) {
    argv.push_back(absl::StrCat("--cert-file=", tls_.cert));
    argv.push_back(absl::StrCat("--key-file=", tls_.key));
  }
  if (!tls_.ca.empty()) {
    argv.push_back(absl::StrCat("--trusted-ca-file=", tls_.ca));
    argv.push_back("--client-cert-auth");
  }
  auto p = Process::Start(argv, {}, absl::StrCat(dir_, "/m", i, ".log"));
  if (!p.ok()) return p.status();
  members_[i] = std::move(*p);
  return absl::OkStatus();
}

EtcdCluster::~EtcdCluster() {
  members_.clear();  // each Process kills and reaps its member
  std::error_code ignored;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
}

std::vector<std::string> EtcdCluster::endpoints() const {
  std::vector<std::string> out;
  for (int port : client_ports_) out.push_back(absl::StrCat("127.0.0.1:", port));
  return out;
}

void EtcdCluster::Kill(int i) {
  if (members_[i] == nullptr) return;
  members_[i]->Kill(SIGKILL);
  (void)members_[i]->Wait(absl::Seconds(10));
}

absl::Status EtcdCluster::Restart(int i) { return StartMember(i, /*fresh=*/false); }

std::string EtcdCluster::Logs() const {
  std::string out;
  for (size_t i = 0; i < members_.size(); ++i) {
    if (members_[i] != nullptr) absl::StrAppend(&out, "--- etcd member ", i, ":\n", members_[i]->Output());
  }
  return out;
}

}  // namespace collserve::testing
