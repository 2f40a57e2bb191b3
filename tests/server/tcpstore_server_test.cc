// TcpStoreServer against raw sockets: the torch 1.13 and >= 2.2 dialects byte for byte
// (layouts in server/coordinator/tcpstore_server.cc), job namespacing, and bad input that
// must close only the offending connection. torch's own client is driven by
// tests/python/test_tcpstore.py.
#include "server/coordinator/tcpstore_protocol.h"
#include "server/coordinator/tcpstore_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/common/networks.h"
#include "store/store.h"
#include "tests/testing/wait_for.h"

namespace collserve::server {
namespace {

using ::collserve::testing::WaitFor;

// Little-endian field encoders (the protocol's host order on x86-64/aarch64).
std::string U8(uint8_t v) { return std::string(1, static_cast<char>(v)); }
std::string U32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }
std::string I64(int64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
std::string Str(const std::string& s) { return I64(static_cast<int64_t>(s.size())) + s; }
std::string Keys(const std::vector<std::string>& keys) {
  std::string out = I64(static_cast<int64_t>(keys.size()));
  for (const auto& k : keys) out += Str(k);
  return out;
}
const std::string kValidate = std::string("\x00\xce\xf7\x85\x3c", 5);

class Client {
 public:
  explicit Client(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~Client() { close(fd_); }
  bool connected() const { return connected_; }

  void Send(const std::string& bytes) {
    ASSERT_EQ(send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  }
  // Reads exactly n bytes, or fewer if the connection closes or 5 s pass.
  std::string Read(size_t n, int timeout_ms = 5000) {
    std::string out;
    while (out.size() < n) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, timeout_ms) <= 0) break;
      char buf[4096];
      ssize_t got = recv(fd_, buf, std::min(sizeof(buf), n - out.size()), 0);
      if (got <= 0) break;
      out.append(buf, static_cast<size_t>(got));
    }
    return out;
  }
  // True if the server closed the connection within 5 s.
  bool Closed() {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 5000) <= 0) return false;
    char c;
    return recv(fd_, &c, 1, 0) <= 0;
  }
  bool Silent(int ms) {
    pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, ms) == 0;
  }
  // Bytes received and not yet read (FIONREAD).
  int Queued() const {
    int n = 0;
    return ioctl(fd_, FIONREAD, &n) == 0 ? n : -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

// Every test runs twice: a memory-only store served on the endpoint's loop thread, and a
// durable store (a write-ahead log in a temp dir) whose writes run on the endpoint's write
// threads and share fdatasyncs, each connection's requests still served in order.
class TcpStoreServerTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    store::StoreOptions store_options;
    TcpStoreOptions options;
    if (GetParam()) {
      char tmpl[] = "/tmp/collserve-tcpstore-test.XXXXXX";
      ASSERT_NE(mkdtemp(tmpl), nullptr);
      dir_ = tmpl;
      store_options.data_dir = dir_ + "/data";
      options.write_threads = 8;
    }
    auto store = store::NewMemoryStore(store_options);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    options.listen_address = "127.0.0.1:0";
    options.job = "jobA";
    options.max_value_bytes = 1 << 20;
    auto server = TcpStoreServer::Start(*store_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override {
    server_.reset();
    store_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  std::string dir_;  // the durable store's temp dir
  std::unique_ptr<store::Store> store_;
  std::unique_ptr<TcpStoreServer> server_;
};

INSTANTIATE_TEST_SUITE_P(Stores, TcpStoreServerTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "DurableWithWriteThreads" : "MemoryOnly";
                         });

TEST_P(TcpStoreServerTest, Torch113DialectByteForByte) {
  Client c(server_->port());
  ASSERT_TRUE(c.connected());
  c.Send(U8(3) + Str("init/") + I64(1));  // ADD init/ 1 (the constructor's)
  EXPECT_EQ(c.Read(8), I64(1));
  c.Send(U8(0) + Str("/k1") + Str("v1"));  // SET, no reply
  c.Send(U8(5) + Keys({"/k1"}));            // WAIT
  EXPECT_EQ(c.Read(1), U8(0));              // STOP_WAITING
  c.Send(U8(2) + Str("/k1"));               // GET
  EXPECT_EQ(c.Read(10), Str("v1"));
  c.Send(U8(3) + Str("/ctr") + I64(5));
  EXPECT_EQ(c.Read(8), I64(5));
  c.Send(U8(3) + Str("/ctr") + I64(-2));
  EXPECT_EQ(c.Read(8), I64(3));
  c.Send(U8(2) + Str("/ctr"));
  EXPECT_EQ(c.Read(9), Str("3"));  // counters are ASCII decimal
  c.Send(U8(1) + Str("/cas") + Str("") + Str("A"));
  EXPECT_EQ(c.Read(9), Str("A"));
  c.Send(U8(1) + Str("/cas") + Str("A") + Str("B"));
  EXPECT_EQ(c.Read(9), Str("B"));
  c.Send(U8(1) + Str("/cas") + Str("X") + Str("C"));
  EXPECT_EQ(c.Read(9), Str("B"));
  c.Send(U8(1) + Str("/none") + Str("wrong") + Str("new"));  // torch's documented "lie"
  EXPECT_EQ(c.Read(13), Str("wrong"));
  c.Send(U8(4) + Keys({"/k1", "/zz"}));  // CHECK
  EXPECT_EQ(c.Read(1), U8(1));           // NOT_READY
  c.Send(U8(4) + Keys({"/k1"}));
  EXPECT_EQ(c.Read(1), U8(0));
  c.Send(U8(6));  // GETNUMKEYS counts init/
  EXPECT_EQ(c.Read(8), I64(4));
  c.Send(U8(8) + Str("/k1"));
  EXPECT_EQ(c.Read(8), I64(1));
  c.Send(U8(8) + Str("/k1"));
  EXPECT_EQ(c.Read(8), I64(0));
  c.Send(U8(2) + Str("/k1"));  // GET of a missing key: empty, the connection stays
  EXPECT_EQ(c.Read(8), Str(""));

  // A deferred WAIT: the reply comes when another connection sets the key, and the waiting
  // connection keeps being served meanwhile.
  c.Send(U8(5) + Keys({"/later", "/ctr"}));
  EXPECT_TRUE(c.Silent(200));
  c.Send(U8(6));
  EXPECT_EQ(c.Read(8), I64(3));
  Client other(server_->port());
  other.Send(U8(0) + Str("/later") + Str("x"));
  EXPECT_EQ(c.Read(1), U8(0));

  // WATCH_KEY (the 1.13 callback connection): acknowledged, and the connection stays open.
  Client callback(server_->port());
  callback.Send(U8(7) + Str("/w"));
  EXPECT_EQ(callback.Read(1), U8(3));
  EXPECT_TRUE(callback.Silent(100));
  EXPECT_EQ(server_->protocol_errors(), 0);
}

TEST_P(TcpStoreServerTest, Torch2DialectByteForByte) {
  Client c(server_->port());
  c.Send(kValidate);
  c.Send(U8(13) + U32(0xdeadbeef));  // PING: echoed
  EXPECT_EQ(c.Read(4), U32(0xdeadbeef));
  c.Send(U8(4) + Str("init/") + I64(1));  // ADD
  EXPECT_EQ(c.Read(8), I64(1));
  c.Send(U8(1) + Str("/a") + Str("1"));  // SET
  c.Send(U8(9) + Str("/a") + Str("23"));  // APPEND
  c.Send(U8(9) + Str("/new") + Str("x"));
  c.Send(U8(3) + Str("/a"));  // GET
  EXPECT_EQ(c.Read(11), Str("123"));
  c.Send(U8(11) + I64(2) + Str("/m1") + Str("one") + Str("/m2") + Str(std::string("\0\xff", 2)));  // MULTI_SET
  c.Send(U8(10) + Keys({"/m1", "/m2", "/new"}));  // MULTI_GET
  EXPECT_EQ(c.Read(11 + 10 + 9), Str("one") + Str(std::string("\0\xff", 2)) + Str("x"));
  c.Send(U8(2) + Str("/cas") + Str("") + Str("A"));  // COMPARE_SET
  EXPECT_EQ(c.Read(9), Str("A"));
  c.Send(U8(5) + Keys({"/a", "/gone"}));  // CHECK
  EXPECT_EQ(c.Read(1), U8(1));
  c.Send(U8(7));  // GETNUMKEYS: init/, /a, /new, /m1, /m2, /cas
  EXPECT_EQ(c.Read(8), I64(6));
  c.Send(U8(8) + Str("/m1"));  // DELETE_KEY
  EXPECT_EQ(c.Read(8), I64(1));
  c.Send(U8(6) + Keys({"/m1"}));  // WAIT on a missing key, then CANCEL_WAIT (2.x's client timeout)
  EXPECT_TRUE(c.Silent(100));
  c.Send(U8(12));
  EXPECT_EQ(c.Read(1), U8(1));  // WAIT_CANCELED
  c.Send(U8(1) + Str("/m1") + Str("back"));  // the cancelled wait sends nothing late
  EXPECT_TRUE(c.Silent(200));
  c.Send(U8(6) + Keys({"/m1"}));
  EXPECT_EQ(c.Read(1), U8(0));
  c.Send(U8(12));  // CANCEL_WAIT with nothing pending
  EXPECT_EQ(c.Read(1), U8(1));
  EXPECT_EQ(server_->protocol_errors(), 0);
  // Counted by command (collserve_tcpstore_requests_total).
  using ::collserve::server::tcpstore::Op;
  const std::vector<int64_t> requests = server_->requests();
  EXPECT_GE(requests[static_cast<int>(Op::kWait)], 2);
  EXPECT_GE(requests[static_cast<int>(Op::kCancelWait)], 2);
  EXPECT_GE(requests[static_cast<int>(Op::kValidate)], 1);
  EXPECT_STREQ(::collserve::server::tcpstore::OpName(Op::kCancelWait), "CANCEL_WAIT");
}

TEST_P(TcpStoreServerTest, KeysLiveInTheJobNamespace) {
  Client c(server_->port());
  c.Send(U8(0) + Str("/k") + Str("v"));
  c.Send(U8(6));
  EXPECT_EQ(c.Read(8), I64(1));
  auto v = store_->Get("jobA//k", absl::ZeroDuration());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v");
  ASSERT_TRUE(store_->Set("jobB//k", "other job").ok());
  c.Send(U8(2) + Str("/k"));
  EXPECT_EQ(c.Read(9), Str("v"));
  c.Send(U8(6));  // only jobA's keys count
  EXPECT_EQ(c.Read(8), I64(1));
}

TEST_P(TcpStoreServerTest, BadInputClosesOnlyThatConnection) {
  ASSERT_TRUE(store_->Set("jobB/secret", "untouched").ok());
  Client good(server_->port());
  good.Send(U8(0) + Str("/before") + Str("1"));
  struct Case {
    const char* what;
    std::string bytes;
  } cases[] = {
      {"unknown 1.13 opcode", U8(9)},
      {"unknown 2.x opcode", kValidate + U8(14) + Str("/q") + Str("x")},
      {"oversized key length", U8(0) + I64(int64_t{1} << 40)},
      {"oversized value length", U8(0) + Str("/k") + I64(int64_t{1} << 30)},
      {"negative (huge) key count", U8(4) + I64(-1)},
      {"wrong validation magic", kValidate + U8(0) + U32(0x12345678)},
      {"ADD on a non-number", U8(0) + Str("/txt") + Str("abc") + U8(3) + Str("/txt") + I64(1)},
  };
  int64_t errors = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    Client bad(server_->port());
    bad.Send(k.bytes);
    EXPECT_TRUE(bad.Closed());
    EXPECT_EQ(server_->protocol_errors(), ++errors);
  }
  {  // truncated: the connection ends inside a frame
    Client bad(server_->port());
    bad.Send(U8(0) + Str("/half") + I64(100) + "only a few");
  }
  EXPECT_TRUE(WaitFor([&] { return server_->protocol_errors() > errors; }, absl::Seconds(5)));
  EXPECT_EQ(server_->protocol_errors(), errors + 1);
  EXPECT_FALSE(store_->Check({"jobA//half"}).value());
  EXPECT_EQ(store_->Get("jobB/secret", absl::ZeroDuration()).value(), "untouched");
  good.Send(U8(2) + Str("/before"));  // the other connection was never disturbed
  EXPECT_EQ(good.Read(9), Str("1"));
}

