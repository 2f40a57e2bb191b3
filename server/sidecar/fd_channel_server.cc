#include "server/sidecar/fd_channel_server.h"

#include <glog/logging.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fd_channel.h"
#include "common/shm.h"

namespace collserve::server {
namespace {

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

// Replies and waits at most this long for room to do so: a client that does not read its
// answers is closed rather than allowed to stall the channel.
constexpr absl::Duration kReplyTimeout = absl::Milliseconds(200);

}  // namespace

absl::StatusOr<std::unique_ptr<FdChannelServer>> FdChannelServer::Start(const std::string& path, int mode,
                                                                        FdChannelOptions options) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory channel path \"", path, "\" is too long"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", ErrnoText(errno)));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 128) != 0 ||
      (mode >= 0 && chmod(path.c_str(), static_cast<mode_t>(mode)) != 0)) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", path, ": ", ErrnoText(err)));
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const int err = errno;
    close(fd);
    unlink(path.c_str());
    return absl::UnavailableError(absl::StrCat("eventfd: ", ErrnoText(err)));
  }
  return std::unique_ptr<FdChannelServer>(new FdChannelServer(path, fd, wake, FileIdOf(path), options));
}

FdChannelServer::FdChannelServer(std::string path, int listen_fd, int wake_fd, FileId socket_id,
                                 FdChannelOptions options)
    : path_(std::move(path)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      options_(options),
      socket_id_(socket_id),
      thread_([this] { Loop(); }) {}

FdChannelServer::~FdChannelServer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  thread_.join();
  close(listen_fd_);
  close(wake_fd_);
  if (FileIdOf(path_) == socket_id_) unlink(path_.c_str());
}

std::string FdChannelServer::NewToken() {
  std::random_device random;  // /dev/urandom
  std::string token(fdchannel::kTokenBytes, '\0');
  for (size_t i = 0; i < token.size(); i += sizeof(uint32_t)) {
    const uint32_t r = random();
    std::memcpy(&token[i], &r, std::min(sizeof(r), token.size() - i));
  }
  absl::MutexLock lock(&mu_);
  tokens_[token] = Binding{};
  return token;
}

void FdChannelServer::Bind(const std::string& token, std::weak_ptr<engine::Group> group, int rank) {
  absl::MutexLock lock(&mu_);
  auto it = tokens_.find(token);
  if (it == tokens_.end()) return;
  it->second = Binding{std::move(group), rank, true};
}

void FdChannelServer::Forget(const std::string& token) {
  absl::MutexLock lock(&mu_);
  tokens_.erase(token);
}

void FdChannelServer::Loop() {
  std::vector<Connection> conns;
  std::vector<pollfd> fds;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
    }
    // Connections that never said a good Hello go after hello_timeout.
    const absl::Time now = absl::Now();
    absl::Time next_expiry = absl::InfiniteFuture();
    for (size_t i = 0; i < conns.size();) {
      if (conns[i].token.empty() && now - conns[i].accepted >= options_.hello_timeout) {
        close(conns[i].fd);
        conns[i] = conns.back();
        conns.pop_back();
        continue;
      }
      if (conns[i].token.empty()) next_expiry = std::min(next_expiry, conns[i].accepted + options_.hello_timeout);
      ++i;
    }
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const Connection& c : conns) fds.push_back({c.fd, POLLIN, 0});
    const int timeout_ms = next_expiry == absl::InfiniteFuture()
                               ? -1
                               : static_cast<int>(absl::ToInt64Milliseconds(next_expiry - now) + 1);
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      LOG(ERROR) << "shared-memory channel: poll: " << ErrnoText(errno);
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    if (fds[0].revents != 0) break;
    // Connections first (indexes stay valid), then new ones.
    std::vector<size_t> closed;
    for (size_t i = 0; i < conns.size(); ++i) {
      if (fds[i + 2].revents == 0) continue;
      if (!Serve(conns[i])) closed.push_back(i);
    }
    for (auto it = closed.rbegin(); it != closed.rend(); ++it) {
      close(conns[*it].fd);
      conns[*it] = conns.back();
      conns.pop_back();
    }
    if (fds[1].revents != 0) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        if (static_cast<int>(conns.size()) >= options_.max_connections) {
          LOG(WARNING) << "shared-memory channel: refusing a connection: " << options_.max_connections
                       << " are open (the limit)";
          close(fd);
        } else {
          conns.push_back(Connection{fd, "", absl::Now()});
        }
      } else if (errno == EMFILE || errno == ENFILE) {
        LOG(WARNING) << "shared-memory channel: accept: " << ErrnoText(errno) << "; backing off";
        absl::SleepFor(absl::Milliseconds(100));
      }
    }
  }
  for (const Connection& c : conns) close(c.fd);
}

