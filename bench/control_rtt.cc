// collserve-control-rtt: what one control message costs between a rank and its sidecar, by
// transport. Two processes on this machine exchange collserve.v1.SessionRequest (a
// Collective) and SessionResponse (its Completion) messages, as the SDK and the sidecar do
// for every operation, over
//   grpc:      a Collectives.Session bidi stream on a unix socket, served with gRPC's
//              callback API (as server/sidecar/sidecar.cc serves it) and driven with the
//              synchronous client API (as client/process_group.cc drives it: one thread
//              writes, another reads);
//   seqpacket: a SOCK_SEQPACKET unix socket pair (the kind the descriptor channel,
//              common/fd_channel.h, uses), one datagram per message, a blocking thread on
//              each side.
// No collserve library code runs: the point is the transport's own cost on this host.
//
//   collserve-control-rtt [--transport=grpc,seqpacket] [-n 20000] [-w 2000] [--depth=1]
//
// --depth: requests kept in flight (1: one round trip at a time, the latency; more: the
// pipelined rate). Prints one line per transport:
//   `<transport> depth=D n=N us_per_round_trip=T client_switches=C server_switches=S`
// where T is wall time per request/reply pair (mean over the -n timed ones) and C / S are
// context switches (voluntary + involuntary, getrusage) per round trip of the client
// process over the timed loop and of the server process over its whole life (warm-up
// included). Exits 1 on a transport error or a reply that does not match its request.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "collserve/v1/collectives.grpc.pb.h"

ABSL_FLAG(std::string, transport, "grpc,seqpacket", "comma-separated: grpc, seqpacket");
ABSL_FLAG(int, n, 20000, "timed round trips");
ABSL_FLAG(int, w, 2000, "warm-up round trips");
ABSL_FLAG(int, depth, 1, "requests in flight (1: one at a time)");

namespace {

namespace pb = ::collserve::v1;

// A request like the SDK's for an 8-byte all_reduce staged in a segment.
pb::SessionRequest Request(int64_t seq) {
  pb::SessionRequest req;
  pb::Collective* c = req.mutable_collective();
  c->set_seq(seq);
  c->set_op(pb::ALL_REDUCE);
  c->set_dtype(pb::FLOAT32);
  c->set_count(2);
  c->set_reduce_op(pb::SUM);
  c->mutable_buffer()->set_segment("collserve-0123456789abcdef");
  c->mutable_buffer()->set_segment_bytes(1 << 20);
  c->set_timeout_ms(300000);
  return req;
}

// The sidecar's answer to it.
pb::SessionResponse Reply(const pb::SessionRequest& req) {
  pb::SessionResponse resp;
  pb::Completion* c = resp.mutable_completion();
  c->set_seq(req.collective().seq());
  c->set_code(0);
  c->set_algorithm("local");
  return resp;
}

int64_t Switches(int who) {
  rusage u{};
  getrusage(who, &u);
  return u.ru_nvcsw + u.ru_nivcsw;
}

struct Result {
  double us_per_round_trip = 0;
  double client_switches = 0;
  bool ok = false;
};

// Runs `total` round trips with `depth` in flight: `send(seq)` then `recv()` -> seq (-1 on
// error). Times the last n. Sends from this thread, receives on another (as the SDK does).
template <typename Send, typename Recv>
Result Drive(int warmup, int n, int depth, Send send, Recv recv) {
  Result r;
  auto phase = [&](int64_t first, int count, bool timed) -> bool {
    absl::Mutex mu;
    int64_t received = 0;  // replies read in this phase
    bool failed = false;
    const int64_t sw0 = Switches(RUSAGE_SELF);
    const auto t0 = std::chrono::steady_clock::now();
    std::thread reader([&] {
      for (int i = 0; i < count; ++i) {
        const int64_t seq = recv();
        absl::MutexLock lock(&mu);
        if (seq != first + i) {
          failed = true;
          return;
        }
        ++received;
      }
    });
    bool ok = true;
    for (int i = 0; i < count && ok; ++i) {
      {
        // At most `depth` in flight.
        absl::MutexLock lock(&mu);
        auto room = [&] { return failed || i - received < depth; };
        mu.Await(absl::Condition(&room));
        if (failed) ok = false;
      }
      if (ok && !send(first + i)) ok = false;
    }
    reader.join();
    if (failed) ok = false;
    if (timed && ok) {
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      r.us_per_round_trip = us / count;
      r.client_switches = static_cast<double>(Switches(RUSAGE_SELF) - sw0) / count;
    }
    return ok;
  };
  r.ok = phase(0, warmup, false) && phase(warmup, n, true);
  return r;
}

// The server's switches per round trip, from its whole life (after it exited).
double ServerSwitches(int64_t before, int round_trips) {
  return static_cast<double>(Switches(RUSAGE_CHILDREN) - before) / round_trips;
}

bool RunSeqpacket(int warmup, int n, int depth) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    std::perror("socketpair");
    return false;
  }
  const int64_t children_before = Switches(RUSAGE_CHILDREN);
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    close(sv[0]);
    char buf[4096];
    pb::SessionRequest req;
    std::string out;
    for (;;) {
      const ssize_t got = recv(sv[1], buf, sizeof(buf), 0);
      if (got <= 0 || !req.ParseFromArray(buf, static_cast<int>(got))) _exit(got == 0 ? 0 : 1);
      Reply(req).SerializeToString(&out);
      if (send(sv[1], out.data(), out.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(out.size())) _exit(1);
    }
  }
  close(sv[1]);
  const int fd = sv[0];
  std::string out;
  auto send_one = [&](int64_t seq) {
    Request(seq).SerializeToString(&out);
    return ::send(fd, out.data(), out.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(out.size());
  };
  auto recv_one = [&]() -> int64_t {
    char buf[4096];
    const ssize_t got = ::recv(fd, buf, sizeof(buf), 0);
    pb::SessionResponse resp;
    if (got <= 0 || !resp.ParseFromArray(buf, static_cast<int>(got))) return -1;
    return resp.completion().seq();
  };
  Result r = Drive(warmup, n, depth, send_one, recv_one);
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!r.ok) return false;
  std::printf("seqpacket depth=%d n=%d us_per_round_trip=%.1f client_switches=%.2f server_switches=%.2f\n", depth,
              n, r.us_per_round_trip, r.client_switches, ServerSwitches(children_before, warmup + n));
  return true;
}

