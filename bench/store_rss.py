#!/usr/bin/env python3
"""Whether the coordinator's memory levels off under store load (issue 41, finding 9: RSS
grew about 0.3 MB/s under 64 clients over 60 s).

A durable coordinator (--data_dir in a fresh directory) serves --clients store clients
(threads, each with its own collserve.Store connection) that, for --seconds, loop over
set / get / add on their own --keys keys each (64 x 100 = 6,400 keys by default), every
write exactly-once (a request id each, which the coordinator remembers: the last
--store_max_request_ids of them, 65,536 by default). Every --sample seconds it prints the
coordinator's VmRSS, its heap's live and free bytes (collserve_heap_allocated_bytes and
collserve_heap_free_bytes from its /metrics), the operations done so far and the store's key
count; at the end the RSS at 1, 5 and 10 minutes (or the fractions of --seconds that exist)
and the growth of each over the second half of the run. RSS that grows while the live heap
stays flat is the allocator's retention, not a leak; --malloc_arena_max N runs the
coordinator with MALLOC_ARENA_MAX=N to compare.

    PYTHONPATH=build/python /usr/bin/python3 bench/store_rss.py [--seconds 600] [--clients 64]
        [--keys 100] [--sample 10] [--malloc_arena_max N] [--build build] [--dir DIR]
"""
import argparse
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from store_bench import Coordinator  # noqa: E402


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def heap_bytes(metrics_port):
    """(allocated, free) from the coordinator's /metrics; (-1, -1) if the scrape fails."""
    values = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name in ("collserve_heap_allocated_bytes", "collserve_heap_free_bytes"):
                    values[name] = float(value)
    except OSError:
        pass
    return (values.get("collserve_heap_allocated_bytes", -1), values.get("collserve_heap_free_bytes", -1))


def client(address, token, index, keys, stop, counts):
    import collserve
    store = collserve.Store(address=address, token=token)
    n = 0
    i = 0
    while not stop.is_set():
        key = f"rss/{index}/{i % keys}"
        store.set(key, b"v" * 64)
        store.get(key)
        store.add(f"rss/{index}/counter", 1)
        n += 3
        i += 1
    counts[index] = n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--keys", type=int, default=100)
    p.add_argument("--sample", type=float, default=10)
    p.add_argument("--malloc_arena_max", type=int, default=0, help="MALLOC_ARENA_MAX for the coordinator (0: unset)")
    p.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="collserve-store-rss-", dir=a.dir)
    metrics_port = free_port()
    env = dict(os.environ)
    if a.malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(a.malloc_arena_max)
    coordinator = Coordinator(os.path.abspath(a.build), work, durable=True,
                              extra_args=[f"--metrics_address=127.0.0.1:{metrics_port}"], env=env)
    import collserve
    stop = threading.Event()
    counts = [0] * a.clients
    threads = [threading.Thread(target=client, args=(coordinator.address, coordinator.token, i, a.keys, stop, counts),
                                daemon=True) for i in range(a.clients)]
    samples = []  # (seconds, rss, heap allocated, heap free)
    try:
        start = time.monotonic()
        for t in threads:
            t.start()
        probe = collserve.Store(address=coordinator.address, token=coordinator.token)
        while True:
            now = time.monotonic() - start
            rss = rss_bytes(coordinator.proc.pid)
            allocated, free = heap_bytes(metrics_port)
            samples.append((now, rss, allocated, free))
            print(f"t={now:6.0f} s  rss={rss / 2**20:7.1f} MiB  heap allocated={allocated / 2**20:7.1f} MiB  "
                  f"free={free / 2**20:6.1f} MiB  keys={probe.num_keys()}", flush=True)
            if now >= a.seconds:
                break
            time.sleep(min(a.sample, max(a.seconds - now, 0.1)))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        coordinator.stop()

    def at(seconds):
        return min(samples, key=lambda s: abs(s[0] - seconds))

    print(f"{a.clients} clients, {sum(counts)} operations in {samples[-1][0]:.0f} s")
    if a.malloc_arena_max:
        print(f"MALLOC_ARENA_MAX={a.malloc_arena_max}")
    for minute in (1, 5, 10, 30, 60):
        if minute * 60 <= a.seconds:
            t, rss, allocated, free = at(minute * 60)
            print(f"at minute {minute}: RSS {rss / 2**20:.1f} MiB, heap allocated {allocated / 2**20:.1f} MiB, "
                  f"free {free / 2**20:.1f} MiB (t={t:.0f} s)")
    half = at(a.seconds / 2)
    end = samples[-1]
    span = max(end[0] - half[0], 1)
    for i, what in ((1, "RSS"), (2, "heap allocated"), (3, "heap free")):
        print(f"{what} growth over the second half: {(end[i] - half[i]) / 2**20:+.1f} MiB "
              f"({(end[i] - half[i]) / 2**20 / span:+.4f} MiB/s)")


if __name__ == "__main__":
    main()