TEST_P(TcpStoreServerTest, ManyConcurrentClients) {
  constexpr int kClients = 32, kAdds = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([this, t] {
      Client c(server_->port());
      if (t % 2 == 1) c.Send(kValidate);
      const uint8_t add = t % 2 == 1 ? 4 : 3;
      for (int i = 0; i < kAdds; ++i) {
        c.Send(U8(add) + Str("/counter") + I64(1));
        EXPECT_EQ(c.Read(8).size(), 8u);
      }
      c.Send(U8(t % 2 == 1 ? 6 : 5) + Keys({"/go"}));  // everyone waits for one key
      EXPECT_EQ(c.Read(1, 10000), U8(0));
    });
  }
  Client setter(server_->port());
  EXPECT_TRUE(WaitFor(
      [&] {
        return store_->Get("jobA//counter", absl::ZeroDuration()).value_or("") == std::to_string(kClients * kAdds);
      },
      absl::Seconds(5)));
  setter.Send(U8(0) + Str("/go") + Str("1"));
  for (auto& t : threads) t.join();
  EXPECT_EQ(store_->Get("jobA//counter", absl::ZeroDuration()).value(), std::to_string(kClients * kAdds));
  if (GetParam()) {  // the connections' adds shared fdatasyncs
    const store::Store::Stats stats = store_->GetStats();
    EXPECT_EQ(stats.wal_writes, kClients * kAdds + 1);
    EXPECT_LT(stats.wal_syncs, stats.wal_writes);
  }
}

