// The coordinator's TCPStore endpoint: an event loop over non-blocking sockets that decodes
// requests with tcpstore_protocol.h and serves them from the store (see tcpstore_server.h).
#include "server/coordinator/tcpstore_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "server/common/blocking_pool.h"
#include "server/common/networks.h"
#include "server/coordinator/services.h"
#include "server/coordinator/tcpstore_protocol.h"

namespace collserve::server {
namespace {

using tcpstore::EncodeBytes;
using tcpstore::EncodeInt;
using tcpstore::Op;

// How long accepting pauses after running out of descriptors.
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);
constexpr size_t kReadChunk = 64 << 10;
// A connection's requests are not decoded while this many bytes of its replies wait to be
// sent: a client that pipelines GETs of a large value and reads none of the answers once
// made the server hold every answer (a few bytes of request each, the value's size each).
constexpr size_t kMaxPendingReplyBytes = 64 << 20;
// Keys of the WAITs one connection may have pending (torch's client has one WAIT pending at
// a time): a WAIT past it closes the connection.
constexpr size_t kMaxWaitedKeysPerConnection = store::kMaxKeysPerRequest;

// Replies waiting to be sent: appended by the loop and by the store's WAIT callbacks,
// sent by the loop. Shared with those callbacks, which may outlive the connection.
struct Outbox {
  absl::Mutex mu;
  std::string bytes ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;
  std::set<store::WaitId> waits ABSL_GUARDED_BY(mu);  // pending WAITs
  size_t waited_keys ABSL_GUARDED_BY(mu) = 0;          // keys of the pending WAITs
  // A write of this connection runs on the write pool (TcpStoreOptions::write_threads): the
  // connection's later requests wait in `in` until it ends, which sets `resumed` (and
  // `error`, why the connection must close, if it failed).
  bool busy ABSL_GUARDED_BY(mu) = false;
  bool resumed ABSL_GUARDED_BY(mu) = false;
  std::string error ABSL_GUARDED_BY(mu);
};

struct Connection {
  int fd = -1;
  std::string peer;     // "ip:port"
  std::string peer_ip;  // for the per-peer cap
  std::string in;       // received, not yet consumed
  size_t need = 1;      // decode again once `in` holds this many bytes
  tcpstore::Dialect dialect = tcpstore::Dialect::kUndecided;
  absl::Time last_request;                           // for idle_timeout
  absl::Time accepted;
  bool requested = false;  // has sent a whole request; until then it may be evicted at the cap
  absl::Time frame_started = absl::InfiniteFuture();  // first byte of an unfinished request
  absl::Time out_stalled = absl::InfiniteFuture();    // replies waiting since
  std::shared_ptr<Outbox> out = std::make_shared<Outbox>();
};

std::string PeerIp(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, host, sizeof(host));
  } else if (addr.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr, host, sizeof(host));
  }
  return host;
}

int PeerPort(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  return 0;
}

