// An etcd cluster on loopback for tests (Debian's etcd-server: /usr/bin/etcd), in a fresh
// temp dir, torn down (processes killed, dir removed) on destruction.
#ifndef COLLSERVE_TESTS_TESTING_ETCD_CLUSTER_H_
#define COLLSERVE_TESTS_TESTING_ETCD_CLUSTER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/testing/process.h"

namespace collserve::testing {

// The etcd server binary; "" when it is not installed (tests then skip, saying so).
std::string EtcdBinary();

// TLS of the members' client URLs (https): their certificate and key, and with ca set,
// client certificates must chain to it (etcd's --client-cert-auth).
struct EtcdTls {
  std::string cert;
  std::string key;
  std::string ca;
};

class EtcdCluster {
 public:
  // Starts `members` etcd members (a fresh cluster) on distinct loopback ports and waits
  // (up to 20 s) until each listens on its client port; starts again on other ports when a
  // port was taken meanwhile (up to 5 times). Does not wait for a leader (a client's first
  // call does, within its deadline).
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(int members, const EtcdTls& tls = {});
  ~EtcdCluster();
  // "127.0.0.1:<port>" of each member's client URL.
  std::vector<std::string> endpoints() const;
  // Kills member i (SIGKILL) / starts it again with the same data dir and ports.
  void Kill(int i);
  absl::Status Restart(int i);
  std::string Logs() const;

 private:
  EtcdCluster() = default;
  absl::Status StartMember(int i, bool fresh);
  // Until every member's process holds the socket listening on its client port; an error
  // (with the logs) when a member exited or `timeout` passed.
  absl::Status WaitListening(absl::Duration timeout);
  EtcdTls tls_;
  std::string dir_;
  std::vector<int> client_ports_;
  std::vector<int> peer_ports_;
  std::vector<std::unique_ptr<Process>> members_;
};

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_ETCD_CLUSTER_H_
