// Fuzz target: a session's ops channel (common/ops_channel.h), the SOCK_SEQPACKET
// connection over which a local client sends its collective requests once it switched its
// descriptor channel to ops mode. Any local process holding a session's token can send
// these bytes. An in-process coordinator and sidecar serve the target (sidecar_target.h).
// Each input attaches a world_size-1 session with shared memory over the gRPC stream,
// opens its ops channel, and sends the input as raw datagrams (each a 2-byte little-endian
// length and that many bytes, fragment header included, so the fuzzer reaches the
// reassembly and the SessionRequest parser); the answers are read until the sidecar closes
// the channel or 200 ms pass. The sidecar must never crash and must still attach a fresh
// session afterwards.
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/fd_channel.h"
#include "common/ops_channel.h"
#include "tests/fuzz/sidecar_target.h"

namespace {

namespace pb = ::collserve::v1;
namespace fdchannel = ::collserve::fdchannel;
namespace opschannel = ::collserve::opschannel;

// Attaches a session to `group`, opens its ops channel and sends `datagrams` on it, then
// reads until the channel closes or `wait` passes. Returns whether the ops channel opened.
bool RunSession(const std::vector<std::string>& datagrams, const std::string& group, absl::Duration wait) {
  auto stub = pb::Collectives::NewStub(grpc::CreateChannel(collserve_fuzz::Get().address,
                                                           grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + wait + absl::Seconds(10)));
  auto stream = stub->Session(&ctx);
  pb::SessionResponse resp;
  bool opened = false;
  if (stream->Write(collserve_fuzz::DefaultAttach(group)) && stream->Read(&resp) && resp.has_attached()) {
    auto ops = fdchannel::ConnectOps(resp.attached().fd_socket(), resp.attached().session_token(),
                                     absl::Now() + absl::Seconds(5));
    if (ops.ok()) {
      opened = true;
      const absl::Time deadline = absl::Now() + wait;
      for (const std::string& d : datagrams) {
        // MSG_DONTWAIT: a sidecar that stopped reading (it closed the channel) ends the run.
        if (send(*ops, d.data(), d.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) break;
      }
      std::vector<char> buf(opschannel::kMaxDatagramBytes);
      for (;;) {
        pollfd p{*ops, POLLIN, 0};
        const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
        if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0) break;
        if (recv(*ops, buf.data(), buf.size(), MSG_DONTWAIT) <= 0) break;
      }
      close(*ops);
    }
  }
  ctx.TryCancel();
  stream->Finish();
  return opened;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static int n = 0;
  ++n;
  const std::vector<std::string> datagrams = collserve_fuzz::SplitInput(data, size);
  RunSession(datagrams, absl::StrCat("fuzz", n % 8), absl::Milliseconds(200));
  if (n % 32 == 0 && !RunSession({}, absl::StrCat("health", n), absl::Milliseconds(10))) {
    std::fprintf(stderr, "the sidecar no longer opens a session's ops channel\n");
    abort();
  }
  return 0;
}
