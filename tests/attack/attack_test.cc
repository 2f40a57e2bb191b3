// The attack suite (issue 14): each finding replayed against real daemons on loopback,
// over raw gRPC or raw sockets, asserting that the daemon answers with the right error,
// names the limit, and still serves afterwards.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "collserve/v1/store.grpc.pb.h"
#include "tests/testing/process.h"

namespace collserve::testing {
namespace {

namespace pb = ::collserve::v1;
using ::testing::HasSubstr;

std::unique_ptr<Cluster> StartCluster(int sidecars, const std::vector<std::string>& coordinator_flags = {}) {
  auto c = Cluster::Start(sidecars, coordinator_flags);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

std::chrono::system_clock::time_point In(absl::Duration d) { return absl::ToChronoTime(absl::Now() + d); }

// The coordinator answers a plain store write and read.
void ExpectStoreServes(const std::string& address) {
  auto stub = pb::Store::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext set_ctx;
  set_ctx.set_deadline(In(absl::Seconds(10)));
  pb::SetRequest set;
  set.set_key("still-serving");
  set.set_value("yes");
  pb::SetResponse set_resp;
  grpc::Status s = stub->Set(&set_ctx, set, &set_resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// A raw Session stream: attach (world_size 1, so no other rank is needed), then requests.
class RawSession {
 public:
  explicit RawSession(const std::string& address, const std::string& group) {
    stub_ = pb::Collectives::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    ctx_.set_deadline(In(absl::Seconds(60)));
    stream_ = stub_->Session(&ctx_);
    pb::SessionRequest req;
    pb::Attach* a = req.mutable_attach();
    a->set_group(group);
    a->set_rank(0);
    a->set_world_size(1);
    a->set_init_timeout_ms(20000);
    a->set_op_timeout_ms(20000);
    pb::SessionResponse resp;
    attached_ = stream_->Write(req) && stream_->Read(&resp) && resp.has_attached();
  }
  ~RawSession() {
    stream_->WritesDone();
    ctx_.TryCancel();
    stream_->Finish();
  }
  bool attached() const { return attached_; }
  // Sends `c` with the next seq and returns its completion (code -1: the stream ended).
  pb::Completion Call(pb::Collective c) {
    c.set_seq(seq_++);
    pb::SessionRequest req;
    *req.mutable_collective() = std::move(c);
    pb::Completion out;
    out.set_code(-1);
    if (!stream_->Write(req)) return out;
    pb::SessionResponse resp;
    if (stream_->Read(&resp) && resp.has_completion()) out = resp.completion();
    return out;
  }

 private:
  std::unique_ptr<pb::Collectives::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::SessionRequest, pb::SessionResponse>> stream_;
  bool attached_ = false;
  int64_t seq_ = 0;
};

pb::Collective InlineAllReduce(int64_t count, const std::string& data) {
  pb::Collective c;
  c.set_op(pb::ALL_REDUCE);
  c.set_dtype(pb::FLOAT32);
  c.set_reduce_op(pb::SUM);
  c.set_count(count);
  c.mutable_buffer()->set_inline_data(data);
  return c;
}

// Finding 1: all_reduce with count 2^62+1 float32 wrapped count x 4 around in size_t, passed
// the inline-size check, and the local reduce wrote out of bounds.
TEST(AttackTest, CollectiveWhoseByteSizeOverflowsIsInvalidArgumentAndTheSidecarServes) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  RawSession session(cluster->sidecar_tcp_address(0), "overflow");
  ASSERT_TRUE(session.attached());
  pb::Completion bad = session.Call(InlineAllReduce((int64_t{1} << 62) + 1, std::string(4096, '\1')));
  EXPECT_EQ(bad.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)) << bad.message();
  EXPECT_THAT(bad.message(), HasSubstr("count"));
  // Negative and mismatched counts too.
  EXPECT_EQ(session.Call(InlineAllReduce(-1, "")).code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(session.Call(InlineAllReduce(1024, std::string(16, '\0'))).code(),
            static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  // The same session still works, and the sidecar is alive.
  std::string one(4 * 4, '\0');
  const float v = 1.5f;
  for (int i = 0; i < 4; ++i) std::memcpy(&one[4 * i], &v, 4);
  pb::Completion ok = session.Call(InlineAllReduce(4, one));
  EXPECT_EQ(ok.code(), 0) << ok.message();
  EXPECT_EQ(ok.inline_data(), one);
  EXPECT_FALSE(cluster->sidecar(0).Wait(absl::ZeroDuration()).ok()) << "the sidecar exited";
}

// Finding 3: one Join with world_size 2^31-1 made the coordinator allocate ~23 GB.
TEST(AttackTest, JoinWithAHugeWorldSizeIsRefusedNamingTheLimit) {
  auto cluster = StartCluster(0, {"--max_world_size=4096"});
  ASSERT_NE(cluster, nullptr);
  auto stub = pb::Registry::NewStub(grpc::CreateChannel(cluster->coordinator_address(), grpc::InsecureChannelCredentials()));
  for (int world : {2147483647, 4097}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(absl::Seconds(10)));
    pb::JoinRequest req;
    req.set_group("huge");
    req.set_world_size(world);
    req.mutable_member()->set_rank(0);
    req.set_timeout_ms(1000);
    pb::JoinResponse resp;
    grpc::Status s = stub->Join(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("--max_world_size of 4096"));
  }
  ExpectStoreServes(cluster->coordinator_address());
}

// Finding 6: a second coordinator on the same port started too (SO_REUSEPORT), and clients
// saw two different stores behind one address.
TEST(AttackTest, SecondCoordinatorOnATakenPortRefusesToStart) {
  auto cluster = StartCluster(0);
  ASSERT_NE(cluster, nullptr);
  auto second = Process::Start({CoordinatorBinary(), absl::StrCat("--listen_address=127.0.0.1:", cluster->coordinator_port()),
                                "--metrics_address="},
                               {}, cluster->dir() + "/second-coordinator.log");
  ASSERT_TRUE(second.ok()) << second.status();
  auto code = (*second)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << "the second coordinator kept running: " << (*second)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*second)->Output(), HasSubstr(absl::StrCat("cannot listen on 127.0.0.1:", cluster->coordinator_port(),
                                                          ": Address already in use")));
  ExpectStoreServes(cluster->coordinator_address());
}

// Finding 6: a second sidecar on the same unix socket path took it over and, when it
// exited, unlinked it, leaving the first sidecar unreachable.
TEST(AttackTest, SecondSidecarOnATakenSocketRefusesAndTheFirstStaysReachable) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  const std::string path = cluster->sidecar_address(0).substr(5);  // "unix:<path>"
  auto second = Process::Start({SidecarBinary(), absl::StrCat("--coordinator=", cluster->coordinator_address()),
                                absl::StrCat("--unix_socket=", path), "--metrics_address="},
                               {}, cluster->dir() + "/second-sidecar.log");
  ASSERT_TRUE(second.ok()) << second.status();
  auto code = (*second)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << "the second sidecar kept running: " << (*second)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*second)->Output(), HasSubstr(absl::StrCat("another server is serving unix:", path)));
  struct stat st;
  ASSERT_EQ(::lstat(path.c_str(), &st), 0) << "the socket was removed";
  RawSession session(cluster->sidecar_address(0), "first-still-serves");
  EXPECT_TRUE(session.attached());
}

