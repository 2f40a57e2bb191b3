// TCPStore wire protocol served over the coordinator's store (see tcpstore_server.h).
//
// Byte layout (torch/csrc/distributed/c10d/TCPStore.cpp, TCPStoreBackend.cpp; torch 1.13.1
// and 2.6.0; ../shared/research/torch_interop.md §1.2-1.8). No frame headers: a request is
// a 1-byte opcode and fields laid out per opcode; integers are host order (little-endian).
//   string/bytes: uint64 length, then the bytes      key list: uint64 n, then n strings
//   int64: 8 bytes, two's complement                  enums: 1 byte
// Opcodes and replies (1.13 value / >= 2.2 value):
//   -/0   VALIDATE   uint32 magic 0x3C85F7CE (bytes 00 CE F7 85 3C on the wire); no reply.
//                    It opens every >= 2.2 connection; its presence selects that dialect.
//   0/1   SET        key, value; no reply
//   1/2   COMPARE_SET key, expected, desired; reply: value (current after the call, or
//                    `expected` when the key is missing and `expected` is not empty)
//   2/3   GET        key; reply: value (empty if missing, as torch 2.x's libuv server)
//   3/4   ADD        key, int64 delta; reply: int64 new value (stored as ASCII decimal)
//   4/5   CHECK      key list; reply: uint8 READY=0 / NOT_READY=1
//   5/6   WAIT       key list; reply: uint8 STOP_WAITING=0 once every key exists (deferred;
//                    the connection keeps being served meanwhile)
//   6/7   GETNUMKEYS no fields; reply: int64 (keys of the job, "init/" included)
//   7/-   WATCH_KEY  key (1.13's callback connection); reply: uint8 KEY_CALLBACK_REGISTERED=3.
//                    No change events follow: torch 1.13's Python API cannot register
//                    watches and c10d never does; the connection is kept open, silent,
//                    because closing it makes a 1.13 client abort or spin.
//   8/8   DELETE_KEY key; reply: int64 keys deleted (0 or 1)
//   -/9   APPEND     key, bytes; no reply
//   -/10  MULTI_GET  key list; reply: one value per key (empty if missing)
//   -/11  MULTI_SET  int64 n, then n x (key, value); no reply
//   -/12  CANCEL_WAIT no fields; cancels this connection's pending WAITs; reply: uint8
//                    WAIT_CANCELED=1 (after any STOP_WAITING already sent)
//   -/13  PING       uint32 nonce; reply: the same 4 bytes
// Not served (closes the connection as an unknown opcode): torch >= 2.7's QUEUE_PUSH/POP/LEN
// (14-16, libuv server only) and later LIST_KEYS/BARRIER. A torch 2.1-era client (no
// VALIDATE, APPEND=8) cannot be told from 1.13 on the wire and is not supported.
#include "server/coordinator/tcpstore_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "server/coordinator/services.h"

namespace collserve::server {
namespace {

constexpr uint32_t kValidationMagic = 0x3C85F7CE;

enum class Op {
  kValidate, kSet, kCompareSet, kGet, kAdd, kCheck, kWait, kNumKeys, kWatchKey, kDeleteKey,
  kAppend, kMultiGet, kMultiSet, kCancelWait, kPing, kUnknown
};

// torch 1.13 (and 2.0) QueryType.
Op DecodeV1(uint8_t code) {
  static constexpr Op kOps[] = {Op::kSet,   Op::kCompareSet, Op::kGet,      Op::kAdd,      Op::kCheck,
                                Op::kWait,  Op::kNumKeys,    Op::kWatchKey, Op::kDeleteKey};
  return code < sizeof(kOps) / sizeof(kOps[0]) ? kOps[code] : Op::kUnknown;
}

// torch >= 2.2 QueryType (2.6 verified; 2.8 appends queue ops we do not serve).
Op DecodeV2(uint8_t code) {
  static constexpr Op kOps[] = {Op::kValidate,  Op::kSet,      Op::kCompareSet, Op::kGet,        Op::kAdd,
                                Op::kCheck,     Op::kWait,     Op::kNumKeys,    Op::kDeleteKey,  Op::kAppend,
                                Op::kMultiGet,  Op::kMultiSet, Op::kCancelWait, Op::kPing};
  return code < sizeof(kOps) / sizeof(kOps[0]) ? kOps[code] : Op::kUnknown;
}

// A protocol violation: closes the connection with `reason` logged.
struct Violation {
  std::string reason;
};

// One client connection. Shared with the store's WAIT callbacks, which may outlive the
// connection's thread (they then find it closed and do nothing).
class Connection {
 public:
  Connection(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~Connection() { close(fd_); }

  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }

