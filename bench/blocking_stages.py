#!/usr/bin/env python3
"""Where a blocking collective's time goes (issue 43): runs bench/torch_perf.py with -z 1
(each op waited for before the next, as `dist.all_gather(outs, t)` without async_op) under
`collserve launch`, once with torch's Gloo and once with the collserve backend, and for the
collserve run reads the embedded sidecar's per-job stage counters
(collserve_job_stage_seconds_total: queued, agree, execute, complete) from its /metrics
while the ranks run. Prints, per op and size, each backend's us per op and the sidecar's
mean us per collective in each stage; what is left of collserve's time is the client side
(the rank's copy in, the session's messages, the completion lane, the copy out).

    PYTHONPATH=build/python python3 bench/blocking_stages.py -o all_gather -s 1M 64M --reps 3
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ("queued", "agree", "execute", "complete")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(backend, op, size, n, w, nproc, metrics_port=None):
    """us per op (torch_perf's time column) and, with metrics_port, the last scrape."""
    cmd = [sys.executable, "-m", "collserve.launch", "--nproc_per_node", str(nproc), "--no_prefix"]
    if metrics_port:
        cmd.append(f"--sidecar_flag=--metrics_address=127.0.0.1:{metrics_port}")
    cmd += [os.path.join(HERE, "torch_perf.py"), "--backend", backend, "-b", size, "-e", size, "-n", str(n),
            "-w", str(w), "-o", op, "-z", "1"]
    scrape = {"text": ""}
    done = threading.Event()

    def poll():
        while not done.wait(0.2):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
                    scrape["text"] = r.read().decode()
            except OSError:
                pass
    poller = threading.Thread(target=poll, daemon=True)
    if metrics_port:
        poller.start()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    done.set()
    if out.returncode != 0:
        sys.exit(f"{backend} {op} {size} failed:\n{out.stdout}\n{out.stderr}")
    rows = [line.split() for line in out.stdout.splitlines() if line.strip() and not line.startswith("#")]
    us = float(rows[-1][5] if rows[-1][5] != "N/A" else rows[-1][9])
    return us, scrape["text"]


def stages(text):
    """Mean us per collective in each stage (every job summed), and the collectives counted."""
    def total(pattern):
        return sum(float(v) for v in re.findall(pattern, text, re.M))
    n = total(r'^collserve_job_collectives_total\{[^}]*\} (\S+)$')
    if n == 0:
        return None, 0
    return {s: total(r'^collserve_job_stage_seconds_total\{[^}]*stage="%s"[^}]*\} (\S+)$' % s) / n * 1e6
            for s in STAGES}, n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", nargs="+", default=["all_gather"])
    p.add_argument("-s", nargs="+", default=["1M", "64M"])
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    print(f"# {a.nproc} ranks on one host, -z 1, -n {a.n} -w {a.w}, {a.reps} paired repetitions (medians); "
          "stage columns: the sidecar's mean us per collective (warm-up included)")
    print("| op | size | gloo us | collserve us | ratio | queued | agree | execute | complete | client side |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op in a.o:
        for size in a.s:
            gloo, cs, st = [], [], {s: [] for s in STAGES}
            for _ in range(a.reps):
                gloo.append(run("gloo", op, size, a.n, a.w, a.nproc)[0])
                us, text = run("collserve", op, size, a.n, a.w, a.nproc, metrics_port=free_port())
                cs.append(us)
                mean, _ = stages(text)
                for s in STAGES:
                    st[s].append(mean[s] if mean else float("nan"))
            g, c = statistics.median(gloo), statistics.median(cs)
            m = {s: statistics.median(v) for s, v in st.items()}
            print(f"| {op} | {size} | {g:.0f} | {c:.0f} | {g / c:.2f} | " +
                  " | ".join(f"{m[s]:.0f}" for s in STAGES) + f" | {c - sum(m.values()):.0f} |", flush=True)


if __name__ == "__main__":
    main()
