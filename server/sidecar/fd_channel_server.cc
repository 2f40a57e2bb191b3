#include "server/sidecar/fd_channel_server.h"

#include <glog/logging.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errno_text.h"
#include "common/fd_channel.h"
#include "common/shm.h"

namespace collserve::server {
namespace {

// One thread serves every connection, so it never waits for one: a reply the client's socket
// has no room for closes the connection. The SDK waits for each answer before it asks again,
// so its socket always has room; a client that sends requests without reading the answers
// (which once held this thread 200 ms per answer, every job's channel with it) is closed.
constexpr absl::Time kNoWait = absl::InfinitePast();

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

void FdChannelServer::Bind(const std::string& token, std::weak_ptr<engine::Group> group, int rank,
                           std::weak_ptr<OpsHandler> ops, SegmentAdmission admit) {
  absl::MutexLock lock(&mu_);
  auto it = tokens_.find(token);
  if (it == tokens_.end()) return;
  it->second = Binding{std::move(group), rank, true, std::move(ops), {}, std::move(admit)};
}

void FdChannelServer::Forget(const std::string& token) {
  std::shared_ptr<OpsLink> link;
  {
    absl::MutexLock lock(&mu_);
    auto it = tokens_.find(token);
    if (it == tokens_.end()) return;
    link = it->second.ops_link.lock();
    tokens_.erase(it);
    forgotten_.push_back(token);
  }
  if (link != nullptr) link->Shutdown();
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));  // the thread closes the session's connections
}

absl::Status OpsLink::Send(absl::string_view message) {
  absl::MutexLock lock(&mu_);
  if (fd_ < 0) return absl::UnavailableError("the session's ops channel is closed");
  if (queue_.empty() && message.size() <= opschannel::kMaxFragmentPayload) {
    // The common case: one datagram straight into the socket.
    char buf[opschannel::kMaxDatagramBytes];
    const opschannel::FragmentHeader h;
    std::memcpy(buf, &h, sizeof(h));
    if (!message.empty()) std::memcpy(buf + sizeof(h), message.data(), message.size());
    const size_t bytes = sizeof(h) + message.size();
    ssize_t n;
    do {
      n = send(fd_, buf, bytes, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n == static_cast<ssize_t>(bytes)) return absl::OkStatus();
    if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      const absl::Status s = absl::UnavailableError(
          absl::StrCat("ops channel: send: ", n >= 0 ? "short send" : ErrnoText(errno)));
      shutdown(fd_, SHUT_RDWR);
      return s;
    }
  }
  absl::StatusOr<std::vector<std::string>> fragments = opschannel::Fragment(message);
  if (!fragments.ok()) return fragments.status();
  return QueueLocked(std::move(*fragments));
}

absl::Status OpsLink::SendBatch(const std::vector<std::string>& messages) {
  absl::MutexLock lock(&mu_);
  if (fd_ < 0) return absl::UnavailableError("the session's ops channel is closed");
  size_t sent = 0;
  if (queue_.empty()) {
    // The common case: every datagram straight into the socket with one system call.
    absl::StatusOr<size_t> n = opschannel::TrySendOpsMessages(fd_, messages);
    if (!n.ok()) {
      if (absl::IsUnavailable(n.status())) shutdown(fd_, SHUT_RDWR);
      return n.status();
    }
    sent = *n;
  }
  size_t datagrams = 0;
  for (const std::string& m : messages) {
    datagrams += m.empty() ? 1 : (m.size() + opschannel::kMaxFragmentPayload - 1) / opschannel::kMaxFragmentPayload;
  }
  if (sent == datagrams) return absl::OkStatus();  // the common case: no copies
  // What the socket had no room for waits in the queue, as Send's.
  std::vector<std::string> rest;
  size_t d = 0;
  for (const std::string& m : messages) {
    absl::StatusOr<std::vector<std::string>> fragments = opschannel::Fragment(m);
    if (!fragments.ok()) return fragments.status();
    for (std::string& f : *fragments) {
      if (d++ >= sent) rest.push_back(std::move(f));
    }
  }
  if (rest.empty()) return absl::OkStatus();
  return QueueLocked(std::move(rest));
}

