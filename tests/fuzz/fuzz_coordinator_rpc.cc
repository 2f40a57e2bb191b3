// Fuzz target: every RPC of the coordinator (Store and Registry) fed raw request bytes over
// a real loopback connection to an in-process coordinator (server/coordinator), as any
// client that can reach its port could send them. The first input byte picks the method;
// the rest is the request message, sent as is (not re-encoded). Each call has a 20 ms
// deadline; the coordinator must answer or be cancelled, never crash, and must still serve
// a plain Set afterwards.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/coordinator/coordinator.h"

namespace {

constexpr const char* kMethods[] = {
    "/collserve.v1.Store/Set",       "/collserve.v1.Store/Get",      "/collserve.v1.Store/Add",
    "/collserve.v1.Store/CompareSet", "/collserve.v1.Store/Check",   "/collserve.v1.Store/Wait",
    "/collserve.v1.Store/DeleteKey", "/collserve.v1.Store/NumKeys",  "/collserve.v1.Store/MultiGet",
    "/collserve.v1.Store/MultiSet",  "/collserve.v1.Store/Append",   "/collserve.v1.Registry/Join",
    "/collserve.v1.Registry/Leave",  "/collserve.v1.Registry/Describe", "/collserve.v1.Registry/List",
    "/collserve.v1.Registry/ReportProgress", "/collserve.v1.Registry/DiagnoseGroup",
    "/collserve.v1.Auth/Authenticate", "/collserve.v1.Auth/MintJobToken", "/collserve.v1.Auth/RevokeJobTokens",
    "/collserve.v1.Registry/DumpGroup", "/collserve.v1.Store/ListKeys", "/collserve.v1.Info/GetInfo",
    "/collserve.v1.Registry/ListJobs", "/collserve.v1.Registry/WatchGroup", "/collserve.v1.Registry/DeleteGroup",
};

struct Target {
  std::unique_ptr<collserve::server::Coordinator> coordinator;
  std::unique_ptr<grpc::GenericStub> stub;
};

// The servers stop before the process exits: their threads must not outlive the globals
// (gRPC's, protobuf's, glog's) that exit() destroys. Registered after those are built, so it
// runs before their destructors.
void StopTarget();

Target& Get() {
  static Target* t = [] {
    auto* target = new Target;
    collserve::server::CoordinatorOptions options;
    options.listen_address = "127.0.0.1:0";
    options.registry.max_world_size = 64;
    options.registry.max_groups = 256;
    options.store.max_job_bytes = 16 << 20;
    options.store.max_total_bytes = 64 << 20;
    options.store.max_value_bytes = 1 << 20;
    options.rpc_memory_bytes = 64 << 20;
    options.credentials.allow_unauthenticated = true;  // the RPCs' semantics; tokens: tests/security
    auto started = collserve::server::Coordinator::Start(options);
    if (!started.ok()) abort();
    target->coordinator = std::move(*started);
    target->stub = std::make_unique<grpc::GenericStub>(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", target->coordinator->port()), grpc::InsecureChannelCredentials()));
    return target;
  }();
  static const bool stop_registered = std::atexit(StopTarget) == 0;
  (void)stop_registered;
  return *t;
}

void StopTarget() {
  Target* t = &Get();
  t->stub.reset();
  t->coordinator->Shutdown(absl::Seconds(5));
  delete t;
}

grpc::Status Call(const std::string& method, const std::string& bytes, absl::Duration deadline) {
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  grpc::CompletionQueue cq;
  grpc::ByteBuffer response;
  grpc::Status status;
  auto call = Get().stub->PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const char* method = kMethods[data[0] % (sizeof(kMethods) / sizeof(kMethods[0]))];
  // Short: requests that wait (Get, Wait, Join) are cancelled by the deadline.
  Call(method, std::string(reinterpret_cast<const char*>(data + 1), size - 1), absl::Milliseconds(20));
  // Still serving: a well-formed Set (job "fuzz", key "k", value "v").
  static int calls = 0;
  if (++calls % 64 == 0) {
    static const char kSet[] = "\x0a\x04" "fuzz" "\x12\x01k" "\x1a\x01v";
    const std::string set(kSet, sizeof(kSet) - 1);
    const grpc::Status s = Call("/collserve.v1.Store/Set", set, absl::Seconds(10));
    if (!s.ok() && s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
      std::fprintf(stderr, "the coordinator no longer serves a plain Set: %d %s\n", s.error_code(),
                   s.error_message().c_str());
      abort();
    }
  }
  return 0;
}
