// Fuzz target: a sidecar's Session stream (collserve.v1.Collectives/Session) fed raw
// SessionRequest messages, as any local process that can reach its unix socket (or a
// remote one, its TCP port) could send them. An in-process coordinator and sidecar serve
// the target. The input is a sequence of messages, each a 2-byte little-endian length and
// that many bytes; the first is sent as is when it parses as an Attach, otherwise a valid
// Attach to a world_size-1 group goes first so that the later messages reach the engine.
// The answers are read (an Attached and one completion per request) until the sidecar ends
// the stream or 200 ms pass; the sidecar must never crash and must still attach a fresh
// session afterwards.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collserve/v1/collectives.grpc.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/sidecar/sidecar.h"

namespace {

namespace pb = ::collserve::v1;

struct Target {
  std::unique_ptr<collserve::server::Coordinator> coordinator;
  std::unique_ptr<collserve::server::Sidecar> sidecar;
  std::string address;
};

// The servers stop before the process exits: their threads must not outlive the globals
// (gRPC's, protobuf's, glog's) that exit() destroys. Registered after those are built, so it
// runs before their destructors.
void StopTarget();

Target& Get() {
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
    return target;
  }();
  static const bool stop_registered = std::atexit(StopTarget) == 0;
  (void)stop_registered;
  return *t;
}

void StopTarget() {
  Target* t = &Get();
  t->sidecar->Shutdown(absl::Seconds(5));
  t->coordinator->Shutdown(absl::Seconds(5));
  delete t;
}

pb::SessionRequest DefaultAttach(const std::string& group) {
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

// One async step on `cq`: waits for `tag`'s completion. False if the operation failed.
bool Await(grpc::CompletionQueue& cq, void* tag) {
  void* got = nullptr;
  bool ok = false;
  if (!cq.Next(&got, &ok)) return false;
  return got == tag && ok;
}

// Runs one session: writes `messages` as raw bytes (first a valid Attach unless the first
// one is an Attach), reads until the end or the deadline. Returns whether the sidecar
// answered with Attached.
bool RunSession(const std::vector<std::string>& messages, const std::string& group, absl::Duration deadline) {
  grpc::GenericStub stub(grpc::CreateChannel(Get().address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  // Long enough for an attach and the requests' answers; a session that waits for ranks
  // that never come (a world_size over 1) is cancelled.
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/collserve.v1.Collectives/Session", &cq);
  int tag = 0;
  call->StartCall(&tag);
  bool alive = Await(cq, &tag);
  int expected = 0;  // answers to wait for: Attached, then one per collective
  auto write = [&](const std::string& bytes) {
    if (!alive) return;
    pb::SessionRequest req;
    if (req.ParseFromString(bytes)) expected += req.has_attach() || req.has_collective() ? 1 : 0;
    grpc::Slice slice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, &tag);
    alive = Await(cq, &tag);
  };
  pb::SessionRequest parsed;
  if (messages.empty() || !parsed.ParseFromString(messages[0]) || !parsed.has_attach()) {
    write(DefaultAttach(group).SerializeAsString());
  }
  for (const std::string& m : messages) write(m);
  // Read the answers (not half-closing first: the sidecar ends a session whose client
  // stops writing, and would not answer).
  bool attached = false;
  for (int got = 0; alive && got < expected; ++got) {
    grpc::ByteBuffer buffer;
    call->Read(&buffer, &tag);
    if (!Await(cq, &tag)) break;
    std::vector<grpc::Slice> slices;
    buffer.Dump(&slices);
    std::string bytes;
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    pb::SessionResponse resp;
    if (resp.ParseFromString(bytes) && resp.has_attached()) attached = true;
  }
  ctx.TryCancel();
  grpc::Status status;
  call->Finish(&status, &tag);
  cq.Shutdown();
  void* ignored_tag;
  bool ignored_ok;
  while (cq.Next(&ignored_tag, &ignored_ok)) {
  }
  return attached;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static int n = 0;
  ++n;
  std::vector<std::string> messages;
  for (size_t pos = 0; pos + 2 <= size && messages.size() < 64;) {
    const size_t len = data[pos] | (static_cast<size_t>(data[pos + 1]) << 8);
    pos += 2;
    const size_t take = std::min(len, size - pos);
    messages.emplace_back(reinterpret_cast<const char*>(data + pos), take);
    pos += take;
  }
  RunSession(messages, absl::StrCat("fuzz", n % 8), absl::Milliseconds(200));
  // Still serving: a fresh session attaches (to a group of its own: re-attaching to a group
  // just left may race with the leave at the coordinator).
  if (n % 32 == 0 && !RunSession({}, absl::StrCat("health", n), absl::Seconds(10))) {
    std::fprintf(stderr, "the sidecar no longer attaches a session\n");
    abort();
  }
  return 0;
}
