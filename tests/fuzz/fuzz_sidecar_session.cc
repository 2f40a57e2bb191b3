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
#include "tests/fuzz/sidecar_target.h"

namespace {

namespace pb = ::collserve::v1;

using collserve_fuzz::DefaultAttach;
using collserve_fuzz::Get;

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
  const std::vector<std::string> messages = collserve_fuzz::SplitInput(data, size);
  RunSession(messages, absl::StrCat("fuzz", n % 8), absl::Milliseconds(200));
  // Still serving: a fresh session attaches (to a group of its own: re-attaching to a group
  // just left may race with the leave at the coordinator).
  if (n % 32 == 0 && !RunSession({}, absl::StrCat("health", n), absl::Seconds(10))) {
    std::fprintf(stderr, "the sidecar no longer attaches a session\n");
    abort();
  }
  return 0;
}
