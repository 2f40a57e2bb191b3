// The attack suite (issue 14): each finding replayed against real daemons on loopback,
// over raw gRPC or raw sockets, asserting that the daemon answers with the right error,
// names the limit, and still serves afterwards.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "collserve/v1/store.grpc.pb.h"
#include "absl/synchronization/notification.h"
#include "client/channel.h"
#include "common/fd_channel.h"
#include "common/ops_channel.h"
#include "common/shm.h"
#include "tests/testing/process.h"
#include "tests/testing/sockets.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

namespace pb = ::collserve::v1;
using ::testing::HasSubstr;

// These attacks are of findings other than credentials (tests/security/token_test covers
// those): the raw clients below send no token, so calls without one are allowed.
std::unique_ptr<Cluster> StartCluster(int sidecars, std::vector<std::string> coordinator_flags = {}) {
  coordinator_flags.push_back("--allow_unauthenticated");
  auto c = Cluster::Start(sidecars, coordinator_flags);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

std::chrono::system_clock::time_point In(absl::Duration d) { return absl::ToChronoTime(absl::Now() + d); }

// The coordinator answers a plain store write and read.
grpc::Status StoreSet(const std::string& address) {
  auto stub = pb::Store::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext set_ctx;
  set_ctx.set_deadline(In(absl::Seconds(10)));
  pb::SetRequest set;
  set.set_key("still-serving");
  set.set_value("yes");
  pb::SetResponse set_resp;
  return stub->Set(&set_ctx, set, &set_resp);
}

void ExpectStoreServes(const std::string& address) {
  grpc::Status s = StoreSet(address);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// The descriptors process `pid` holds open now (-1 if unknown).
int OpenDescriptors(pid_t pid) {
  std::error_code ec;
  int n = 0;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return ec ? -1 : n;
}

// How a RawSession attaches beyond its group and shared memory.
struct RawAttach {
  bool peer_reads = false;
  int rank = 0;
  int world_size = 1;
  int64_t op_timeout_ms = 20000;
  std::string job = "";  // "" = "default"
};

// A raw Session stream: attach (world_size 1 by default, so no other rank is needed), then
// requests. With world_size > 1 the constructor returns once every rank attached.
class RawSession {
 public:
  explicit RawSession(const std::string& address, const std::string& group, bool shared_memory = false,
                      RawAttach how = {}) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);  // inline results as large as the sidecar sends
    stub_ = pb::Collectives::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    ctx_.set_deadline(In(absl::Seconds(60)));
    stream_ = stub_->Session(&ctx_);
    pb::SessionRequest req;
    pb::Attach* a = req.mutable_attach();
    a->set_group(group);
    a->set_rank(how.rank);
    a->set_world_size(how.world_size);
    a->set_init_timeout_ms(20000);
    a->set_op_timeout_ms(how.op_timeout_ms);
    a->set_shared_memory(shared_memory);
    a->set_peer_reads(how.peer_reads);
    a->set_job(how.job);
    pb::SessionResponse resp;
    attached_ = stream_->Write(req) && stream_->Read(&resp) && resp.has_attached();
    if (attached_) attached_info_ = resp.attached();
  }
  ~RawSession() {
    if (finished_) return;
    stream_->WritesDone();
    ctx_.TryCancel();
    stream_->Finish();
  }
  // Reads until the sidecar ends the stream (at most `wait`) and returns how it ended.
  grpc::Status End(absl::Duration wait = absl::Seconds(20)) {
    std::thread cancel([this, wait, done = &end_notice_] {
      if (!done->WaitForNotificationWithTimeout(wait)) ctx_.TryCancel();
    });
    pb::SessionResponse resp;
    while (stream_->Read(&resp)) {
    }
    end_notice_.Notify();
    cancel.join();
    finished_ = true;
    return stream_->Finish();
  }
  // Writes a raw request on the stream.
  bool Write(const pb::SessionRequest& req) { return stream_->Write(req); }
  bool attached() const { return attached_; }
  const pb::Attached& info() const { return attached_info_; }
  // Sends `c` with the next seq and returns its completion (code -1: the stream ended).
  pb::Completion Call(pb::Collective c) {
    c.set_seq(seq_++);
    pb::SessionRequest req;
    *req.mutable_collective() = std::move(c);
    pb::Completion out;
    out.set_code(-1);
    if (!stream_->Write(req)) return out;
    return Next();
  }
  // Sends `c` with the next seq without waiting for its completion (Next reads them).
  bool Send(pb::Collective c) {
    c.set_seq(seq_++);
    pb::SessionRequest req;
    *req.mutable_collective() = std::move(c);
    return stream_->Write(req);
  }
  // The next completion the sidecar sends (code -1: the stream ended). Group events
  // (collserve.v1.GroupEvent: a rank left, the group failed) are counted, not returned.
  pb::Completion Next() {
    pb::Completion out;
    out.set_code(-1);
    pb::SessionResponse resp;
    while (stream_->Read(&resp)) {
      if (resp.has_group_event()) {
        ++group_events_;
        continue;
      }
      if (resp.has_completion()) out = resp.completion();
      break;
    }
    return out;
  }
  int group_events() const { return group_events_; }
  // Sends ReadDone for request `seq` (peer reads).
  bool ReadDone(int64_t seq) {
    pb::SessionRequest req;
    req.mutable_read_done()->set_seq(seq);
    return stream_->Write(req);
  }

 private:
  std::unique_ptr<pb::Collectives::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::SessionRequest, pb::SessionResponse>> stream_;
  int group_events_ = 0;
  bool attached_ = false;
  pb::Attached attached_info_;
  int64_t seq_ = 0;
  bool finished_ = false;
  absl::Notification end_notice_;
};

// Sends `req` on ops channel `sock`.
absl::Status OpsSend(int sock, const pb::SessionRequest& req) {
  return opschannel::SendOpsMessage(sock, req.SerializeAsString(), absl::Now() + absl::Seconds(10));
}

// Reads one SessionResponse other than a group event from ops channel `sock` within `wait`.
// NOT_FOUND: the sidecar closed the channel; DEADLINE_EXCEEDED: nothing came.
absl::StatusOr<pb::SessionResponse> OpsReceive(int sock, absl::Duration wait = absl::Seconds(20)) {
  opschannel::Reassembler reassembler;
  const absl::Time deadline = absl::Now() + wait;
  std::vector<char> buf(opschannel::kMaxDatagramBytes);
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0) return absl::DeadlineExceededError("no answer");
    const ssize_t n = recv(sock, buf.data(), buf.size(), MSG_DONTWAIT);
    if (n <= 0) return absl::NotFoundError("the ops channel was closed");
    absl::StatusOr<bool> complete = reassembler.Add(buf.data(), static_cast<size_t>(n));
    if (!complete.ok()) return complete.status();
    if (!*complete) continue;
    pb::SessionResponse resp;
    if (!resp.ParseFromString(reassembler.Take())) return absl::DataLossError("not a SessionResponse");
    if (resp.has_group_event()) continue;  // a rank left, the group failed: not an answer
    return resp;
  }
}

// A socket that closes itself.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
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

pb::Collective InlineP2P(pb::CollectiveOp op, int peer, int64_t count, std::string data = "") {
  pb::Collective c;
  c.set_op(op);
  c.set_dtype(pb::FLOAT32);
  c.set_count(count);
  c.set_peer(peer);
  c.mutable_buffer()->set_inline_data(std::move(data));
  return c;
}

// Ranks 0 and 1 of a 2-rank group `group` over TCP (inline tensors), attached at once.
std::pair<std::unique_ptr<RawSession>, std::unique_ptr<RawSession>> AttachInlinePair(const std::string& address,
                                                                                     const std::string& group,
                                                                                     const std::string& job = "") {
  std::unique_ptr<RawSession> rank0;
  std::thread attach0([&] {
    rank0 = std::make_unique<RawSession>(address, group, false, RawAttach{.rank = 0, .world_size = 2, .job = job});
  });
  auto rank1 = std::make_unique<RawSession>(address, group, false, RawAttach{.rank = 1, .world_size = 2, .job = job});
  attach0.join();
  return {std::move(rank0), std::move(rank1)};
}

// A RECV of a remote (inline) rank costs ~50 bytes on the wire and made the sidecar allocate
// and zero-fill its whole result (up to 1 GiB) at once, held until a matching SEND came: a
// few thousand of them exhausted the host's memory. Inline bytes in flight are now bounded
// host-wide (--max_inline_bytes, 64 MiB here): past it a request is refused naming the limit
// before anything is allocated, the requests already held complete with the right bytes, and
// the budget comes back as they complete.
TEST(AttackTest, InlineResultsAreBoundedByTheSidecarsInlineBudget) {
  const int metrics_port = UnusedPort();
  ASSERT_GT(metrics_port, 0);
  auto cluster = Cluster::Start(1, {"--allow_unauthenticated"},
                                {"--max_inline_bytes=67108864",
                                 absl::StrCat("--metrics_address=127.0.0.1:", metrics_port)});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->sidecar_tcp_address(0);
  auto [rank0, rank1_session] = AttachInlinePair(address, "inline-budget");
  RawSession& rank1 = *rank1_session;
  ASSERT_TRUE(rank0->attached() && rank1.attached());
  constexpr int64_t kCount = int64_t{4} << 20;  // 16 MiB of float32
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(rank0->Send(InlineP2P(pb::RECV, 1, kCount)));
  // 48 MiB held: a 32 MiB RECV (and a 1 GiB one) is refused at once, the three still pending.
  for (int64_t count : {2 * kCount, int64_t{1} << 28}) {
    ASSERT_TRUE(rank0->Send(InlineP2P(pb::RECV, 1, count)));
    pb::Completion refused = rank0->Next();
    EXPECT_EQ(refused.code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED)) << refused.message();
    EXPECT_THAT(refused.message(), HasSubstr("--max_inline_bytes 67108864"));
  }
  // Rank 1's SENDs (16 MiB of input each, which count too: 64 MiB with the RECVs) complete
  // the three with the right bytes, and give the budget back.
  for (int i = 0; i < 3; ++i) {
    std::string data(static_cast<size_t>(kCount) * 4, static_cast<char>('a' + i));
    pb::Completion sent = rank1.Call(InlineP2P(pb::SEND, 0, kCount, std::move(data)));
    EXPECT_EQ(sent.code(), 0) << sent.message();
    pb::Completion got = rank0->Next();
    ASSERT_EQ(got.code(), 0) << got.message();
    EXPECT_EQ(got.inline_data(), std::string(static_cast<size_t>(kCount) * 4, static_cast<char>('a' + i)));
  }
  // A whole budget's worth fits again once the answers are read (a result's bytes come back
  // when its answer is written to the client; the input's when the request completes).
  ASSERT_TRUE(WaitFor([&] { return MetricValue(metrics_port, "collserve_inline_bytes") == 0; }, absl::Seconds(10)));
  ASSERT_TRUE(rank0->Send(InlineP2P(pb::RECV, 1, 2 * kCount)));
  pb::Completion sent = rank1.Call(InlineP2P(pb::SEND, 0, 2 * kCount, std::string(static_cast<size_t>(kCount) * 8, 'z')));
  EXPECT_EQ(sent.code(), 0) << sent.message();
  pb::Completion whole = rank0->Next();
  EXPECT_EQ(whole.code(), 0) << whole.message();
  EXPECT_EQ(whole.inline_data().size(), static_cast<size_t>(kCount) * 8);
  EXPECT_FALSE((*cluster)->sidecar(0).Wait(absl::ZeroDuration()).ok()) << "the sidecar exited";
}

