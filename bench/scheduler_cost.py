#!/usr/bin/env python3
"""The cost of the scheduling between jobs when one job runs alone (issue 43): every
collserve-perf figure of this tree against the landed tree's binaries (the sidecar, its
coordinator and collserve-perf of a build of the commit before the scheduling work), in one
run, paired repetitions (each repetition runs both trees, alternating which goes first), one
host, 4 ranks, arena tensors, medians. The target: every time within 5% of the landed tree's.
At the small sizes one figure moves by tens of percent between two runs of the same binary
(where the ranks' and the sidecar's threads land on 2 cores), so the script also prints each
op's geometric mean of the ratios below and above 1 MiB; `--landed build` (this tree against
itself) measures that noise in the same way.

Build the landed tree once (any commit; the launcher of this tree starts its daemons through
COLLSERVE_BIN_DIR):

    git worktree add /tmp/landed 203c5bf   # the parent of the first issue-43 commit
    cmake -S /tmp/landed -B /tmp/landed/build -DCMAKE_BUILD_TYPE=Release -DCOLLSERVE_BUILD_TESTS=OFF \\
        -DCOLLSERVE_BUILD_BENCH=ON
    cmake --build /tmp/landed/build -j2 --target collserve-perf collserve-sidecar collserve-coordinator
    PYTHONPATH=build/python /usr/bin/python3 bench/scheduler_cost.py --landed /tmp/landed/build [--reps 3]
"""
import argparse
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402  (bench/compare.py: launch, rows, finish)

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")


def perf(build, op, a):
    """{size: (time_us, busbw, algorithm)} of one collserve-perf run of `build`'s binaries."""
    env = dict(os.environ, COLLSERVE_BIN_DIR=os.path.join(build, "server"))
    cmd = ["--no_python", os.path.join(build, "bench", "collserve-perf"), "-b", "8", "-e", a.max_bytes, "-f", "8",
           "-n", str(a.n), "-w", str(a.w), "-o", op, "-m", a.m, "-z", str(a.z)]
    # The launcher (and its Python package) is this tree's: it starts COLLSERVE_BIN_DIR's daemons.
    return compare.rows(compare.finish(compare.launch(cmd, a.nproc, a.build, env=env), f"{build} {op}"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--landed", required=True, help="build directory of the landed tree")
    p.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    p.add_argument("--max_bytes", default="64M")
    p.add_argument("-m", default="arena", help="collserve-perf's -m: arena or heap tensors")
    p.add_argument("-z", type=int, default=0, help="collserve-perf's -z: 1 waits for each op before the next")
    p.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    a = p.parse_args()
    a.build = os.path.abspath(a.build)
    trees = {"landed": os.path.abspath(a.landed), "this": a.build}
    times = {}  # (tree, op, size) -> [time_us per repetition]
    for rep in range(a.reps):
        order = ("landed", "this") if rep % 2 == 0 else ("this", "landed")
        for op in a.ops:
            for tree in order:
                for size, (t, _, _) in perf(trees[tree], op, a).items():
                    times.setdefault((tree, op, size), []).append(t)
        print(f"# repetition {rep + 1} of {a.reps} done", flush=True)
    print(f"\n{'op':<16}{'size':>10}{'landed us':>12}{'this us':>12}{'this/landed':>13}")
    ratios = {}  # op -> [(size, this/landed)]
    for op in a.ops:
        for size in sorted({s for (tree, o, s) in times if o == op}):
            landed = statistics.median(times[("landed", op, size)])
            this = statistics.median(times[("this", op, size)])
            ratios.setdefault(op, []).append((size, this / landed))
            print(f"{op:<16}{size:>10}{landed:>12.1f}{this:>12.1f}{this / landed:>13.3f}", flush=True)
    # One figure's ratio moves by tens of percent between two runs of one binary at the small
    # sizes (which of the 4 ranks and the sidecar's threads share a core differs run to run):
    # the geometric means over sizes are the measurement; compare them with a run of this
    # tree against itself (--landed build) for the noise.
    def geomean(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
    print(f"\n{'op':<16}{'geomean < 1 MiB':>17}{'geomean >= 1 MiB':>18}{'largest':>10}")
    small_all, large_all = [], []
    for op, rs in ratios.items():
        small = [r for size, r in rs if size < (1 << 20)]
        large = [r for size, r in rs if size >= (1 << 20)]
        small_all += small
        large_all += large
        print(f"{op:<16}{geomean(small):>17.3f}{geomean(large):>18.3f}{max(r for _, r in rs):>10.3f}")
    print(f"{'every op':<16}{geomean(small_all):>17.3f}{geomean(large_all):>18.3f}"
          f"{max(r for rs in ratios.values() for _, r in rs):>10.3f}")
    print("# target: this/landed at most 1.05")

if __name__ == "__main__":
    main()
