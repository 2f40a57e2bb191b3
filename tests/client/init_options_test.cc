// env:// parsing of the SDK (InitOptions::FromEnv), as torch.distributed's env:// reads it,
// and the argument checks InitProcessGroup makes before any RPC.
#include <gtest/gtest.h>

#include <cstdlib>

#include "collserve/client.h"

namespace collserve::client {
namespace {

class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "COLLSERVE_COORDINATOR", "COLLSERVE_SIDECAR",
                          "COLLSERVE_JOB", "COLLSERVE_INIT_TIMEOUT_S", "COLLSERVE_OP_TIMEOUT_S",
                          "COLLSERVE_SHARED_MEMORY", "COLLSERVE_PEER_READS", "COLLSERVE_OPS_CHANNEL",
                          "COLLSERVE_PIPELINED_BROADCAST", "COLLSERVE_MAX_STAGING_BYTES",
                          "COLLSERVE_STAGING_WINDOW_BYTES", "COLLSERVE_TOKEN", "COLLSERVE_TOKEN_FILE", "COLLSERVE_TLS_CA", "COLLSERVE_TLS_CERT", "COLLSERVE_TLS_KEY",
                          "COLLSERVE_TLS_SERVER_NAME", "COLLSERVE_CUDA_PATH", "COLLSERVE_NCCL_RECORDS",
                          "COLLSERVE_KEEPALIVE_TIMEOUT_S"}) {
      unsetenv(v);
    }
  }
};

TEST_F(EnvTest, ReadsTorchVariablesAndOurs) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("MASTER_ADDR", "coord.svc", 1);
  setenv("MASTER_PORT", "29400", 1);
  setenv("COLLSERVE_SIDECAR", "unix:/run/cs.sock", 1);
  setenv("COLLSERVE_JOB", "train-7", 1);
  setenv("COLLSERVE_OP_TIMEOUT_S", "2.5", 1);
  setenv("COLLSERVE_SHARED_MEMORY", "0", 1);
  setenv("COLLSERVE_PEER_READS", "false", 1);
  setenv("COLLSERVE_OPS_CHANNEL", "0", 1);
  auto defaults = InitOptions::FromEnv();
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->keepalive_timeout, absl::Seconds(20));
  setenv("COLLSERVE_KEEPALIVE_TIMEOUT_S", "1.5", 1);
  auto o = InitOptions::FromEnv();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->keepalive_timeout, absl::Milliseconds(1500));
  // The Python SDK and the c10d backend read it too (they take the timeouts from their caller).
  InitOptions tuned;
  ASSERT_TRUE(tuned.ReadTuningFromEnv().ok());
  EXPECT_EQ(tuned.keepalive_timeout, absl::Milliseconds(1500));
  setenv("COLLSERVE_KEEPALIVE_TIMEOUT_S", "0", 1);
  EXPECT_EQ(InitOptions::FromEnv().status().code(), absl::StatusCode::kInvalidArgument);
  setenv("COLLSERVE_KEEPALIVE_TIMEOUT_S", "1.5", 1);
  EXPECT_EQ(o->rank, 3);
  EXPECT_EQ(o->world_size, 8);
  EXPECT_EQ(o->local_rank, 1);
  EXPECT_EQ(o->coordinator_address, "coord.svc:29400");
  EXPECT_EQ(o->sidecar_address, "unix:/run/cs.sock");
  EXPECT_EQ(o->job, "train-7");
  EXPECT_EQ(o->op_timeout, absl::Milliseconds(2500));
  EXPECT_EQ(o->init_timeout, absl::Seconds(300));
  EXPECT_FALSE(o->shared_memory);
  EXPECT_FALSE(o->peer_reads);
  EXPECT_FALSE(o->ops_channel);
}

// Under `collserve launch`, MASTER_PORT is the coordinator's TCPStore endpoint (torch's
// rendezvous); COLLSERVE_COORDINATOR names the gRPC API and wins.
TEST_F(EnvTest, CollserveCoordinatorWinsOverMasterAddrAndPort) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  setenv("COLLSERVE_COORDINATOR", "127.0.0.1:29400", 1);
  auto o = InitOptions::FromEnv();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->coordinator_address, "127.0.0.1:29400");
}

TEST_F(EnvTest, MissingOrMalformedVariablesAreInvalidArgument) {
  EXPECT_EQ(InitOptions::FromEnv().status().code(), absl::StatusCode::kInvalidArgument);
  setenv("RANK", "zero", 1);
  setenv("WORLD_SIZE", "2", 1);
  auto o = InitOptions::FromEnv();
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("RANK=\"zero\""), absl::string_view::npos) << o.status();
  setenv("RANK", "0", 1);
  setenv("COLLSERVE_INIT_TIMEOUT_S", "-1", 1);
  EXPECT_EQ(InitOptions::FromEnv().status().code(), absl::StatusCode::kInvalidArgument);
}

