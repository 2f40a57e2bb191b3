#!/usr/bin/env python3
"""Fair share between two busy jobs on one sidecar (issue 43): jobs B and C (4 ranks each,
collserve-perf with arena tensors) run back to back at once, each wanting every core, with
different operations: B 64 MiB all_reduces, C 16 MiB all_gathers (the mixed case) or the
same as B. The sidecar's per-job counters (collserve_job_data_path_seconds_total: the time
its data-path threads spent on each job's chunks, executors included) say what share of the
sidecar's time each job got. The target: with equal classes and weights, each job within
20% of an equal share (0.40 to 0.60); with weights 2:1, B's share near 2/3.

In one run, --reps paired repetitions of each configuration in turn (a fresh coordinator and
sidecar each; the operator's policies file sets the weights):

  same        B and C both 64 MiB all_reduces, default class, weight 1
  mixed       B 64 MiB all_reduces, C 16 MiB all_gathers, default class, weight 1
  weighted    the mixed pair with B at share_weight 2

Each job also runs alone once per repetition, for its busbw alone. Prints, medians over the
repetitions: each job's share of the data-path time, its busbw shared and alone.

    PYTHONPATH=build/python /usr/bin/python3 bench/fair_share.py [--build build] [--iters 40] [--reps 3]
"""
import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import noisy_neighbor as nn  # noqa: E402  (its daemons, rank start and finish)

JOBS = {
    "all_reduce": ("all_reduce", 64 << 20),
    "all_gather": ("all_gather", 16 << 20),
}


def perf_cmd(build, op, nbytes, iters):
    return [os.path.join(build, "bench", "collserve-perf"), "-b", str(nbytes), "-e", str(nbytes), "-n", str(iters),
            "-w", "2", "-o", op, "-d", "float", "-m", "arena"]


def busbw(out, nbytes):
    """The busbw (GB/s) of collserve-perf's one row."""
    for line in out.splitlines():
        f = line.split()
        if f and f[0].isdigit() and int(f[0]) == nbytes:
            return float(f[11])
    raise SystemExit(f"no {nbytes}-byte row in:\n{out}")


def run(build, jobs, policy):
    """Runs `jobs` ({job: (op, bytes, iters)}) at once on one sidecar: {job: (thread seconds, busbw)}."""
    daemons = nn.daemons_module(build)
    d = tempfile.mkdtemp(prefix="collserve-share.")
    started = []
    try:
        coord, tokens, metrics_port = nn.start_daemons(daemons, d, tuple(jobs), policy, started)
        procs = {job: nn.start_ranks(perf_cmd(build, op, nbytes, iters), job, tokens[job], d, coord.port)
                 for job, (op, nbytes, iters) in jobs.items()}
        bw = {job: busbw(nn.finish(procs[job], f"job {job}"), jobs[job][1]) for job in jobs}
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for job in jobs:
            m = re.search(rf'^collserve_job_data_path_seconds_total\{{collserve_job="{job}",priority_class="\w+"\}} (\S+)$',
                          text, re.M)
            out[job] = (float(m.group(1)) if m else 0.0, bw[job])
        return out
    finally:
        for s in reversed(started):
            s.stop()
        shutil.rmtree(d, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    p.add_argument("--iters", type=int, default=40, help="operations of job B; C's are sized to last as long")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    build = os.path.abspath(a.build)
    # C's iterations to last about as long as B's, from one op's time alone.
    ar = run(build, {"b": ("all_reduce", 64 << 20, 5)}, {})["b"][1]
    ag = run(build, {"c": ("all_gather", 16 << 20, 5)}, {})["c"][1]
    # busbw = bytes * (n-1)/n / time for all_gather, bytes * 2(n-1)/n / time for all_reduce.
    ar_s, ag_s = 2 * 3 / 4 * (64 << 20) / (ar * 1e9), 3 / 4 * (16 << 20) / (ag * 1e9)
    c_iters = max(10, int(a.iters * ar_s / ag_s))
    print(f"# alone: 64 MiB all_reduce {ar_s * 1e3:.1f} ms, 16 MiB all_gather {ag_s * 1e3:.1f} ms; "
          f"B runs {a.iters}, C {c_iters} ops", flush=True)
    b_ar = ("all_reduce", 64 << 20, a.iters)
    c_ar = ("all_reduce", 64 << 20, a.iters)
    c_ag = ("all_gather", 16 << 20, c_iters)
    configs = {
        "same": ({"b": b_ar, "c": c_ar}, {}),
        "mixed": ({"b": b_ar, "c": c_ag}, {}),
        "weighted": ({"b": b_ar, "c": c_ag}, {"b": {"share_weight": 2}}),
    }
    alone = {"b all_reduce": [], "c all_gather": []}
    results = {k: [] for k in configs}
    for rep in range(a.reps):
        alone["b all_reduce"].append(run(build, {"b": b_ar}, {})["b"][1])
        for k, (jobs, policy) in configs.items():
            results[k].append(run(build, jobs, policy))
        alone["c all_gather"].append(run(build, {"c": c_ag}, {})["c"][1])
        print(f"# repetition {rep + 1} of {a.reps} done", flush=True)

    med = statistics.median
    print(f"\n{'configuration':<10} {'B share':>8} {'C share':>8} {'B thread s':>11} {'C thread s':>11} "
          f"{'B busbw':>8} {'C busbw':>8}")
    for k, rows in results.items():
        share_b = med([r["b"][0] / (r["b"][0] + r["c"][0]) for r in rows])
        print(f"{k:<10} {share_b:>8.2f} {1 - share_b:>8.2f} {med([r['b'][0] for r in rows]):>11.2f} "
              f"{med([r['c'][0] for r in rows]):>11.2f} {med([r['b'][1] for r in rows]):>8.2f} "
              f"{med([r['c'][1] for r in rows]):>8.2f}")
    for k, xs in alone.items():
        print(f"alone: {k} busbw {med(xs):.2f} GB/s")
    for k in ("same", "mixed"):
        share_b = med([r["b"][0] / (r["b"][0] + r["c"][0]) for r in results[k]])
        ok = 0.4 <= share_b <= 0.6
        print(f"{k}: B's share {share_b:.2f}, C's {1 - share_b:.2f} (target: each in [0.40, 0.60]: "
              f"{'met' if ok else 'missed'})")
    share_b = med([r["b"][0] / (r["b"][0] + r["c"][0]) for r in results["weighted"]])
    print(f"weighted: B's share {share_b:.2f} at weight 2 against 1 (2/3 = 0.67)")


if __name__ == "__main__":
    main()
