// The coordinator binary: clean SIGTERM shutdown, and an acknowledged store write
// survives a restart when --data_dir is set.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "collserve/client.h"
#include "tests/testing/process.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

std::unique_ptr<client::StoreClient> Connect(Cluster& c, const std::string& job) {
  client::StoreClientOptions o;
  o.job = job;
  o.token = c.admin_token();  // every job's
  o.connect_timeout = absl::Seconds(10);
  auto s = client::StoreClient::Connect(c.coordinator_address(), o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(CoordinatorProcessTest, StoreSurvivesRestartWithDataDir) {
  auto started = Cluster::Start(0);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& c = **started;
  const std::string data = absl::StrCat("--data_dir=", c.dir(), "/data");
  ASSERT_TRUE(c.RestartCoordinator({data}).ok());
  {
    auto store = Connect(c, "train");
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->Set("addr/0", std::string("10.0.0.1\0:29500", 16)).ok());
    ASSERT_TRUE(store->Add("epoch", 3).ok());
    ASSERT_TRUE(store->Append("log", "a").ok());
    ASSERT_TRUE(store->Append("log", "b").ok());
    ASSERT_TRUE(store->Set("gone", "x").ok());
    ASSERT_TRUE(store->DeleteKey("gone").ok());
  }
  ASSERT_TRUE(c.RestartCoordinator({data}).ok());
  auto store = Connect(c, "train");
  ASSERT_NE(store, nullptr);
  auto v = store->Get("addr/0", absl::Seconds(1));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("10.0.0.1\0:29500", 16));
  EXPECT_EQ(*store->Add("epoch", 1), 4);
  EXPECT_EQ(*store->Get("log", absl::Seconds(1)), "ab");
  EXPECT_EQ(store->Get("gone", absl::Milliseconds(100)).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(*store->NumKeys(), 3);
}

TEST(CoordinatorProcessTest, WithoutDataDirTheStoreIsMemoryOnly) {
  auto started = Cluster::Start(0);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& c = **started;
  ASSERT_TRUE(Connect(c, "j")->Set("k", "v").ok());
  ASSERT_TRUE(c.RestartCoordinator({}).ok());
  EXPECT_EQ(*Connect(c, "j")->NumKeys(), 0);
}

TEST(CoordinatorProcessTest, SigtermShutsDownCleanlyWithWaitersParked) {
  const int metrics_port = UnusedPort();
  ASSERT_NE(metrics_port, 0);
  auto started = Cluster::Start(1, {absl::StrCat("--metrics_address=127.0.0.1:", metrics_port)});
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& c = **started;
  auto store = Connect(c, "j");
  std::thread waiter([&] {
    // Parked when the coordinator goes away: it must exit all the same, and the Get end
    // with an error (the client retries a restarting coordinator until the Get's timeout).
    auto r = store->Get("never", absl::Seconds(5));
    EXPECT_FALSE(r.ok());
  });
  EXPECT_TRUE(WaitFor([&] { return MetricValue(metrics_port, "collserve_store_pending_waits") >= 1; },
                      absl::Seconds(5)))
      << "the Get never parked";
  c.coordinator().Kill(SIGTERM);
  auto code = c.coordinator().Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << "coordinator did not exit on SIGTERM";
  EXPECT_EQ(*code, 0) << c.coordinator().Output();
  waiter.join();
  c.sidecar(0).Kill(SIGTERM);
  auto sc = c.sidecar(0).Wait(absl::Seconds(10));
  ASSERT_TRUE(sc.ok()) << "sidecar did not exit on SIGTERM";
  EXPECT_EQ(*sc, 0) << c.sidecar(0).Output();
}

TEST(SidecarProcessTest, UnixSocketModeFlagSetsPermissions) {
  auto started = Cluster::Start(0);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& c = **started;
  const std::string sock = c.dir() + "/open.sock";
  auto sidecar = Process::Start({SidecarBinary(), "--coordinator=" + c.coordinator_address(), "--unix_socket=" + sock,
                                 "--unix_socket_mode=0666", "--metrics_address=", "--port_file=" + c.dir() + "/open.port"},
                                {}, c.dir() + "/open.log");
  ASSERT_TRUE(sidecar.ok());
  struct stat st;
  WaitFor([&] { return stat((c.dir() + "/open.port").c_str(), &st) == 0; }, absl::Seconds(20));
  ASSERT_EQ(stat(sock.c_str(), &st), 0) << (*sidecar)->Output();
  EXPECT_EQ(st.st_mode & 0777, 0666u);
  auto bad = Process::Start({SidecarBinary(), "--unix_socket_mode=999"}, {}, c.dir() + "/bad.log");
  ASSERT_TRUE(bad.ok());
  auto code = (*bad)->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 2);
}

}  // namespace
}  // namespace collserve::testing