class TcpStoreServerImpl : public TcpStoreServer {
 public:
  TcpStoreServerImpl(store::Store& store, TcpStoreOptions options, NetworkList allowed,
                     std::optional<std::vector<uid_t>> local_uids)
      : store_(store),
        options_(std::move(options)),
        allowed_(std::move(allowed)),
        local_uids_(std::move(local_uids)),
        prefix_(absl::StrCat(options_.job, "/")) {
    limits_.max_key_bytes = options_.max_key_bytes;
    limits_.max_value_bytes = options_.max_value_bytes;
    limits_.max_keys_per_request = options_.max_keys_per_request;
    // Never let connections take more than half of the process's descriptors.
    rlimit nofile{};
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY) {
      max_connections_ = static_cast<int>(std::min<rlim_t>(static_cast<rlim_t>(options_.max_connections),
                                                           std::max<rlim_t>(nofile.rlim_cur / 2, 16)));
    } else {
      max_connections_ = options_.max_connections;
    }
  }
  ~TcpStoreServerImpl() override { Shutdown(); }

  absl::Status Listen() {
    const std::string& address = options_.listen_address;
    const size_t colon = address.rfind(':');
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
        port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("tcpstore address \"", address, "\" is not host:port"));
    }
    std::string host = address.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    if (host.empty() || host == "0.0.0.0" || host == "::") {
      // The wildcard, both families when possible (as torch's server listens).
      fd_ = BindWildcard(port);
    } else {
      addrinfo hints{};
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
      addrinfo* res = nullptr;
      if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0) {
        return absl::InvalidArgumentError(absl::StrCat("tcpstore address ", address, ": ", gai_strerror(rc)));
      }
      for (addrinfo* ai = res; ai != nullptr && fd_ < 0; ai = ai->ai_next) {
        fd_ = BindTo(ai->ai_family, ai->ai_addr, ai->ai_addrlen, false);
      }
      freeaddrinfo(res);
    }
    if (fd_ < 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", strerror(errno)));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                             : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
    wake_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", strerror(errno)));
    spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (options_.write_threads > 0) writes_ = std::make_unique<BlockingPool>(options_.write_threads);
    thread_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

  int port() const override { return port_; }
  int64_t protocol_errors() const override { return protocol_errors_.load(); }
  int64_t evicted() const override { return evicted_.load(); }
  std::vector<int64_t> requests() const override {
    std::vector<int64_t> out;
    for (const auto& r : requests_) out.push_back(r.load(std::memory_order_relaxed));
    return out;
  }

  void Shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    if (thread_.joinable()) {
      Wake();
      thread_.join();
    }
    writes_.reset();  // runs the writes handed to it (they Wake() through wake_)
    if (fd_ >= 0) close(fd_);
    if (wake_ >= 0) close(wake_);
    if (spare_fd_ >= 0) close(spare_fd_);
    fd_ = wake_ = spare_fd_ = -1;
  }

 private:
  static int BindTo(int family, const sockaddr* addr, socklen_t len, bool dual_stack) {
    int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (family == AF_INET6 && dual_stack) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    if (bind(fd, addr, len) != 0 || listen(fd, 1024) != 0) {
      const int saved = errno;
      close(fd);
      errno = saved;
      return -1;
    }
    return fd;
  }

  static int BindWildcard(int port) {
    sockaddr_in6 a6{};
    a6.sin6_family = AF_INET6;
    a6.sin6_addr = in6addr_any;
    a6.sin6_port = htons(static_cast<uint16_t>(port));
    int fd = BindTo(AF_INET6, reinterpret_cast<sockaddr*>(&a6), sizeof(a6), true);
    if (fd >= 0) return fd;
    sockaddr_in a4{};
    a4.sin_family = AF_INET;
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
    a4.sin_port = htons(static_cast<uint16_t>(port));
    return BindTo(AF_INET, reinterpret_cast<sockaddr*>(&a4), sizeof(a4), false);
  }

  void Wake() {
    const uint64_t one = 1;
    (void)!write(wake_, &one, sizeof(one));
  }

  bool Stopping() {
    absl::MutexLock lock(&mu_);
    return stopping_;
  }

  // The loop: accepts, reads and decodes requests, serves them, sends replies, and closes
  // connections that break the rules. Runs until Shutdown.
  void Loop() {
    std::list<Connection> conns;
    std::map<std::string, int> per_peer;
    int64_t buffered = 0;  // sum of conns' `in`
    absl::Time accept_paused_until = absl::InfinitePast();
    std::vector<pollfd> fds;
    std::vector<std::list<Connection>::iterator> polled;
    while (!Stopping()) {
      const absl::Time now = absl::Now();
      // Deadlines: unfinished requests, unread replies, idle connections, the accept pause.
      absl::Time wake_at = accept_paused_until > now ? accept_paused_until : absl::InfiniteFuture();
      for (auto it = conns.begin(); it != conns.end();) {
        std::string why;
        if (now - it->frame_started >= options_.frame_timeout) {
          why = absl::StrCat("a request was not completed within ", absl::FormatDuration(options_.frame_timeout));
        } else if (now - it->out_stalled >= options_.frame_timeout) {
          why = absl::StrCat("the client did not read its replies for ", absl::FormatDuration(options_.frame_timeout));
        } else if (options_.idle_timeout > absl::ZeroDuration() && now - it->last_request >= options_.idle_timeout &&
                   it->in.empty() && !HasWaits(*it)) {
          why = absl::StrCat("idle for ", absl::FormatDuration(options_.idle_timeout));
        }
        if (!why.empty()) {
          protocol_errors_.fetch_add(1);
          LOG(WARNING) << "tcpstore: closing the connection from " << it->peer << " (job " << options_.job
                       << "): " << why;
          buffered -= static_cast<int64_t>(it->in.size());
          CloseConnection(*it, per_peer);
          it = conns.erase(it);
          continue;
        }
        wake_at = std::min({wake_at, it->frame_started + options_.frame_timeout,
                            it->out_stalled + options_.frame_timeout});
        if (options_.idle_timeout > absl::ZeroDuration()) wake_at = std::min(wake_at, it->last_request + options_.idle_timeout);
        ++it;
      }
      fds.clear();
      polled.clear();
      fds.push_back({wake_, POLLIN, 0});
      fds.push_back({accept_paused_until > now ? -1 : fd_, POLLIN, 0});
      const bool may_read = buffered < options_.max_buffered_bytes;
      // Requests received while their connection was held (Held) are decoded once it is not:
      // no event on the socket says so, so poll does not wait then.
      bool decodable = false;
      for (auto it = conns.begin(); it != conns.end(); ++it) {
        short events = 0;
        const bool held = Held(*it);
        if ((may_read || it->in.empty()) && !held) events |= POLLIN;
        if (!held && Decodable(*it)) decodable = true;
        if (PendingOut(*it)) events |= POLLOUT;
        fds.push_back({it->fd, events, 0});
        polled.push_back(it);
      }
      const int timeout_ms = decodable ? 0
                             : wake_at == absl::InfiniteFuture()
                                 ? -1
                                 : static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake_at - now) + 1, 0, 1 << 30));
      if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
        if (errno == EINTR) continue;
        LOG(ERROR) << "tcpstore: poll: " << strerror(errno);
        absl::SleepFor(absl::Milliseconds(100));
        continue;
      }
      if (fds[0].revents != 0) {
        uint64_t drained;
        (void)!read(wake_, &drained, sizeof(drained));
      }
      for (size_t i = 0; i < polled.size(); ++i) {
        auto it = polled[i];
        const short re = fds[i + 2].revents;
        std::string why;
        bool eof = false;
        const bool resumed = TakeResumed(*it, &why);
        if (why.empty() && (resumed || (re & (POLLIN | POLLHUP | POLLERR)) || Decodable(*it))) {
          if (re & (POLLIN | POLLHUP | POLLERR)) {
            const size_t before = it->in.size();
            eof = !ReadInto(*it, &why);
            buffered += static_cast<int64_t>(it->in.size()) - static_cast<int64_t>(before);
          }
          if (why.empty()) {
            const size_t held = it->in.size();
            why = Decode(*it);
            buffered -= static_cast<int64_t>(held) - static_cast<int64_t>(it->in.size());
          }
        }
        if (why.empty() && !Flush(*it)) eof = true;
        if (why.empty() && !eof) continue;
        if (!why.empty()) {
          protocol_errors_.fetch_add(1);
          LOG(WARNING) << "tcpstore: closing the connection from " << it->peer << " (job " << options_.job
                       << "): " << why;
        }
        buffered -= static_cast<int64_t>(it->in.size());
        CloseConnection(*it, per_peer);
        conns.erase(it);
      }
      // Replies queued by WAIT callbacks on connections that had nothing to read.
      for (Connection& c : conns) {
        if (PendingOut(c)) Flush(c);
      }
      if (fds[1].revents != 0) Accept(conns, per_peer, &accept_paused_until);
    }
    for (Connection& c : conns) CloseConnection(c, per_peer);
  }

  void Accept(std::list<Connection>& conns, std::map<std::string, int>& per_peer, absl::Time* paused_until) {
    for (int accepted = 0; accepted < 64; ++accepted) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      const int fd = accept4(fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // Out of descriptors: shed the connection at the head of the queue (so it fails
          // fast rather than hangs) with the spare descriptor, and pause accepting.
          LOG(WARNING) << "tcpstore: accept: " << strerror(errno) << "; shedding a connection and pausing "
                       << absl::FormatDuration(kAcceptBackoff);
          if (spare_fd_ >= 0) {
            close(spare_fd_);
            const int shed = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (shed >= 0) close(shed);
            spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
          }
          *paused_until = absl::Now() + kAcceptBackoff;
        }
        return;  // EAGAIN, or an error of one connection
      }
      const std::string ip = PeerIp(addr);
      const std::string peer = absl::StrCat(ip, ":", PeerPort(addr));
      std::string refused;
      if (!allowed_.empty() && !allowed_.Contains(addr)) {
        refused = absl::StrCat(ip, " is outside the allowed networks (", allowed_.ToString(), ")");
      } else if (static_cast<int>(conns.size()) >= max_connections_ && !EvictSilent(conns, per_peer)) {
        refused = absl::StrCat(max_connections_, " connections are open (the limit), each of which has sent a request");
      } else if (per_peer[ip] >= options_.max_connections_per_peer) {
        refused = absl::StrCat(per_peer[ip], " connections from ", ip, " are open (the per-peer limit)");
      } else if (local_uids_.has_value() && IsLoopback(addr)) {
        refused = RefusedLocalPeer(fd);
      }
      if (!refused.empty()) {
        LOG(WARNING) << "tcpstore: refusing a connection from " << peer << ": " << refused;
        if (per_peer[ip] == 0) per_peer.erase(ip);
        close(fd);
        continue;
      }
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      ++per_peer[ip];
      Connection& c = conns.emplace_back();
      c.fd = fd;
      c.peer = peer;
      c.peer_ip = ip;
      c.last_request = c.accepted = absl::Now();
    }
  }

  // At the connection cap: closes the oldest connection that has sent nothing since it was
  // accepted (no byte buffered, no request served), so that idle sockets held open cannot
  // lock legitimate clients out; one that has sent a request is never evicted. False if
  // every connection has.
  bool EvictSilent(std::list<Connection>& conns, std::map<std::string, int>& per_peer) {
    auto oldest = conns.end();
    for (auto it = conns.begin(); it != conns.end(); ++it) {
      if (!it->requested && it->in.empty() && (oldest == conns.end() || it->accepted < oldest->accepted)) oldest = it;
    }
    if (oldest == conns.end()) return false;
    evicted_.fetch_add(1);
    LOG(WARNING) << "tcpstore: closing the connection from " << oldest->peer << " (job " << options_.job
                 << "): it has sent nothing in " << absl::FormatDuration(absl::Now() - oldest->accepted) << " and the "
                 << max_connections_ << " connections of the limit are open (the oldest silent one makes room)";
    CloseConnection(*oldest, per_peer);
    conns.erase(oldest);
    return true;
  }

  // Why a loopback connection is refused ("" = admitted): its other end belongs to a uid not
  // in local_uids_, or its owner cannot be learned (fail closed).
  std::string RefusedLocalPeer(int fd) const {
    absl::StatusOr<uid_t> uid = LocalPeerUid(fd);
    const std::string allowed = absl::StrCat("uid ", absl::StrJoin(*local_uids_, ", "),
                                             "; --tcpstore_local_uids names who may connect from this host");
    if (!uid.ok()) return absl::StrCat("the owner of its socket cannot be learned (", uid.status().message(), "; allowed: ", allowed, ")");
    if (std::find(local_uids_->begin(), local_uids_->end(), *uid) != local_uids_->end()) return "";
    return absl::StrCat("its socket belongs to uid ", *uid, " (allowed: ", allowed, ")");
  }

  // Reads what is there (non-blocking). False at end of stream or on an error (with no
  // bytes of a request pending, a clean close; else `*why`).
  bool ReadInto(Connection& c, std::string* why) {
    for (int round = 0; round < 16; ++round) {
      char chunk[kReadChunk];
      const ssize_t n = recv(c.fd, chunk, sizeof(chunk), 0);
      if (n > 0) {
        if (c.in.empty()) c.frame_started = absl::Now();
        c.in.append(chunk, static_cast<size_t>(n));
        if (static_cast<size_t>(n) < sizeof(chunk)) return true;
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
      if (!c.in.empty()) *why = absl::StrCat("truncated frame: the connection ended inside a request (", c.in.size(), " bytes)");
      return false;
    }
    return true;
  }

  // Decodes and serves every complete request in `c.in`. Returns "" or why the connection
  // must close.
  std::string Decode(Connection& c) {
    size_t pos = 0;
    std::string why;
    while (c.in.size() - pos >= c.need && why.empty() && !Held(c)) {
      tcpstore::Request request;
      const tcpstore::ParseResult r =
          tcpstore::ParseRequest(absl::string_view(c.in).substr(pos), limits_, &c.dialect, &request);
      if (r.status == tcpstore::Parse::kError) return r.error;
      if (r.status == tcpstore::Parse::kIncomplete) {
        c.need = r.needed;
        break;
      }
      pos += r.consumed;
      c.need = 1;
      c.last_request = absl::Now();
      c.requested = true;
      why = Handle(request, c);
    }
    c.in.erase(0, pos);
    if (c.in.empty()) {
      c.frame_started = absl::InfiniteFuture();
      c.in.shrink_to_fit();
    } else if (pos > 0) {
      c.frame_started = absl::Now();  // a new request began in what was left
    }
    return why;
  }

  void Queue(Connection& c, absl::string_view bytes) {
    absl::MutexLock lock(&c.out->mu);
    c.out->bytes.append(bytes.data(), bytes.size());
  }

  bool PendingOut(Connection& c) {
    absl::MutexLock lock(&c.out->mu);
    return !c.out->bytes.empty();
  }

  bool Busy(Connection& c) {
    absl::MutexLock lock(&c.out->mu);
    return c.out->busy;
  }

  // Whether `c.in` holds enough for Decode to go on (requests left while it was held).
  static bool Decodable(const Connection& c) { return !c.in.empty() && c.in.size() >= c.need; }

  // Whether the connection's next request must wait: a pooled write runs, or
  // kMaxPendingReplyBytes of replies wait to be sent.
  bool Held(Connection& c) {
    absl::MutexLock lock(&c.out->mu);
    return c.out->busy || c.out->bytes.size() >= kMaxPendingReplyBytes;
  }

  // True once after a pooled write of `c` ended; `*why` = its error, if it failed.
  bool TakeResumed(Connection& c, std::string* why) {
    absl::MutexLock lock(&c.out->mu);
    if (!c.out->resumed) return false;
    c.out->resumed = false;
    *why = std::move(c.out->error);
    c.out->error.clear();
    return true;
  }

  // Runs a write: `write` returns the reply's bytes ("" for none). With a write pool it
  // runs there and the connection reads no further request until it ended (its order is
  // kept); the loop is woken to go on. Without one it runs here. Returns "" or why the
  // connection must close (inline only; a pooled failure closes it through TakeResumed).
  std::string Write(Connection& c, const char* what, absl::AnyInvocable<absl::StatusOr<std::string>() &&> write) {
    if (writes_ == nullptr) {
      absl::StatusOr<std::string> reply = std::move(write)();
      if (!reply.ok()) return absl::StrCat(what, " failed: ", reply.status().ToString());
      if (!reply->empty()) Queue(c, *reply);
      return "";
    }
    {
      absl::MutexLock lock(&c.out->mu);
      c.out->busy = true;
    }
    writes_->Run([this, out = c.out, what, write = std::move(write)]() mutable {
      absl::StatusOr<std::string> reply = std::move(write)();
      {
        absl::MutexLock lock(&out->mu);
        if (reply.ok()) {
          out->bytes += *reply;
        } else {
          out->error = absl::StrCat(what, " failed: ", reply.status().ToString());
        }
        out->busy = false;
        out->resumed = true;
      }
      Wake();
    });
    return "";
  }

  bool HasWaits(Connection& c) {
    absl::MutexLock lock(&c.out->mu);
    return !c.out->waits.empty();
  }

  // Sends what the outbox holds, without blocking. False if the connection broke.
  bool Flush(Connection& c) {
    absl::MutexLock lock(&c.out->mu);
    std::string& out = c.out->bytes;
    size_t sent = 0;
    bool broken = false;
    while (sent < out.size()) {
      const ssize_t n = send(c.fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      broken = !(n < 0 && errno == EAGAIN);
      break;
    }
    out.erase(0, sent);
    if (out.empty()) {
      c.out_stalled = absl::InfiniteFuture();
    } else if (sent > 0 || c.out_stalled == absl::InfiniteFuture()) {
      c.out_stalled = absl::Now();
    }
    return !broken;
  }

  void CloseConnection(Connection& c, std::map<std::string, int>& per_peer) {
    std::set<store::WaitId> waits;
    {
      absl::MutexLock lock(&c.out->mu);
      c.out->closed = true;
      waits.swap(c.out->waits);
      c.out->waited_keys = 0;
    }
    for (store::WaitId w : waits) store_.CancelWait(w);
    close(c.fd);
    if (--per_peer[c.peer_ip] <= 0) per_peer.erase(c.peer_ip);
  }

  std::string Ns(const std::string& key) const { return prefix_ + key; }
  std::vector<std::string> Ns(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const std::string& k : keys) out.push_back(Ns(k));
    return out;
  }

  std::string GetOrEmpty(const std::string& key) {
    absl::StatusOr<std::string> v = store_.Get(Ns(key), absl::ZeroDuration());
    return v.ok() ? *std::move(v) : std::string();
  }

  // Serves one request. Returns "" or why the connection must close.
  std::string Handle(tcpstore::Request& q, Connection& c) {
    requests_[static_cast<int>(q.op)].fetch_add(1, std::memory_order_relaxed);
    auto failed = [](const char* what, const absl::Status& s) { return absl::StrCat(what, " failed: ", s.ToString()); };
    switch (q.op) {
      case Op::kValidate:
        return "";
      case Op::kPing:
        Queue(c, absl::string_view(reinterpret_cast<const char*>(&q.nonce), sizeof(q.nonce)));
        return "";
      case Op::kSet:
        return Write(c, "SET", [this, key = Ns(q.keys[0]), value = std::move(q.values[0])]() -> absl::StatusOr<std::string> {
          COLLSERVE_RETURN_IF_ERROR(store_.Set(key, value));
          return std::string();
        });
      case Op::kAppend:
        return Write(c, "APPEND", [this, key = Ns(q.keys[0]), value = std::move(q.values[0])]() -> absl::StatusOr<std::string> {
          COLLSERVE_RETURN_IF_ERROR(store_.Append(key, value));
          return std::string();
        });
      case Op::kCompareSet:
        return Write(c, "COMPARE_SET", [this, key = Ns(q.keys[0]), expected = std::move(q.values[0]),
                                        desired = std::move(q.values[1])]() -> absl::StatusOr<std::string> {
          COLLSERVE_ASSIGN_OR_RETURN(std::string v, store_.CompareSet(key, expected, desired));
          return EncodeBytes(v);
        });
      case Op::kGet:
        Queue(c, EncodeBytes(GetOrEmpty(q.keys[0])));
        return "";
      case Op::kAdd:
        return Write(c, "ADD", [this, key = Ns(q.keys[0]), delta = q.delta]() -> absl::StatusOr<std::string> {
          COLLSERVE_ASSIGN_OR_RETURN(int64_t v, store_.Add(key, delta));
          return EncodeInt(v);
        });
      case Op::kCheck: {
        absl::StatusOr<bool> ready = q.keys.empty() ? absl::StatusOr<bool>(true) : store_.Check(Ns(q.keys));
        if (!ready.ok()) return failed("CHECK", ready.status());
        Queue(c, std::string(1, *ready ? '\0' : '\1'));
        return "";
      }
      case Op::kWait:
        return StartWait(q.keys, c);
      case Op::kCancelWait: {
        std::set<store::WaitId> waits;
        {
          absl::MutexLock lock(&c.out->mu);
          waits.swap(c.out->waits);
          c.out->waited_keys = 0;
        }
        for (store::WaitId w : waits) store_.CancelWait(w);
        Queue(c, std::string(1, '\1'));  // WAIT_CANCELED
        return "";
      }
      case Op::kNumKeys: {
        absl::StatusOr<int64_t> n = store_.NumKeys(prefix_);
        if (!n.ok()) return failed("GETNUMKEYS", n.status());
        Queue(c, EncodeInt(*n));
        return "";
      }
      case Op::kDeleteKey:
        return Write(c, "DELETE_KEY", [this, key = Ns(q.keys[0])]() -> absl::StatusOr<std::string> {
          COLLSERVE_ASSIGN_OR_RETURN(bool deleted, store_.DeleteKey(key));
          return EncodeInt(deleted ? 1 : 0);
        });
      case Op::kWatchKey:
        Queue(c, std::string(1, '\3'));  // KEY_CALLBACK_REGISTERED; no events (tcpstore_protocol.h)
        return "";
      case Op::kMultiGet: {
        std::string reply;
        uint64_t values = 0;
        for (const std::string& k : q.keys) {
          const std::string v = GetOrEmpty(k);
          values += v.size();
          if (values > store::kMaxMultiGetBytes) return failed("MULTI_GET", store::MultiGetTooLarge(q.keys.size(), values));
          reply += EncodeBytes(v);
        }
        Queue(c, reply);
        return "";
      }
      case Op::kMultiSet:
        if (q.keys.empty()) return "";
        return Write(c, "MULTI_SET", [this, keys = Ns(q.keys), values = std::move(q.values)]() -> absl::StatusOr<std::string> {
          COLLSERVE_RETURN_IF_ERROR(store_.MultiSet(keys, values));
          return std::string();
        });
    }
    return "unknown opcode";
  }

  // WAIT: STOP_WAITING is queued by the store's callback once every key exists (inline if
  // they already do) and sent by the loop. No server-side deadline (torch's timeouts are
  // the client's); it ends with the connection or a CANCEL_WAIT. Returns "" or why the
  // connection must close (its pending WAITs would name more than
  // kMaxWaitedKeysPerConnection keys).
  std::string StartWait(const std::vector<std::string>& keys, Connection& c) {
    if (keys.empty()) {
      Queue(c, std::string(1, '\0'));
      return "";
    }
    {
      absl::MutexLock lock(&c.out->mu);
      if (c.out->waited_keys + keys.size() > kMaxWaitedKeysPerConnection) {
        return absl::StrCat("WAIT of ", keys.size(), " keys with ", c.out->waited_keys,
                            " keys waited on already: the limit is ", kMaxWaitedKeysPerConnection,
                            " keys of pending WAITs per connection");
      }
    }
    struct State {
      absl::Mutex mu;
      bool done = false;
      store::WaitId id = 0;  // once counted in the outbox (guarded by the outbox's mu)
      bool counted = false;  // guarded by the outbox's mu
    };
    auto state = std::make_shared<State>();
    std::shared_ptr<Outbox> out = c.out;
    const size_t count = keys.size();
    const store::WaitId id =
        store_.WaitAsync(Ns(keys), absl::InfiniteFuture(), [this, out, state, count](absl::Status s) {
          {
            absl::MutexLock lock(&state->mu);
            state->done = true;
          }
          // Under the lock: once the loop has closed the connection (it does so for every
          // connection before Shutdown returns), no callback touches the server any more.
          absl::MutexLock lock(&out->mu);
          if (state->counted && out->waits.erase(state->id) > 0) out->waited_keys -= count;
          if (!s.ok() || out->closed) return;
          out->bytes.push_back('\0');  // STOP_WAITING
          Wake();
        });
    absl::MutexLock lock(&state->mu);
    if (state->done) return "";
    absl::MutexLock out_lock(&out->mu);
    out->waits.insert(id);
    out->waited_keys += count;
    state->id = id;
    state->counted = true;
    return "";
  }

  store::Store& store_;
  const TcpStoreOptions options_;
  const NetworkList allowed_;  // empty = any peer
  const std::optional<std::vector<uid_t>> local_uids_;  // nullopt = any local user
  const std::string prefix_;
  tcpstore::Limits limits_;
  int max_connections_ = 0;
  int fd_ = -1;
  int wake_ = -1;      // eventfd: WAIT replies queued, or Shutdown
  int spare_fd_ = -1;  // given up to shed a connection when out of descriptors
  int port_ = 0;
  std::thread thread_;
  std::unique_ptr<BlockingPool> writes_;  // write_threads > 0: where writes run
  std::atomic<int64_t> protocol_errors_{0};
  std::atomic<int64_t> evicted_{0};
  std::atomic<int64_t> requests_[tcpstore::kNumOps] = {};
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(store::Store& store,
                                                                      const TcpStoreOptions& options) {
  if (options.job.empty()) return absl::InvalidArgumentError("the tcpstore job name is empty");
  // A frame timeout of 0 closed every connection with a request in progress; a limit below 1
  // admitted no connection (or, negative, every one).
  if (options.frame_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("tcpstore frame timeout ", absl::FormatDuration(options.frame_timeout),
                                                   " must be positive"));
  }
  if (options.idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("tcpstore idle timeout ", absl::FormatDuration(options.idle_timeout),
                                                   " is negative (0: none)"));
  }
  if (options.max_connections < 1 || options.max_connections_per_peer < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tcpstore max_connections ", options.max_connections,
                                                   " and max_connections_per_peer ", options.max_connections_per_peer,
                                                   " must be >= 1"));
  }
  if (absl::Status s = ValidateJob(options.job); !s.ok()) return s;
  auto allowed = NetworkList::Parse(options.allowed_networks);
  if (!allowed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tcpstore allowed networks: ", allowed.status().message()));
  }
  if (allowed->empty() && !IsLoopbackListenAddress(options.listen_address)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the TCPStore endpoint ", options.listen_address,
        " can be reached from other hosts and torch's TCPStore protocol carries no credentials: name the networks "
        "of the job's hosts with --tcpstore_allow (e.g. 10.244.0.0/16; 0.0.0.0/0,::/0 admits anyone), or listen on "
        "loopback"));
  }
  std::optional<std::vector<uid_t>> local_uids;
  if (options.local_uids != "any") {
    local_uids.emplace();
    if (options.local_uids.empty()) {
      local_uids->push_back(0);
      if (geteuid() != 0) local_uids->push_back(geteuid());
    } else {
      for (absl::string_view part : absl::StrSplit(options.local_uids, ',')) {
        uint32_t uid;
        if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &uid) || uid == static_cast<uint32_t>(-1)) {
          return absl::InvalidArgumentError(absl::StrCat("--tcpstore_local_uids=", options.local_uids, ": \"", part,
                                                         "\" is not a decimal uid (or give \"any\")"));
        }
        local_uids->push_back(static_cast<uid_t>(uid));
      }
    }
  }
  auto server = std::make_unique<TcpStoreServerImpl>(store, options, std::move(*allowed), std::move(local_uids));
  if (absl::Status s = server->Listen(); !s.ok()) return s;
  return std::unique_ptr<TcpStoreServer>(std::move(server));
}

}  // namespace collserve::server