absl::Status OpsLink::QueueLocked(std::vector<std::string> datagrams) {
  size_t bytes = 0;
  for (const std::string& d : datagrams) bytes += d.size() + kQueuedDatagramOverhead;
  if (bytes > kMaxQueuedBytes - queued_bytes_) {
    shutdown(fd_, SHUT_RDWR);
    return absl::ResourceExhaustedError(absl::StrCat(
        "the client did not read its completions: more than ", kMaxQueuedBytes,
        " bytes of them (counting ", kQueuedDatagramOverhead,
        " bytes of bookkeeping per datagram) waited for room in the ops channel (the limit)"));
  }
  const bool was_empty = queue_.empty();
  for (std::string& d : datagrams) queue_.push_back(std::move(d));
  queued_bytes_ += bytes;
  if (absl::Status s = SendQueuedLocked(); !s.ok()) {
    shutdown(fd_, SHUT_RDWR);
    return s;
  }
  if (was_empty && !queue_.empty()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));  // the channel thread polls for room now
  }
  return absl::OkStatus();
}

absl::Status OpsLink::SendQueuedLocked() {
  while (!queue_.empty()) {
    const std::string& d = queue_.front();
    const ssize_t n = send(fd_, d.data(), d.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return absl::OkStatus();
    if (n != static_cast<ssize_t>(d.size())) {
      return absl::UnavailableError(absl::StrCat("ops channel: send: ", n >= 0 ? "short send" : ErrnoText(errno)));
    }
    queued_bytes_ -= d.size() + kQueuedDatagramOverhead;
    queue_.pop_front();
  }
  return absl::OkStatus();
}

void OpsLink::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
}

bool OpsLink::WantsWrite() {
  absl::MutexLock lock(&mu_);
  return !queue_.empty();
}

bool OpsLink::Flush() {
  absl::MutexLock lock(&mu_);
  if (fd_ < 0) return false;
  return SendQueuedLocked().ok();
}

void OpsLink::Detach() {
  absl::MutexLock lock(&mu_);
  fd_ = -1;
  queue_.clear();
  queued_bytes_ = 0;
}

void FdChannelServer::CloseConnection(Connection& conn) {
  if (!conn.token.empty()) {
    auto it = connections_of_.find(conn.token);
    if (it != connections_of_.end() && --it->second <= 0) connections_of_.erase(it);
  }
  if (conn.ops != nullptr) conn.ops->Detach();
  close(conn.fd);
  conn.fd = -1;
  if (conn.ops != nullptr) {
    if (std::shared_ptr<OpsHandler> handler = conn.handler.lock(); handler != nullptr) {
      handler->OnOpsClosed(conn.why_closed.ok() ? absl::UnavailableError("the client closed its ops channel")
                                                : conn.why_closed);
    }
  }
}