// One job's inline requests cannot use up the host's budget: past its policy's
// max_inline_bytes (32 MiB here) job A's RECV is refused naming that limit, while job B
// beside it on the same sidecar holds 48 MiB, more than A's whole share, and every held
// request completes with its bytes.
TEST(AttackTest, AJobPastItsInlineShareIsRefusedAndItsNeighborIsServed) {
  const std::string policies = ::testing::TempDir() + "/attack-inline-policies.json";
  std::ofstream(policies) << R"({"jobs": {"inline-a": {"max_inline_bytes": "33554432"}}})";
  auto cluster = StartCluster(1, {"--job_policies_file=" + policies});
  ASSERT_NE(cluster, nullptr);
  const std::string address = cluster->sidecar_tcp_address(0);
  auto [a0, a1] = AttachInlinePair(address, "share", "inline-a");
  auto [b0, b1] = AttachInlinePair(address, "share", "inline-b");
  ASSERT_TRUE(a0->attached() && a1->attached() && b0->attached() && b1->attached());
  constexpr int64_t kCount = int64_t{4} << 20;  // 16 MiB of float32
  ASSERT_TRUE(a0->Send(InlineP2P(pb::RECV, 1, kCount)));
  ASSERT_TRUE(a0->Send(InlineP2P(pb::RECV, 1, 2 * kCount)));  // 16 + 32 MiB > 32 MiB
  pb::Completion refused = a0->Next();
  EXPECT_EQ(refused.code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED)) << refused.message();
  EXPECT_THAT(refused.message(), HasSubstr("job \"inline-a\"'s inline bytes on this sidecar"));
  EXPECT_THAT(refused.message(), HasSubstr("max_inline_bytes 33554432"));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(b0->Send(InlineP2P(pb::RECV, 1, kCount)));
  for (int i = 0; i < 3; ++i) {
    pb::Completion sent = b1->Call(InlineP2P(pb::SEND, 0, kCount, std::string(static_cast<size_t>(kCount) * 4, 'b')));
    EXPECT_EQ(sent.code(), 0) << sent.message();
    pb::Completion got = b0->Next();
    ASSERT_EQ(got.code(), 0) << got.message();
    EXPECT_EQ(got.inline_data(), std::string(static_cast<size_t>(kCount) * 4, 'b'));
  }
  pb::Completion sent = a1->Call(InlineP2P(pb::SEND, 0, kCount, std::string(static_cast<size_t>(kCount) * 4, 'a')));
  EXPECT_EQ(sent.code(), 0) << sent.message();
  pb::Completion got = a0->Next();
  ASSERT_EQ(got.code(), 0) << got.message();
  EXPECT_EQ(got.inline_data(), std::string(static_cast<size_t>(kCount) * 4, 'a'));
  std::remove(policies.c_str());
}

// A rank whose peers never call can queue collectives without end, each one held (and
// refusing one would not free it: a refused request still waits in its group). Past the
// sidecar's --max_session_requests (8 here) the session ends naming the limit, the rank
// leaves its group (its peer's pending call fails at once), and the sidecar serves on.
TEST(AttackTest, ASessionPastItsRequestsInFlightIsEndedNamingTheLimit) {
  auto cluster = Cluster::Start(1, {"--allow_unauthenticated"}, {"--max_session_requests=8"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string address = (*cluster)->sidecar_tcp_address(0);
  auto [rank0, rank1_session] = AttachInlinePair(address, "flood");
  RawSession& rank1 = *rank1_session;
  ASSERT_TRUE(rank0->attached() && rank1.attached());
  // Rank 0 issues nine all_reduces that rank 1 has not called: the ninth ends its session.
  std::string one(4, '\0');
  for (int i = 0; i < 9; ++i) ASSERT_TRUE(rank0->Send(InlineAllReduce(1, one)));
  grpc::Status ended = rank0->End();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << ended.error_message();
  EXPECT_THAT(ended.error_message(), HasSubstr("--max_session_requests 8"));
  EXPECT_THAT(ended.error_message(), HasSubstr("request seq 8"));
  // Rank 1's call fails at once: rank 0 left the group.
  pb::Completion after = rank1.Call(InlineAllReduce(1, one));
  EXPECT_EQ(after.code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE)) << after.message();
  EXPECT_THAT(after.message(), HasSubstr("rank 0 left"));
  // The sidecar serves a new group.
  RawSession fresh(address, "after-flood");
  ASSERT_TRUE(fresh.attached());
  EXPECT_EQ(fresh.Call(InlineAllReduce(1, one)).code(), 0);
}

// A client on the session's stream (a TCP session here; COLLSERVE_OPS_CHANNEL=0 too) that
// sends requests and reads none of their answers made the sidecar queue every answer: with
// inline all_reduces its memory grew by each result, for every job on the host. Now a
// session's unwritten answers past 64 MiB stop the sidecar reading its requests (the client
// stalls itself on flow control), and the inline results among them stay counted in
// --max_inline_bytes until written. Once the client reads, every answer arrives, in order,
// with its bytes, the requests it could not send go on, and the budget comes back.
TEST(AttackTest, AClientThatReadsNoneOfItsAnswersStallsItselfNotTheSidecar) {
  const int metrics_port = UnusedPort();
  ASSERT_GT(metrics_port, 0);
  auto cluster = Cluster::Start(1, {"--allow_unauthenticated"},
                                {absl::StrCat("--metrics_address=127.0.0.1:", metrics_port)});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto inline_bytes = [&] { return MetricValue(metrics_port, "collserve_inline_bytes"); };
  ASSERT_TRUE(WaitFor([&] { return inline_bytes() == 0; }, absl::Seconds(10))) << (*cluster)->Logs();
  RawSession session((*cluster)->sidecar_tcp_address(0), "unread-answers");
  ASSERT_TRUE(session.attached());
  // 256 KiB all_reduces (world_size 1: each is answered at once), 768 of them (192 MiB).
  constexpr int64_t kCount = 64 << 10;
  constexpr int kRequests = 768;
  auto payload = [](int i) { return std::string(static_cast<size_t>(kCount) * 4, static_cast<char>('a' + i % 23)); };
  std::atomic<int> sent{0};
  std::thread writer([&] {
    for (int i = 0; i < kRequests; ++i) {
      if (!session.Send(InlineAllReduce(kCount, payload(i)))) return;
      sent.fetch_add(1);
    }
  });
  // The sidecar stops reading the session's requests (and says so) with 64 MiB unwritten...
  ASSERT_TRUE((*cluster)->sidecar(0).WaitForOutput("its client has not read", absl::Seconds(60)))
      << "sent " << sent.load() << "\n" << (*cluster)->Logs();
  EXPECT_THAT((*cluster)->sidecar(0).Output(), HasSubstr("past the limit of 67108864 bytes"));
  // ... holding about that: the answers, and the requests it had read and not yet run (each
  // counted with its input and result; measured 1.5 to 10 MiB of them in Release, up to 19
  // MiB under TSan), far from the 192 MiB the client tried to queue. The results' bytes count
  // in the inline budget while they wait.
  const double held = inline_bytes();
  std::cerr << "paused with " << held << " inline bytes held, " << sent.load() << " requests sent\n";
  EXPECT_GE(held, 32.0 * (1 << 20)) << "the waiting results are not counted in --max_inline_bytes";
  EXPECT_LE(held, 128.0 * (1 << 20)) << "sent " << sent.load();
  EXPECT_LT(sent.load(), kRequests) << "the client's writes were never held back";
  // The client reads: every answer comes, in order, with its bytes; the writer finishes.
  for (int i = 0; i < kRequests; ++i) {
    pb::Completion c = session.Next();
    ASSERT_EQ(c.code(), 0) << "answer " << i << ": " << c.message();
    ASSERT_EQ(c.seq(), i);
    ASSERT_TRUE(c.inline_data() == payload(i)) << "answer " << i << " holds other bytes";
  }
  writer.join();
  EXPECT_EQ(sent.load(), kRequests);
  EXPECT_TRUE(WaitFor([&] { return inline_bytes() == 0; }, absl::Seconds(10))) << inline_bytes();
  EXPECT_EQ(session.Call(InlineAllReduce(1, std::string(4, '\0'))).code(), 0);
  EXPECT_FALSE((*cluster)->sidecar(0).Wait(absl::ZeroDuration()).ok()) << "the sidecar exited";
}

// Finding 3: one Join with world_size 2^31-1 made the coordinator allocate ~23 GB.
// A group's name is a label of the sidecar's metric series and is stored with the group: a
// name of megabytes made every scrape megabytes per series. Names are bounded (1024 bytes)
// and hold no control characters; the sidecar refuses the attach naming the rule.
TEST(AttackTest, AGroupNamePastItsLimitIsRefusedAtAttach) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  for (const std::string& name : {std::string(1 << 20, 'g'), std::string("tab\tin-name")}) {
    RawSession session(cluster->sidecar_address(0), name);
    EXPECT_FALSE(session.attached());
    grpc::Status end = session.End();
    EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << end.error_message();
    EXPECT_THAT(end.error_message(), ::testing::AnyOf(HasSubstr("longer than the limit (1024 bytes)"),
                                                      HasSubstr("control character")));
  }
  RawSession fine(cluster->sidecar_address(0), std::string(1024, 'g'));
  EXPECT_TRUE(fine.attached());
}

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
                                "--metrics_address=", "--allow_unauthenticated"},
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
  EXPECT_TRUE(WaitFor([&] { return RawSession(absl::StrCat("unix:", stale), "stale").attached(); }, absl::Seconds(20),
                      absl::Milliseconds(100)))
      << (*sidecar)->Output();
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
  ASSERT_TRUE(cluster->RestartCoordinator({absl::StrCat("--data_dir=", data), "--allow_unauthenticated"}).ok());
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
  const std::string original = wal;
  wal[3] ^= 0x10;  // record 0's length now points far past the end of the file
  std::ofstream(data + "/wal", std::ios::binary | std::ios::trunc) << wal;
  auto refused = Process::Start({CoordinatorBinary(), "--listen_address=127.0.0.1:0", absl::StrCat("--data_dir=", data),
                                 "--metrics_address=", "--allow_unauthenticated"},
                                {}, cluster->dir() + "/corrupt-coordinator.log");
  ASSERT_TRUE(refused.ok());
  auto code = (*refused)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << "the coordinator started on a corrupt log: " << (*refused)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*refused)->Output(), HasSubstr("DATA_LOSS: record runs past the end of the file at offset 0"));
  std::stringstream after;
  after << std::ifstream(data + "/wal", std::ios::binary).rdbuf();
  EXPECT_EQ(after.str(), wal) << "the log was changed";

  // Issue 41, finding 6: zeros from the middle of the records to the end of the file look
  // like the zeros preallocated after the last record: the coordinator started with half
  // its keys and logged nothing. Refused too, by the acknowledged length it kept in
  // wal.committed up to its kill -9. (The 100 records take more than 6,400 bytes; the file
  // is longer still, by its preallocated zeros.)
  std::string zeroed = original;
  std::fill(zeroed.begin() + 3000, zeroed.end(), '\0');
  std::ofstream(data + "/wal", std::ios::binary | std::ios::trunc) << zeroed;
  auto zeros = Process::Start({CoordinatorBinary(), "--listen_address=127.0.0.1:0", absl::StrCat("--data_dir=", data),
                               "--metrics_address=", "--allow_unauthenticated"},
                              {}, cluster->dir() + "/zeroed-coordinator.log");
  ASSERT_TRUE(zeros.ok());
  code = (*zeros)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << "the coordinator started on a log with its second half zeroed: " << (*zeros)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*zeros)->Output(), HasSubstr("DATA_LOSS: checksum mismatch at offset "));
  EXPECT_THAT((*zeros)->Output(), HasSubstr("bytes were acknowledged (wal.committed)"));
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
  int64_t after = 0;
  WaitFor([&] { return (after = RssBytes(pid)) - before < (int64_t{32} << 20); }, absl::Seconds(15),
          absl::Milliseconds(200));
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

