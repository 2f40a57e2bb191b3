// Health and reflection of the daemons as processes (issue 16): a sidecar's readiness follows
// its coordinator (NOT_SERVING while the coordinator is down, SERVING again when it is back)
// while its liveness stays SERVING and it keeps running; a sidecar started before its
// coordinator serves NOT_SERVING instead of exiting; both daemons answer gRPC server
// reflection (what grpc_cli and grpcurl use). Raw bytes over a generic stub, no generated
// health or reflection code.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "tests/testing/process.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// grpc.health.v1.Health/Check of `service` at `address`: "SERVING", "NOT_SERVING", or the
// RPC's error ("error <code>: ...").
std::string Health(const std::string& address, const std::string& service) {
  return client::CheckHealth(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), service,
                             absl::Seconds(3));
}

// Waits up to `timeout` for Health(address, service) == want; returns the last answer.
std::string AwaitHealth(const std::string& address, const std::string& service, const std::string& want,
                        absl::Duration timeout) {
  std::string got;
  WaitFor([&] { return (got = Health(address, service)) == want; }, timeout, absl::Milliseconds(200));
  return got;
}

// The service names listed by grpc.reflection.v1alpha.ServerReflection (list_services),
// as the raw response bytes.
std::string ReflectionServices(const std::string& address) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::CompletionQueue cq;
  int tag = 0;
  void* got;
  bool ok = false;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(&tag);
  std::string out;
  if (cq.Next(&got, &ok) && ok) {
    const std::string request("\x3a\x00", 2);  // ServerReflectionRequest{list_services: ""}
    grpc::Slice slice(request);
    grpc::ByteBuffer req(&slice, 1);
    call->Write(req, &tag);
    if (cq.Next(&got, &ok) && ok) {
      grpc::ByteBuffer resp;
      call->Read(&resp, &tag);
      if (cq.Next(&got, &ok) && ok) out = Bytes(resp);
    }
  }
  ctx.TryCancel();
  grpc::Status status;
  call->Finish(&status, &tag);
  cq.Shutdown();
  while (cq.Next(&got, &ok)) {
  }
  return out;
}

TEST(HealthTest, SidecarReadinessFollowsItsCoordinator) {
  auto started = Cluster::Start(1);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& c = **started;
  const std::string sidecar = c.sidecar_tcp_address(0);
  EXPECT_EQ(AwaitHealth(sidecar, "", "SERVING", absl::Seconds(10)), "SERVING");
  EXPECT_EQ(Health(sidecar, "collserve.v1.Collectives"), "SERVING");
  EXPECT_EQ(Health(sidecar, "liveness"), "SERVING");
  EXPECT_EQ(Health(c.coordinator_address(), "liveness"), "SERVING");
  c.coordinator().Kill(SIGKILL);
  ASSERT_TRUE(c.coordinator().Wait(absl::Seconds(10)).ok());
  EXPECT_EQ(AwaitHealth(sidecar, "", "NOT_SERVING", absl::Seconds(10)), "NOT_SERVING");
  EXPECT_EQ(Health(sidecar, "collserve.v1.Collectives"), "NOT_SERVING");
  EXPECT_EQ(Health(sidecar, "liveness"), "SERVING") << "liveness must not follow the coordinator";
  ASSERT_TRUE(c.RestartCoordinator({}).ok());
  EXPECT_EQ(AwaitHealth(sidecar, "", "SERVING", absl::Seconds(15)), "SERVING") << c.Logs();
  EXPECT_EQ(c.sidecar(0).Wait(absl::ZeroDuration()).status().code(), absl::StatusCode::kDeadlineExceeded)
      << "the sidecar exited: " << c.Logs();
}

TEST(HealthTest, SidecarStartedBeforeItsCoordinatorWaitsNotReady) {
  auto started = Cluster::Start(0);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& c = **started;
  c.coordinator().Kill(SIGKILL);  // its port is now free: the sidecar points at nothing
  ASSERT_TRUE(c.coordinator().Wait(absl::Seconds(10)).ok());
  const std::string port_file = c.dir() + "/early.port";
  auto sidecar = Process::Start({SidecarBinary(), "--coordinator=" + c.coordinator_address(),
                                 "--unix_socket=" + c.dir() + "/early.sock", "--listen_address=127.0.0.1:0",
                                 "--port_file=" + port_file, "--metrics_address=", "--log_level=warning",
                                 "--coordinator_connect_timeout=1s"},
                                {}, c.dir() + "/early.log");
  ASSERT_TRUE(sidecar.ok());
  absl::StatusOr<int> port = ReadPortFile(port_file, **sidecar, absl::Seconds(10));
  ASSERT_TRUE(port.ok()) << "the sidecar did not serve without its coordinator: " << (*sidecar)->Output();
  const std::string address = absl::StrCat("127.0.0.1:", *port);
  EXPECT_EQ(Health(address, ""), "NOT_SERVING");
  EXPECT_EQ(Health(address, "liveness"), "SERVING");
  ASSERT_TRUE(c.RestartCoordinator({}).ok());
  EXPECT_EQ(AwaitHealth(address, "", "SERVING", absl::Seconds(15)), "SERVING") << (*sidecar)->Output();
}

TEST(HealthTest, BothDaemonsAnswerServerReflection) {
  auto started = Cluster::Start(1);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& c = **started;
  const std::string coordinator = ReflectionServices(c.coordinator_address());
  EXPECT_NE(coordinator.find("collserve.v1.Store"), std::string::npos) << coordinator;
  EXPECT_NE(coordinator.find("collserve.v1.Registry"), std::string::npos) << coordinator;
  EXPECT_NE(coordinator.find("grpc.health.v1.Health"), std::string::npos) << coordinator;
  const std::string sidecar = ReflectionServices(c.sidecar_tcp_address(0));
  EXPECT_NE(sidecar.find("collserve.v1.Collectives"), std::string::npos) << sidecar;
}

}  // namespace
}  // namespace collserve::testing