void FdChannelServer::Loop() {
  std::vector<Connection> conns;
  std::vector<pollfd> fds;
  std::vector<std::string> forgotten;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
      forgotten.swap(forgotten_);
    }
    // Connections that never said a good Hello go after hello_timeout; those of ended
    // sessions (an ops connection ends through its link's shutdown) at once.
    const absl::Time now = absl::Now();
    absl::Time next_expiry = absl::InfiniteFuture();
    for (size_t i = 0; i < conns.size();) {
      const bool ended = !forgotten.empty() && conns[i].ops == nullptr && !conns[i].token.empty() &&
                         std::find(forgotten.begin(), forgotten.end(), conns[i].token) != forgotten.end();
      if (ended || (conns[i].token.empty() && now - conns[i].accepted >= options_.hello_timeout)) {
        CloseConnection(conns[i]);
        if (i + 1 != conns.size()) conns[i] = std::move(conns.back());
        conns.pop_back();
        continue;
      }
      if (conns[i].token.empty()) next_expiry = std::min(next_expiry, conns[i].accepted + options_.hello_timeout);
      ++i;
    }
    forgotten.clear();
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const Connection& c : conns) {
      const short events = c.ops != nullptr && c.ops->WantsWrite() ? POLLIN | POLLOUT : POLLIN;
      fds.push_back({c.fd, events, 0});
    }
    const int timeout_ms = next_expiry == absl::InfiniteFuture()
                               ? -1
                               : static_cast<int>(absl::ToInt64Milliseconds(next_expiry - now) + 1);
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      LOG(ERROR) << "shared-memory channel: poll: " << ErrnoText(errno);
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    if (fds[0].revents != 0) {
      // Stop (checked above), or an ops link queued a message: poll again with POLLOUT.
      uint64_t count;
      (void)!read(wake_fd_, &count, sizeof(count));
    }
    // Connections first (indexes stay valid), then new ones.
    std::vector<size_t> closed;
    for (size_t i = 0; i < conns.size(); ++i) {
      const short revents = fds[i + 2].revents;
      if (revents == 0) continue;
      Connection& c = conns[i];
      bool keep = true;
      if (c.ops != nullptr) {
        if ((revents & POLLOUT) != 0 && !c.ops->Flush()) {
          c.why_closed = absl::UnavailableError("ops channel: the client's socket broke");
          keep = false;
        }
        if (keep && (revents & ~POLLOUT) != 0) keep = ServeOps(c);
      } else {
        keep = Serve(c);
      }
      if (!keep) closed.push_back(i);
    }
    for (auto it = closed.rbegin(); it != closed.rend(); ++it) {
      CloseConnection(conns[*it]);
      if (*it + 1 != conns.size()) conns[*it] = std::move(conns.back());
      conns.pop_back();
    }
    if (fds[1].revents != 0) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        if (static_cast<int>(conns.size()) >= options_.max_connections) {
          // The oldest connection still without a good Hello makes room (a session's client
          // says Hello at once).
          auto oldest = conns.end();
          for (auto it = conns.begin(); it != conns.end(); ++it) {
            if (it->token.empty() && (oldest == conns.end() || it->accepted < oldest->accepted)) oldest = it;
          }
          if (oldest != conns.end()) {
            LOG_EVERY_T(WARNING, 10) << "shared-memory channel: " << options_.max_connections
                                         << " connections are open (the limit): closing the oldest that has not "
                                            "said Hello to take a new one";
            CloseConnection(*oldest);
            if (oldest + 1 != conns.end()) *oldest = std::move(conns.back());
            conns.pop_back();
          }
        }
        if (static_cast<int>(conns.size()) >= options_.max_connections) {
          LOG_EVERY_T(WARNING, 10) << "shared-memory channel: refusing a connection: " << options_.max_connections
                                       << " sessions' connections are open (the limit)";
          close(fd);
        } else {
          Connection c;
          c.fd = fd;
          c.accepted = absl::Now();
          conns.push_back(std::move(c));
        }
      } else if (errno == EMFILE || errno == ENFILE) {
        LOG(WARNING) << "shared-memory channel: accept: " << ErrnoText(errno) << "; backing off";
        absl::SleepFor(absl::Milliseconds(100));
      }
    }
  }
  for (Connection& c : conns) {
    c.why_closed = absl::UnavailableError("the sidecar is shutting down");
    CloseConnection(c);
  }
}

bool FdChannelServer::Serve(Connection& conn) {
  alignas(8) char buf[fdchannel::kMaxMessageBytes];
  int fd = -1;
  const absl::Time deadline = kNoWait;
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
        LOG_EVERY_T(WARNING, 10) << "shared-memory channel: a connection offered an unknown session token";
        return reply(absl::PermissionDeniedError("unknown session token"));
      }
    }
    int& held = connections_of_[token];
    if (held >= options_.max_connections_per_session) {
      return reply(absl::ResourceExhaustedError(absl::StrCat(
          "the session has ", held, " connections on the shared-memory channel, the limit (",
          options_.max_connections_per_session, " per session)")));
    }
    ++held;
    conn.token = token;
    return reply(absl::OkStatus());
  }
  if (op == fdchannel::kOpen && *got == sizeof(fdchannel::Open)) return ServeOpen(conn, buf, deadline);
  if (op == fdchannel::kOps && *got == sizeof(fdchannel::OpsMode)) return ServeOpsMode(conn, deadline);
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
  SegmentAdmission admit;
  absl::StatusOr<std::shared_ptr<engine::Group>> group = GroupOf(conn.token, &rank, &admit);
  if (!group.ok()) return reply(group.status());
  // A read-only descriptor is kept so that peers of the rank can be handed it (Open).
  auto segment = ShmSegment::FromFd(std::string(r.name, name_len), fd, r.bytes, {.share = true});
  fd = -1;  // FromFd took it
  if (segment.ok() && admit != nullptr) {
    // The job's quota (JobQuotas), on the size of the file as mapped, not the size the
    // client claims (a file may be larger). The requests of every session come through this
    // one thread, so checks do not race each other. A refused segment is unmapped here.
    if (absl::Status s = admit(static_cast<int64_t>(std::min<size_t>((*segment)->size(), INT64_MAX))); !s.ok()) {
      segment = s;
    }
  }
  if (!segment.ok()) {
    // Keeps serving: a bad descriptor or a refusal is an answer, not a broken connection.
    const fdchannel::Reply rep = fdchannel::ReplyFor(segment.status());
    return fdchannel::SendMessage(conn.fd, &rep, sizeof(rep), -1, deadline).ok();
  }
  absl::Status added = (*group)->AddSegment(rank, std::shared_ptr<ShmSegment>(std::move(*segment)));
  const fdchannel::Reply rep = fdchannel::ReplyFor(added);
  return fdchannel::SendMessage(conn.fd, &rep, sizeof(rep), -1, deadline).ok();
}

