// TLS on the daemons' gRPC endpoints (issue 15): real daemons on loopback with certificates
// the test makes with openssl (its own CAs, in its own temp dir). Server-authenticated TLS
// works and refuses plaintext and clients trusting another CA; mutual TLS refuses clients
// without a certificate or with one from another CA; a rotated certificate is picked up
// without a restart; a job runs end to end with TLS between every party that speaks gRPC
// (rank -> sidecar TCP listener, sidecar -> coordinator with a client certificate,
// rendezvous store); a bad certificate flag stops the daemon at start naming the file.
#include <gtest/gtest.h>
#include <openssl/crypto.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collserve/client.h"
#include "tests/testing/pki.h"
#include "tests/testing/process.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

using client::StoreClient;
using client::StoreClientOptions;
using client::TlsOptions;

// As the daemons' KeepOpenSslStateUntilExit (server/common/daemon.h): this process speaks TLS
// through gRPC, and OpenSSL's exit handler would orphan the per-thread state of gRPC threads
// that end after it (LeakSanitizer reported 21 of libcrypto's allocations once under load).
[[maybe_unused]] const bool kOpenSslStateKeptUntilExit = OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr) == 1;

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(pki_.dir().empty());
    ASSERT_TRUE(pki_.MakeCa("ca") && pki_.MakeCa("other-ca")) << "openssl failed; see " << pki_.Path("openssl.log");
    ASSERT_TRUE(pki_.MakeCert("server", "ca") && pki_.MakeCert("client", "ca") &&
                pki_.MakeCert("stranger", "other-ca") && pki_.MakeCert("server2", "other-ca"))
        << "openssl failed; see " << pki_.Path("openssl.log");
  }

  std::vector<std::string> ServerFlags(bool mutual) const {
    std::vector<std::string> flags = {absl::StrCat("--tls_cert=", pki_.Path("server.pem")),
                                      absl::StrCat("--tls_key=", pki_.Path("server.key"))};
    if (mutual) {
      flags.push_back(absl::StrCat("--tls_ca=", pki_.Path("ca.pem")));
      flags.push_back("--tls_client_auth");
    }
    return flags;
  }

  TlsOptions Trusting(const std::string& ca, const std::string& cert = "") const {
    TlsOptions tls;
    tls.ca_file = pki_.Path(ca + ".pem");
    if (!cert.empty()) {
      tls.cert_file = pki_.Path(cert + ".pem");
      tls.key_file = pki_.Path(cert + ".key");
    }
    return tls;
  }

  // A Set then Get through a fresh client presenting `token`; the status of the first failure.
  static absl::Status UseStore(const std::string& address, const TlsOptions& tls, const std::string& token) {
    StoreClientOptions options;
    options.tls = tls;
    options.token = token;
    options.connect_timeout = absl::Seconds(3);
    options.timeout = absl::Seconds(5);
    auto store = StoreClient::Connect(address, options);
    if (!store.ok()) return store.status();
    if (absl::Status s = (*store)->Set("tls-key", "tls-value"); !s.ok()) return s;
    auto value = (*store)->Get("tls-key");
    if (!value.ok()) return value.status();
    if (*value != "tls-value") return absl::InternalError(absl::StrCat("read back \"", *value, "\""));
    return absl::OkStatus();
  }

  Pki pki_;
};

TEST_F(TlsTest, ServerAuthenticatedTlsServesTrustingClientsOnly) {
  auto cluster = Cluster::Start(0, ServerFlags(/*mutual=*/false));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->coordinator_address();
  const std::string token = (*cluster)->job_token();
  EXPECT_TRUE(UseStore(address, Trusting("ca"), token).ok()) << UseStore(address, Trusting("ca"), token);
  // A presented client certificate is fine where none is asked for.
  EXPECT_TRUE(UseStore(address, Trusting("ca", "client"), token).ok());
  // Plaintext, and TLS trusting another CA, never get through.
  EXPECT_FALSE(UseStore(address, TlsOptions{}, token).ok());
  EXPECT_FALSE(UseStore(address, Trusting("other-ca"), token).ok());
  // The certificate names 127.0.0.1 and localhost, not another name.
  TlsOptions wrong_name = Trusting("ca");
  wrong_name.server_name = "coordinator.example";
  EXPECT_FALSE(UseStore(address, wrong_name, token).ok());
  TlsOptions right_name = Trusting("ca");
  right_name.server_name = "localhost";
  EXPECT_TRUE(UseStore(address, right_name, token).ok());
}

TEST_F(TlsTest, MutualTlsRefusesClientsWithoutACertificateFromTheCa) {
  auto cluster = Cluster::Start(0, ServerFlags(/*mutual=*/true));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->coordinator_address();
  const std::string token = (*cluster)->job_token();
  EXPECT_TRUE(UseStore(address, Trusting("ca", "client"), token).ok())
      << UseStore(address, Trusting("ca", "client"), token);
  EXPECT_FALSE(UseStore(address, Trusting("ca"), token).ok()) << "no client certificate";
  EXPECT_FALSE(UseStore(address, Trusting("ca", "stranger"), token).ok()) << "a certificate from another CA";
  EXPECT_FALSE(UseStore(address, TlsOptions{}, token).ok()) << "plaintext";
}