TEST_P(TcpStoreServerTest, PipelinedRequestsOfOneConnectionAreServedInOrder) {
  // torch's SET and APPEND have no reply, so a client sends the next request at once: each
  // must see the writes before it on its connection, even when writes run elsewhere.
  Client c(server_->port());
  std::string burst;
  for (int i = 0; i < 20; ++i) {
    burst += U8(0) + Str("/a") + Str(std::to_string(i));  // SET
    burst += U8(2) + Str("/a");                           // GET
    burst += U8(3) + Str("/n") + I64(1);                  // ADD
  }
  c.Send(burst);
  for (int i = 0; i < 20; ++i) {
    const std::string v = std::to_string(i);
    EXPECT_EQ(c.Read(8 + v.size()), Str(v));
    EXPECT_EQ(c.Read(8), I64(i + 1));
  }
}

// A connection's requests wait while 64 MiB of its replies are unsent: a client that
// pipelines GETs of a large value and reads nothing no longer makes the server hold every
// answer. Here the ADD behind 100 GETs of 1 MiB is not applied until the client reads; then
// every reply arrives in order.
TEST_P(TcpStoreServerTest, RequestsWaitWhileTheirConnectionsRepliesAreUnread) {
  const std::string big(1 << 20, 'x');
  ASSERT_TRUE(store_->Set("jobA//big", big).ok());
  Client c(server_->port());
  std::string burst;
  for (int i = 0; i < 100; ++i) burst += U8(2) + Str("/big");  // GET: 100 MiB of replies
  burst += U8(3) + Str("/n") + I64(1);                         // ADD
  c.Send(burst);
  EXPECT_TRUE(WaitFor([&] { return c.Queued() >= (64 << 10); }, absl::Seconds(10))) << c.Queued();
  // Replies are sent only after the requests read with them were decoded: a server that did
  // not hold the connection had run the ADD (inline, memory-only) before the first reply
  // byte left. Held, it runs only once the client reads.
  EXPECT_FALSE(store_->Check({"jobA//n"}).value_or(true)) << "the ADD ran behind 64 MiB of unread replies";
  for (int i = 0; i < 100; ++i) ASSERT_EQ(c.Read(8 + big.size()), Str(big)) << "reply " << i;
  EXPECT_EQ(c.Read(8), I64(1));
  EXPECT_EQ(server_->protocol_errors(), 0);
}

