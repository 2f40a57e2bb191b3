#include "tests/testing/etcd_cluster.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace collserve::testing {

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
  for (int i = 0; i < members; ++i) {
    c->client_ports_.push_back(UnusedPort());
    c->peer_ports_.push_back(UnusedPort());
  }
  c->members_.resize(members);
  for (int i = 0; i < members; ++i) {
    if (absl::Status s = c->StartMember(i, /*fresh=*/true); !s.ok()) return s;
  }
  return c;
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
