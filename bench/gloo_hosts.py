"""Bare Gloo allreduce between N network-namespace hosts, one process per host
(build/bench/collserve-gloo-latency at 4, 16 and 64 MiB, 3 rounds): the transport ceiling of
collserve's cross-host step, which is such an allreduce between the hosts' sidecars.

    sudo PYTHONPATH=build/python python3 bench/gloo_hosts.py N [--build build]

Prints one `gloo_allreduce bytes=B ranks=N mean_us=T median_us=M` line per size and round
(bench/RESULTS.md, 2026-11-29 afternoon). Needs root and `ip` (namespaces, as compare.py).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402  (its Hosts: namespaces over a veth bridge)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hosts", type=int)
    p.add_argument("--build", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    tool = os.path.join(os.path.abspath(a.build), "bench", "collserve-gloo-latency")
    with compare.Hosts(a.hosts) as net:
        for _ in range(a.rounds):
            for size in (4 << 20, 16 << 20, 64 << 20):
                d = tempfile.mkdtemp(prefix="collserve-gloo.")
                try:
                    procs = [subprocess.Popen(["ip", "netns", "exec", net.host(h), tool, f"--store_dir={d}",
                                               f"--rank={h - 1}", f"--world_size={net.n}", f"--hostname={net.ip(h)}",
                                               f"--bytes={size}", "-n=20", "-w=5"],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                             for h in range(1, net.n + 1)]
                    outs = [compare.finish(p, f"collserve-gloo-latency on host {h}", timeout=600)
                            for h, p in enumerate(procs, 1)]
                finally:
                    shutil.rmtree(d, ignore_errors=True)
                print(outs[0].strip(), flush=True)


if __name__ == "__main__":
    main()