pb::Collective SegmentAllReduce(const std::string& segment, int64_t count) {
  pb::Collective c = InlineAllReduce(count, "");
  c.mutable_buffer()->set_segment(segment);
  c.mutable_buffer()->set_segment_bytes(4096);
  return c;
}

// Finding 2: the sidecar opened, mapped, read, wrote and unlinked any shared-memory name a
// client sent, from a TCP session too. Now a TCP session gets no shared memory, and a
// unix-socket session can only name segments whose descriptors it passed.
TEST(AttackTest, SharedMemoryIsNeverOpenedByNameAndNeverOfferedOverTcp) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  // Another user's segment, by name, the way the attack named it.
  const std::string victim = absl::StrCat("/collserve-attack-victim-", getpid());
  const int vfd = shm_open(victim.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(vfd, 0);
  ASSERT_EQ(ftruncate(vfd, 4096), 0);
  ASSERT_EQ(pwrite(vfd, "secret", 6, 0), 6);
  struct Unlink {
    std::string name;
    ~Unlink() { shm_unlink(name.c_str()); }
  } unlink_victim{victim};
  {
    RawSession tcp(cluster->sidecar_tcp_address(0), "tcp-shm", /*shared_memory=*/true);
    ASSERT_TRUE(tcp.attached());
    EXPECT_FALSE(tcp.info().shared_memory());
    EXPECT_TRUE(tcp.info().session_token().empty());
    // (A rank's own bad request fails the collective on every rank: INVALID_ARGUMENT with
    // the reason.)
    pb::Completion c = tcp.Call(SegmentAllReduce(victim, 1));
    EXPECT_EQ(c.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)) << c.message();
    EXPECT_THAT(c.message(), HasSubstr("this session may not use shared memory: send tensors inline"));
  }
  {
    RawSession local(cluster->sidecar_address(0), "unix-shm", /*shared_memory=*/true);
    ASSERT_TRUE(local.attached());
    EXPECT_TRUE(local.info().shared_memory());
    pb::Completion c = local.Call(SegmentAllReduce(victim, 1));
    EXPECT_EQ(c.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT)) << c.message();
    EXPECT_THAT(c.message(), HasSubstr("was not registered by this session"));
  }
  // The victim's segment is still there, unchanged.
  char buf[6] = {};
  const int again = shm_open(victim.c_str(), O_RDONLY, 0);
  ASSERT_GE(again, 0) << "the sidecar removed another process's segment";
  EXPECT_EQ(pread(again, buf, 6, 0), 6);
  close(again);
  close(vfd);
  EXPECT_EQ(std::string(buf, 6), "secret");
}

// The descriptor channel admits only a session's own token, and only sealed memfds: a file
// that can shrink under the sidecar's mapping would make it fault (SIGBUS).
TEST(AttackTest, DescriptorChannelRefusesStrangersAndShrinkableFiles) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  RawSession session(cluster->sidecar_address(0), "fd-channel", /*shared_memory=*/true);
  ASSERT_TRUE(session.attached());
  ASSERT_TRUE(session.info().shared_memory());
  const std::string path = session.info().fd_socket();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto stranger = fdchannel::Connect(path, std::string(fdchannel::kTokenBytes, 'x'), deadline);
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kPermissionDenied) << stranger.status();
  auto sock = fdchannel::Connect(path, session.info().session_token(), deadline);
  ASSERT_TRUE(sock.ok()) << sock.status();
  // An unsealed memfd and a regular file: refused, and the channel keeps serving.
  const int unsealed = memfd_create("attack", MFD_CLOEXEC);
  ASSERT_EQ(ftruncate(unsealed, 4096), 0);
  absl::Status s = fdchannel::RegisterSegment(*sock, "unsealed", 4096, unsealed, deadline);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  const std::string file = cluster->dir() + "/plain-file";
  std::ofstream(file) << std::string(4096, 'f');
  const int plain = open(file.c_str(), O_RDWR);
  s = fdchannel::RegisterSegment(*sock, "plain", 4096, plain, deadline);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  close(unsealed);
  close(plain);
  // A proper segment registers, and a collective on it works.
  auto seg = ShmSegment::Create(4096);
  ASSERT_TRUE(seg.ok());
  const float v[2] = {2.5f, -1.0f};
  std::memcpy((*seg)->data(), v, sizeof(v));
  ASSERT_TRUE(fdchannel::RegisterSegment(*sock, (*seg)->name(), 4096, (*seg)->fd(), deadline).ok());
  pb::Completion c = session.Call(SegmentAllReduce((*seg)->name(), 2));
  EXPECT_EQ(c.code(), 0) << c.message();
  EXPECT_EQ(std::memcmp((*seg)->data(), v, sizeof(v)), 0);
  close(*sock);
}

// Per-job quotas count what the sidecar maps, not what the client claims: a sealed memfd
// far larger than its Register says is charged its real size and refused past the job's
// max_segment_bytes (the coordinator's --job_policies_file), and the channel keeps serving.
TEST(AttackTest, ASegmentLargerThanClaimedIsChargedItsRealSizeAgainstTheJobsQuota) {
  const std::string policies = ::testing::TempDir() + "/attack-job-policies.json";
  std::ofstream(policies) << R"({"default_policy": {"max_segment_bytes": 1048576}})";
  auto cluster = StartCluster(1, {"--job_policies_file=" + policies});
  ASSERT_NE(cluster, nullptr);
  RawSession session(cluster->sidecar_address(0), "quota-lie", /*shared_memory=*/true);
  ASSERT_TRUE(session.attached());
  ASSERT_TRUE(session.info().shared_memory());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto sock = fdchannel::Connect(session.info().fd_socket(), session.info().session_token(), deadline);
  ASSERT_TRUE(sock.ok()) << sock.status();
  auto big = ShmSegment::Create(8 << 20);
  ASSERT_TRUE(big.ok()) << big.status();
  absl::Status s = fdchannel::RegisterSegment(*sock, (*big)->name(), 4096, (*big)->fd(), deadline);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("max_segment_bytes 1048576")) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("8388608 bytes")) << s;
  // Within the quota: registers, and a collective on it works.
  auto small = ShmSegment::Create(64 << 10);
  ASSERT_TRUE(small.ok());
  const float v[2] = {1.5f, 2.0f};
  std::memcpy((*small)->data(), v, sizeof(v));
  ASSERT_TRUE(fdchannel::RegisterSegment(*sock, (*small)->name(), 64 << 10, (*small)->fd(), deadline).ok());
  pb::Completion c = session.Call(SegmentAllReduce((*small)->name(), 2));
  EXPECT_EQ(c.code(), 0) << c.message();
  close(*sock);
  std::remove(policies.c_str());
}

// Peer reads: a rank's client is handed a read-only descriptor of another rank's segment
// (Open on the descriptor channel) only for a rank of its own group on that sidecar, and
// only if it asked for peer reads; the descriptor cannot be mapped for writing.
TEST(AttackTest, PeerSegmentsOpenOnlyWithinTheGroupAndReadOnly) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  RawSession owner(cluster->sidecar_address(0), "peer-owner", true, {.peer_reads = true});
  RawSession other(cluster->sidecar_address(0), "peer-other", true, {.peer_reads = true});
  RawSession plain(cluster->sidecar_address(0), "peer-plain", true);
  ASSERT_TRUE(owner.attached() && other.attached() && plain.attached());
  EXPECT_TRUE(owner.info().peer_reads());
  EXPECT_FALSE(plain.info().peer_reads());
  auto owner_sock = fdchannel::Connect(owner.info().fd_socket(), owner.info().session_token(), deadline);
  auto other_sock = fdchannel::Connect(other.info().fd_socket(), other.info().session_token(), deadline);
  auto plain_sock = fdchannel::Connect(plain.info().fd_socket(), plain.info().session_token(), deadline);
  ASSERT_TRUE(owner_sock.ok() && other_sock.ok() && plain_sock.ok());
  auto seg = ShmSegment::Create(4096);
  ASSERT_TRUE(seg.ok());
  std::memcpy((*seg)->data(), "secret", 6);
  ASSERT_TRUE(fdchannel::RegisterSegment(*owner_sock, (*seg)->name(), 4096, (*seg)->fd(), deadline).ok());
  // Rank 0 of another group (on the same sidecar) does not reach it: its own rank 0 has no
  // such segment.
  auto stolen = fdchannel::OpenPeerSegment(*other_sock, 0, (*seg)->name(), deadline);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound) << stolen.status();
  EXPECT_EQ(fdchannel::OpenPeerSegment(*other_sock, 5, (*seg)->name(), deadline).status().code(),
            absl::StatusCode::kPermissionDenied);
  // A session that did not ask for peer reads gets nothing.
  EXPECT_EQ(fdchannel::OpenPeerSegment(*plain_sock, 0, (*seg)->name(), deadline).status().code(),
            absl::StatusCode::kPermissionDenied);
  // Within the group: read-only.
  auto fd = fdchannel::OpenPeerSegment(*owner_sock, 0, (*seg)->name(), deadline);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(fcntl(*fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0), MAP_FAILED);
  void* p = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, *fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_EQ(std::memcmp(p, "secret", 6), 0);
  munmap(p, 4096);
  close(*fd);
  // The channel goes on serving after refusals.
  EXPECT_TRUE(fdchannel::OpenPeerSegment(*owner_sock, 0, (*seg)->name(), deadline).ok());
  close(*owner_sock);
  close(*other_sock);
  close(*plain_sock);
}