// A socket left by a sidecar that died is not a reason to refuse: it is replaced. A path
// that is not a socket is never removed.
TEST(AttackTest, StaleSocketIsReplacedButAFileIsNot) {
  auto cluster = StartCluster(0);
  ASSERT_NE(cluster, nullptr);
  const std::string stale = cluster->dir() + "/stale.sock";
  {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, stale.c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ::close(fd);  // bound, never listened: nobody answers
  }
  auto sidecar = Process::Start({SidecarBinary(), absl::StrCat("--coordinator=", cluster->coordinator_address()),
                                 absl::StrCat("--unix_socket=", stale), "--metrics_address="},
                                {}, cluster->dir() + "/stale-sidecar.log");
  ASSERT_TRUE(sidecar.ok());
  {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    bool attached = false;
    while (!attached && absl::Now() < deadline) {
      RawSession session(absl::StrCat("unix:", stale), "stale");
      attached = session.attached();
      if (!attached) absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_TRUE(attached) << (*sidecar)->Output();
  }
  const std::string file = cluster->dir() + "/not-a-socket";
  std::ofstream(file) << "precious";
  auto refused = Process::Start({SidecarBinary(), absl::StrCat("--coordinator=", cluster->coordinator_address()),
                                 absl::StrCat("--unix_socket=", file), "--metrics_address="},
                                {}, cluster->dir() + "/file-sidecar.log");
  ASSERT_TRUE(refused.ok());
  auto code = (*refused)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok());
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*refused)->Output(), HasSubstr("exists and is not a socket"));
  std::stringstream kept;
  kept << std::ifstream(file).rdbuf();
  EXPECT_EQ(kept.str(), "precious");
}