absl::StatusOr<std::shared_ptr<engine::Group>> FdChannelServer::GroupOf(const std::string& token, int* rank,
                                                                         SegmentAdmission* admit) {
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
  if (admit != nullptr) *admit = binding.admit;
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

bool FdChannelServer::ServeOpsMode(Connection& conn, absl::Time deadline) {
  std::shared_ptr<OpsHandler> handler;
  const absl::Status s = [&]() -> absl::Status {
    if (conn.token.empty()) return absl::FailedPreconditionError("OpsMode before Hello");
    absl::MutexLock lock(&mu_);
    auto it = tokens_.find(conn.token);
    if (it == tokens_.end()) return absl::FailedPreconditionError("the session has ended");
    if (!it->second.bound) return absl::UnavailableError("the session is not attached to a group (yet)");
    handler = it->second.ops.lock();
    if (handler == nullptr) return absl::FailedPreconditionError("this session is not offered an ops channel");
    if (!it->second.ops_link.expired()) return absl::FailedPreconditionError("the session already has an ops channel");
    conn.ops = std::make_shared<OpsLink>(conn.fd, wake_fd_);
    it->second.ops_link = conn.ops;
    return absl::OkStatus();
  }();
  const fdchannel::Reply rep = fdchannel::ReplyFor(s);
  if (!fdchannel::SendMessage(conn.fd, &rep, sizeof(rep), -1, deadline).ok() || !s.ok()) {
    // A refused switch closes the connection (the session goes on without an ops channel
    // only if it never got one: a link already handed out is not replaced).
    if (conn.ops != nullptr) {
      conn.why_closed = absl::UnavailableError("ops channel: the answer to OpsMode could not be sent");
      conn.handler = handler;
      handler->OnOpsOpened(conn.ops);
    }
    return false;
  }
  conn.handler = handler;
  conn.reassembler = std::make_unique<opschannel::Reassembler>();
  handler->OnOpsOpened(conn.ops);
  return true;
}

bool FdChannelServer::ServeOps(Connection& conn) {
  // At most this many datagrams per wake-up, so that one busy session cannot starve others.
  constexpr int kMaxDatagramsPerWake = 64;
  for (int taken = 0; taken < kMaxDatagramsPerWake;) {
    // Several datagrams per system call (descriptors sent along are discarded by the kernel:
    // no control buffer).
    absl::StatusOr<int> got = ops_receiver_.Receive(conn.fd, /*wait=*/false);
    if (!got.ok()) {
      if (!ops_receiver_.closed()) conn.why_closed = got.status();  // else the client closed it
      return false;
    }
    for (int i = 0; i < *got; ++i) {
      absl::StatusOr<bool> complete = conn.reassembler->Add(ops_receiver_.data(i), ops_receiver_.size(i));
      if (!complete.ok()) {
        conn.why_closed = complete.status();
        return false;
      }
      if (!*complete) continue;
      std::shared_ptr<OpsHandler> handler = conn.handler.lock();
      if (handler == nullptr) {
        conn.why_closed = absl::FailedPreconditionError("the session has ended");
        return false;
      }
      if (absl::Status s = handler->OnOpsMessage(conn.reassembler->Take()); !s.ok()) {
        conn.why_closed = s;
        return false;
      }
    }
    if (ops_receiver_.closed()) return false;  // the client closed it after these
    // Fewer than a batch: the socket had no more just now (poll says when it has), which
    // spares the system call that would find it empty.
    if (*got < kOpsReceiveBatch) return true;
    taken += *got;
  }
  return true;
}

}  // namespace collserve::server
