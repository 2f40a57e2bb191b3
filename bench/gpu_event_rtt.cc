// collserve-gpu-event-rtt: the floor of the sidecar's CUDA path (issue 44, item 4: "each
// operation through the sidecar costs 52-58 us"), with no collserve code. A rank's CUDA op
// through a sidecar needs, per op, at least: an event recorded on the rank's stream, a
// message to the sidecar, the sidecar's stream waiting for that event (an interprocess event:
// another process, another CUDA context), the sidecar's GPU work and an event recorded after
// it, a message back, and the rank's stream waiting for that event. This program does
// exactly that between two processes on one GPU over a SOCK_SEQPACKET unix socket pair (the
// ops channel's kind), and prints the time per op next to what each part costs alone:
//
//   socket                   the message round trip alone (no CUDA)
//   one_process              the same event hand-offs between two streams of one process
//                            (one CUDA context, ordinary events): the cost without a second
//                            context or interprocess events
//   ipc[_work][_both] ...    two processes with interprocess events; "_work": the second
//                            process queues a 4-byte cudaMemsetAsync between its wait and its
//                            record (a stand-in for its NCCL launch); "_both": the first
//                            process queues one too before its record (GPU work in both
//                            contexts, which the GPU time-slices without MPS)
//   call costs               host time of one cudaEventRecord of an interprocess event and of
//                            one cudaStreamWaitEvent on an opened one, each alone
//
// Each variant runs blocking (each op's reply and stream wait before the next op: a rank that
// waits for every op) and pipelined (--depth ops in flight: a rank that issues back to back,
// as collserve-perf does), over -n ops after -w warm-up ops; the time includes a final
// cudaStreamSynchronize, so GPU work that falls behind the host is counted.
//
//   collserve-gpu-event-rtt [-n 2000] [-w 200] [--depth 16]
//
// Prints one line per variant: `<variant> mode=<blocking|pipelined> us_per_op=<T>`, and
// `call cudaEventRecord(ipc) us=<T>` / `call cudaStreamWaitEvent(ipc) us=<T>`. Without a
// GPU it prints the socket line and "no GPU: <why>" and exits 0; exits 1 on a CUDA or socket
// error (naming the call). Device 0 is used.
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"

ABSL_FLAG(int, n, 2000, "Timed ops per variant.");
ABSL_FLAG(int, w, 200, "Warm-up ops per variant.");
ABSL_FLAG(int, depth, 16, "Ops in flight in the pipelined mode (at most kSlots - 1).");

namespace {

constexpr int kSlots = 64;  // event pairs; a slot is reused only after its reply

// One message each way: what the second process does for an op.
struct Msg {
  int32_t kind;  // kOp, kPing, kQuit
  int32_t slot;
  int32_t work;  // 1: a cudaMemsetAsync before the done event
};
enum : int32_t { kOp = 1, kPing = 2, kQuit = 3, kReady = 4, kNoGpu = 5 };

[[noreturn]] void Die(const char* what, const char* why) {
  std::fprintf(stderr, "collserve-gpu-event-rtt: %s: %s\n", what, why);
  std::exit(1);
}
void Check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) Die(call, cudaGetErrorString(e));
}
void SendAll(int fd, const void* p, size_t n) {
  if (send(fd, p, n, MSG_NOSIGNAL) != static_cast<ssize_t>(n)) Die("send", std::strerror(errno));
}
void RecvAll(int fd, void* p, size_t n) {
  if (recv(fd, p, n, 0) != static_cast<ssize_t>(n)) Die("recv", "short read or the other process ended");
}

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Makes kSlots interprocess events, sends their handles, receives and opens the other side's.
void ExchangeEvents(int fd, std::vector<cudaEvent_t>* mine, std::vector<cudaEvent_t>* theirs) {
  std::vector<cudaIpcEventHandle_t> handles(kSlots), remote(kSlots);
  for (int i = 0; i < kSlots; ++i) {
    cudaEvent_t e;
    Check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess), "cudaEventCreateWithFlags");
    Check(cudaIpcGetEventHandle(&handles[i], e), "cudaIpcGetEventHandle");
    mine->push_back(e);
  }
  SendAll(fd, handles.data(), sizeof(cudaIpcEventHandle_t) * kSlots);
  RecvAll(fd, remote.data(), sizeof(cudaIpcEventHandle_t) * kSlots);
  for (int i = 0; i < kSlots; ++i) {
    cudaEvent_t e;
    Check(cudaIpcOpenEventHandle(&e, remote[i]), "cudaIpcOpenEventHandle");
    theirs->push_back(e);
  }
}

