#include "server/common/tls.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/pem.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of this daemon's gRPC endpoint (for a sidecar: its TCP listener; the unix "
          "socket stays plaintext). Set = TLS. Re-read every --tls_refresh_interval.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle that client certificates must chain to; a client that presents one is verified.");
ABSL_FLAG(bool, tls_client_auth, false,
          "Mutual TLS: refuse clients without a certificate from --tls_ca (needs --tls_cert and --tls_ca).");
ABSL_FLAG(absl::Duration, tls_refresh_interval, absl::Seconds(60),
          "How often the TLS files are re-read (a rotated certificate is used from then on; at least 1s).");

namespace collserve::server {

ServerTlsOptions ServerTlsOptionsFromFlags() {
  ServerTlsOptions o;
  o.cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.key_file = absl::GetFlag(FLAGS_tls_key);
  o.ca_file = absl::GetFlag(FLAGS_tls_ca);
  o.require_client_cert = absl::GetFlag(FLAGS_tls_client_auth);
  o.refresh = absl::GetFlag(FLAGS_tls_refresh_interval);
  return o;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(const ServerTlsOptions& options) {
  if (options.cert_file.empty()) {
    if (!options.key_file.empty() || !options.ca_file.empty() || options.require_client_cert) {
      return absl::InvalidArgumentError(
          "--tls_key, --tls_ca and --tls_client_auth need --tls_cert (the daemon's certificate)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.key_file.empty()) return absl::InvalidArgumentError("--tls_cert needs --tls_key (its private key)");
  if (options.require_client_cert && options.ca_file.empty()) {
    return absl::InvalidArgumentError("--tls_client_auth needs --tls_ca (the CA that signs client certificates)");
  }
  if (absl::Status s = CheckPemFile("--tls_cert", options.cert_file); !s.ok()) return s;
  if (absl::Status s = CheckPemFile("--tls_key", options.key_file); !s.ok()) return s;
  if (!options.ca_file.empty()) {
    if (absl::Status s = CheckPemFile("--tls_ca", options.ca_file); !s.ok()) return s;
  }
  const auto refresh_s = static_cast<unsigned int>(
      std::clamp<int64_t>(absl::ToInt64Seconds(options.refresh), 1, int64_t{24} * 3600));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.key_file, options.cert_file, options.ca_file, refresh_s);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (!options.ca_file.empty()) tls.watch_root_certs();
  tls.set_cert_request_type(options.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                            : options.ca_file.empty()   ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                        : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace collserve::server