// A broadcast over segments whose receivers read the root's segment (peer reads): the
// root's completion waits for the reader's ReadDone, but a reader that never sends it
// holds it only until the op deadline, and a reader whose session ends not at all.
// Two raw sessions of `group` on one sidecar (ranks 0 and 1 of 2, with peer reads), each
// with a registered 4096-byte segment of its own; null if any step failed.
struct PeerPair {
  std::unique_ptr<RawSession> rank0, rank1;
  std::unique_ptr<ShmSegment> seg0, seg1;
  int sock0 = -1, sock1 = -1;
  ~PeerPair() {
    if (sock0 >= 0) close(sock0);
    if (sock1 >= 0) close(sock1);
  }
};

// `reader_peer_reads` = false: rank 1 does not ask for peer reads (the sidecar copies its results).
std::unique_ptr<PeerPair> AttachPeerPair(const std::string& address, const std::string& group, int op_timeout_ms,
                                         bool reader_peer_reads = true) {
  auto pair = std::make_unique<PeerPair>();
  std::thread attach0([&] {
    pair->rank0 = std::make_unique<RawSession>(
        address, group, true, RawAttach{.peer_reads = true, .rank = 0, .world_size = 2, .op_timeout_ms = op_timeout_ms});
  });
  pair->rank1 = std::make_unique<RawSession>(
      address, group, true,
      RawAttach{.peer_reads = reader_peer_reads, .rank = 1, .world_size = 2, .op_timeout_ms = op_timeout_ms});
  attach0.join();
  if (!pair->rank0->attached() || !pair->rank1->attached()) return nullptr;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto sock0 = fdchannel::Connect(pair->rank0->info().fd_socket(), pair->rank0->info().session_token(), deadline);
  auto sock1 = fdchannel::Connect(pair->rank1->info().fd_socket(), pair->rank1->info().session_token(), deadline);
  if (!sock0.ok() || !sock1.ok()) return nullptr;
  pair->sock0 = *sock0;
  pair->sock1 = *sock1;
  auto seg0 = ShmSegment::Create(4096);
  auto seg1 = ShmSegment::Create(4096);
  if (!seg0.ok() || !seg1.ok()) return nullptr;
  pair->seg0 = std::move(*seg0);
  pair->seg1 = std::move(*seg1);
  if (!fdchannel::RegisterSegment(pair->sock0, pair->seg0->name(), 4096, pair->seg0->fd(), deadline).ok() ||
      !fdchannel::RegisterSegment(pair->sock1, pair->seg1->name(), 4096, pair->seg1->fd(), deadline).ok()) {
    return nullptr;
  }
  return pair;
}

TEST(AttackTest, PeerReaderThatNeverAnswersHoldsTheRootOnlyUntilItsDeadline) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  for (bool reader_hangs_up : {false, true}) {
    SCOPED_TRACE(reader_hangs_up ? "the reader's session ends" : "the reader stays silent");
    auto pair = AttachPeerPair(cluster->sidecar_address(0), reader_hangs_up ? "peer-gone" : "peer-silent", 2000);
    ASSERT_NE(pair, nullptr);
    std::unique_ptr<RawSession>& root = pair->rank0;
    std::unique_ptr<RawSession>& reader = pair->rank1;
    ShmSegment& root_seg = *pair->seg0;
    ShmSegment& reader_seg = *pair->seg1;
    const float v[2] = {7.0f, 8.0f};
    std::memcpy(root_seg.data(), v, sizeof(v));
    auto broadcast = [](const std::string& segment) {
      pb::Collective c = SegmentAllReduce(segment, 2);
      c.set_op(pb::BROADCAST);
      c.set_root(0);
      return c;
    };
    pb::Completion root_done;
    absl::Time root_answered;
    std::thread root_call([&] {
      root_done = root->Call(broadcast(root_seg.name()));
      root_answered = absl::Now();
    });
    pb::Completion got = reader->Call(broadcast(reader_seg.name()));
    const absl::Time reader_answered = absl::Now();
    EXPECT_EQ(got.code(), 0) << got.message();
    EXPECT_TRUE(got.has_peer_source());  // not ASSERT: the other call's thread is still to be joined
    EXPECT_EQ(got.peer_source().rank(), 0);
    EXPECT_EQ(got.peer_source().segment(), root_seg.name());
    EXPECT_EQ(got.peer_source().bytes(), 8);
    // The reader's own segment was not written: the result is the root's to read.
    EXPECT_NE(std::memcmp(reader_seg.data(), v, sizeof(v)), 0);
    if (reader_hangs_up) {
      absl::SleepFor(absl::Milliseconds(300));  // a pause the test is about: the reader hangs up later
      reader.reset();
    }
    root_call.join();
    EXPECT_EQ(root_done.code(), 0) << root_done.message();
    if (reader_hangs_up) {
      EXPECT_LT(root_answered - reader_answered, absl::Milliseconds(1500));
    } else {
      // Held until the op deadline (2 s after submission; expiry is checked every second).
      EXPECT_GE(root_answered - reader_answered, absl::Milliseconds(1000));
      EXPECT_LT(root_answered - reader_answered, absl::Seconds(8));
      // A late or made-up ReadDone is ignored: the session goes on.
      EXPECT_TRUE(reader->ReadDone(0));
      EXPECT_TRUE(reader->ReadDone(12345));
      pb::Collective barrier;
      barrier.set_op(pb::BARRIER);
      std::thread root_barrier([&] { EXPECT_EQ(root->Call(barrier).code(), 0); });
      EXPECT_EQ(reader->Call(barrier).code(), 0);
      root_barrier.join();
    }
  }
}

// ALL_REDUCE with peer reads: the sum is written once, into the owner's segment (the first
// rank whose tensor is shareable); the other rank's segment keeps its input, its completion
// names the owner's bytes, and its ReadDone releases the owner at once.
TEST(AttackTest, PeerReadAllReduceWritesTheResultOnceIntoTheOwnersSegment) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  auto pair = AttachPeerPair(cluster->sidecar_address(0), "peer-sum", 20000);
  ASSERT_NE(pair, nullptr);
  std::unique_ptr<RawSession>& owner = pair->rank0;
  std::unique_ptr<RawSession>& reader = pair->rank1;
  ShmSegment& owner_seg = *pair->seg0;
  ShmSegment& reader_seg = *pair->seg1;
  const float a[2] = {1.0f, 2.0f}, b[2] = {10.0f, 20.0f}, sum[2] = {11.0f, 22.0f};
  std::memcpy(owner_seg.data(), a, sizeof(a));
  std::memcpy(reader_seg.data(), b, sizeof(b));
  pb::Completion owner_done;
  absl::Time owner_answered;
  std::thread owner_call([&] {
    owner_done = owner->Call(SegmentAllReduce(owner_seg.name(), 2));
    owner_answered = absl::Now();
  });
  pb::Completion got = reader->Call(SegmentAllReduce(reader_seg.name(), 2));
  EXPECT_EQ(got.code(), 0) << got.message();
  EXPECT_TRUE(got.has_peer_source());  // not ASSERT: the other call's thread is still to be joined
  EXPECT_EQ(got.peer_source().rank(), 0);
  EXPECT_EQ(got.peer_source().segment(), owner_seg.name());
  EXPECT_EQ(got.peer_source().offset(), 0);
  EXPECT_EQ(got.peer_source().bytes(), 8);
  EXPECT_EQ(std::memcmp(owner_seg.data(), sum, sizeof(sum)), 0);
  EXPECT_EQ(std::memcmp(reader_seg.data(), b, sizeof(b)), 0);  // its input, untouched
  const absl::Time read_done = absl::Now();
  EXPECT_TRUE(reader->ReadDone(got.seq()));
  owner_call.join();
  EXPECT_EQ(owner_done.code(), 0) << owner_done.message();
  EXPECT_FALSE(owner_done.has_peer_source());
  EXPECT_LT(owner_answered - read_done, absl::Seconds(5));  // released by ReadDone, not the 20 s deadline
}

// A broadcast root may send its request before its tensor's bytes (Buffer.fill_offset: the
// SDK's pipelined broadcast writes them after, behind a count of the bytes written). A peer
// reader is answered at once with the count's place; a reader the sidecar copies for gets
// the bytes only once the count covers them; a root that never writes them fails the op at
// its deadline, naming the bytes written. A fill_offset anywhere else is INVALID_ARGUMENT.
constexpr int64_t kFillAt = 4088;  // the count: the last aligned word of the 4096-byte segment
pb::Collective FillingBroadcast(const std::string& segment, int64_t fill_offset) {
  pb::Collective c = SegmentAllReduce(segment, 2);
  c.set_op(pb::BROADCAST);
  c.set_root(0);
  c.mutable_buffer()->set_fill_offset(fill_offset);
  return c;
}
void PublishFill(ShmSegment& seg, const float (&v)[2]) {
  std::memcpy(seg.data(), v, sizeof(v));
  __atomic_store_n(reinterpret_cast<uint64_t*>(seg.data() + kFillAt), uint64_t{sizeof(v)}, __ATOMIC_RELEASE);
}

