// A rank of a collserve job: joins the default group through the sidecar on its host
// and all-reduces a small tensor, printing the result.
//
// Run one process per rank with torch's env:// variables plus COLLSERVE_SIDECAR:
//   RANK=0 WORLD_SIZE=4 COLLSERVE_SIDECAR=unix:/run/collserve/a.sock ./allreduce_example
// scripts/run_example.sh starts a coordinator, two sidecars and four ranks for you.
#include <cstdio>
#include <vector>

#include "absl/strings/str_join.h"
#include "collserve/client.h"

int main() {
  using collserve::client::InitOptions;
  auto options = InitOptions::FromEnv();
  if (!options.ok()) {
    std::fprintf(stderr, "env:// init: %s\n", options.status().ToString().c_str());
    return 2;
  }
  auto pg = collserve::client::InitProcessGroup(*options);
  if (!pg.ok()) {
    std::fprintf(stderr, "rank %d: init_process_group failed: %s\n", options->rank,
                 pg.status().ToString().c_str());
    return 1;
  }
  const int rank = (*pg)->GetRank();
  const int world = (*pg)->GetWorldSize();

  // As in the torch.distributed tutorial: every rank contributes rank + 1.
  std::vector<float> tensor(4);
  for (size_t i = 0; i < tensor.size(); ++i) tensor[i] = static_cast<float>((rank + 1) * (i + 1));
  auto work = (*pg)->AllReduce(tensor, collserve::ReduceOp::kSum);
  if (absl::Status s = work->Wait(); !s.ok()) {
    std::fprintf(stderr, "rank %d: all_reduce failed: %s\n", rank, s.ToString().c_str());
    return 1;
  }
  // Sum over ranks r of (r + 1) * (i + 1) = (i + 1) * world * (world + 1) / 2.
  for (size_t i = 0; i < tensor.size(); ++i) {
    const float want = static_cast<float>((i + 1) * world * (world + 1) / 2);
    if (tensor[i] != want) {
      std::fprintf(stderr, "rank %d: element %zu is %g, expected %g\n", rank, i, tensor[i], want);
      return 1;
    }
  }
  std::vector<double> shown(tensor.begin(), tensor.end());
  std::printf("rank %d of %d (%d hosts, %d ranks on this host): all_reduce(SUM) = [%s]\n", rank, world,
              (*pg)->num_hosts(), (*pg)->local_world_size(), absl::StrJoin(shown, ", ").c_str());

  std::vector<int64_t> ids = {rank};
  if (absl::Status s = (*pg)->AllReduce(ids, collserve::ReduceOp::kMax)->Wait(); !s.ok()) {
    std::fprintf(stderr, "rank %d: all_reduce(MAX) failed: %s\n", rank, s.ToString().c_str());
    return 1;
  }
  std::printf("rank %d: all_reduce(MAX) of ranks = %lld\n", rank, static_cast<long long>(ids[0]));
  if (ids[0] != world - 1) {
    std::fprintf(stderr, "rank %d: expected MAX %d\n", rank, world - 1);
    return 1;
  }
  return 0;
}
