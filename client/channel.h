// Internal to the SDK and the sidecar (not installed): opens a gRPC channel with a client's
// TlsOptions (collserve/client.h).
#ifndef COLLSERVE_CLIENT_CHANNEL_H_
#define COLLSERVE_CLIENT_CHANNEL_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/channel_arguments.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "collserve/client.h"

namespace collserve::client {

// A channel to `address` ("host:port" or "unix:/path") with `args`. TLS when tls.ca_file is
// set and the address is not a unix socket: the server's certificate must chain to
// tls.ca_file and name the address's host (or tls.server_name); tls.cert_file/key_file are
// presented when a server asks for a client certificate. The files are watched through
// gRPC's FileWatcherCertificateProvider (re-read every 60 s). Reconnects after a lost
// connection with gRPC's backoff bounded to 100 ms .. 1 s; one connection attempt gets at
// least 5 s. Does not connect, but a "unix:" address is checked first (CheckSocketPath,
// common/local_socket.h): the socket and its directory must belong to the expected user
// (ExpectedSocketOwners: root or this process's uid, or COLLSERVE_SIDECAR_UID) and the
// directory must be writable by nobody else, since the job token goes over it in clear.
// Errors: INVALID_ARGUMENT naming the file when a TLS file is missing, unreadable or not
// PEM, or when the options are inconsistent (a key without a certificate, a certificate
// without a CA), or COLLSERVE_SIDECAR_UID is not a uid; FAILED_PRECONDITION naming the
// owner and mode found when a unix socket fails that check; UNAVAILABLE when its directory
// does not exist. Thread-safe.
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const std::string& address, const TlsOptions& tls,
                                                             grpc::ChannelArguments args);

// grpc.health.v1.Health/Check of `service` ("" = the server as a whole) on `channel`,
// within `timeout`, with no generated stubs (the request and answer are one-field
// messages): "SERVING", "NOT_SERVING", "UNKNOWN" (another answer), or the RPC's error as
// "error <code>: <message>". Blocks; thread-safe.
std::string CheckHealth(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                        absl::Duration timeout);

// Adds `token` to the call as "authorization: Bearer <token>" metadata (RFC 6750 §2.1, as
// the coordinator's credentials expect); nothing when `token` is empty.
void AddJobToken(grpc::ClientContext& ctx, const std::string& token);

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_CHANNEL_H_