TEST(AttackTest, BroadcastRootWritingAfterItsRequestIsFollowedByPeerReadersAndAwaitedByTheSidecar) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  const float v[2] = {7.0f, 8.0f};
  {
    SCOPED_TRACE("a peer reader follows the count");
    auto pair = AttachPeerPair(cluster->sidecar_address(0), "fill-peer", 20000);
    ASSERT_NE(pair, nullptr);
    pb::Completion root_done;
    std::thread root_call([&] { root_done = pair->rank0->Call(FillingBroadcast(pair->seg0->name(), kFillAt)); });
    pb::Completion got = pair->rank1->Call(FillingBroadcast(pair->seg1->name(), 0));
    // Answered before the root wrote a byte: the reader is to follow the count.
    EXPECT_EQ(got.code(), 0) << got.message();
    EXPECT_EQ(got.peer_source().segment(), pair->seg0->name());
    EXPECT_EQ(got.peer_source().fill_offset(), kFillAt);
    PublishFill(*pair->seg0, v);
    EXPECT_TRUE(pair->rank1->ReadDone(got.seq()));
    root_call.join();
    EXPECT_EQ(root_done.code(), 0) << root_done.message();
  }
  {
    SCOPED_TRACE("the sidecar waits for the count before it copies");
    auto pair = AttachPeerPair(cluster->sidecar_address(0), "fill-copied", 20000, /*reader_peer_reads=*/false);
    ASSERT_NE(pair, nullptr);
    pb::Completion root_done;
    const absl::Time start = absl::Now();
    std::thread root_call([&] { root_done = pair->rank0->Call(FillingBroadcast(pair->seg0->name(), kFillAt)); });
    std::thread writer([&] {
      absl::SleepFor(absl::Milliseconds(300));  // a pause the test is about: the root writes 300 ms late
      PublishFill(*pair->seg0, v);
    });
    pb::Completion got = pair->rank1->Call(FillingBroadcast(pair->seg1->name(), 0));
    const absl::Duration waited = absl::Now() - start;
    writer.join();
    root_call.join();
    EXPECT_EQ(got.code(), 0) << got.message();
    EXPECT_FALSE(got.has_peer_source());
    EXPECT_EQ(std::memcmp(pair->seg1->data(), v, sizeof(v)), 0);
    EXPECT_GE(waited, absl::Milliseconds(250));
    EXPECT_EQ(root_done.code(), 0) << root_done.message();
  }
  {
    SCOPED_TRACE("a root that never writes fails the op at its deadline");
    auto pair = AttachPeerPair(cluster->sidecar_address(0), "fill-never", 1500, /*reader_peer_reads=*/false);
    ASSERT_NE(pair, nullptr);
    pb::Completion root_done;
    std::thread root_call([&] { root_done = pair->rank0->Call(FillingBroadcast(pair->seg0->name(), kFillAt)); });
    pb::Completion got = pair->rank1->Call(FillingBroadcast(pair->seg1->name(), 0));
    root_call.join();
    for (const pb::Completion* c : {&got, &root_done}) {
      EXPECT_EQ(c->code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded)) << c->message();
      EXPECT_THAT(c->message(),
                  testing::HasSubstr("ahead of its 8-byte tensor (fill_offset) and had written 0 of its bytes"));
    }
  }
  {
    SCOPED_TRACE("fill_offset anywhere else is refused");
    RawSession one(cluster->sidecar_address(0), "fill-invalid", true);
    ASSERT_TRUE(one.attached());
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    auto sock = fdchannel::Connect(one.info().fd_socket(), one.info().session_token(), deadline);
    ASSERT_TRUE(sock.ok()) << sock.status();
    auto seg = ShmSegment::Create(4096);
    ASSERT_TRUE(seg.ok()) << seg.status();
    ASSERT_TRUE(fdchannel::RegisterSegment(*sock, (*seg)->name(), 4096, (*seg)->fd(), deadline).ok());
    pb::Collective all_reduce = SegmentAllReduce((*seg)->name(), 2);
    all_reduce.mutable_buffer()->set_fill_offset(kFillAt);
    pb::Collective as_output = FillingBroadcast((*seg)->name(), 0);
    as_output.mutable_output()->set_fill_offset(kFillAt);
    const std::vector<std::pair<pb::Collective, std::string>> refused = {
        {FillingBroadcast((*seg)->name(), 4090), "multiple of 8"},
        {FillingBroadcast((*seg)->name(), 4), "outside the tensor"},
        {FillingBroadcast((*seg)->name(), 4096), "inside segment"},
        {FillingBroadcast((*seg)->name(), -8), "only for a broadcast root"},
        {all_reduce, "only for a broadcast root"},
        {as_output, "only for a broadcast root"},
    };
    for (const auto& [c, why] : refused) {
      pb::Completion got = one.Call(c);
      EXPECT_EQ(got.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << why;
      EXPECT_THAT(got.message(), testing::HasSubstr(why));
    }
    // The session goes on.
    PublishFill(**seg, v);
    EXPECT_EQ(one.Call(FillingBroadcast((*seg)->name(), kFillAt)).code(), 0);
    close(*sock);
  }
}

// Whether the server closed `fd` (a read returns end of stream) within `within`.
bool ClosedByServer(int fd, absl::Duration within) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(within))) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, 0) <= 0;
}

// torch >= 2.2's VALIDATE, then a PING; true if the nonce comes back.
bool Pings(int fd) {
  const char validate[5] = {0, static_cast<char>(0xCE), static_cast<char>(0xF7), static_cast<char>(0x85), 0x3C};
  const char ping[5] = {13, 'p', 'i', 'n', 'g'};
  if (::send(fd, validate, 5, MSG_NOSIGNAL) != 5 || ::send(fd, ping, 5, MSG_NOSIGNAL) != 5) return false;
  char back[4] = {};
  return ::recv(fd, back, 4, MSG_WAITALL) == 4 && std::memcmp(back, "ping", 4) == 0;
}

// A cluster whose coordinator also serves the TCPStore protocol, with `flags`; its port.
std::unique_ptr<Cluster> StartTcpStore(const std::vector<std::string>& flags, int* port) {
  auto cluster = StartCluster(0);
  if (cluster == nullptr) return nullptr;
  std::vector<std::string> all = {"--tcpstore_address=127.0.0.1:0",
                                  absl::StrCat("--tcpstore_port_file=", cluster->dir(), "/tcpstore.port"),
                                  "--allow_unauthenticated"};
  all.insert(all.end(), flags.begin(), flags.end());
  EXPECT_TRUE(cluster->RestartCoordinator(all).ok());
  std::ifstream in(cluster->dir() + "/tcpstore.port");
  in >> *port;
  return *port > 0 ? std::move(cluster) : nullptr;
}

// Runs tests/python/tcpstore_get.py (a raw TCPStore client: "got VALUE" or "closed") for
// `key` on `port`, as uid 65534 when `as_nobody` (its text is passed with -c: that uid may
// not be able to read the checkout); its output.
std::string TcpStoreGet(Cluster& cluster, int port, const std::string& key, bool as_nobody, const std::string& name);

// Issue 41, finding 2: the TCPStore endpoint took no credentials, so uid nobody read and
// overwrote a launched job's keys on 127.0.0.1:$MASTER_PORT. Now a loopback connection is
// admitted only for root and the coordinator's uid (or --tcpstore_local_uids), and an
// endpoint off loopback does not start without --tcpstore_allow.
TEST(AttackTest, AnotherLocalUserCannotReachTheTcpStoreEndpoint) {
  if (::geteuid() != 0 || ::access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "needs root and setpriv";
  int port = 0;
  auto cluster = StartTcpStore({}, &port);
  ASSERT_NE(cluster, nullptr);
  ExpectStoreServes(cluster->coordinator_address());  // sets "still-serving" = "yes"
  EXPECT_EQ(TcpStoreGet(*cluster, port, "still-serving", false, "owner"), "got yes\n");
  EXPECT_EQ(TcpStoreGet(*cluster, port, "still-serving", true, "intruder"), "closed\n");
  EXPECT_TRUE(WaitFor([&] { return absl::StrContains(cluster->coordinator().Output(), "belongs to uid 65534"); },
                      absl::Seconds(10)))
      << cluster->coordinator().Output();
  // Naming the uid admits it.
  cluster = StartTcpStore({"--tcpstore_local_uids=0,65534"}, &port);
  ASSERT_NE(cluster, nullptr);
  ExpectStoreServes(cluster->coordinator_address());
  EXPECT_EQ(TcpStoreGet(*cluster, port, "still-serving", true, "named"), "got yes\n");
  // Off loopback without --tcpstore_allow: no start.
  auto open = Process::Start({CoordinatorBinary(), "--listen_address=127.0.0.1:0", "--tcpstore_address=0.0.0.0:0",
                              "--metrics_address=", "--allow_unauthenticated"},
                             {}, cluster->dir() + "/wildcard-coordinator.log");
  ASSERT_TRUE(open.ok());
  auto code = (*open)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << (*open)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*open)->Output(), HasSubstr("carries no credentials: name the networks of the job's hosts with "
                                           "--tcpstore_allow"));
}

// Finding 5: the TCPStore endpoint took 4096 idle connections (one thread each) and then
// refused legitimate clients; a client trickling a request held its connection forever.
TEST(AttackTest, TcpStoreCapsConnectionsPerPeerAndClosesTricklingRequests) {
  int port = 0;
  auto cluster = StartTcpStore({"--tcpstore_max_connections_per_peer=8", "--tcpstore_frame_timeout=1s"}, &port);
  ASSERT_NE(cluster, nullptr);
  std::vector<int> held;
  for (int i = 0; i < 8; ++i) {
    held.push_back(ConnectTcp(port));
    ASSERT_GE(held.back(), 0);
    ASSERT_TRUE(Pings(held.back())) << "connection " << i;
  }
  const int ninth = ConnectTcp(port);
  ASSERT_GE(ninth, 0);  // the kernel accepts; the server closes it at once
  EXPECT_TRUE(ClosedByServer(ninth, absl::Seconds(5)));
  ::close(ninth);
  // One of the eight trickles a SET (its opcode and 2 of 8 length bytes), then stalls.
  const char partial[3] = {1, 5, 0};
  ASSERT_EQ(::send(held[0], partial, 3, MSG_NOSIGNAL), 3);
  EXPECT_TRUE(ClosedByServer(held[0], absl::Seconds(5))) << "a trickled request was not timed out";
  ::close(held[0]);
  held.erase(held.begin());
  // Its place is free again, and the others still work.
  const int again = ConnectTcp(port);
  ASSERT_GE(again, 0);
  EXPECT_TRUE(Pings(again));
  held.push_back(again);
  for (int fd : held) {
    EXPECT_TRUE(Pings(fd));
    ::close(fd);
  }
}

