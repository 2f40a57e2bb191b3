// The SDK's write watch (client/session_process_group.cc: WatchedWrite, WriteWatchLoop): a
// sidecar that is alive but reads nothing more of a session (here a stand-in that answers the
// attach and then never reads) left the rank's call blocked in the stream's write for good,
// whatever its op timeout; now the write is given up after the op timeout and the session
// ends with DEADLINE_EXCEEDED naming it. (A stopped sidecar, whose socket fills, is
// ErrorsTest.ACallWritingToAStoppedSidecarFailsInsteadOfBlocking: the keepalive's part.)
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "collserve/client.h"
#include "collserve/v1/collectives.grpc.pb.h"

namespace collserve::client {
namespace {

namespace pb = ::collserve::v1;
using ::testing::HasSubstr;

// A session that answers the attach (one rank, one host, no shared memory) and then reads
// no request: what the client writes stays in HTTP/2 flow control.
class StallingSession : public grpc::ServerBidiReactor<pb::SessionRequest, pb::SessionResponse> {
 public:
  StallingSession() { StartRead(&request_); }
  void OnReadDone(bool ok) override {
    if (!ok || !request_.has_attach()) {
      FinishOnce(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "test: expected attach"));
      return;
    }
    pb::Attached* a = response_.mutable_attached();
    a->set_generation(1);
    a->set_shared_memory(false);
    a->set_num_hosts(1);
    a->set_local_world_size(1);
    a->set_host_id("stalling");
    StartWrite(&response_);  // and no StartRead: the session's requests are never read
  }
  void OnWriteDone(bool) override {}
  void OnCancel() override { FinishOnce(grpc::Status::CANCELLED); }
  void OnDone() override { delete this; }

 private:
  void FinishOnce(const grpc::Status& s) {
    if (!finished_.exchange(true)) Finish(s);
  }
  pb::SessionRequest request_;
  pb::SessionResponse response_;
  std::atomic<bool> finished_{false};
};

class StallingSidecar final : public pb::Collectives::CallbackService {
  grpc::ServerBidiReactor<pb::SessionRequest, pb::SessionResponse>* Session(grpc::CallbackServerContext*) override {
    return new StallingSession();
  }
};

TEST(SessionWriteWatchTest, AWriteTheSidecarDoesNotTakeEndsTheSessionAfterTheOpTimeout) {
  StallingSidecar service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  InitOptions options;
  options.sidecar_address = "127.0.0.1:" + std::to_string(port);
  options.group = "stalled";
  options.rank = 0;
  options.world_size = 1;
  options.shared_memory = false;  // the tensor goes inline: far more than the stream's window
  options.init_timeout = absl::Seconds(10);
  options.op_timeout = absl::Seconds(1);
  auto pg = InitProcessGroup(options);
  ASSERT_TRUE(pg.ok()) << pg.status();

  std::vector<float> data(size_t{16} << 20, 1.0f);  // 64 MiB
  const absl::Time start = absl::Now();
  absl::Status s = (*pg)->AllReduce(data.data(), static_cast<int64_t>(data.size()), DataType::kFloat32,
                                    ReduceOp::kSum)->Wait();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("could not be written to it within the op timeout (1s)"));
  EXPECT_GE(took, absl::Seconds(1));
  EXPECT_LT(took, absl::Seconds(20));
  // The session is over: the next call fails at once, naming why.
  absl::Status next = (*pg)->AllReduce(data.data(), 4, DataType::kFloat32, ReduceOp::kSum)->Wait();
  EXPECT_FALSE(next.ok());
  pg->reset();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

}  // namespace
}  // namespace collserve::client
