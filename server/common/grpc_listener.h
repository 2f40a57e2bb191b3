// GrpcListener: a listening socket the daemon owns, whose connections it accepts itself and
// hands to its gRPC server (grpc::experimental::ExternalConnectionAcceptor, any server
// credentials). gRPC 1.51's own listener stops accepting for good after one accept fails
// with EMFILE (the coordinator then never took a gRPC connection again); this one sheds
// the connection it cannot take (so that client fails at once instead of hanging), pauses
// for a moment, and keeps accepting, so the port recovers as soon as descriptors free up.
// It also never shares its port (no SO_REUSEPORT): a second daemon on a taken address
// fails to bind.
//
// Thread safety: Bind/RegisterWith/Start from one thread in that order; one accept thread
// of its own until destroyed.
#ifndef COLLSERVE_SERVER_COMMON_GRPC_LISTENER_H_
#define COLLSERVE_SERVER_COMMON_GRPC_LISTENER_H_

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/common/daemon.h"

namespace collserve::server {

class GrpcListener {
 public:
  // Binds and listens on `address`: "host:port" (port 0 picks a free one; "[v6]:port";
  // "0.0.0.0" or "[::]" for every address) or "unix:/path" (the path must be free: see
  // ClaimUnixSocketPath). UNAVAILABLE naming why ("Address already in use", ...),
  // INVALID_ARGUMENT for an address that does not parse.
  static absl::StatusOr<std::unique_ptr<GrpcListener>> Bind(const std::string& address);

  // Stops accepting, closes the socket and (unix) removes the path if it is still this
  // listener's socket.
  ~GrpcListener();
  GrpcListener(const GrpcListener&) = delete;
  GrpcListener& operator=(const GrpcListener&) = delete;

  // Before builder.BuildAndStart(): connections will reach that server with `credentials`.
  void RegisterWith(grpc::ServerBuilder& builder, std::shared_ptr<grpc::ServerCredentials> credentials);
  // After BuildAndStart(): starts accepting.
  void Start();

  // The bound TCP port (0 for a unix socket).
  int port() const { return port_; }
  const std::string& address() const { return address_; }
  // Connections shed because the process was out of descriptors (for tests and logs).
  int64_t shed() const { return shed_.load(); }

 private:
  GrpcListener(std::string address, int fd, int port, std::string unix_path);
  void Loop();

  const std::string address_;
  const int fd_;
  const int port_;
  const std::string unix_path_;
  const FileId unix_id_;
  int wake_ = -1;   // eventfd: stop
  int spare_ = -1;  // given up to shed a connection when out of descriptors
  std::atomic<int64_t> shed_{0};
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_GRPC_LISTENER_H_