// Replaces `cluster`'s coordinator by one limited to 64 descriptors, serving gRPC on a
// port it writes to DIR/NAME.port, with `flags`; its log is DIR/NAME-coordinator.log.
absl::StatusOr<std::unique_ptr<Process>> StartSmallCoordinator(Cluster& cluster, const std::string& name,
                                                              const std::vector<std::string>& flags) {
  cluster.coordinator().Kill(SIGKILL);
  if (absl::StatusOr<int> code = cluster.coordinator().Wait(absl::Seconds(10)); !code.ok()) return code.status();
  std::vector<std::string> argv = {"/usr/bin/prlimit", "--nofile=64:64", CoordinatorBinary(),
                                   "--listen_address=127.0.0.1:0",
                                   absl::StrCat("--port_file=", cluster.dir(), "/", name, ".port"),
                                   "--metrics_address=", "--log_level=warning"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return Process::Start(argv, {}, absl::StrCat(cluster.dir(), "/", name, "-coordinator.log"));
}

// Connects to 127.0.0.1:`port` from the loopback address `source` (e.g. "127.0.0.7"), as
// hosts of many addresses would; -1 on failure.
int ConnectTcpFrom(const std::string& source, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, source.c_str(), &from.sin_addr) != 1 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Issue 41, finding 5: idle connections from 16 or more addresses (each under the per-peer
// cap) filled --tcpstore_max_connections and every legitimate client was closed at accept
// for as long as they stayed open. Now a newcomer takes the place of the oldest connection
// that has sent nothing; a connection that has sent a request keeps its place.
TEST(AttackTest, IdleTcpStoreConnectionsFromManyAddressesDoNotLockClientsOut) {
  int port = 0;
  auto cluster = StartTcpStore({"--tcpstore_max_connections=32"}, &port);
  ASSERT_NE(cluster, nullptr);
  const int before = ConnectTcp(port);  // a client of the job, connected before the flood
  ASSERT_GE(before, 0);
  ASSERT_TRUE(Pings(before));
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) {
    const int fd = ConnectTcpFrom(absl::StrCat("127.0.0.", 2 + i % 16), port);
    ASSERT_GE(fd, 0) << i;
    idle.push_back(fd);
  }
  // The first idle ones made room for the later ones, oldest first: the first is closed.
  EXPECT_TRUE(ClosedByServer(idle[0], absl::Seconds(10)));
  // Newcomers are served, and the earlier client too.
  for (int i = 0; i < 3; ++i) {
    const int fd = ConnectTcp(port);
    ASSERT_GE(fd, 0);
    EXPECT_TRUE(Pings(fd)) << "newcomer " << i;
    ::close(fd);
  }
  EXPECT_TRUE(Pings(before));
  ::close(before);
  for (int fd : idle) ::close(fd);
  EXPECT_THAT(cluster->coordinator().Output(), HasSubstr("the oldest silent one makes room"));
}

// Finding 5: after one EMFILE on the gRPC listener the coordinator never accepted a gRPC
// connection again. With 64 descriptors, 150 connections exhaust them; once they close,
// both endpoints serve again, and the TCPStore accept loop did not spin meanwhile.
TEST(AttackTest, RunningOutOfDescriptorsIsSurvived) {
  auto cluster = StartCluster(0);
  ASSERT_NE(cluster, nullptr);
  const std::string dir = cluster->dir();
  auto coordinator = StartSmallCoordinator(
      *cluster, "small",
      {"--tcpstore_address=127.0.0.1:0", absl::StrCat("--tcpstore_port_file=", dir, "/small-tcpstore.port"),
       "--allow_unauthenticated"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  const absl::StatusOr<int> grpc_port_file = ReadPortFile(dir + "/small.port", **coordinator, absl::Seconds(10));
  const absl::StatusOr<int> tcp_port_file = ReadPortFile(dir + "/small-tcpstore.port", **coordinator, absl::Seconds(10));
  ASSERT_TRUE(grpc_port_file.ok()) << grpc_port_file.status();
  ASSERT_TRUE(tcp_port_file.ok()) << tcp_port_file.status();
  const int grpc_port = *grpc_port_file, tcp_port = *tcp_port_file;
  const std::string address = absl::StrCat("127.0.0.1:", grpc_port);
  ExpectStoreServes(address);
  std::vector<int> flood;
  for (int i = 0; i < 75; ++i) {
    for (int port : {grpc_port, tcp_port}) {
      const int fd = ConnectTcp(port);
      if (fd >= 0) flood.push_back(fd);
    }
  }
  // Until the coordinator holds (nearly) all 64 descriptors it may: the rest of the flood
  // waits unaccepted.
  EXPECT_TRUE(WaitFor([&] { return OpenDescriptors((*coordinator)->pid()) >= 60; }, absl::Seconds(10)))
      << OpenDescriptors((*coordinator)->pid()) << " open";
  // While out of descriptors the coordinator backs off instead of spinning.
  const double before = CpuSeconds((*coordinator)->pid());
  absl::SleepFor(absl::Seconds(2));  // the window the CPU time is measured over
  EXPECT_LT(CpuSeconds((*coordinator)->pid()) - before, 0.5) << "the coordinator spun while out of descriptors";
  for (int fd : flood) ::close(fd);
  // It serves again once it has closed the flood's connections (as it backs off, its next
  // accept may come a moment later).
  EXPECT_TRUE(WaitFor([&] { return StoreSet(address).ok(); }, absl::Seconds(10), absl::Milliseconds(100)));
  // The TCPStore endpoint too, on a fresh connection. One connection may still be shed: while
  // the gRPC server accepts the flood's queued (closed) connections, the descriptors can run
  // out once more, and the TCPStore listener then closes the connection at the head of its
  // queue so that it fails fast (the CI failure of stop 50 was this test pinging once).
  EXPECT_TRUE(WaitFor(
      [&] {
        const int fd = ConnectTcp(tcp_port);
        const bool pinged = fd >= 0 && Pings(fd);
        if (fd >= 0) ::close(fd);
        return pinged;
      },
      absl::Seconds(10), absl::Milliseconds(100)));
}

// Issue 41, finding 4: with the coordinator out of descriptors (64, held by a flood of
// unauthenticated connections), the token directory's refresh failed with EMFILE and the
// coordinator then refused every valid job token, on connections it already had. Now it
// keeps the tokens it read before (fail static) and says so in its log.
TEST(AttackTest, ADescriptorFloodDoesNotTurnIntoRefusedTokens) {
  auto cluster = StartCluster(0);
  ASSERT_NE(cluster, nullptr);
  const std::string dir = cluster->dir();
  auto coordinator = StartSmallCoordinator(
      *cluster, "flood", {absl::StrCat("--job_tokens_dir=", dir, "/job-tokens"), "--token_refresh_interval=100ms"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  auto port = ReadPortFile(dir + "/flood.port", **coordinator, absl::Seconds(10));
  ASSERT_TRUE(port.ok()) << port.status();
  // One channel with the job's token, connected before the flood.
  auto stub = pb::Store::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", *port), grpc::InsecureChannelCredentials()));
  auto set = [&](const std::string& key) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(absl::Seconds(10)));
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", cluster->job_token()));
    pb::SetRequest req;
    req.set_key(key);
    req.set_value("v");
    pb::SetResponse resp;
    return stub->Set(&ctx, req, &resp);
  };
  grpc::Status before = set("before-the-flood");
  ASSERT_TRUE(before.ok()) << before.error_message();
  std::vector<int> flood;
  for (int i = 0; i < 100; ++i) {
    const int fd = ConnectTcp(*port);
    if (fd >= 0) flood.push_back(fd);
  }
  EXPECT_TRUE(WaitFor([&] { return OpenDescriptors((*coordinator)->pid()) >= 60; }, absl::Seconds(10)))
      << OpenDescriptors((*coordinator)->pid()) << " open";
  // A refresh failed for want of descriptors, and the old tokens were kept.
  ASSERT_TRUE((*coordinator)->WaitForOutput("keeping the tokens read before", absl::Seconds(20)))
      << (*coordinator)->Output();
  grpc::Status during = set("during-the-flood");
  EXPECT_TRUE(during.ok()) << during.error_code() << ": " << during.error_message();
  for (int fd : flood) ::close(fd);
  EXPECT_TRUE(WaitFor([&] { return set("after-the-flood").ok(); }, absl::Seconds(10), absl::Milliseconds(100)));
}

// A raw connection to the descriptor channel at `path` (no Hello); -1 on failure.
int RawChannelConnection(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), std::min(path.size(), sizeof(addr.sun_path) - 1));
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
  if (fd >= 0) close(fd);
  return -1;
}

// Whether the sidecar closed connection `fd` within `wait` (its answers, if any, read and
// dropped on the way).
bool ClosedBySidecar(int fd, absl::Duration wait) {
  const absl::Time deadline = absl::Now() + wait;
  char buf[fdchannel::kMaxMessageBytes];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
}

// The descriptor channel's one thread never waits for a client: a connection that sends
// requests without reading the answers (here Opens before Hello, which need no token) is
// closed once its socket has no room, instead of holding the thread 200 ms per answer and
// every session's registrations and ops channels with it.
TEST(AttackTest, AChannelClientThatReadsNoAnswersIsClosedWithoutStallingOthers) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  RawSession session(cluster->sidecar_address(0), "fd-flood", /*shared_memory=*/true);
  ASSERT_TRUE(session.attached());
  const std::string path = session.info().fd_socket();
  fdchannel::Open open;
  std::strncpy(open.name, "nothing", sizeof(open.name) - 1);
  // 40 flooders, one after the other: each sends Opens (answered before Hello, no token
  // needed) and reads nothing, until the sidecar closes it. A sidecar that waited 200 ms for
  // room to answer each one once full took at least 8 s for them, its thread held all along.
  constexpr int kFlooders = 40;
  const absl::Time start = absl::Now();
  int closed = 0;
  for (int i = 0; i < kFlooders; ++i) {
    Fd f{RawChannelConnection(path)};
    ASSERT_GE(f.fd, 0);
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (absl::Now() < give_up) {
      pollfd p{f.fd, POLLOUT, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      if (send(f.fd, &open, sizeof(open), MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno != EAGAIN && errno != EINTR) {
        ++closed;  // EPIPE, ECONNRESET: the sidecar closed it
        break;
      }
    }
  }
  const absl::Duration took = absl::Now() - start;
  std::printf("%d flooding connections were closed in %s\n", closed, absl::FormatDuration(took).c_str());
  EXPECT_EQ(closed, kFlooders);
  EXPECT_LT(took, absl::Seconds(4)) << "the channel's thread waited on clients that read nothing";
  // The channel serves a session as before.
  auto sock = fdchannel::Connect(path, session.info().session_token(), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(sock.ok()) << sock.status();
  Fd sock_fd{*sock};
  auto seg = ShmSegment::Create(4096);
  ASSERT_TRUE(seg.ok());
  EXPECT_TRUE(fdchannel::RegisterSegment(sock_fd.fd, (*seg)->name(), 4096, (*seg)->fd(),
                                         absl::Now() + absl::Seconds(10))
                  .ok());
}

// One session's token says Hello on at most 4 connections at once (the SDK opens 2), so one
// job cannot hold the channel's connection slots; when the session ends, the sidecar closes
// its connections; connections that never say Hello make room for ones that do.
TEST(AttackTest, ChannelConnectionsAreBoundedPerSessionAndNeverOutliveIt) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  auto session = std::make_unique<RawSession>(cluster->sidecar_address(0), "fd-slots", /*shared_memory=*/true);
  ASSERT_TRUE(session->attached());
  const std::string path = session->info().fd_socket();
  const std::string token = session->info().session_token();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::vector<Fd> conns(4);
  for (Fd& c : conns) {
    auto fd = fdchannel::Connect(path, token, deadline);
    ASSERT_TRUE(fd.ok()) << fd.status();
    c.fd = *fd;
  }
  auto fifth = fdchannel::Connect(path, token, deadline);
  EXPECT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted) << fifth.status();
  EXPECT_THAT(std::string(fifth.status().message()), HasSubstr("the limit (4 per session)"));
  if (fifth.ok()) close(*fifth);
  // One closed makes room for another.
  close(conns[3].fd);
  conns[3].fd = -1;
  EXPECT_TRUE(WaitFor(
      [&] {
        auto again = fdchannel::Connect(path, token, absl::Now() + absl::Seconds(5));
        if (!again.ok()) return false;
        conns[3].fd = *again;
        return true;
      },
      absl::Seconds(10), absl::Milliseconds(50)));
  // The session ends: every connection of its token is closed by the sidecar.
  session.reset();
  for (Fd& c : conns) EXPECT_TRUE(ClosedBySidecar(c.fd, absl::Seconds(10))) << "a connection outlived its session";

  // All 1024 slots held by connections that never say Hello: a session's Connect takes the
  // place of the oldest of them.
  rlimit nofile{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &nofile), 0);
  const rlimit before = nofile;
  nofile.rlim_cur = std::min<rlim_t>(nofile.rlim_max, 2048);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &nofile), 0);
  struct RestoreLimit {
    rlimit limit;
    ~RestoreLimit() { setrlimit(RLIMIT_NOFILE, &limit); }
  } restore{before};
  if (nofile.rlim_cur < 1100) GTEST_SKIP() << "this process may open only " << nofile.rlim_cur << " descriptors";
  RawSession later(cluster->sidecar_address(0), "fd-slots-later", /*shared_memory=*/true);
  ASSERT_TRUE(later.attached());
  std::vector<Fd> silent(1024);
  for (Fd& c : silent) {
    c.fd = RawChannelConnection(path);
    ASSERT_GE(c.fd, 0);
  }
  auto admitted = fdchannel::Connect(path, later.info().session_token(), absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(admitted.ok()) << admitted.status();
  if (admitted.ok()) close(*admitted);
  EXPECT_TRUE(ClosedBySidecar(silent[0].fd, absl::Seconds(10))) << "the oldest silent connection was kept";
  silent.clear();
}

