// Server-side TLS for the daemons' gRPC listeners (the coordinator's API, a sidecar's TCP
// listener), through gRPC's TLS credentials API; and the same certificate files used as a
// client identity (a sidecar towards its coordinator).
#ifndef COLLSERVE_SERVER_COMMON_TLS_H_
#define COLLSERVE_SERVER_COMMON_TLS_H_

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace collserve::server {

// PEM files; cert_file empty = plaintext. The files are watched (gRPC's
// FileWatcherCertificateProvider) and re-read every `refresh`, so replacing them (a
// Kubernetes Secret update: the directory's symlink swapped) takes effect without a restart
// for new connections.
struct ServerTlsOptions {
  std::string cert_file;  // the daemon's certificate chain (--tls_cert)
  std::string key_file;   // its private key (--tls_key)
  // CA bundle that client certificates must chain to (--tls_ca). With it, a client that
  // presents a certificate is verified; with require_client_cert too, a client without one
  // is refused during the handshake (mutual TLS).
  std::string ca_file;
  bool require_client_cert = false;  // (--tls_client_auth)
  absl::Duration refresh = absl::Seconds(60);  // (--tls_refresh_interval; at least 1 s)
};

// Credentials for a listener: insecure when cert_file is empty, TLS otherwise. Errors:
// INVALID_ARGUMENT naming the setting when a key or CA or client authentication is asked
// for without a certificate, a certificate without its key, client authentication without
// a CA, or a file that cannot be read or holds no PEM block. Thread-safe.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(const ServerTlsOptions& options);

// The daemons' flags --tls_cert, --tls_key, --tls_ca, --tls_client_auth and
// --tls_refresh_interval (defined in tls.cc), as options. Call after absl::ParseCommandLine.
ServerTlsOptions ServerTlsOptionsFromFlags();

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_TLS_H_
