// InitOptions from the environment (env:// as torch.distributed reads it, plus collserve's
// own COLLSERVE_* variables; docs/guide.md lists them): parsing only, no I/O besides
// getenv and the token file JobTokenFromEnv reads.
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "collserve/client.h"

namespace collserve::client {
namespace {

absl::StatusOr<int> EnvInt(const char* name, bool required, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    if (required) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable ", name,
                                                     " is not set (env:// initialization needs it)"));
    }
    return fallback;
  }
  int out;
  if (!absl::SimpleAtoi(v, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=\"", v, "\" is not an integer"));
  }
  return out;
}

absl::StatusOr<absl::Duration> EnvSeconds(const char* name, absl::Duration fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  double s;
  if (!absl::SimpleAtod(v, &s) || !(s > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=\"", v, "\" is not a positive number of seconds"));
  }
  return absl::Seconds(s);
}

// The non-negative byte count in environment variable `name`; `fallback` when unset or empty.
absl::StatusOr<int64_t> BytesFromEnv(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  int64_t bytes;
  if (!absl::SimpleAtoi(v, &bytes) || bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=\"", v, "\" is not a non-negative number of bytes"));
  }
  return bytes;
}

// Switch `name`: "0" or "false" = off, any other value = on, unset or empty = `fallback`.
bool SwitchFromEnv(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return !(absl::string_view(v) == "0" || absl::string_view(v) == "false");
}

}  // namespace

absl::StatusOr<InitOptions> InitOptions::FromEnv() {
  InitOptions o;
  auto rank = EnvInt("RANK", true, -1);
  if (!rank.ok()) return rank.status();
  auto world = EnvInt("WORLD_SIZE", true, -1);
  if (!world.ok()) return world.status();
  auto local = EnvInt("LOCAL_RANK", false, -1);
  if (!local.ok()) return local.status();
  o.rank = *rank;
  o.world_size = *world;
  o.local_rank = *local;
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  if (const char* c = std::getenv("COLLSERVE_COORDINATOR"); c != nullptr && *c != '\0') {
    o.coordinator_address = c;
  } else if (addr != nullptr && *addr != '\0' && port != nullptr && *port != '\0') {
    o.coordinator_address = absl::StrCat(addr, ":", port);
  }
  if (const char* s = std::getenv("COLLSERVE_SIDECAR"); s != nullptr && *s != '\0') {
    o.sidecar_address = s;
  }
  if (const char* j = std::getenv("COLLSERVE_JOB"); j != nullptr && *j != '\0') o.job = j;
  auto it = EnvSeconds("COLLSERVE_INIT_TIMEOUT_S", o.init_timeout);
  if (!it.ok()) return it.status();
  o.init_timeout = *it;
  auto ot = EnvSeconds("COLLSERVE_OP_TIMEOUT_S", o.op_timeout);
  if (!ot.ok()) return ot.status();
  o.op_timeout = *ot;
  if (absl::Status s = o.ReadTuningFromEnv(); !s.ok()) return s;
  return o;
}


absl::Status InitOptions::ReadTuningFromEnv() {
  absl::StatusOr<int64_t> staging = BytesFromEnv("COLLSERVE_MAX_STAGING_BYTES", max_staging_bytes);
  if (!staging.ok()) return staging.status();
  absl::StatusOr<int64_t> window = BytesFromEnv("COLLSERVE_STAGING_WINDOW_BYTES", staging_window_bytes);
  if (!window.ok()) return window.status();
  absl::StatusOr<absl::Duration> keepalive = EnvSeconds("COLLSERVE_KEEPALIVE_TIMEOUT_S", keepalive_timeout);
  if (!keepalive.ok()) return keepalive.status();
  absl::StatusOr<TlsOptions> tls_env = TlsOptions::FromEnv();
  if (!tls_env.ok()) return tls_env.status();
  absl::StatusOr<std::string> token_env = JobTokenFromEnv();
  if (!token_env.ok()) return token_env.status();
  CudaPath cuda_path_env = cuda_path;
  if (const char* c = std::getenv("COLLSERVE_CUDA_PATH"); c != nullptr && *c != '\0') {
    const std::string path = c;
    if (path == "nccl") {
      cuda_path_env = CudaPath::kNccl;
    } else if (path == "sidecar") {
      cuda_path_env = CudaPath::kSidecar;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("COLLSERVE_CUDA_PATH=", path, ": must be \"sidecar\" or \"nccl\" (docs/gpu.md)"));
    }
  }
  cuda_path = cuda_path_env;
  if (const char* b = std::getenv("COLLSERVE_BACKEND"); b != nullptr && *b != '\0') backend = b;
  shared_memory = SwitchFromEnv("COLLSERVE_SHARED_MEMORY", shared_memory);
  peer_reads = SwitchFromEnv("COLLSERVE_PEER_READS", peer_reads);
  ops_channel = SwitchFromEnv("COLLSERVE_OPS_CHANNEL", ops_channel);
  nccl_records = SwitchFromEnv("COLLSERVE_NCCL_RECORDS", nccl_records);
  pipelined_broadcast = SwitchFromEnv("COLLSERVE_PIPELINED_BROADCAST", pipelined_broadcast);
  max_staging_bytes = *staging;
  staging_window_bytes = *window;
  keepalive_timeout = *keepalive;
  if (!tls_env->ca_file.empty() || !tls_env->cert_file.empty() || !tls_env->key_file.empty() ||
      !tls_env->server_name.empty()) {
    tls = std::move(*tls_env);
  }
  if (!token_env->empty()) token = std::move(*token_env);
  return absl::OkStatus();
}

}  // namespace collserve::client
