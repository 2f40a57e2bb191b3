#!/usr/bin/env python3
"""Rendezvous of K ranks in one run: collserve's registry against torch's TCPStore pattern
(issue 18's targets).

  torch      torch.distributed.TCPStore: a server in this process and K client threads
             (one TCPStore client each, connected before the clock starts; TCPStore's calls
             release the GIL). Each rank does what torch's rendezvous code does with a
             store: set its own address, add 1 to a counter (the last rank sets "ready"),
             wait for "ready", then get all K addresses. K gets per rank: K^2 in all.
  collserve  collserve-rendezvous-bench (bench/rendezvous_bench.cc): K ranks on K/8
             simulated hosts (one gRPC connection each, connected before the clock starts,
             as sidecars are) call Registry.Join at once against a coordinator; each gets
             one answer with every rank's host (the compact answer the sidecars ask for).
  Both clocks run from the first rank's first call to the last rank holding all K
  addresses.

Targets: 256 ranks at least 5x faster than torch; 1024 ranks in under 2 s; 4096 complete
(reported). torch's pattern costs K^2 gets, so it runs only up to --torch_max ranks.
Each K runs --reps paired repetitions (torch, then collserve on a fresh group name); the
ratio is taken per repetition and the median reported, since these VMs drift.

    PYTHONPATH=build/python /usr/bin/python3 bench/rendezvous_bench.py [--ranks 64,256,1024,4096]
        [--torch_max 1024] [--reps 3] [--build build]
"""
import argparse
import datetime
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from store_bench import Coordinator, free_port  # noqa: E402


def torch_rendezvous(ranks, timeout_s):
    """Seconds for K threads to rendezvous through torch's TCPStore (the module docstring)."""
    from torch.distributed import TCPStore
    timeout = datetime.timedelta(seconds=timeout_s)
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timeout, wait_for_workers=False)
    clients = [TCPStore("127.0.0.1", port, is_master=False, timeout=timeout) for _ in range(ranks)]
    start_line = threading.Barrier(ranks + 1, timeout=timeout_s)
    done = [None] * ranks
    errors = []

    def rank_main(rank):
        store = clients[rank]
        try:
            start_line.wait()
            store.set(f"addr/{rank}", f"10.0.{rank // 256}.{rank % 256}:29500")
            if store.add("joined", 1) == ranks:
                store.set("ready", "1")
            store.wait(["ready"])
            addresses = [store.get(f"addr/{r}") for r in range(ranks)]
            if len(addresses) != ranks or addresses[-1] != f"10.0.{(ranks - 1) // 256}.{(ranks - 1) % 256}:29500".encode():
                raise RuntimeError(f"rank {rank} got wrong addresses")
            done[rank] = time.perf_counter()
        except Exception as e:  # reported after the join
            errors.append(f"rank {rank}: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    start_line.wait()
    start = time.perf_counter()
    for t in threads:
        t.join(timeout_s)
    if errors or any(d is None for d in done):
        raise SystemExit(f"torch rendezvous of {ranks} ranks failed: {errors[:3] or 'timed out'}")
    del clients, server
    return max(done) - start


def collserve_rendezvous(build, coordinator, ranks, group, timeout_s):
    """(seconds, answer bytes) of collserve-rendezvous-bench against `coordinator`."""
    argv = [os.path.join(build, "bench", "collserve-rendezvous-bench"), f"--coordinator={coordinator.address}",
            f"--ranks={ranks}", f"--group={group}", f"--token={coordinator.token}", f"--timeout_s={timeout_s}"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 60)
    m = re.search(r"seconds=([0-9.]+) answer_bytes=([0-9]+)", r.stdout)
    if r.returncode != 0 or not m:
        raise SystemExit(f"collserve rendezvous of {ranks} ranks failed: {r.stdout}{r.stderr}")
    return float(m.group(1)), int(m.group(2))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=os.path.join(os.path.dirname(HERE), "build"))
    p.add_argument("--ranks", default="64,256,1024,4096")
    p.add_argument("--torch_max", type=int, default=1024, help="largest K torch's pattern runs at")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout_s", type=int, default=300)
    a = p.parse_args()
    build = os.path.abspath(a.build)
    work = tempfile.mkdtemp(prefix="collserve-rendezvous-bench.")
    coordinator = Coordinator(build, work, durable=False)
    try:
        print(f"# rendezvous_bench: {a.reps} paired repetitions; collserve: 8 ranks per simulated host")
        print(f"{'ranks':>6} | {'torch s':>9} | {'collserve s':>11} | {'answer B':>8} | torch/collserve per rep | "
              f"median | target")
        for ranks in [int(k) for k in a.ranks.split(",")]:
            torch_s, ours_s, ratios, size = [], [], [], 0
            for rep in range(a.reps):
                if ranks <= a.torch_max:
                    torch_s.append(torch_rendezvous(ranks, a.timeout_s))
                seconds, size = collserve_rendezvous(build, coordinator, ranks, f"rdzv-{ranks}-{rep}", a.timeout_s)
                ours_s.append(seconds)
                if torch_s:
                    ratios.append(torch_s[-1] / seconds)
            median_torch = f"{statistics.median(torch_s):9.4f}" if torch_s else f"{'-':>9}"
            median_ours = statistics.median(ours_s)
            ratio = statistics.median(ratios) if ratios else None
            if ranks == 256:
                target = f"{'met' if ratio and ratio >= 5 else 'NOT met'} (>= 5x torch)"
            elif ranks == 1024:
                target = f"{'met' if median_ours < 2 else 'NOT met'} (< 2 s)"
            elif ranks == 4096:
                target = "completes (reported)"
            else:
                target = "-"
            per_rep = " ".join(f"{x:.1f}x" for x in ratios) or "-"
            median_ratio = f"{ratio:.1f}x" if ratio else "-"
            print(f"{ranks:>6} | {median_torch} | {median_ours:11.4f} | {size:>8} | {per_rep:<23} | "
                  f"{median_ratio:>6} | {target}", flush=True)
    finally:
        coordinator.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