// Echoes each Collective with its Completion, reading and writing concurrently with a
// write queue (as the sidecar's SessionReactor does).
class EchoReactor : public grpc::ServerBidiReactor<pb::SessionRequest, pb::SessionResponse> {
 public:
  EchoReactor() { StartRead(&req_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      done_reading_ = true;
      if (writing_.empty() && !finished_) {
        finished_ = true;
        Finish(grpc::Status::OK);
      }
      return;
    }
    pb::SessionResponse resp = Reply(req_);
    const pb::SessionResponse* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      writing_.push_back(std::move(resp));
      if (writing_.size() == 1) start = &writing_.front();
    }
    if (start != nullptr) StartWrite(start);
    StartRead(&req_);
  }
  void OnWriteDone(bool ok) override {
    const pb::SessionResponse* next = nullptr;
    absl::MutexLock lock(&mu_);
    writing_.pop_front();
    if (!ok) writing_.clear();
    if (!writing_.empty()) {
      next = &writing_.front();
    } else if (done_reading_ && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
    if (next != nullptr) StartWrite(next);
  }
  void OnDone() override { delete this; }

 private:
  pb::SessionRequest req_;
  absl::Mutex mu_;
  std::deque<pb::SessionResponse> writing_;
  bool done_reading_ = false;
  bool finished_ = false;
};

class EchoService final : public pb::Collectives::CallbackService {
  grpc::ServerBidiReactor<pb::SessionRequest, pb::SessionResponse>* Session(grpc::CallbackServerContext*) override {
    return new EchoReactor();
  }
};

bool RunGrpc(int warmup, int n, int depth) {
  char dir[] = "/tmp/collserve-control-rtt-XXXXXX";
  if (mkdtemp(dir) == nullptr) return false;
  const std::string address = absl::StrCat("unix:", dir, "/grpc.sock");
  int stop[2];  // the server exits when the client closes its end
  if (pipe2(stop, O_CLOEXEC) != 0) return false;
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) return false;
  const int64_t children_before = Switches(RUSAGE_CHILDREN);
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    close(stop[1]);
    close(ready[0]);
    EchoService service;
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials());
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    const char ok = server != nullptr ? 1 : 0;
    if (write(ready[1], &ok, 1) != 1 || !ok) _exit(1);
    char c;
    while (read(stop[0], &c, 1) > 0) {
    }
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    _exit(0);
  }
  close(stop[0]);
  close(ready[1]);
  char ok = 0;
  const bool started = read(ready[0], &ok, 1) == 1 && ok == 1;
  close(ready[0]);
  Result r;
  if (started) {
    auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    auto stub = pb::Collectives::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
    auto stream = stub->Session(&ctx);
    auto send_one = [&](int64_t seq) { return stream->Write(Request(seq)); };
    auto recv_one = [&]() -> int64_t {
      pb::SessionResponse resp;
      return stream->Read(&resp) ? resp.completion().seq() : -1;
    };
    r = Drive(warmup, n, depth, send_one, recv_one);
    stream->WritesDone();
    grpc::Status s = stream->Finish();
    if (!s.ok()) {
      std::fprintf(stderr, "grpc: %s\n", s.error_message().c_str());
      r.ok = false;
    }
  }
  close(stop[1]);
  int status = 0;
  waitpid(pid, &status, 0);
  std::string sock = absl::StrCat(dir, "/grpc.sock");
  unlink(sock.c_str());
  rmdir(dir);
  if (!r.ok) return false;
  std::printf("grpc depth=%d n=%d us_per_round_trip=%.1f client_switches=%.2f server_switches=%.2f\n", depth, n,
              r.us_per_round_trip, r.client_switches, ServerSwitches(children_before, warmup + n));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_n);
  const int w = absl::GetFlag(FLAGS_w);
  const int depth = absl::GetFlag(FLAGS_depth);
  if (n <= 0 || w < 0 || depth <= 0) {
    std::fprintf(stderr, "-n and --depth must be positive, -w not negative\n");
    return 2;
  }
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_transport), ',')) {
    bool ok;
    if (t == "grpc") {
      ok = RunGrpc(w, n, depth);
    } else if (t == "seqpacket") {
      ok = RunSeqpacket(w, n, depth);
    } else {
      std::fprintf(stderr, "unknown transport \"%.*s\" (grpc, seqpacket)\n", static_cast<int>(t.size()), t.data());
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "%.*s: failed\n", static_cast<int>(t.size()), t.data());
      return 1;
    }
  }
  return 0;
}