// The keys of one connection's pending WAITs are bounded (torch's client has one WAIT at a
// time): a WAIT past kMaxKeysPerRequest of them closes the connection; a WAIT that completed
// counts no more.
TEST_P(TcpStoreServerTest, PendingWaitsOfAConnectionAreBoundedAndCompletedOnesFreeTheirShare) {
  constexpr int kKeys = 70000;  // two of them pass 131072
  std::vector<std::string> first, second, stored;
  for (int i = 0; i < kKeys; ++i) {
    first.push_back(absl::StrCat("/a", i));
    second.push_back(absl::StrCat("/b", i));
    stored.push_back(absl::StrCat("jobA//a", i));
  }
  Client c(server_->port());
  c.Send(U8(5) + Keys(first));  // WAIT
  EXPECT_TRUE(c.Silent(50));
  ASSERT_TRUE(store_->MultiSet(stored, std::vector<std::string>(stored.size(), "v")).ok());
  EXPECT_EQ(c.Read(1), U8(0));  // STOP_WAITING: this WAIT's keys count no more
  c.Send(U8(5) + Keys(second));
  EXPECT_TRUE(c.Silent(200)) << "a WAIT within the bound was refused";
  c.Send(U8(5) + Keys(second));  // 140000 keys pending: closed
  EXPECT_TRUE(c.Closed());
  EXPECT_EQ(server_->protocol_errors(), 1);
}