TEST_F(TlsTest, RotatedCertificateIsUsedWithoutARestart) {
  const std::string cert = pki_.Path("live.pem");
  const std::string key = pki_.Path("live.key");
  std::filesystem::copy_file(pki_.Path("server.pem"), cert);
  std::filesystem::copy_file(pki_.Path("server.key"), key);
  auto cluster = Cluster::Start(0, {absl::StrCat("--tls_cert=", cert), absl::StrCat("--tls_key=", key),
                                    "--tls_refresh_interval=1s"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->coordinator_address();
  const std::string token = (*cluster)->job_token();
  ASSERT_TRUE(UseStore(address, Trusting("ca"), token).ok());
  ASSERT_FALSE(UseStore(address, Trusting("other-ca"), token).ok());
  // Replace both files at once, as a Secret update does (rename over the old ones).
  std::filesystem::copy_file(pki_.Path("server2.pem"), cert + ".new");
  std::filesystem::copy_file(pki_.Path("server2.key"), key + ".new");
  std::filesystem::rename(key + ".new", key);
  std::filesystem::rename(cert + ".new", cert);
  const bool rotated =
      WaitFor([&] { return UseStore(address, Trusting("other-ca"), token).ok(); }, absl::Seconds(20),
              absl::Milliseconds(500));
  EXPECT_TRUE(rotated) << "the coordinator still presents the old certificate 20 s after rotation";
  EXPECT_EQ((*cluster)->coordinator().Wait(absl::ZeroDuration()).status().code(), absl::StatusCode::kDeadlineExceeded)
      << "the coordinator restarted or exited";
}

TEST_F(TlsTest, JobRunsWithTlsBetweenEveryParty) {
  // Coordinator: mutual TLS. Sidecars: TLS on their TCP listeners, a client certificate
  // towards the coordinator. Ranks on the TCP listeners (as ranks on other hosts), with
  // TLS to their sidecar; the sweep checks every element of 78 collectives.
  std::vector<std::string> sidecar_flags = ServerFlags(/*mutual=*/false);
  for (const std::string& f : {absl::StrCat("--coordinator_tls_ca=", pki_.Path("ca.pem")),
                               absl::StrCat("--coordinator_tls_cert=", pki_.Path("client.pem")),
                               absl::StrCat("--coordinator_tls_key=", pki_.Path("client.key"))}) {
    sidecar_flags.push_back(f);
  }
  // A sanitizer's lease grace (Cluster's kLeaseGraceFlag); and 1/8 of the bytes there.
  std::vector<std::string> coordinator_flags = ServerFlags(/*mutual=*/true);
  auto cluster = Cluster::Start(2, coordinator_flags, sidecar_flags);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    std::map<std::string, std::string> env = {{"COLLSERVE_SIDECAR", (*cluster)->sidecar_tcp_address(r / 2)},
                                              {"COLLSERVE_SHARED_MEMORY", "0"},
                                              {"COLLSERVE_TLS_CA", pki_.Path("ca.pem")},
                                              {"COLLSERVE_TLS_CERT", pki_.Path("client.pem")},
                                              {"COLLSERVE_TLS_KEY", pki_.Path("client.key")}};
    auto p = (*cluster)->StartRank(r, 4, r / 2, {"--mode=sweep", UnderSanitizer("--counts=0,7,1048576", "--counts=0,7,131072")}, env);
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (int r = 0; r < 4; ++r) {
    auto code = ranks[r]->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.ok()) << "rank " << r << " hung: " << ranks[r]->Output();
    EXPECT_EQ(*code, 0) << ranks[r]->Output() << (*cluster)->Logs();
    EXPECT_NE(ranks[r]->Output().find("sweep done: 78 collectives, 0 wrong elements"), std::string::npos)
        << ranks[r]->Output();
  }
  // A rank without TLS is refused by the sidecar's TCP listener.
  auto plain = (*cluster)->StartRank(0, 1, 0, {"--mode=single", "--count=4"},
                                     {{"COLLSERVE_SIDECAR", (*cluster)->sidecar_tcp_address(0)},
                                      {"COLLSERVE_SHARED_MEMORY", "0"},
                                      {"COLLSERVE_INIT_TIMEOUT_S", "3"}});
  ASSERT_TRUE(plain.ok());
  auto code = (*plain)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << "a plaintext rank hung";
  EXPECT_NE(*code, 0) << (*plain)->Output();
}

TEST_F(TlsTest, BadCertificateFlagsStopTheDaemonNamingTheFile) {
  auto bad = Cluster::Start(0, {"--tls_cert=/nonexistent/cert.pem", absl::StrCat("--tls_key=", pki_.Path("server.key"))});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("/nonexistent/cert.pem"), std::string::npos) << bad.status();
  auto half = Cluster::Start(0, {absl::StrCat("--tls_cert=", pki_.Path("server.pem"))});
  ASSERT_FALSE(half.ok());
  EXPECT_NE(std::string(half.status().message()).find("--tls_key"), std::string::npos) << half.status();
}

}  // namespace
}  // namespace collserve::testing