// Finding 7: a flipped bit in an early WAL record's length field: the coordinator started
// with 5 of 842 keys, logged nothing, and truncated the log. Now it refuses to start,
// names the offset, and leaves the log as it was; --wal_repair starts it knowingly.
TEST(AttackTest, CorruptWalRefusesToStartAndIsNeverTruncated) {
  auto cluster = StartCluster(0);
  ASSERT_NE(cluster, nullptr);
  const std::string data = cluster->dir() + "/data";
  ASSERT_TRUE(cluster->RestartCoordinator({absl::StrCat("--data_dir=", data)}).ok());
  {
    auto stub = pb::Store::NewStub(grpc::CreateChannel(cluster->coordinator_address(), grpc::InsecureChannelCredentials()));
    for (int i = 0; i < 100; ++i) {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(absl::Seconds(10)));
      pb::SetRequest req;
      req.set_key(absl::StrCat("k", i));
      req.set_value(std::string(64, 'v'));
      pb::SetResponse resp;
      ASSERT_TRUE(stub->Set(&ctx, req, &resp).ok());
    }
  }
  cluster->coordinator().Kill(SIGKILL);
  ASSERT_TRUE(cluster->coordinator().Wait(absl::Seconds(10)).ok());
  std::string wal;
  {
    std::stringstream ss;
    ss << std::ifstream(data + "/wal", std::ios::binary).rdbuf();
    wal = ss.str();
  }
  ASSERT_GT(wal.size(), 1000u);
  wal[3] ^= 0x10;  // record 0's length now points far past the end of the file
  std::ofstream(data + "/wal", std::ios::binary | std::ios::trunc) << wal;
  auto refused = Process::Start({CoordinatorBinary(), "--listen_address=127.0.0.1:0", absl::StrCat("--data_dir=", data),
                                 "--metrics_address="},
                                {}, cluster->dir() + "/corrupt-coordinator.log");
  ASSERT_TRUE(refused.ok());
  auto code = (*refused)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << "the coordinator started on a corrupt log: " << (*refused)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*refused)->Output(), HasSubstr("DATA_LOSS: record runs past the end of the file at offset 0"));
  std::stringstream after;
  after << std::ifstream(data + "/wal", std::ios::binary).rdbuf();
  EXPECT_EQ(after.str(), wal) << "the log was changed";
}

// Resident memory of process `pid`, in bytes (VmRSS).
int64_t RssBytes(pid_t pid, const std::string& field = "VmRSS:") {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(field.size())) * 1024;
  }
  return -1;
}

