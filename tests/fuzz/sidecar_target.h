// The fuzz targets' in-process servers for the sidecar's session surface: a coordinator
// and a sidecar on a unix socket in a temporary directory, started on first use and
// stopped before the process exits. One per fuzz binary (function-local statics).
#ifndef COLLSERVE_TESTS_FUZZ_SIDECAR_TARGET_H_
#define COLLSERVE_TESTS_FUZZ_SIDECAR_TARGET_H_

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/sidecar/sidecar.h"

namespace collserve_fuzz {

namespace pb = ::collserve::v1;

struct Target {
  std::unique_ptr<collserve::server::Coordinator> coordinator;
  std::unique_ptr<collserve::server::Sidecar> sidecar;
  std::string address;
  std::string dir;  // the sidecar's socket directory (mkdtemp), removed by StopTarget
};

// The servers stop before the process exits: their threads must not outlive the globals
// (gRPC's, protobuf's, glog's) that exit() destroys. Registered after those are built, so it
// runs before their destructors.
inline void StopTarget();

inline Target& Get() {
  static Target* t = [] {
    auto* target = new Target;
    collserve::server::CoordinatorOptions co;
    co.listen_address = "127.0.0.1:0";
    co.registry.max_world_size = 64;
    co.registry.max_groups = 1024;
    co.credentials.allow_unauthenticated = true;  // the session's semantics; tokens: tests/security
    auto coordinator = collserve::server::Coordinator::Start(co);
    if (!coordinator.ok()) abort();
    target->coordinator = std::move(*coordinator);
    std::string dir = "/tmp/collserve-fuzz-sidecar.XXXXXX";
    if (mkdtemp(dir.data()) == nullptr) abort();
    collserve::server::SidecarOptions so;
    so.coordinator_address = absl::StrCat("127.0.0.1:", target->coordinator->port());
    so.unix_socket = dir + "/sidecar.sock";
    so.metrics_address = "";
    so.data_threads = 1;
    auto sidecar = collserve::server::Sidecar::Start(so);
    if (!sidecar.ok()) {
      std::fprintf(stderr, "sidecar: %s\n", sidecar.status().ToString().c_str());
      abort();
    }
    target->sidecar = std::move(*sidecar);
    target->address = "unix:" + so.unix_socket;
    target->dir = dir;
    return target;
  }();
  static const bool stop_registered = std::atexit(StopTarget) == 0;
  (void)stop_registered;
  return *t;
}

inline void StopTarget() {
  Target* t = &Get();
  t->sidecar->Shutdown(absl::Seconds(5));
  t->coordinator->Shutdown(absl::Seconds(5));
  std::error_code ignored;
  std::filesystem::remove_all(t->dir, ignored);
  delete t;
}

inline pb::SessionRequest DefaultAttach(const std::string& group) {
  pb::SessionRequest req;
  pb::Attach* a = req.mutable_attach();
  a->set_group(group);
  a->set_rank(0);
  a->set_world_size(1);
  a->set_init_timeout_ms(2000);
  a->set_op_timeout_ms(1000);
  a->set_shared_memory(true);
  return req;
}

// A fuzz input as a list of messages: each a 2-byte little-endian length and that many
// bytes (the last one cut short if the input ends first), at most 64 of them.
inline std::vector<std::string> SplitInput(const uint8_t* data, size_t size) {
  std::vector<std::string> messages;
  for (size_t pos = 0; pos + 2 <= size && messages.size() < 64;) {
    const size_t len = data[pos] | (static_cast<size_t>(data[pos + 1]) << 8);
    pos += 2;
    const size_t take = std::min(len, size - pos);
    messages.emplace_back(reinterpret_cast<const char*>(data + pos), take);
    pos += take;
  }
  return messages;
}

}  // namespace collserve_fuzz

#endif  // COLLSERVE_TESTS_FUZZ_SIDECAR_TARGET_H_