// The bindings (Python SDK, c10d backend) take rank, group and timeouts from their caller
// and the tuning variables from here: set ones replace the caller's values, unset or empty
// ones keep them, and a malformed one changes nothing.
TEST_F(EnvTest, TuningVariablesOverrideOnlyWhenSet) {
  InitOptions o;
  o.max_staging_bytes = 7;
  o.token = "from-caller";
  o.tls.server_name = "caller.svc";
  ASSERT_TRUE(o.ReadTuningFromEnv().ok());
  EXPECT_TRUE(o.shared_memory);
  EXPECT_TRUE(o.peer_reads);
  EXPECT_TRUE(o.ops_channel);
  EXPECT_TRUE(o.pipelined_broadcast);
  EXPECT_EQ(o.max_staging_bytes, 7);
  EXPECT_EQ(o.staging_window_bytes, InitOptions::kDefaultStagingWindowBytes);
  EXPECT_EQ(o.token, "from-caller");
  EXPECT_EQ(o.tls.server_name, "caller.svc");

  setenv("COLLSERVE_SHARED_MEMORY", "false", 1);
  setenv("COLLSERVE_PEER_READS", "0", 1);
  setenv("COLLSERVE_OPS_CHANNEL", "", 1);
  setenv("COLLSERVE_PIPELINED_BROADCAST", "0", 1);
  setenv("COLLSERVE_MAX_STAGING_BYTES", "0", 1);
  setenv("COLLSERVE_STAGING_WINDOW_BYTES", "4096", 1);
  setenv("COLLSERVE_TOKEN", " t0k ", 1);
  ASSERT_TRUE(o.ReadTuningFromEnv().ok());
  EXPECT_FALSE(o.shared_memory);
  EXPECT_FALSE(o.peer_reads);
  EXPECT_TRUE(o.ops_channel);
  EXPECT_FALSE(o.pipelined_broadcast);
  EXPECT_EQ(o.max_staging_bytes, 0);
  EXPECT_EQ(o.staging_window_bytes, 4096);
  EXPECT_EQ(o.token, "t0k");
  EXPECT_EQ(o.tls.server_name, "caller.svc");

  // Where CUDA tensors go: through the sidecar unless COLLSERVE_CUDA_PATH=nccl (one GPU per rank).
  absl::Status s;
  EXPECT_EQ(o.cuda_path, InitOptions::CudaPath::kSidecar);
  setenv("COLLSERVE_CUDA_PATH", "nccl", 1);
  ASSERT_TRUE(o.ReadTuningFromEnv().ok());
  EXPECT_EQ(o.cuda_path, InitOptions::CudaPath::kNccl);
  setenv("COLLSERVE_CUDA_PATH", "gpu", 1);
  s = o.ReadTuningFromEnv();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("COLLSERVE_CUDA_PATH=gpu: must be \"sidecar\" or \"nccl\""), absl::string_view::npos) << s;
  EXPECT_EQ(o.cuda_path, InitOptions::CudaPath::kNccl);  // unchanged on error
  setenv("COLLSERVE_CUDA_PATH", "sidecar", 1);
  ASSERT_TRUE(o.ReadTuningFromEnv().ok());
  EXPECT_EQ(o.cuda_path, InitOptions::CudaPath::kSidecar);
  // The records of NCCL-in-the-rank collectives: on unless COLLSERVE_NCCL_RECORDS=0.
  EXPECT_TRUE(o.nccl_records);
  setenv("COLLSERVE_NCCL_RECORDS", "0", 1);
  ASSERT_TRUE(o.ReadTuningFromEnv().ok());
  EXPECT_FALSE(o.nccl_records);

  setenv("COLLSERVE_SHARED_MEMORY", "1", 1);
  setenv("COLLSERVE_STAGING_WINDOW_BYTES", "-1", 1);
  s = o.ReadTuningFromEnv();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("COLLSERVE_STAGING_WINDOW_BYTES"), absl::string_view::npos) << s;
  EXPECT_FALSE(o.shared_memory);  // unchanged on error
  EXPECT_EQ(o.staging_window_bytes, 4096);
}

TEST_F(EnvTest, InitProcessGroupChecksArgumentsFirst) {
  InitOptions o;
  o.world_size = 0;
  o.rank = 0;
  EXPECT_EQ(InitProcessGroup(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.world_size = 2;
  o.rank = 2;
  EXPECT_EQ(InitProcessGroup(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.rank = 0;
  o.group = "";
  EXPECT_EQ(InitProcessGroup(o).status().code(), absl::StatusCode::kInvalidArgument);
  // Nobody listens there: UNAVAILABLE, not a hang.
  o.group = "world";
  o.sidecar_address = "unix:/nonexistent/collserve.sock";
  o.init_timeout = absl::Seconds(1);
  EXPECT_EQ(InitProcessGroup(o).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace collserve::client
