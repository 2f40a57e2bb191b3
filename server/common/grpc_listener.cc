#include "server/common/grpc_listener.h"

#include <fcntl.h>
#include <glog/logging.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/errno_text.h"

namespace collserve::server {
namespace {

constexpr absl::Duration kBackoff = absl::Milliseconds(100);


int ListenOn(int family, const sockaddr* addr, socklen_t len, bool dual_stack, int* err) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  const int one = 1, zero = 0;
  if (family != AF_UNIX) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, dual_stack ? &zero : &one, sizeof(int));
  if (::bind(fd, addr, len) != 0 || ::listen(fd, 1024) != 0) {
    *err = errno;
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::Bind(const std::string& address) {
  int err = 0;
  if (absl::StartsWith(address, "unix:")) {
    const std::string path = address.substr(5);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat("unix socket path \"", path, "\" is empty or too long"));
    }
    std::memcpy(addr.sun_path, path.data(), path.size());
    const int fd = ListenOn(AF_UNIX, reinterpret_cast<sockaddr*>(&addr), sizeof(addr), false, &err);
    if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", ErrnoText(err)));
    return std::unique_ptr<GrpcListener>(new GrpcListener(address, fd, 0, path));
  }
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("address \"", address, "\" is not host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int fd = -1;
  if (host == "::" || host == "*") {
    sockaddr_in6 a6{};
    a6.sin6_family = AF_INET6;
    a6.sin6_addr = in6addr_any;
    a6.sin6_port = htons(static_cast<uint16_t>(port));
    fd = ListenOn(AF_INET6, reinterpret_cast<sockaddr*>(&a6), sizeof(a6), true, &err);
  }
  if (fd < 0) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string service = std::to_string(port);
    const bool any = host.empty() || host == "*" || host == "::";
    if (const int rc = ::getaddrinfo(any ? nullptr : host.c_str(), service.c_str(), &hints, &found); rc != 0) {
      return absl::InvalidArgumentError(absl::StrCat("address ", address, ": ", ::gai_strerror(rc)));
    }
    for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
      fd = ListenOn(ai->ai_family, ai->ai_addr, ai->ai_addrlen, false, &err);
    }
    ::freeaddrinfo(found);
  }
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", ErrnoText(err)));
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                                          : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  return std::unique_ptr<GrpcListener>(new GrpcListener(address, fd, bound_port, ""));
}

GrpcListener::GrpcListener(std::string address, int fd, int port, std::string unix_path)
    : address_(std::move(address)),
      fd_(fd),
      port_(port),
      unix_path_(std::move(unix_path)),
      unix_id_(unix_path_.empty() ? FileId{} : FileIdOf(unix_path_)) {
  wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  spare_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
}

GrpcListener::~GrpcListener() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!::write(wake_, &one, sizeof(one));
    thread_.join();
  }
  ::close(fd_);
  if (wake_ >= 0) ::close(wake_);
  if (spare_ >= 0) ::close(spare_);
  if (!unix_path_.empty() && !(unix_id_ == FileId{}) && FileIdOf(unix_path_) == unix_id_) ::unlink(unix_path_.c_str());
}

void GrpcListener::RegisterWith(grpc::ServerBuilder& builder, std::shared_ptr<grpc::ServerCredentials> credentials) {
  acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, std::move(credentials));
}

void GrpcListener::Start() {
  if (acceptor_ == nullptr || thread_.joinable()) return;
  thread_ = std::thread([this] { Loop(); });
}

void GrpcListener::Loop() {
  absl::Time paused_until = absl::InfinitePast();
  for (;;) {
    const absl::Time now = absl::Now();
    pollfd fds[2] = {{wake_, POLLIN, 0}, {paused_until > now ? -1 : fd_, POLLIN, 0}};
    const int timeout = paused_until > now ? static_cast<int>(absl::ToInt64Milliseconds(paused_until - now) + 1) : -1;
    if (::poll(fds, 2, timeout) < 0 && errno != EINTR) {
      LOG(ERROR) << "listener " << address_ << ": poll: " << ErrnoText(errno);
      absl::SleepFor(kBackoff);
      continue;
    }
    if (fds[0].revents != 0) return;
    if (fds[1].revents == 0) continue;
    for (int i = 0; i < 64; ++i) {
      const int conn = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (conn < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors (or memory): shed the waiting connection with the spare
          // descriptor so that its client fails at once, and pause before trying again.
          if (shed_.fetch_add(1) % 100 == 0) {
            LOG(WARNING) << "listener " << address_ << ": accept: " << ErrnoText(errno)
                         << "; shedding connections and pausing " << absl::FormatDuration(kBackoff)
                         << " (shed so far: " << shed_.load() << ")";
          }
          if (spare_ >= 0) {
            ::close(spare_);
            const int drop = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (drop >= 0) ::close(drop);
            spare_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
          }
          paused_until = absl::Now() + kBackoff;
        }
        break;  // EAGAIN, or one connection's error
      }
      if (unix_path_.empty()) {
        const int one = 1;
        ::setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      }
      grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
      p.listener_fd = fd_;
      p.fd = conn;
      acceptor_->HandleNewConnection(&p);  // gRPC owns `conn` from here on
    }
  }
}

}  // namespace collserve::server
