#!/usr/bin/env python3
"""Noisy neighbor on one host (issue 43): two jobs share one sidecar. Job A (4 ranks, the
Python SDK) times 8-byte and 256 KiB all_reduces one at a time; job B (4 ranks,
collserve-perf with arena tensors) runs 64 MiB all_reduces back to back. In one run, with
--reps paired repetitions of each configuration in turn:

  alone       A alone, then B alone (B's busbw alone, A's p50/p99 alone)
  classes     A and B at once, A PRIORITY_CLASS_LATENCY_CRITICAL and B PRIORITY_CLASS_BULK
  no_lane     the same with the sidecar's --bulk_nice=0: B's threads at the sidecar's priority,
              sharing the workers with A (the data path before the bulk lane)
  equal       A and B at once, both of the default class (fair share)
  a_hogs      A alone beside one CPU-bound process per core at nice +10 (the bulk lane's
              priority, --bulk_nice): the floor of A's tail on this host when anything at
              all runs beside it, whatever the sidecar schedules

The operator's policies file sets the classes (docs/operations.md "Sharing a host between
jobs"); every configuration starts a fresh coordinator and sidecar. Prints A's p50 and p99
per size and B's busbw, medians over the repetitions, and the ratios the issue sets targets
for: A's p99 shared / alone (target at most 2 with A in the better class) and B's busbw
shared / alone (target at least 0.7), with each job's thread time and mean wait from the
sidecar's collserve_job_data_path_* counters.

The same pair on torch's Gloo in the same run (--gloo, on by default): A's loop on torch
tensors and B's 64 MiB all_reduces back to back, each job its own 4 processes and Gloo
ranks, nothing shared but the cores: A alone, B alone, and both at once. That is the
floor a service sharing one host's cores can be held to: what the operating system alone
makes of two jobs.

Two hosts over a shaped link: bench/noisy_neighbor_hosts.py.

    PYTHONPATH=build/python /usr/bin/python3 bench/noisy_neighbor.py [--build build] [--seconds 6] [--reps 3]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = (8, 256 * 1024)  # A's all_reduce sizes, bytes
BULK_BYTES = 64 << 20    # B's


def time_all_reduces(dist, ones, zeros, seconds):
    """Job A's loop on `dist` (collserve's SDK or torch.distributed, initialized): alternates
    the two sizes for `seconds`, timing each all_reduce one at a time; rank 0 prints
    {size: [p50_us, p99_us, n]} as JSON. `ones(n)` / `zeros(n)` make float32 tensors."""
    bufs = {s: ones(max(s // 4, 1)) for s in SIZES}
    for _ in range(20):  # warm up: staging segments made, paths taken once
        for b in bufs.values():
            dist.all_reduce(b)
    # Every rank runs the same number of ops: rank 0 decides when time is up.
    lat = {s: [] for s in SIZES}
    end = time.monotonic() + seconds
    flag = zeros(1)
    while True:
        for s, b in bufs.items():
            t = time.perf_counter()
            dist.all_reduce(b)
            lat[s].append((time.perf_counter() - t) * 1e6)
        flag[0] = 1.0 if (dist.get_rank() == 0 and time.monotonic() >= end) else 0.0
        dist.all_reduce(flag)
        if flag[0] > 0:
            break
    if dist.get_rank() == 0:
        out = {}
        for s, v in lat.items():
            v.sort()
            out[s] = [v[len(v) // 2], v[min(len(v) - 1, int(len(v) * 0.99))], len(v)]
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def rank_a(seconds):
    """One rank of job A through collserve's Python SDK (numpy arrays)."""
    import numpy as np
    import collserve as dist
    dist.init_process_group()
    time_all_reduces(dist, lambda n: np.ones(n, dtype=np.float32), lambda n: np.zeros(n, dtype=np.float32), seconds)


def rank_a_gloo(seconds):
    """One rank of job A on torch's Gloo (torch tensors)."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    time_all_reduces(dist, lambda n: torch.ones(n, dtype=torch.float32),
                     lambda n: torch.zeros(n, dtype=torch.float32), seconds)


def rank_b_gloo(iters):
    """Job B on torch's Gloo: `iters` 64 MiB all_reduces back to back after 2 of warm-up;
    rank 0 prints the busbw (GB/s, nccl-tests' 2(n-1)/n factor) as its last line."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(BULK_BYTES // 4, dtype=torch.float32)
    for _ in range(2):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    per_op = (time.perf_counter() - start) / iters
    n = dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"{2 * (n - 1) / n * BULK_BYTES / per_op / 1e9:.4f}", flush=True)
    dist.destroy_process_group()


