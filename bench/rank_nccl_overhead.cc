// collserve-rank-nccl-overhead: what COLLSERVE_CUDA_PATH=nccl (one GPU per rank, NCCL in the
// rank: docs/gpu.md) adds to each collective, measured without a GPU: the ranks' communicator
// is one that does nothing (every call returns at once), so what is timed is the SDK's part of
// a call, chiefly the record of it sent to the sidecar (collserve.v1.Collective.in_rank), and
// how fast the sidecars check and answer those records.
//
//   collserve launch --nproc_per_node N --no_python collserve-rank-nccl-overhead [-n 20000] [-w 2000]
//
// Each rank issues -w then -n all_reduces of 1024 float32 on CUDA's path (a null stream, a
// fake device address: the communicator never touches them) and prints, on rank 0:
//   `issue_us_per_op=<T>`: the rank's time per call (what the call costs the training thread);
//   `answered_us_per_op=<T>`: from the first timed call until the sidecar answered the last
//     record, per op (the sidecars' rate: the rank stalls only when 1024 records are unanswered;
//     with COLLSERVE_NCCL_RECORDS=0, no records: the same as issue_us_per_op).
// Exits 1 when a call fails.
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "client/rank_comm.h"
#include "collserve/client.h"
#include "tests/testing/null_rank_comm.h"

ABSL_FLAG(int, n, 20000, "Timed calls.");
ABSL_FLAG(int, w, 2000, "Warm-up calls.");

namespace {

using collserve::DataType;
using collserve::ReduceOp;

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_n), w = absl::GetFlag(FLAGS_w);
  auto options = collserve::client::InitOptions::FromEnv();
  if (!options.ok()) {
    std::fprintf(stderr, "init options: %s\n", options.status().ToString().c_str());
    return 1;
  }
  options->cuda_path = collserve::client::InitOptions::CudaPath::kNccl;
  collserve::testing::NullRankCommFactory factory;
  collserve::client::SetRankCommFactoryForTesting(&factory);
  auto pg = collserve::client::InitProcessGroup(*options);
  if (!pg.ok()) {
    std::fprintf(stderr, "init: %s\n", pg.status().ToString().c_str());
    return 1;
  }
  void* fake_device_memory = reinterpret_cast<void*>(uintptr_t{1} << 40);  // never dereferenced
  const auto call = [&]() {
    absl::Status s = (*pg)->AllReduceCuda(fake_device_memory, 1024, DataType::kFloat32, ReduceOp::kSum, nullptr)->Wait();
    if (!s.ok()) {
      std::fprintf(stderr, "all_reduce: %s\n", s.ToString().c_str());
      std::exit(1);
    }
  };
  for (int i = 0; i < w; ++i) call();
  const absl::Time start = absl::Now();
  for (int i = 0; i < n; ++i) call();
  const absl::Duration issued = absl::Now() - start;
  const int64_t last = static_cast<int64_t>(w) + n - 1;
  while (options->nccl_records && (*pg)->last_completed_seq() < last) {
    if (absl::Now() - start > absl::Minutes(5)) {
      std::fprintf(stderr, "the sidecar answered records only up to seq %lld of %lld\n",
                   static_cast<long long>((*pg)->last_completed_seq()), static_cast<long long>(last));
      return 1;
    }
    absl::SleepFor(absl::Microseconds(200));  // polls a counter; the timed part ended above
  }
  const absl::Duration answered = absl::Now() - start;
  // The null communicator does not hold the ranks together as NCCL would: a rank that
  // finished first and left would end the others' communicators (the group's RANK_LEFT).
  if (absl::Status s = (*pg)->Barrier()->Wait(); !s.ok()) {
    std::fprintf(stderr, "barrier: %s\n", s.ToString().c_str());
    return 1;
  }
  if ((*pg)->GetRank() == 0) {
    std::printf("ranks=%d n=%d issue_us_per_op=%.2f answered_us_per_op=%.2f\n", (*pg)->GetWorldSize(), n,
                absl::ToDoubleMicroseconds(issued) / n, absl::ToDoubleMicroseconds(answered) / n);
  }
  return 0;
}
