#include "client/channel.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <cstdlib>
#include <fstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/local_socket.h"
#include "common/pem.h"
#include "common/status_macros.h"

namespace collserve::client {

namespace {
constexpr unsigned int kRefreshSeconds = 60;  // how often the watched files are re-read
constexpr int kMinConnectTimeoutMs = 5000;    // the least time one connection attempt gets

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

absl::Status CheckConsistent(const TlsOptions& tls, absl::string_view source) {
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": a client certificate needs both its certificate (",
                                                   tls.cert_file.empty() ? "unset" : tls.cert_file, ") and its key (",
                                                   tls.key_file.empty() ? "unset" : tls.key_file, ")"));
  }
  if (!tls.cert_file.empty() && tls.ca_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": a client certificate is set but no CA to verify the server with (TLS needs the CA file)"));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<TlsOptions> TlsOptions::FromEnv() {
  TlsOptions tls;
  tls.ca_file = Env("COLLSERVE_TLS_CA");
  tls.cert_file = Env("COLLSERVE_TLS_CERT");
  tls.key_file = Env("COLLSERVE_TLS_KEY");
  tls.server_name = Env("COLLSERVE_TLS_SERVER_NAME");
  if (absl::Status s = CheckConsistent(tls, "COLLSERVE_TLS_CA/CERT/KEY"); !s.ok()) return s;
  return tls;
}

absl::StatusOr<std::string> JobTokenFromEnv() {
  std::string token = Env("COLLSERVE_TOKEN");
  if (!token.empty()) return std::string(absl::StripAsciiWhitespace(token));
  const std::string path = Env("COLLSERVE_TOKEN_FILE");
  if (path.empty()) return std::string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("COLLSERVE_TOKEN_FILE: cannot read ", path));
  constexpr size_t kMaxTokenBytes = 4096;  // as the coordinator's limit
  std::string content(kMaxTokenBytes + 2, '\0');
  in.read(content.data(), static_cast<std::streamsize>(content.size()));
  content.resize(static_cast<size_t>(in.gcount()));
  token = std::string(absl::StripAsciiWhitespace(content));
  if (token.empty() || token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("COLLSERVE_TOKEN_FILE: ", path, " must hold a token of 1 to ", kMaxTokenBytes, " bytes"));
  }
  return token;
}

std::string CheckHealth(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                        absl::Duration timeout) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  std::string request;  // HealthCheckRequest{service}: field 1, length-delimited
  if (!service.empty() && service.size() < 128) {
    request = absl::StrCat(std::string(1, '\x0a'), std::string(1, static_cast<char>(service.size())), service);
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::CompletionQueue cq;
  grpc::Status status;
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", req, &cq);
  call->StartCall();
  call->Finish(&resp, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) return absl::StrCat("error ", status.error_code(), ": ", status.error_message());
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (resp.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  if (bytes == std::string("\x08\x01", 2)) return "SERVING";  // HealthCheckResponse{status}
  if (bytes == std::string("\x08\x02", 2)) return "NOT_SERVING";
  return "UNKNOWN";
}

void AddJobToken(grpc::ClientContext& ctx, const std::string& token) {
  if (!token.empty()) ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateChannel(const std::string& address, const TlsOptions& tls,
                                                             grpc::ChannelArguments args) {
  // Reconnection after the server went away (a coordinator restart): gRPC's backoff with
  // its jitter, from 100 ms up to at most 1 s between attempts instead of its default
  // 1 s up to 120 s, so that a restarted coordinator is found within about a second.
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is not a backoff but the least time one connection
  // attempt gets (MIN_CONNECT_TIMEOUT of gRPC's doc/connection-backoff.md, default 20 s):
  // at 100 ms a busy server that accepted the TCP connection but sent its HTTP/2 SETTINGS
  // later failed the call ("connection attempt timed out before receiving SETTINGS
  // frame"). 5 s lets a loaded host answer; a refused connection still fails at once.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kMinConnectTimeoutMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  if (absl::StartsWith(address, "unix:")) {
    // The token goes over this socket in clear: only to a socket of the expected user in a
    // directory nobody else can write (common/local_socket.h).
    absl::string_view path = absl::string_view(address).substr(5);
    if (absl::StartsWith(path, "//")) path.remove_prefix(2);  // unix:///abs/path
    COLLSERVE_ASSIGN_OR_RETURN(std::vector<uid_t> owners, ExpectedSocketOwners());
    if (absl::Status s = CheckSocketPath(std::string(path), owners); !s.ok()) return s;
  }
  if (tls.ca_file.empty() || absl::StartsWith(address, "unix:")) {
    if (absl::Status s = CheckConsistent(tls, "TLS options"); !s.ok()) return s;
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  }
  if (absl::Status s = CheckConsistent(tls, "TLS options"); !s.ok()) return s;
  if (absl::Status s = CheckPemFile("TLS CA file", tls.ca_file); !s.ok()) return s;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider;
  if (tls.cert_file.empty()) {
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(tls.ca_file, kRefreshSeconds);
  } else {
    if (absl::Status s = CheckPemFile("TLS certificate file", tls.cert_file); !s.ok()) return s;
    if (absl::Status s = CheckPemFile("TLS key file", tls.key_file); !s.ok()) return s;
    provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(tls.key_file, tls.cert_file,
                                                                                    tls.ca_file, kRefreshSeconds);
  }
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  if (!tls.cert_file.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  return grpc::CreateCustomChannel(address, grpc::experimental::TlsCredentials(options), args);
}

}  // namespace collserve::client