// The second process (the sidecar's part): waits for each op's ready event on its stream,
// optionally queues a memset, records the op's done event and replies.
int Server(int fd) {
  Msg m{};
  void* buf = nullptr;
  cudaStream_t s;
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  const bool gpu = probe == cudaSuccess && devices > 0;
  std::vector<cudaEvent_t> done, ready;
  m.kind = gpu ? kReady : kNoGpu;
  SendAll(fd, &m, sizeof m);
  if (gpu) {
    Check(cudaSetDevice(0), "cudaSetDevice");
    Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    Check(cudaMalloc(&buf, 4), "cudaMalloc");
    ExchangeEvents(fd, &done, &ready);
  }
  for (;;) {
    RecvAll(fd, &m, sizeof m);
    if (m.kind == kQuit) break;
    if (m.kind == kOp) {
      Check(cudaStreamWaitEvent(s, ready[m.slot], 0), "cudaStreamWaitEvent");
      if (m.work) Check(cudaMemsetAsync(buf, 0, 4, s), "cudaMemsetAsync");
      Check(cudaEventRecord(done[m.slot], s), "cudaEventRecord");
    }
    SendAll(fd, &m, sizeof m);
  }
  if (gpu) Check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return 0;
}

struct Client {
  int fd;
  cudaStream_t s;
  void* buf;
  std::vector<cudaEvent_t> ready, done;

  // One variant: `ops` ops with `depth` in flight; returns seconds.
  double Run(int ops, int depth, bool gpu, bool work, bool both) {
    const double start = Seconds();
    int sent = 0, answered = 0;
    const auto answer = [&]() {
      Msg r{};
      RecvAll(fd, &r, sizeof r);
      if (gpu) Check(cudaStreamWaitEvent(s, done[r.slot], 0), "cudaStreamWaitEvent");
      ++answered;
    };
    while (answered < ops) {
      if (sent < ops && sent - answered < depth) {
        Msg m{gpu ? kOp : kPing, sent % kSlots, work ? 1 : 0};
        if (gpu) {
          if (both) Check(cudaMemsetAsync(buf, 0, 4, s), "cudaMemsetAsync");
          Check(cudaEventRecord(ready[m.slot], s), "cudaEventRecord");
        }
        SendAll(fd, &m, sizeof m);
        ++sent;
      } else {
        answer();
      }
    }
    if (gpu) Check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return Seconds() - start;
  }
};

