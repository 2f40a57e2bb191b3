// collserve-gloo-latency: the latency of a bare Gloo allreduce, the yardstick of the
// two-host 8-byte all_reduce target (bench/compare.py (c)). No collserve code runs: one
// process per host, Gloo's own FileStore for the rendezvous (the hosts of the benchmark
// are network namespaces of one machine, so they share a directory), Gloo's TCP transport
// bound to --hostname, and gloo::allreduce (Gloo's default algorithm for the size) on
// --bytes of float32.
//
//   collserve-gloo-latency --store_dir=DIR --rank=R --world_size=N --hostname=ADDR [-n 200] [-w 20]
//
// Each process runs -w warm-up allreduces, then -n timed back to back ones, and prints one
// line: `gloo_allreduce bytes=B ranks=N mean_us=T median_us=M` (per op; rank 0's clock).
// The sum is checked after the loop (exit 1 on a wrong value). Exits 2 on bad flags; a
// Gloo error (its exception's message) exits 1. Gloo's timeout bounds every wait (--timeout_s).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"

ABSL_FLAG(std::string, store_dir, "", "directory shared by all ranks for Gloo's FileStore (must exist)");
ABSL_FLAG(int, rank, 0, "this process's rank in [0, world_size)");
ABSL_FLAG(int, world_size, 2, "processes (hosts)");
ABSL_FLAG(std::string, hostname, "127.0.0.1", "address Gloo's TCP transport binds and advertises");
ABSL_FLAG(int, bytes, 8, "allreduce size in bytes (a multiple of 4: float32)");
ABSL_FLAG(int, n, 200, "timed allreduces");
ABSL_FLAG(int, w, 20, "warm-up allreduces");
ABSL_FLAG(int, timeout_s, 120, "Gloo's timeout for the rendezvous and each allreduce, seconds");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int rank = absl::GetFlag(FLAGS_rank), size = absl::GetFlag(FLAGS_world_size);
  const int bytes = absl::GetFlag(FLAGS_bytes), n = absl::GetFlag(FLAGS_n), w = absl::GetFlag(FLAGS_w);
  if (absl::GetFlag(FLAGS_store_dir).empty() || size < 1 || rank < 0 || rank >= size || bytes < 4 ||
      bytes % 4 != 0 || n < 1 || w < 0) {
    std::fprintf(stderr, "collserve-gloo-latency: needs --store_dir, 0 <= --rank < --world_size, --bytes a "
                         "positive multiple of 4, -n >= 1, -w >= 0\n");
    return 2;
  }
  try {
    const auto timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
    gloo::transport::tcp::attr attr(absl::GetFlag(FLAGS_hostname).c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(absl::GetFlag(FLAGS_store_dir));
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout);
    context->connectFullMesh(store, device);

    std::vector<float> data(static_cast<size_t>(bytes) / 4);
    std::vector<double> us;
    for (int i = 0; i < w + n; ++i) {
      std::fill(data.begin(), data.end(), static_cast<float>(rank + 1));
      gloo::AllreduceOptions opts(context);
      opts.setOutput(data.data(), data.size());
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setTimeout(timeout);
      const auto t0 = std::chrono::steady_clock::now();
      gloo::allreduce(opts);
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= w) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    const float want = static_cast<float>(size) * static_cast<float>(size + 1) / 2;
    for (float v : data) {
      if (v != want) {
        std::fprintf(stderr, "collserve-gloo-latency: rank %d got %g, want %g\n", rank, v, want);
        return 1;
      }
    }
    double total = 0;
    for (double v : us) total += v;
    std::sort(us.begin(), us.end());
    std::printf("gloo_allreduce bytes=%d ranks=%d mean_us=%.1f median_us=%.1f\n", bytes, size, total / n,
                us[us.size() / 2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collserve-gloo-latency: %s\n", e.what());
    return 1;
  }
  return 0;
}