  // Sends all of `bytes`; false once the connection is closed or broken.
  bool Send(absl::string_view bytes) ABSL_LOCKS_EXCLUDED(write_mu_) {
    absl::MutexLock lock(&write_mu_);
    if (closed_) return false;
    while (!bytes.empty()) {
      ssize_t n = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        closed_ = true;
        return false;
      }
      bytes.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // Stops sends and unblocks the reader (Shutdown, or the end of the connection's thread).
  // shutdown() first, outside the lock: it also unblocks a Send() stuck on a client that
  // stopped reading (which holds the lock).
  void Close() ABSL_LOCKS_EXCLUDED(write_mu_) {
    shutdown(fd_, SHUT_RDWR);
    absl::MutexLock lock(&write_mu_);
    closed_ = true;
  }

  // ---- buffered reads; throw nothing: a Violation or end-of-stream is reported by status ----
  // Makes `n` bytes available in the buffer. Returns false at end of stream or on error;
  // `*at_boundary` tells whether no byte of a new frame had been read.
  bool Fill(size_t n) {
    while (buffer_.size() - offset_ < n) {
      if (offset_ > 0 && offset_ == buffer_.size()) {
        buffer_.clear();
        offset_ = 0;
      }
      char chunk[64 << 10];
      const size_t want = std::min(sizeof(chunk), std::max<size_t>(n - (buffer_.size() - offset_), 4096));
      ssize_t got = recv(fd_, chunk, want, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      buffer_.append(chunk, static_cast<size_t>(got));
    }
    return true;
  }
  absl::string_view Peek(size_t n) const { return absl::string_view(buffer_).substr(offset_, n); }
  void Consume(size_t n) { offset_ += n; }
  size_t Buffered() const { return buffer_.size() - offset_; }

  absl::Mutex waits_mu;
  std::set<store::WaitId> waits ABSL_GUARDED_BY(waits_mu);

 private:
  const int fd_;
  const std::string peer_;
  absl::Mutex write_mu_;
  bool closed_ ABSL_GUARDED_BY(write_mu_) = false;
  std::string buffer_;
  size_t offset_ = 0;
};

// Reads the fields of one request from a Connection. Any failure (end of stream inside a
// frame, a length over the limits) is sticky: `error` says why and every later read fails.
class FrameReader {
 public:
  FrameReader(Connection& conn, const TcpStoreOptions& options) : conn_(conn), options_(options) {}

  std::string error;
  bool ok() const { return error.empty(); }

  template <typename T>
  T Scalar(const char* what) {
    T v{};
    if (!ok()) return v;
    if (!conn_.Fill(sizeof(T))) {
      error = absl::StrCat("truncated frame: the connection ended inside ", what);
      return v;
    }
    std::memcpy(&v, conn_.Peek(sizeof(T)).data(), sizeof(T));
    conn_.Consume(sizeof(T));
    return v;
  }

  std::string Bytes(int64_t limit, const char* what) {
    const uint64_t len = Scalar<uint64_t>(what);
    if (!ok()) return "";
    if (len > static_cast<uint64_t>(limit)) {
      error = absl::StrCat(what, " of ", len, " bytes exceeds the limit of ", limit);
      return "";
    }
    std::string out;
    out.reserve(len);
    while (out.size() < len) {
      const size_t step = std::min<size_t>(len - out.size(), 1 << 20);
      if (!conn_.Fill(step)) {
        error = absl::StrCat("truncated frame: the connection ended inside ", what, " (",
                             out.size() + conn_.Buffered(), " of ", len, " bytes)");
        return "";
      }
      absl::string_view part = conn_.Peek(step);
      out.append(part.data(), part.size());
      conn_.Consume(step);
    }
    return out;
  }

  std::string Key() { return Bytes(options_.max_key_bytes, "key"); }
  std::string Value() { return Bytes(options_.max_value_bytes, "value"); }

  int64_t Count(const char* what) {
    const uint64_t n = Scalar<uint64_t>(what);
    if (ok() && n > static_cast<uint64_t>(options_.max_keys_per_request)) {
      error = absl::StrCat(what, " of ", n, " exceeds the limit of ", options_.max_keys_per_request);
      return 0;
    }
    return static_cast<int64_t>(n);
  }

  std::vector<std::string> Keys() {
    const int64_t n = Count("key count");
    std::vector<std::string> keys;
    for (int64_t i = 0; i < n && ok(); ++i) keys.push_back(Key());
    return keys;
  }

 private:
  Connection& conn_;
  const TcpStoreOptions& options_;
};

std::string EncodeBytes(absl::string_view v) {
  const uint64_t len = v.size();
  std::string out(reinterpret_cast<const char*>(&len), sizeof(len));
  out.append(v.data(), v.size());
  return out;
}

std::string EncodeInt(int64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }

std::string PeerName(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return absl::StrCat(host, ":", port);
}

class TcpStoreServerImpl : public TcpStoreServer {
 public:
  TcpStoreServerImpl(store::Store& store, TcpStoreOptions options)
      : store_(store), options_(std::move(options)), prefix_(absl::StrCat(options_.job, "/")) {}
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
    if (pipe(wake_) != 0) return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
    accept_thread_ = std::thread([this] { AcceptLoop(); });
    return absl::OkStatus();
  }

  int port() const override { return port_; }
  int64_t protocol_errors() const override { return protocol_errors_.load(); }

  void Shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
      for (auto& [id, conn] : connections_) conn->Close();
    }
    if (accept_thread_.joinable()) {
      const char byte = 0;
      (void)!write(wake_[1], &byte, 1);
      accept_thread_.join();
    }
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](absl::flat_hash_map<int64_t, std::shared_ptr<Connection>>* c) { return c->empty(); }, &connections_));
    }
    if (fd_ >= 0) close(fd_);
    if (wake_[0] >= 0) {
      close(wake_[0]);
      close(wake_[1]);
    }
    fd_ = wake_[0] = wake_[1] = -1;
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

  void AcceptLoop() {
    while (true) {
      pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      if (poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        LOG(ERROR) << "tcpstore: poll: " << strerror(errno);
        return;
      }
      if (fds[1].revents != 0) return;
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      int fd = accept4(fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
      if (fd < 0) continue;
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto conn = std::make_shared<Connection>(fd, PeerName(addr));
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      if (static_cast<int>(connections_.size()) >= options_.max_connections) {
        LOG(WARNING) << "tcpstore: refusing a connection from " << conn->peer() << ": "
                     << options_.max_connections << " connections are open";
        continue;
      }
      const int64_t id = next_id_++;
      connections_.emplace(id, conn);
      std::thread([this, id, conn] { Serve(id, conn); }).detach();
    }
  }

  // The connection's thread: detects the dialect, then serves requests until the stream
  // ends or a request is malformed.
  void Serve(int64_t id, std::shared_ptr<Connection> conn) {
    std::string reason = ServeRequests(conn);
    if (!reason.empty()) {
      protocol_errors_.fetch_add(1);
      LOG(WARNING) << "tcpstore: closing the connection from " << conn->peer() << " (job " << options_.job
                   << "): " << reason;
    }
    conn->Close();
    CancelWaits(*conn);
    absl::MutexLock lock(&mu_);
    connections_.erase(id);
  }

  // Returns "" when the client closed the connection between requests, else the reason.
  std::string ServeRequests(const std::shared_ptr<Connection>& self) {
    Connection& conn = *self;
    if (!conn.Fill(1)) return "";
    bool v2 = false;
    if (conn.Peek(1)[0] == 0 && conn.Fill(5)) {
      uint32_t magic;
      std::memcpy(&magic, conn.Peek(5).data() + 1, sizeof(magic));
      if (magic == kValidationMagic) {
        v2 = true;
        conn.Consume(5);
      }
    }
    while (true) {
      if (!conn.Fill(1)) return conn.Buffered() == 0 ? "" : "truncated frame";
      const uint8_t code = static_cast<uint8_t>(conn.Peek(1)[0]);
      conn.Consume(1);
      const Op op = v2 ? DecodeV2(code) : DecodeV1(code);
      if (op == Op::kUnknown) {
        return absl::StrCat("unknown opcode ", code, v2 ? " (torch >= 2.2 dialect)" : " (torch 1.13 dialect)");
      }
      FrameReader in(conn, options_);
      std::string reason = Handle(op, in, self);
      if (!in.ok()) return in.error;
      if (!reason.empty()) return reason;
    }
  }

  std::string Ns(const std::string& key) const { return prefix_ + key; }
  std::vector<std::string> Ns(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const std::string& k : keys) out.push_back(Ns(k));
    return out;
  }

  // Serves one request whose opcode was read. Returns "" or why the connection must close.
  std::string Handle(Op op, FrameReader& in, const std::shared_ptr<Connection>& self) {
    Connection& conn = *self;
    auto failed = [](const char* what, const absl::Status& s) { return absl::StrCat(what, " failed: ", s.ToString()); };
    switch (op) {
      case Op::kValidate: {
        const uint32_t magic = in.Scalar<uint32_t>("VALIDATE magic");
        if (in.ok() && magic != kValidationMagic) return absl::StrCat("VALIDATE with a wrong magic ", magic);
        return "";
      }
      case Op::kPing: {
        const uint32_t nonce = in.Scalar<uint32_t>("PING nonce");
        if (!in.ok()) return "";
        conn.Send(absl::string_view(reinterpret_cast<const char*>(&nonce), sizeof(nonce)));
        return "";
      }
      case Op::kSet: {
        std::string key = in.Key(), value = in.Value();
        if (!in.ok()) return "";
        if (absl::Status s = store_.Set(Ns(key), value); !s.ok()) return failed("SET", s);
        return "";
      }
      case Op::kAppend: {
        std::string key = in.Key(), value = in.Value();
        if (!in.ok()) return "";
        if (absl::Status s = store_.Append(Ns(key), value); !s.ok()) return failed("APPEND", s);
        return "";
      }
      case Op::kCompareSet: {
        std::string key = in.Key(), expected = in.Value(), desired = in.Value();
        if (!in.ok()) return "";
        absl::StatusOr<std::string> v = store_.CompareSet(Ns(key), expected, desired);
        if (!v.ok()) return failed("COMPARE_SET", v.status());
        conn.Send(EncodeBytes(*v));
        return "";
      }
      case Op::kGet: {
        std::string key = in.Key();
        if (!in.ok()) return "";
        conn.Send(EncodeBytes(GetOrEmpty(key)));
        return "";
      }
      case Op::kAdd: {
        std::string key = in.Key();
        const int64_t delta = in.Scalar<int64_t>("ADD delta");
        if (!in.ok()) return "";
        absl::StatusOr<int64_t> v = store_.Add(Ns(key), delta);
        if (!v.ok()) return failed("ADD", v.status());
        conn.Send(EncodeInt(*v));
        return "";
      }
      case Op::kCheck: {
        std::vector<std::string> keys = in.Keys();
        if (!in.ok()) return "";
        absl::StatusOr<bool> ready = keys.empty() ? absl::StatusOr<bool>(true) : store_.Check(Ns(keys));
        if (!ready.ok()) return failed("CHECK", ready.status());
        conn.Send(std::string(1, *ready ? '\0' : '\1'));
        return "";
      }
      case Op::kWait: {
        std::vector<std::string> keys = in.Keys();
        if (!in.ok()) return "";
        StartWait(keys, self);
        return "";
      }
      case Op::kCancelWait: {
        CancelWaits(conn);
        conn.Send(std::string(1, '\1'));  // WAIT_CANCELED
        return "";
      }
      case Op::kNumKeys: {
        absl::StatusOr<int64_t> n = store_.NumKeys(prefix_);
        if (!n.ok()) return failed("GETNUMKEYS", n.status());
        conn.Send(EncodeInt(*n));
        return "";
      }
      case Op::kDeleteKey: {
        std::string key = in.Key();
        if (!in.ok()) return "";
        absl::StatusOr<bool> deleted = store_.DeleteKey(Ns(key));
        if (!deleted.ok()) return failed("DELETE_KEY", deleted.status());
        conn.Send(EncodeInt(*deleted ? 1 : 0));
        return "";
      }
      case Op::kWatchKey: {
        in.Key();
        if (!in.ok()) return "";
        conn.Send(std::string(1, '\3'));  // KEY_CALLBACK_REGISTERED; no events (see the top)
        return "";
      }
      case Op::kMultiGet: {
        std::vector<std::string> keys = in.Keys();
        if (!in.ok()) return "";
        std::string reply;
        for (const std::string& k : keys) reply += EncodeBytes(GetOrEmpty(k));
        conn.Send(reply);
        return "";
      }
      case Op::kMultiSet: {
        const int64_t n = in.Count("MULTI_SET count");
        std::vector<std::string> keys, values;
        for (int64_t i = 0; i < n && in.ok(); ++i) {
          keys.push_back(Ns(in.Key()));
          values.push_back(in.Value());
        }
        if (!in.ok()) return "";
        if (n == 0) return "";
        if (absl::Status s = store_.MultiSet(keys, values); !s.ok()) return failed("MULTI_SET", s);
        return "";
      }
      case Op::kUnknown:
        break;
    }
    return "unknown opcode";
  }

  // Cancels the connection's pending WAITs (their callbacks then send nothing).
  void CancelWaits(Connection& conn) {
    std::vector<store::WaitId> waits;
    {
      absl::MutexLock lock(&conn.waits_mu);
      waits.assign(conn.waits.begin(), conn.waits.end());
      conn.waits.clear();
    }
    for (store::WaitId w : waits) store_.CancelWait(w);
  }

  std::string GetOrEmpty(const std::string& key) {
    absl::StatusOr<std::string> v = store_.Get(Ns(key), absl::ZeroDuration());
    return v.ok() ? *std::move(v) : std::string();
  }

  // WAIT: STOP_WAITING is sent by the store's callback once every key exists (inline if
  // they already do). The wait has no server-side deadline (torch's timeouts are the
  // client's); it ends with the connection or a CANCEL_WAIT.
  void StartWait(const std::vector<std::string>& keys, const std::shared_ptr<Connection>& self) {
    Connection& conn = *self;
    if (keys.empty()) {
      conn.Send(std::string(1, '\0'));
      return;
    }
    struct State {
      absl::Mutex mu;
      bool done = false;
    };
    auto state = std::make_shared<State>();
    const store::WaitId id = store_.WaitAsync(
        Ns(keys), absl::InfiniteFuture(), [self, state](absl::Status s) {
          {
            absl::MutexLock lock(&state->mu);
            state->done = true;
          }
          if (s.ok()) self->Send(std::string(1, '\0'));  // STOP_WAITING
        });
    absl::MutexLock lock(&state->mu);
    if (state->done) return;
    absl::MutexLock waits_lock(&conn.waits_mu);
    conn.waits.insert(id);
  }

  store::Store& store_;
  const TcpStoreOptions options_;
  const std::string prefix_;
  int fd_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::thread accept_thread_;
  std::atomic<int64_t> protocol_errors_{0};
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<int64_t, std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(store::Store& store,
                                                                      const TcpStoreOptions& options) {
  if (options.job.empty()) return absl::InvalidArgumentError("the tcpstore job name is empty");
  if (absl::Status s = ValidateJob(options.job); !s.ok()) return s;
  auto server = std::make_unique<TcpStoreServerImpl>(store, options);
  if (absl::Status s = server->Listen(); !s.ok()) return s;
  return std::unique_ptr<TcpStoreServer>(std::move(server));
}

}  // namespace collserve::server
