#!/usr/bin/env python3
"""Side-by-side: torch.distributed's Gloo (bench/torch_perf.py) and collserve
(build/bench/collserve-perf) in one run, same sizes, same ranks, one host, each under
`collserve launch` (which gives torch its env:// store and collserve its sidecar). Prints
both tools' busbw per op and size and the ratio collserve / torch Gloo, and the 8-byte
all_reduce latency ratio, against issue 5's targets.

    PYTHONPATH=build/python /usr/bin/python3 bench/compare.py [--nproc 4] [--build build]

Not yet here: the two-host (network namespace) run and the sidecar's peak RSS.
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# (op, sizes as -b/-e/-f, target busbw ratio)
CASES = [("all_reduce", "1M", "64M", 64, 3.0), ("all_gather", "1M", "64M", 64, 2.0),
         ("broadcast", "1M", "64M", 64, 2.0), ("reduce_scatter", "1M", "64M", 64, 2.0)]


def rows(text):
    """{size: (time_us, busbw)} from a collserve-perf/torch_perf table (the filled column:
    out-of-place where there is one, else in-place)."""
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split()
        cols = f[5:9] if f[5] != "N/A" else f[9:13]
        if cols[3] not in ("0", "N/A"):
            raise SystemExit(f"wrong results: {line}")
        out[int(f[0])] = (float(cols[0]), float(cols[2]))
    return out


def run(args, nproc, build, cmd):
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
    r = subprocess.run([sys.executable, "-m", "collserve.launch", "--nproc_per_node", str(nproc), "--no_prefix",
                        *cmd, *args], capture_output=True, text=True, env=env, timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    p.add_argument("-n", type=int, default=10)
    p.add_argument("-w", type=int, default=3)
    a = p.parse_args()
    build = os.path.abspath(a.build)
    ours = ["--no_python", os.path.join(build, "bench", "collserve-perf")]
    torch = [os.path.join(HERE, "torch_perf.py"), "--backend", "gloo"]
    print(f"# one host, {a.nproc} ranks, -n {a.n} -w {a.w}; busbw in GB/s (nccl-tests' definition)")
    print(f"{'op':<16}{'size':>10}{'torch gloo':>12}{'collserve':>12}{'ratio':>8}{'target':>8}")
    for op, b, e, f, target in CASES:
        common = ["-b", b, "-e", e, "-f", str(f), "-n", str(a.n), "-w", str(a.w), "-o", op]
        theirs = rows(run(common, a.nproc, build, torch))
        mine = rows(run(common, a.nproc, build, ours))
        for size in sorted(mine):
            t, m = theirs[size][1], mine[size][1]
            print(f"{op:<16}{size:>10}{t:>12.3f}{m:>12.3f}{m / t:>8.2f}{'>=' + str(target):>8}", flush=True)
    common = ["-b", "8", "-e", "8", "-n", str(a.n * 10), "-w", str(a.w), "-o", "all_reduce"]
    t = rows(run(common, a.nproc, build, torch))[8][0]
    m = rows(run(common, a.nproc, build, ours))[8][0]
    print(f"# 8-byte all_reduce latency: torch gloo {t:.1f} us, collserve {m:.1f} us, "
          f"collserve / gloo = {m / t:.2f} (target <= 0.25)")


if __name__ == "__main__":
    main()