def run_gloo(a, with_a, with_b, b_iters):
    """One configuration of the pair on torch's Gloo: (A's {size: [p50, p99, n]} or None,
    B's busbw or None). Each job rendezvouses through its own TCPStore (MASTER_PORT)."""
    b_procs = a_procs = []
    if with_b:
        b_procs = start_ranks([sys.executable, os.path.abspath(__file__), "--rank_b_gloo", str(b_iters)], "b", "",
                              "", free_port())
    if with_a:
        if with_b:
            time.sleep(1.0)
        a_procs = start_ranks([sys.executable, os.path.abspath(__file__), "--rank_a_gloo", str(a.seconds)], "a", "",
                              "", free_port())
    lat = json.loads(finish(a_procs, "job A (gloo)").strip().splitlines()[-1]) if with_a else None
    bw = float(finish(b_procs, "job B (gloo)").strip().splitlines()[-1]) if with_b else None
    return lat, bw, None  # no sidecar: no thread counters


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemons_module(build):
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    os.environ.setdefault("COLLSERVE_BUILD_DIR", build)
    import daemons
    return daemons


def start_ranks(cmd, job, token, d, port, env_extra=None):
    procs = []
    for r in range(4):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="4",
                   COLLSERVE_SIDECAR=f"unix:{d}/s.sock", COLLSERVE_JOB=job, COLLSERVE_TOKEN=token,
                   COLLSERVE_COORDINATOR=f"127.0.0.1:{port}", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   COLLSERVE_INIT_TIMEOUT_S="60", COLLSERVE_OP_TIMEOUT_S="120", OMP_NUM_THREADS="1",
                   **(env_extra or {}))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs, what):
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, o in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"{what} failed (exit {p.returncode}):\n{o}")
    return outs[0]


def busbw(perf_out):
    """The in-place busbw (GB/s) of collserve-perf's one row."""
    for line in perf_out.splitlines():
        f = line.split()
        if f and f[0].isdigit() and int(f[0]) == BULK_BYTES:
            return float(f[11])
    raise SystemExit(f"no {BULK_BYTES}-byte row in:\n{perf_out}")


def cpu_hogs():
    """One busy-looping process per core at nice +10 (the caller kills them)."""
    return [subprocess.Popen([sys.executable, "-c", "import os\nos.nice(10)\nwhile True: pass"])
            for _ in range(os.cpu_count() or 1)]


def run_beside_hogs(a, build, b_iters):
    hogs = cpu_hogs()
    try:
        return run(a, build, {}, True, False, b_iters)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def start_daemons(daemons, d, jobs, policy, started, sidecar_flags=()):
    """A coordinator with a token per job of `jobs` and the operator's `policy` ({job:
    JobPolicy as JSON}), and one sidecar with metrics, both appended to `started`: returns
    (the coordinator, {job: token}, the sidecar's metrics port)."""
    flags, tokens = daemons.credentials(d, jobs)
    with open(os.path.join(d, "policies.json"), "w") as f:
        json.dump({"jobs": policy}, f)
    coord = daemons.start_coordinator(d, *flags, f"--job_policies_file={d}/policies.json")
    started.append(coord)
    metrics_port = daemons.free_port()
    started.append(daemons.start_sidecar(d, coord.port, f"--unix_socket={d}/s.sock",
                                         f"--metrics_address=127.0.0.1:{metrics_port}", *sidecar_flags))
    return coord, tokens, metrics_port


