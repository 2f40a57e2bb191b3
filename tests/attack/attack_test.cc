// The attack suite (issue 14): each finding replayed against real daemons on loopback,
// over raw gRPC or raw sockets, asserting that the daemon answers with the right error,
// names the limit, and still serves afterwards.
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
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

}  // namespace
}  // namespace collserve::testing