TEST_P(TcpStoreServerTest, ShutdownClosesConnectionsWithPendingWaits) {
  Client c(server_->port());
  c.Send(U8(5) + Keys({"/never"}));
  EXPECT_TRUE(c.Silent(100));
  server_->Shutdown();
  EXPECT_TRUE(c.Closed());
  Client late(server_->port());
  EXPECT_FALSE(late.connected());
}

TEST_P(TcpStoreServerTest, ShutdownUnblocksAClientThatStoppedReading) {
  ASSERT_TRUE(store_->Set("jobA//big", std::string(512 << 10, 'x')).ok());
  Client c(server_->port());
  std::string gets;
  for (int i = 0; i < 64; ++i) gets += U8(2) + Str("/big");  // 32 MiB of replies, never read
  c.Send(gets);
  // Until replies arrive (64 KiB of them): 32 MiB cannot fit in the socket buffers of a
  // client that does not read (here about 128 KB), so the server's thread is in send() from
  // about here on.
  EXPECT_TRUE(WaitFor([&] { return c.Queued() >= (64 << 10); }, absl::Seconds(10))) << c.Queued();
  server_->Shutdown();  // returns although the connection's thread is stuck in send()
  EXPECT_EQ(server_->protocol_errors(), 0);
}

TEST(TcpStoreServerStartTest, RejectsBadAddressesAndJobs) {
  auto store = store::NewMemoryStore(store::StoreOptions{});
  ASSERT_TRUE(store.ok());
  TcpStoreOptions o;
  o.listen_address = "no-port";
  EXPECT_EQ(TcpStoreServer::Start(**store, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.listen_address = "127.0.0.1:0";
  o.job = "a/b";
  EXPECT_EQ(TcpStoreServer::Start(**store, o).status().code(), absl::StatusCode::kInvalidArgument);
  // Limits out of range.
  o.job = "ok";
  o.frame_timeout = absl::ZeroDuration();
  EXPECT_EQ(TcpStoreServer::Start(**store, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.frame_timeout = absl::Seconds(30);
  o.idle_timeout = absl::Seconds(-1);
  EXPECT_EQ(TcpStoreServer::Start(**store, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.idle_timeout = absl::ZeroDuration();
  o.max_connections_per_peer = 0;
  EXPECT_EQ(TcpStoreServer::Start(**store, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.max_connections_per_peer = 256;
  EXPECT_TRUE(TcpStoreServer::Start(**store, o).ok());
}

TEST(TcpStoreServerStartTest, AllowListAdmitsOnlyItsNetworks) {
  auto store = store::NewMemoryStore(store::StoreOptions{});
  ASSERT_TRUE(store.ok());
  TcpStoreOptions o;
  o.listen_address = "127.0.0.1:0";
  o.allowed_networks = "10.0.0.0/8, 192.168.0.0/16";
  auto outside = TcpStoreServer::Start(**store, o);
  ASSERT_TRUE(outside.ok()) << outside.status();
  {
    Client c((*outside)->port());
    ASSERT_TRUE(c.connected());  // the kernel accepts; the server then closes it unserved
    c.Send(U8(3) + Str("init/") + I64(1));
    EXPECT_TRUE(c.Closed()) << "a loopback client was served outside 10/8 and 192.168/16";
  }
  o.allowed_networks = "10.0.0.0/8,127.0.0.1";
  auto inside = TcpStoreServer::Start(**store, o);
  ASSERT_TRUE(inside.ok()) << inside.status();
  Client c((*inside)->port());
  ASSERT_TRUE(c.connected());
  c.Send(U8(3) + Str("init/") + I64(1));
  EXPECT_EQ(c.Read(8), I64(1));
  o.allowed_networks = "10.0.0.0/33";
  auto bad = TcpStoreServer::Start(**store, o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("10.0.0.0/33"), std::string::npos) << bad.status();
}

sockaddr_storage Address(const char* ip) {
  sockaddr_storage a{};
  if (inet_pton(AF_INET, ip, &reinterpret_cast<sockaddr_in*>(&a)->sin_addr) == 1) {
    a.ss_family = AF_INET;
  } else {
    EXPECT_EQ(inet_pton(AF_INET6, ip, &reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr), 1) << ip;
    a.ss_family = AF_INET6;
  }
  return a;
}

TEST(NetworkListTest, MatchesPrefixesOfBothFamilies) {
  auto list = NetworkList::Parse("10.4.0.0/14, 127.0.0.1, fd00::/8, 0.0.0.0/0x");
  EXPECT_FALSE(list.ok());  // a bad prefix is named
  list = NetworkList::Parse("10.4.0.0/14, 127.0.0.1, fd00::/8");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->ToString(), "10.4.0.0/14,127.0.0.1/32,fd00::/8");
  EXPECT_TRUE(list->Contains(Address("10.7.255.1")));
  EXPECT_FALSE(list->Contains(Address("10.8.0.1")));
  EXPECT_TRUE(list->Contains(Address("127.0.0.1")));
  EXPECT_FALSE(list->Contains(Address("127.0.0.2")));
  EXPECT_TRUE(list->Contains(Address("::ffff:127.0.0.1")));  // IPv4-mapped counts as IPv4
  EXPECT_TRUE(list->Contains(Address("fd12::1")));
  EXPECT_FALSE(list->Contains(Address("fe80::1")));
  auto any = NetworkList::Parse("0.0.0.0/0,::/0");
  ASSERT_TRUE(any.ok());
  EXPECT_TRUE(any->Contains(Address("8.8.8.8")));
  EXPECT_TRUE(any->Contains(Address("2001:db8::1")));
  EXPECT_TRUE(NetworkList::Parse("")->empty());
  EXPECT_FALSE(NetworkList::Parse("not-an-ip").ok());
  EXPECT_FALSE(NetworkList::Parse("::1/129").ok());
}

}  // namespace
}  // namespace collserve::server