def run(a, build, policy, with_a, with_b, b_iters, sidecar_flags=()):
    """One configuration: returns (A's {size: [p50, p99, n]} or None, B's busbw or None,
    {job: (thread seconds, mean wait us)})."""
    daemons = daemons_module(build)
    d = tempfile.mkdtemp(prefix="collserve-noisy.")
    started = []
    try:
        coord, tokens, metrics_port = start_daemons(daemons, d, ("a", "b"), policy, started, sidecar_flags)
        b_procs = a_procs = []
        if with_b:
            perf = [os.path.join(build, "bench", "collserve-perf"), "-b", str(BULK_BYTES), "-e", str(BULK_BYTES),
                    "-n", str(b_iters), "-w", "2", "-o", "all_reduce", "-d", "float", "-m", "arena"]
            b_procs = start_ranks(perf, "b", tokens["b"], d, coord.port)
        if with_a:
            if with_b:
                time.sleep(1.0)  # B's ranks attach and start their loop first
            a_procs = start_ranks([sys.executable, os.path.abspath(__file__), "--rank_a", str(a.seconds)], "a",
                                  tokens["a"], d, coord.port)
        lat = json.loads(finish(a_procs, "job A").strip().splitlines()[-1]) if with_a else None
        bw = busbw(finish(b_procs, "job B")) if with_b else None
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            text = r.read().decode()
        use = {}
        for job in ("a", "b"):
            def value(name):
                m = re.search(rf'^{name}\{{collserve_job="{job}",priority_class="\w+"\}} (\S+)$', text, re.M)
                return float(m.group(1)) if m else 0.0
            loops = value("collserve_job_data_path_loops_total")
            use[job] = (value("collserve_job_data_path_seconds_total"),
                        value("collserve_job_data_path_wait_seconds_total") / loops * 1e6 if loops else 0.0)
        return lat, bw, use
    finally:
        for s in reversed(started):
            s.stop()
        shutil.rmtree(d, ignore_errors=True)


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--rank_a":
        return rank_a(float(sys.argv[2]))
    if len(sys.argv) >= 3 and sys.argv[1] == "--rank_a_gloo":
        return rank_a_gloo(float(sys.argv[2]))
    if len(sys.argv) >= 3 and sys.argv[1] == "--rank_b_gloo":
        return rank_b_gloo(int(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    p.add_argument("--seconds", type=float, default=6.0, help="how long job A runs in each configuration")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-gloo", dest="gloo", action="store_false", help="leave out the pair on torch's Gloo")
    a = p.parse_args()
    build = os.path.abspath(a.build)
    classes = {"a": {"priority_class": "PRIORITY_CLASS_LATENCY_CRITICAL"}, "b": {"priority_class": "PRIORITY_CLASS_BULK"}}
    # B's iterations to last about A's seconds, from one op's time alone.
    _, bw0, _ = run(a, build, {}, False, True, 5)
    op_s = 2 * 3 / 4 * BULK_BYTES / (bw0 * 1e9)
    b_iters = max(10, int((a.seconds + 2) / op_s))
    print(f"# B alone: {bw0:.2f} GB/s busbw, {op_s * 1e3:.1f} ms per 64 MiB all_reduce; B runs {b_iters} ops "
          f"per configuration", flush=True)
    names = ("a_alone", "b_alone", "classes", "no_lane", "equal", "a_hogs") + (("gloo_a_alone", "gloo_b_alone", "gloo_shared") if a.gloo else ())
    results = {k: [] for k in names}
    for rep in range(a.reps):
        results["a_alone"].append(run(a, build, classes, True, False, b_iters))
        results["b_alone"].append(run(a, build, classes, False, True, b_iters))
        results["classes"].append(run(a, build, classes, True, True, b_iters))
        results["no_lane"].append(run(a, build, classes, True, True, b_iters, ["--bulk_nice=0"]))
        results["equal"].append(run(a, build, {}, True, True, b_iters))
        results["a_hogs"].append(run_beside_hogs(a, build, b_iters))
        if a.gloo:
            results["gloo_a_alone"].append(run_gloo(a, True, False, b_iters))
            results["gloo_b_alone"].append(run_gloo(a, False, True, b_iters))
            results["gloo_shared"].append(run_gloo(a, True, True, b_iters))
        print(f"# repetition {rep + 1} of {a.reps} done", flush=True)

    def med(xs):
        return statistics.median(xs)
    print(f"\n{'configuration':<12} {'A 8 B p50/p99 us':>18} {'A 256 KiB p50/p99 us':>22} {'B busbw GB/s':>13} "
          f"{'A, B thread s':>14} {'A, B mean wait us':>18}")
    for k, rows in results.items():
        cols = []
        for s in SIZES:
            if rows[0][0] is None:
                cols.append("-")
            else:
                cols.append(f"{med([r[0][str(s)][0] for r in rows]):.0f}/{med([r[0][str(s)][1] for r in rows]):.0f}")
        bw = f"{med([r[1] for r in rows]):.2f}" if rows[0][1] is not None else "-"
        thread = wait = "-"
        if rows[0][2] is not None:
            thread = f"{med([r[2]['a'][0] for r in rows]):.2f}, {med([r[2]['b'][0] for r in rows]):.2f}"
            wait = f"{med([r[2]['a'][1] for r in rows]):.0f}, {med([r[2]['b'][1] for r in rows]):.0f}"
        print(f"{k:<12} {cols[0]:>18} {cols[1]:>22} {bw:>13} {thread:>14} {wait:>18}")
    pairs = [("classes", "a_alone", "b_alone"), ("no_lane", "a_alone", "b_alone"), ("equal", "a_alone", "b_alone")]
    if a.gloo:
        pairs.append(("gloo_shared", "gloo_a_alone", "gloo_b_alone"))
    for k, a_alone, b_alone in pairs:
        for s in SIZES:
            ratio = med([r[0][str(s)][1] for r in results[k]]) / med([r[0][str(s)][1] for r in results[a_alone]])
            print(f"{k}: A's p99 at {s} B shared / alone: {ratio:.2f} (target at most 2.0 for classes)")
        bw = med([r[1] for r in results[k]]) / med([r[1] for r in results[b_alone]])
        print(f"{k}: B's busbw shared / alone: {bw:.2f} (target at least 0.70)")
    for s in SIZES:
        floor = med([r[0][str(s)][1] for r in results["a_hogs"]]) / med([r[0][str(s)][1] for r in results["a_alone"]])
        lane = med([r[0][str(s)][1] for r in results["classes"]]) / med([r[0][str(s)][1] for r in results["a_hogs"]])
        print(f"floor: A's p99 at {s} B beside nice-10 CPU hogs / alone: {floor:.2f}; classes / beside hogs: {lane:.2f}")


if __name__ == "__main__":
    main()