// The ops channel (a session's requests and completions over its descriptor channel,
// common/ops_channel.h) opens only with the session's token, once, after Hello; a session
// with one takes no requests on its stream (one path keeps their order).
TEST(AttackTest, OpsChannelOpensOnlyForItsSessionOnceAndKeepsOnePath) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  RawSession session(cluster->sidecar_address(0), "ops-open", /*shared_memory=*/true);
  ASSERT_TRUE(session.attached());
  const std::string path = session.info().fd_socket();
  EXPECT_EQ(fdchannel::ConnectOps(path, std::string(fdchannel::kTokenBytes, 'x'), deadline).status().code(),
            absl::StatusCode::kPermissionDenied);
  {
    // OpsMode before Hello: refused, and the connection is closed.
    Fd raw{socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)};
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    ASSERT_EQ(connect(raw.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    fdchannel::OpsMode ops;
    ASSERT_TRUE(fdchannel::SendMessage(raw.fd, &ops, sizeof(ops), -1, deadline).ok());
    fdchannel::Reply reply;
    auto got = fdchannel::ReceiveMessage(raw.fd, &reply, sizeof(reply), nullptr, deadline);
    ASSERT_TRUE(got.ok()) << got.status();
    absl::Status s = fdchannel::StatusOf(reply, *got);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("OpsMode before Hello"));
  }
  auto ops = fdchannel::ConnectOps(path, session.info().session_token(), deadline);
  ASSERT_TRUE(ops.ok()) << ops.status();
  Fd ops_fd{*ops};
  auto second = fdchannel::ConnectOps(path, session.info().session_token(), deadline);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("already has an ops channel"));
  if (second.ok()) close(*second);
  // A request over the channel is answered over it.
  pb::SessionRequest req;
  req.mutable_collective()->set_op(pb::BARRIER);
  req.mutable_collective()->set_seq(0);
  ASSERT_TRUE(OpsSend(ops_fd.fd, req).ok());
  auto resp = OpsReceive(ops_fd.fd);
  ASSERT_TRUE(resp.ok()) << resp.status();
  ASSERT_TRUE(resp->has_completion());
  EXPECT_EQ(resp->completion().seq(), 0);
  EXPECT_EQ(resp->completion().code(), 0) << resp->completion().message();
  // A request on the stream now ends the session, and the sidecar closes the channel.
  req.mutable_collective()->set_seq(1);
  ASSERT_TRUE(session.Write(req));
  grpc::Status end = session.End();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << end.error_message();
  EXPECT_THAT(end.error_message(), HasSubstr("after it opened its ops channel"));
  EXPECT_EQ(OpsReceive(ops_fd.fd).status().code(), absl::StatusCode::kNotFound);
  RawSession fresh(cluster->sidecar_address(0), "ops-open-after", /*shared_memory=*/true);
  EXPECT_TRUE(fresh.attached());
}

// Malformed framing on the ops channel (a bad magic, unknown flags, a datagram or a message
// over its limit, bytes that are not a SessionRequest, a request with inline tensors) ends that session with an error that
// names the fault or the limit, without holding the bytes; the sidecar serves on.
TEST(AttackTest, OpsChannelFramingFaultsEndTheSessionNamingTheLimit) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  struct Case {
    std::string name;
    std::vector<std::string> datagrams;
    grpc::StatusCode code;
    std::string says;
  };
  const auto header = [](uint32_t magic, uint32_t flags) {
    std::string h(sizeof(opschannel::FragmentHeader), '\0');
    std::memcpy(h.data(), &magic, 4);
    std::memcpy(h.data() + 4, &flags, 4);
    return h;
  };
  const std::string good = header(opschannel::kFragmentMagic, 0);
  const std::string more = header(opschannel::kFragmentMagic, opschannel::kMore);
  std::vector<Case> cases = {
      {"bad-magic", {header(0x12345678, 0) + "x"}, grpc::StatusCode::INVALID_ARGUMENT, "bad magic"},
      {"flags", {header(opschannel::kFragmentMagic, 6)}, grpc::StatusCode::INVALID_ARGUMENT, "unknown flags 6"},
      {"short", {"abc"}, grpc::StatusCode::INVALID_ARGUMENT, "has no header"},
      {"not-a-request", {good + std::string("\xff\xff\xff", 3)}, grpc::StatusCode::INVALID_ARGUMENT,
       "not a collserve.v1.SessionRequest"},
      {"big-datagram", {more + std::string(opschannel::kMaxFragmentPayload + 1, 'a')},
       grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("exceeds the limit of ", opschannel::kMaxDatagramBytes)},
      // An empty datagram reads as the end (the sidecar takes up to 16 datagrams per call:
      // the end must not be lost among them, nor what follows it taken as more).
      {"empty-datagram", {more + "a", "", header(0x12345678, 0) + "x"}, grpc::StatusCode::UNAVAILABLE,
       "closed its ops channel"},
  };
  // Inline tensors (an all_gather's 1 GiB result would be zeroed on the channel's thread).
  pb::SessionRequest inline_request;
  pb::Collective* gather = inline_request.mutable_collective();
  gather->set_op(pb::ALL_GATHER);
  gather->set_dtype(pb::FLOAT32);
  gather->set_output_count(int64_t{1} << 28);
  cases.push_back({"inline", {good + inline_request.SerializeAsString()}, grpc::StatusCode::INVALID_ARGUMENT,
                   "has inline tensors; they go over the session's stream"});
  // A message just over kMaxOpsMessageBytes, in full fragments, all flagged "more".
  Case big{"big-message", {}, grpc::StatusCode::INVALID_ARGUMENT,
           absl::StrCat("over the limit of ", opschannel::kMaxOpsMessageBytes, " bytes")};
  for (size_t sent = 0; sent <= opschannel::kMaxOpsMessageBytes; sent += opschannel::kMaxFragmentPayload) {
    big.datagrams.push_back(more + std::string(opschannel::kMaxFragmentPayload, 'b'));
  }
  cases.push_back(big);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RawSession session(cluster->sidecar_address(0), "ops-" + c.name, /*shared_memory=*/true);
    ASSERT_TRUE(session.attached());
    auto ops = fdchannel::ConnectOps(session.info().fd_socket(), session.info().session_token(),
                                     absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(ops.ok()) << ops.status();
    Fd ops_fd{*ops};
    for (const std::string& d : c.datagrams) {
      // The sidecar may close the channel before the last one: a failed send is expected then.
      if (!fdchannel::SendMessage(ops_fd.fd, d.data(), d.size(), -1, absl::Now() + absl::Seconds(10)).ok()) break;
    }
    EXPECT_EQ(OpsReceive(ops_fd.fd).status().code(), absl::StatusCode::kNotFound);
    grpc::Status end = session.End();
    EXPECT_EQ(end.error_code(), c.code) << end.error_message();
    EXPECT_THAT(end.error_message(), HasSubstr(c.says));
  }
  RawSession fresh(cluster->sidecar_address(0), "ops-fresh", /*shared_memory=*/true);
  EXPECT_TRUE(fresh.attached());
}