// Sends a Store.Set whose value has `value_bytes` zero bytes, without holding them in this
// process: the value is one static slice over an untouched anonymous mapping.
grpc::Status SendHugeSet(const std::string& address, size_t value_bytes) {
  void* zeros = ::mmap(nullptr, value_bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (zeros == MAP_FAILED) return grpc::Status(grpc::StatusCode::INTERNAL, "mmap failed");
  std::string head = "\x12\x01k\x1a";  // key (field 2) = "k", then field 3's tag and length
  for (uint64_t v = value_bytes; ; v >>= 7) {
    head.push_back(static_cast<char>(v >= 0x80 ? (v & 0x7f) | 0x80 : v));
    if (v < 0x80) break;
  }
  grpc::Slice slices[] = {grpc::Slice(head), grpc::Slice(zeros, value_bytes, grpc::Slice::STATIC_SLICE)};
  grpc::ByteBuffer request(slices, 2);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  grpc::GenericStub stub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(In(absl::Seconds(60)));
  grpc::CompletionQueue cq;
  grpc::ByteBuffer response;
  grpc::Status status;
  auto call = stub.PrepareUnaryCall(&ctx, "/collserve.v1.Store/Set", request, &cq);
  call->StartCall();
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  ::munmap(zeros, value_bytes);
  return status;
}

// Finding 4: a refused 1 GiB gRPC message left ~400 MB of coordinator RSS each (1.5 GB
// after three concurrent ones), never given back.
TEST(AttackTest, OversizedMessagesAreRefusedWithoutHoldingTheirBytes) {
  auto cluster = StartCluster(0, {"--rpc_memory_bytes=134217728"});
  ASSERT_NE(cluster, nullptr);
  ExpectStoreServes(cluster->coordinator_address());
  const pid_t pid = cluster->coordinator().pid();
  const int64_t before = RssBytes(pid);
  std::vector<std::thread> senders;
  std::vector<grpc::Status> results(3);
  for (int i = 0; i < 3; ++i) {
    senders.emplace_back([&, i] { results[i] = SendHugeSet(cluster->coordinator_address(), size_t{1} << 30); });
  }
  for (auto& t : senders) t.join();
  for (const grpc::Status& s : results) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }
  // Three concurrent 1 GiB messages never made it hold much more than its 128 MiB for RPCs.
  const int64_t peak = RssBytes(pid, "VmHWM:");
  EXPECT_LT(peak - before, int64_t{256} << 20) << "peak RSS " << peak << ", before " << before;
  ExpectStoreServes(cluster->coordinator_address());
  // What it held is given back within a few seconds.
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  int64_t after = RssBytes(pid);
  while (after - before >= (int64_t{32} << 20) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
    after = RssBytes(pid);
  }
  EXPECT_LT(after - before, int64_t{32} << 20) << "RSS before " << before << ", after " << after;
  // A value just under --max_value_bytes (64 MiB) still fits.
  grpc::Status large = SendHugeSet(cluster->coordinator_address(), size_t{60} << 20);
  EXPECT_TRUE(large.ok()) << large.error_message();
}

// Finding 4: nothing bounded what the store holds (16 x 60 MiB values were accepted).
TEST(AttackTest, StoreBytesArePerJobAndTotalQuotas) {
  auto cluster = StartCluster(0, {"--max_job_bytes=50000000", "--max_store_bytes=70000000"});
  ASSERT_NE(cluster, nullptr);
  auto stub = pb::Store::NewStub(grpc::CreateChannel(cluster->coordinator_address(), grpc::InsecureChannelCredentials()));
  auto set = [&](const std::string& job, const std::string& key, size_t bytes) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(absl::Seconds(30)));
    pb::SetRequest req;
    req.set_job(job);
    req.set_key(key);
    req.set_value(std::string(bytes, 'v'));
    pb::SetResponse resp;
    return stub->Set(&ctx, req, &resp);
  };
  int accepted = 0;
  grpc::Status s;
  for (int i = 0; i < 16 && (s = set("greedy", absl::StrCat("k", i), 10 << 20)).ok(); ++i) ++accepted;
  EXPECT_EQ(accepted, 4);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("job \"greedy\" holds 41943076 bytes of at most 50000000 (max_job_bytes)"));
  // Another job still has room, up to the store's total.
  EXPECT_TRUE(set("other", "a", 10 << 20).ok());
  EXPECT_TRUE(set("other", "b", 10 << 20).ok());
  s = set("other", "c", 10 << 20);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("(max_total_bytes)"));
  ExpectStoreServes(cluster->coordinator_address());
}

}  // namespace
}  // namespace collserve::testing
