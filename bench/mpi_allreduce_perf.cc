// collserve-mpi-allreduce-perf: MPI's own MPI_Allreduce (float, MPI_SUM) with no collserve
// code, the yardstick of the MPI column in bench/compare.py (f): what the MPI library does
// between the same hosts when each host's process calls it directly. One process per rank,
// started by mpirun; rank 0 prints collserve-perf's table (nccl-tests' columns: size count
// type redop root | out-of-place time algbw busbw #wrong | in-place ..., then the algorithm),
// so the same parser reads both:
//
//   mpirun -np 2 build/bench/collserve-mpi-allreduce-perf -b 1K -e 64M -f 4 -n 20 -w 5
//
//   size   bytes of the buffer (float elements x 4)
//   time   microseconds per op: each rank's mean over -n back-to-back MPI_Allreduce calls
//          after -w warm-up calls and a barrier, averaged over ranks
//   algbw  size / time (GB/s, 1e9 bytes); busbw = algbw x 2(n-1)/n (nccl-tests'
//          doc/PERFORMANCE.md)
//   #wrong elements that differ from the expected sum after one checked call, summed over
//          ranks (inputs are small integers: exact)
// In place is MPI_IN_PLACE. Exits 1 when any element is wrong, 2 on bad flags.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"

ABSL_FLAG(std::string, b, "1K", "Smallest size in bytes (suffixes K, M, G: powers of 1024).");
ABSL_FLAG(std::string, e, "64M", "Largest size in bytes (suffixes K, M, G).");
ABSL_FLAG(int, f, 4, "Multiplication factor between sizes (>= 2).");
ABSL_FLAG(int, n, 20, "Timed calls per size.");
ABSL_FLAG(int, w, 5, "Warm-up calls per size.");
ABSL_FLAG(bool, nonblocking, false,
          "MPI_Iallreduce waited for with MPI_Wait (Open MPI's libnbc) instead of MPI_Allreduce: what collserve's "
          "MPI backend calls");
ABSL_FLAG(bool, user_op, false,
          "A user-defined MPI_Op (commutative float sum) on a 4-byte contiguous datatype instead of MPI_SUM on "
          "MPI_FLOAT: how collserve's MPI backend reduces");

namespace {

void UserSum(void* in, void* inout, int* len, MPI_Datatype*) {
  const float* a = static_cast<const float*>(in);
  float* b = static_cast<float*>(inout);
  for (int i = 0; i < *len; ++i) b[i] += a[i];
}

// "64M" -> 67108864; -1 when not a size.
int64_t ParseBytes(std::string s) {
  int64_t scale = 1;
  if (!s.empty()) {
    const char last = s.back();
    scale = last == 'K' ? 1 << 10 : last == 'M' ? 1 << 20 : last == 'G' ? 1 << 30 : 1;
    if (scale != 1) s.pop_back();
  }
  int64_t v = 0;
  if (!absl::SimpleAtoi(s, &v) || v < 0 || v > (int64_t{1} << 34) / scale) return -1;
  return v * scale;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  absl::ParseCommandLine(argc, argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const int64_t min_bytes = ParseBytes(absl::GetFlag(FLAGS_b)), max_bytes = ParseBytes(absl::GetFlag(FLAGS_e));
  const int factor = absl::GetFlag(FLAGS_f), iters = absl::GetFlag(FLAGS_n), warmup = absl::GetFlag(FLAGS_w);
  if (min_bytes < 4 || max_bytes < min_bytes || max_bytes / 4 > INT32_MAX || factor < 2 || iters < 1 || warmup < 0) {
    if (rank == 0) std::fprintf(stderr, "collserve-mpi-allreduce-perf: bad -b/-e/-f/-n/-w (see --help)\n");
    MPI_Finalize();
    return 2;
  }
  const bool nonblocking = absl::GetFlag(FLAGS_nonblocking);
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(version, &length);
  std::string library(version, static_cast<size_t>(std::max(length, 0)));
  library = library.substr(0, library.find_first_of(",\n"));
  if (rank == 0) {
    std::printf("# collserve-mpi-allreduce-perf: %s, float, %s, %d processes, -n %d -w %d (%s)\n",
                nonblocking ? "MPI_Iallreduce + MPI_Wait" : "MPI_Allreduce",
                absl::GetFlag(FLAGS_user_op) ? "user-defined op" : "MPI_SUM", n, iters, warmup, library.c_str());
    std::printf("#%62s%32s\n", "out-of-place", "in-place");
    std::printf("#%11s %12s %8s %6s %6s %8s %7s %7s %6s %8s %7s %7s %6s  %s\n", "size", "count", "type", "redop",
                "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "algorithm");
  }
  MPI_Datatype type = MPI_FLOAT;
  MPI_Op op = MPI_SUM;
  if (absl::GetFlag(FLAGS_user_op)) {
    MPI_Type_contiguous(4, MPI_BYTE, &type);
    MPI_Type_commit(&type);
    MPI_Op_create(&UserSum, /*commute=*/1, &op);
  }
  int64_t total_wrong = 0;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
    const int count = static_cast<int>(bytes / 4);
    std::vector<float> in(static_cast<size_t>(count)), out(static_cast<size_t>(count));
    const float expected = static_cast<float>(n) * static_cast<float>(n + 1) / 2;
    std::string columns;
    for (bool in_place : {false, true}) {
      auto call = [&] {
        const void* send = in_place ? MPI_IN_PLACE : in.data();
        if (!nonblocking) return MPI_Allreduce(send, out.data(), count, type, op, MPI_COMM_WORLD);
        MPI_Request req;
        MPI_Iallreduce(send, out.data(), count, type, op, MPI_COMM_WORLD, &req);
        return MPI_Wait(&req, MPI_STATUS_IGNORE);
      };
      std::fill(in.begin(), in.end(), static_cast<float>(rank + 1));
      std::fill(out.begin(), out.end(), in_place ? static_cast<float>(rank + 1) : 0.0f);
      call();
      int64_t wrong = std::count_if(out.begin(), out.end(), [&](float v) { return v != expected; });
      MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
      total_wrong += wrong;
      for (int i = 0; i < warmup; ++i) call();
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      for (int i = 0; i < iters; ++i) call();
      double us = (MPI_Wtime() - start) * 1e6 / iters;
      MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
      us /= n;
      const double algbw = static_cast<double>(bytes) / (us * 1e3);
      const double busbw = algbw * 2.0 * (n - 1) / n;
      char cell[96];
      std::snprintf(cell, sizeof(cell), " %8.1f %7.3f %7.3f %6lld", us, algbw, busbw, static_cast<long long>(wrong));
      columns += cell;
    }
    if (rank == 0) {
      std::printf(" %11lld %12d %8s %6s %6d%s  %s\n", static_cast<long long>(bytes), count, "float", "sum", -1,
                  columns.c_str(), nonblocking ? "MPI_Iallreduce" : "MPI_Allreduce");
      std::fflush(stdout);
    }
  }
  if (rank == 0) std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(total_wrong),
                             total_wrong ? "FAILED" : "OK");
  MPI_Finalize();
  return total_wrong == 0 ? 0 : 1;
}