// The same hand-offs between two streams of this process with ordinary events.
double OneProcess(int ops, int depth) {
  cudaStream_t a, b;
  Check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "cudaStreamCreate");
  Check(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "cudaStreamCreate");
  void* buf = nullptr;
  Check(cudaMalloc(&buf, 4), "cudaMalloc");
  std::vector<cudaEvent_t> ready(kSlots), done(kSlots);
  for (int i = 0; i < kSlots; ++i) {
    Check(cudaEventCreateWithFlags(&ready[i], cudaEventDisableTiming), "cudaEventCreateWithFlags");
    Check(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  const double start = Seconds();
  for (int i = 0; i < ops; ++i) {
    const int slot = i % kSlots;
    Check(cudaEventRecord(ready[slot], a), "cudaEventRecord");
    Check(cudaStreamWaitEvent(b, ready[slot], 0), "cudaStreamWaitEvent");
    Check(cudaMemsetAsync(buf, 0, 4, b), "cudaMemsetAsync");
    Check(cudaEventRecord(done[slot], b), "cudaEventRecord");
    // The waiting side waits `depth` ops behind (1: at once).
    const int behind = i - (depth - 1);
    if (behind >= 0) Check(cudaStreamWaitEvent(a, done[behind % kSlots], 0), "cudaStreamWaitEvent");
  }
  Check(cudaStreamSynchronize(a), "cudaStreamSynchronize");
  Check(cudaStreamSynchronize(b), "cudaStreamSynchronize");
  const double t = Seconds() - start;
  for (int i = 0; i < kSlots; ++i) {
    cudaEventDestroy(ready[i]);
    cudaEventDestroy(done[i]);
  }
  cudaFree(buf);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_n), w = absl::GetFlag(FLAGS_w);
  const int depth = absl::GetFlag(FLAGS_depth);
  if (n <= 0 || w < 0 || depth < 1 || depth >= kSlots) Die("flags", "need -n > 0, -w >= 0, 1 <= --depth < 64");
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) != 0) Die("socketpair", std::strerror(errno));
  // Fork before any CUDA call: a CUDA context does not survive fork.
  const pid_t child = fork();
  if (child < 0) Die("fork", std::strerror(errno));
  if (child == 0) {
    close(sv[0]);
    return Server(sv[1]);
  }
  close(sv[1]);
  Client c{sv[0], nullptr, nullptr, {}, {}};
  Msg hello{};
  RecvAll(c.fd, &hello, sizeof hello);
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  const bool gpu = hello.kind == kReady && probe == cudaSuccess && devices > 0;
  const auto report = [&](const char* variant, const char* mode, double seconds) {
    std::printf("%s mode=%s us_per_op=%.2f\n", variant, mode, seconds * 1e6 / n);
  };
  if (gpu) {
    Check(cudaSetDevice(0), "cudaSetDevice");
    Check(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking), "cudaStreamCreate");
    Check(cudaMalloc(&c.buf, 4), "cudaMalloc");
    ExchangeEvents(c.fd, &c.ready, &c.done);
    cudaDeviceProp prop{};
    Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    std::printf("# device 0: %s; -n %d -w %d --depth %d\n", prop.name, n, w, depth);
  }
  for (int d : {1, depth}) {
    const char* mode = d == 1 ? "blocking" : "pipelined";
    c.Run(w, d, false, false, false);
    report("socket", mode, c.Run(n, d, false, false, false));
    if (!gpu) continue;
    OneProcess(w, d);
    report("one_process", mode, OneProcess(n, d));
    struct Variant {
      const char* name;
      bool work, both;
    };
    for (const Variant& v : {Variant{"ipc", false, false}, Variant{"ipc_work", true, false},
                             Variant{"ipc_work_both", true, true}}) {
      c.Run(w, d, true, v.work, v.both);
      report(v.name, mode, c.Run(n, d, true, v.work, v.both));
    }
  }
  if (gpu) {
    // Host time of the two calls alone (no messages in between).
    double start = Seconds();
    for (int i = 0; i < n; ++i) Check(cudaEventRecord(c.ready[i % kSlots], c.s), "cudaEventRecord");
    std::printf("call cudaEventRecord(ipc) us=%.2f\n", (Seconds() - start) * 1e6 / n);
    start = Seconds();
    for (int i = 0; i < n; ++i) Check(cudaStreamWaitEvent(c.s, c.done[i % kSlots], 0), "cudaStreamWaitEvent");
    std::printf("call cudaStreamWaitEvent(ipc) us=%.2f\n", (Seconds() - start) * 1e6 / n);
    Check(cudaStreamSynchronize(c.s), "cudaStreamSynchronize");
    // What COLLSERVE_CUDA_PATH=nccl pays per buffer of a call to check it is on the
    // communicator's GPU (client/rank_comm.cc: an all_to_all names 2 x world_size pieces).
    start = Seconds();
    for (int i = 0; i < n; ++i) {
      cudaPointerAttributes a;
      Check(cudaPointerGetAttributes(&a, static_cast<char*>(c.buf) + (i & 3)), "cudaPointerGetAttributes");
    }
    std::printf("call cudaPointerGetAttributes us=%.2f\n", (Seconds() - start) * 1e6 / n);
  } else {
    std::printf("no GPU: %s\n", hello.kind == kNoGpu ? "the second process found none"
                                                     : cudaGetErrorString(probe));
  }
  Msg quit{kQuit, 0, 0};
  SendAll(c.fd, &quit, sizeof quit);
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