// The session's end closes its ops channel (the client's reader must not wait forever), and
// a client that closes its ops channel ends its session.
TEST(AttackTest, OpsChannelAndSessionEndTogether) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  {
    RawSession session(cluster->sidecar_address(0), "ops-end-1", /*shared_memory=*/true);
    ASSERT_TRUE(session.attached());
    auto ops = fdchannel::ConnectOps(session.info().fd_socket(), session.info().session_token(),
                                     absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(ops.ok()) << ops.status();
    Fd ops_fd{*ops};
    shutdown(ops_fd.fd, SHUT_RDWR);
    grpc::Status end = session.End();
    EXPECT_EQ(end.error_code(), grpc::StatusCode::UNAVAILABLE) << end.error_message();
    EXPECT_THAT(end.error_message(), HasSubstr("closed its ops channel"));
  }
  Fd ops_fd;
  {
    RawSession session(cluster->sidecar_address(0), "ops-end-2", /*shared_memory=*/true);
    ASSERT_TRUE(session.attached());
    auto ops = fdchannel::ConnectOps(session.info().fd_socket(), session.info().session_token(),
                                     absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(ops.ok()) << ops.status();
    ops_fd.fd = *ops;
  }  // the stream ends here
  EXPECT_EQ(OpsReceive(ops_fd.fd).status().code(), absl::StatusCode::kNotFound);
}

// ---- Issue 41, finding 1: token theft through a squatted socket directory. ----
//
// Another local user (uid 65534 through setpriv, so the test needs root) makes the socket's
// directory first, mode 0777, as anyone could in /tmp. Before the fix the sidecar took the
// directory as it found it, so that user could move its socket aside and serve their own,
// and every rank then sent them its job token.

// A directory of this test that uid 65534 can write into, like /tmp (mode 1777), inside
// the cluster's own temp dir (made traversable, 0711).
std::string SharedTmp(Cluster& cluster) {
  const std::string dir = cluster.dir() + "/pub";
  EXPECT_EQ(::chmod(cluster.dir().c_str(), 0711), 0);
  EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0);
  EXPECT_EQ(::chmod(dir.c_str(), 01777), 0);
  return dir;
}

// Runs `argv` as uid/gid 65534 with no supplementary groups.
std::vector<std::string> AsNobody(std::vector<std::string> argv) {
  argv.insert(argv.begin(), {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"});
  return argv;
}

int RunAsNobody(Cluster& cluster, const std::vector<std::string>& argv, const std::string& name) {
  auto p = Process::Start(AsNobody(argv), {}, cluster.dir() + "/" + name + ".log");
  if (!p.ok()) return -1;
  auto code = (*p)->Wait(absl::Seconds(20));
  EXPECT_TRUE(code.ok() && *code == 0) << name << ": " << (*p)->Output();
  return code.ok() ? *code : -1;
}

std::string TcpStoreGet(Cluster& cluster, int port, const std::string& key, bool as_nobody, const std::string& name) {
  std::ifstream in(SourceDir() + "/tests/python/tcpstore_get.py");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.empty()) return "cannot read tests/python/tcpstore_get.py";
  std::vector<std::string> argv = {"/usr/bin/python3", "-c", text, std::to_string(port), key};
  auto p = Process::Start(as_nobody ? AsNobody(argv) : argv, {}, cluster.dir() + "/" + name + ".log");
  if (!p.ok()) return p.status().ToString();
  auto code = (*p)->Wait(absl::Seconds(20));
  if (!code.ok() || *code != 0) return absl::StrCat("failed: ", (*p)->Output());
  return (*p)->Output();
}

bool CanActAsNobody() { return ::geteuid() == 0 && ::access("/usr/bin/setpriv", X_OK) == 0; }

TEST(AttackTest, SidecarRefusesASocketDirectoryAnotherUserMadeOrCanWrite) {
  if (!CanActAsNobody()) GTEST_SKIP() << "needs root and setpriv, to act as uid 65534";
  auto cluster = StartCluster(0);
  ASSERT_NE(cluster, nullptr);
  const std::string pub = SharedTmp(*cluster);
  ASSERT_EQ(RunAsNobody(*cluster, {"mkdir", "-m", "0777", pub + "/sq"}, "squat"), 0);
  auto sidecar = Process::Start({SidecarBinary(), absl::StrCat("--coordinator=", cluster->coordinator_address()),
                                 absl::StrCat("--unix_socket=", pub, "/sq/sidecar.sock"), "--metrics_address="},
                                {}, cluster->dir() + "/squatted-sidecar.log");
  ASSERT_TRUE(sidecar.ok()) << sidecar.status();
  auto code = (*sidecar)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << "the sidecar served from a directory uid 65534 owns: " << (*sidecar)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*sidecar)->Output(),
              HasSubstr(absl::StrCat("refusing the socket directory ", pub, "/sq (owner uid 65534, mode 0777)")));
  struct stat st;
  EXPECT_NE(::lstat((pub + "/sq/sidecar.sock").c_str(), &st), 0) << "a socket was made there";

  // Its own directory, writable by its group: refused too, naming the mode.
  const std::string group_writable = cluster->dir() + "/group-writable";
  ASSERT_EQ(::mkdir(group_writable.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(group_writable.c_str(), 0775), 0);
  auto second = Process::Start({SidecarBinary(), absl::StrCat("--coordinator=", cluster->coordinator_address()),
                                absl::StrCat("--unix_socket=", group_writable, "/sidecar.sock"), "--metrics_address="},
                               {}, cluster->dir() + "/group-writable-sidecar.log");
  ASSERT_TRUE(second.ok());
  code = (*second)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << (*second)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*second)->Output(), HasSubstr("(owner uid 0, mode 0775): it must be owned by this daemon's uid 0"));

  // An absent directory it makes itself, 0755, and serves from.
  const std::string mine = pub + "/mine";
  auto good = Process::Start({SidecarBinary(), absl::StrCat("--coordinator=", cluster->coordinator_address()),
                              absl::StrCat("--unix_socket=", mine, "/sidecar.sock"), "--metrics_address="},
                             {}, cluster->dir() + "/own-dir-sidecar.log");
  ASSERT_TRUE(good.ok());
  EXPECT_TRUE(WaitFor([&] { return RawSession(absl::StrCat("unix:", mine, "/sidecar.sock"), "own-dir").attached(); },
                      absl::Seconds(20), absl::Milliseconds(100)))
      << (*good)->Output();
  ASSERT_EQ(::stat(mine.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 0u);
  EXPECT_EQ(st.st_mode & 07777, 0755u);
}

// A server of uid 65534 on both of the sidecar's socket paths (the gRPC socket and the
// descriptor channel) in a directory it made. It prints what each connection sent.
constexpr char kFakeSidecar[] = R"py(
import os, select, socket, sys
d = sys.argv[1]
grpc = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
grpc.bind(d + "/sidecar.sock")
grpc.listen(8)
fd = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
fd.bind(d + "/sidecar.sock.fd")
fd.listen(8)
for p in ("/sidecar.sock", "/sidecar.sock.fd"):
    os.chmod(d + p, 0o777)
print("listening", flush=True)
while True:
    for l in select.select([grpc, fd], [], [])[0]:
        c, _ = l.accept()
        c.settimeout(5)
        n = 0
        try:
            while True:
                b = c.recv(65536)
                if not b:
                    break
                n += len(b)
        except OSError:
            pass
        print("connection on", "fd" if l is fd else "grpc", "sent", n, "bytes", flush=True)
        c.close()
)py";

TEST(AttackTest, ClientsSendNothingToASocketAnotherUserServes) {
  if (!CanActAsNobody()) GTEST_SKIP() << "needs root and setpriv, to act as uid 65534";
  auto cluster = StartCluster(0);
  ASSERT_NE(cluster, nullptr);
  const std::string pub = SharedTmp(*cluster);
  // A squatted, world-writable directory, and one uid 65534 owns with a safe mode.
  ASSERT_EQ(RunAsNobody(*cluster, {"mkdir", "-m", "0777", pub + "/sq"}, "squat"), 0);
  ASSERT_EQ(RunAsNobody(*cluster, {"mkdir", "-m", "0755", pub + "/theirs"}, "theirs"), 0);
  std::vector<std::unique_ptr<Process>> fakes;
  for (const std::string& d : {pub + "/sq", pub + "/theirs"}) {
    auto fake = Process::Start(AsNobody({"/usr/bin/python3", "-c", kFakeSidecar, d}), {},
                               absl::StrCat(d, ".fake.log"));
    ASSERT_TRUE(fake.ok()) << fake.status();
    ASSERT_TRUE((*fake)->WaitForOutput("listening", absl::Seconds(20))) << (*fake)->Output();
    fakes.push_back(std::move(*fake));
  }
  ASSERT_EQ(::unsetenv("COLLSERVE_SIDECAR_UID"), 0);
  auto squatted = client::CreateChannel(absl::StrCat("unix:", pub, "/sq/sidecar.sock"), {}, {});
  ASSERT_FALSE(squatted.ok());
  EXPECT_EQ(squatted.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(squatted.status().message()),
              HasSubstr(absl::StrCat("its directory ", pub, "/sq (mode 0777, owner uid 65534) is writable by other users")));
  auto theirs = client::CreateChannel(absl::StrCat("unix://", pub, "/theirs/sidecar.sock"), {}, {});
  ASSERT_FALSE(theirs.ok());
  EXPECT_THAT(std::string(theirs.status().message()),
              HasSubstr(absl::StrCat("its directory ", pub, "/theirs is owned by uid 65534, expected uid 0 (root or this process")));
  // The descriptor channel checks the connected peer's uid before it sends the token.
  auto fd = fdchannel::Connect(pub + "/sq/sidecar.sock.fd", std::string(fdchannel::kTokenBytes, 'x'),
                               absl::Now() + absl::Seconds(10));
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(fd.status().message()), HasSubstr("it is served by uid 65534"));
  // A whole rank (the SDK) pointed at the squatted socket fails naming it, and sends nothing.
  auto rank = cluster->StartRank(0, 1, 0, {"--mode=loop", "--iters=1", "--count=4"},
                                 {{"COLLSERVE_SIDECAR", absl::StrCat("unix:", pub, "/sq/sidecar.sock")}});
  ASSERT_TRUE(rank.ok()) << rank.status();
  auto code = (*rank)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << (*rank)->Output();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*rank)->Output(), HasSubstr("is writable by other users"));
  // The fake servers: no gRPC connection at all, and the descriptor channel's got 0 bytes.
  EXPECT_TRUE(fakes[0]->WaitForOutput("connection on fd sent 0 bytes", absl::Seconds(10))) << fakes[0]->Output();
  EXPECT_THAT(fakes[0]->Output(), ::testing::Not(HasSubstr("on grpc")));
  EXPECT_THAT(fakes[1]->Output(), ::testing::Not(HasSubstr("connection")));

  // The expected user can be named: a sidecar running as uid 65534 is then accepted.
  ASSERT_EQ(::setenv("COLLSERVE_SIDECAR_UID", "65534", 1), 0);
  auto named = client::CreateChannel(absl::StrCat("unix:", pub, "/theirs/sidecar.sock"), {}, {});
  ASSERT_EQ(::unsetenv("COLLSERVE_SIDECAR_UID"), 0);
  EXPECT_TRUE(named.ok()) << named.status();
}

}  // namespace
}  // namespace collserve::testing