bool FdChannelServer::Serve(Connection& conn) {
  alignas(8) char buf[fdchannel::kMaxMessageBytes];
  int fd = -1;
  const absl::Time deadline = absl::Now() + kReplyTimeout;
  absl::StatusOr<size_t> got = fdchannel::ReceiveMessage(conn.fd, buf, sizeof(buf), &fd, deadline);
  // Whatever happens below, a descriptor not handed to a segment is closed.
  struct CloseFd {
    int* fd;
    ~CloseFd() {
      if (*fd >= 0) close(*fd);
    }
  } close_fd{&fd};
  if (!got.ok() || *got == 0) return false;
  auto reply = [&](const absl::Status& s) {
    const fdchannel::Reply r = fdchannel::ReplyFor(s);
    return fdchannel::SendMessage(conn.fd, &r, sizeof(r), -1, deadline).ok() && s.ok();
  };
  uint32_t magic = 0, op = 0;
  if (*got >= 8) {
    std::memcpy(&magic, buf, 4);
    std::memcpy(&op, buf + 4, 4);
  }
  if (magic != fdchannel::kMagic) {
    return reply(absl::InvalidArgumentError("not a shared-memory channel message (bad magic)"));
  }
  if (op == fdchannel::kHello) {
    if (*got != sizeof(fdchannel::Hello) || !conn.token.empty()) {
      return reply(absl::InvalidArgumentError("malformed or repeated Hello"));
    }
    fdchannel::Hello hello;
    std::memcpy(&hello, buf, sizeof(hello));
    const std::string token(hello.token, fdchannel::kTokenBytes);
    {
      absl::MutexLock lock(&mu_);
      if (tokens_.count(token) == 0) {
        LOG(WARNING) << "shared-memory channel: a connection offered an unknown session token";
        return reply(absl::PermissionDeniedError("unknown session token"));
      }
    }
    conn.token = token;
    return reply(absl::OkStatus());
  }
  if (op == fdchannel::kOpen && *got == sizeof(fdchannel::Open)) return ServeOpen(conn, buf, deadline);
  if (op != fdchannel::kRegister || *got != sizeof(fdchannel::Register)) {
    return reply(absl::InvalidArgumentError(absl::StrCat("unknown or malformed request (op ", op, ")")));
  }
  if (conn.token.empty()) return reply(absl::FailedPreconditionError("Register before Hello"));
  if (fd < 0) return reply(absl::InvalidArgumentError("Register without a descriptor"));
  fdchannel::Register r;
  std::memcpy(&r, buf, sizeof(r));
  const size_t name_len = strnlen(r.name, sizeof(r.name));
  if (name_len == 0 || name_len == sizeof(r.name)) return reply(absl::InvalidArgumentError("malformed segment name"));
  int rank = -1;
  absl::StatusOr<std::shared_ptr<engine::Group>> group = GroupOf(conn.token, &rank);
  if (!group.ok()) return reply(group.status());
  // A read-only descriptor is kept so that peers of the rank can be handed it (Open).
  auto segment = ShmSegment::FromFd(std::string(r.name, name_len), fd, r.bytes, {.share = true});
  fd = -1;  // FromFd took it
  if (!segment.ok()) {
    // Keeps serving: a bad descriptor is an answer, not a broken connection.
    const fdchannel::Reply rep = fdchannel::ReplyFor(segment.status());
    return fdchannel::SendMessage(conn.fd, &rep, sizeof(rep), -1, deadline).ok();
  }
  absl::Status added = (*group)->AddSegment(rank, std::shared_ptr<ShmSegment>(std::move(*segment)));
  const fdchannel::Reply rep = fdchannel::ReplyFor(added);
  return fdchannel::SendMessage(conn.fd, &rep, sizeof(rep), -1, deadline).ok();
}

absl::StatusOr<std::shared_ptr<engine::Group>> FdChannelServer::GroupOf(const std::string& token, int* rank) {
  Binding binding;
  {
    absl::MutexLock lock(&mu_);
    auto it = tokens_.find(token);
    if (it == tokens_.end()) return absl::FailedPreconditionError("the session has ended");
    binding = it->second;
  }
  std::shared_ptr<engine::Group> group = binding.group.lock();
  if (!binding.bound || group == nullptr) {
    return absl::UnavailableError("the session is not attached to a group (yet or any more)");
  }
  *rank = binding.rank;
  return group;
}

bool FdChannelServer::ServeOpen(Connection& conn, const char* buf, absl::Time deadline) {
  int fd = -1;
  const absl::Status s = [&]() -> absl::Status {
    if (conn.token.empty()) return absl::FailedPreconditionError("Open before Hello");
    fdchannel::Open o;
    std::memcpy(&o, buf, sizeof(o));
    const size_t name_len = strnlen(o.name, sizeof(o.name));
    if (name_len == 0 || name_len == sizeof(o.name)) return absl::InvalidArgumentError("malformed segment name");
    int rank = -1;
    absl::StatusOr<std::shared_ptr<engine::Group>> group = GroupOf(conn.token, &rank);
    if (!group.ok()) return group.status();
    absl::StatusOr<int> opened = (*group)->OpenPeerSegment(rank, o.owner_rank, std::string(o.name, name_len));
    if (!opened.ok()) return opened.status();
    fd = *opened;
    return absl::OkStatus();
  }();
  const fdchannel::Reply rep = fdchannel::ReplyFor(s);
  const bool sent = fdchannel::SendMessage(conn.fd, &rep, sizeof(rep), fd, deadline).ok();
  if (fd >= 0) close(fd);
  // A refused Open is an answer, not a broken connection.
  return sent;
}

}  // namespace collserve::server
