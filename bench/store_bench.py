#!/usr/bin/env python3
"""Store writes in one run: collserve's durable store (--data_dir, group commit) against
torch's TCPStore, whose server keeps nothing on disk (issue 18's targets).

  (a) add() throughput with C concurrent clients (one process each, C in --clients,
      default 1 and 16), every client adding to its own counter for --seconds:
        torch      torch.distributed.TCPStore: a server in this process, TCPStore clients;
        durable    collserve's gRPC store API (collserve.Store) against a coordinator with
                   --data_dir in a fresh directory under --dir (default: the system's temp
                   dir; put it on the disk you mean to measure);
        memory     the same coordinator without --data_dir (what durability costs);
        endpoint   torch's own TCPStore clients against the durable coordinator's
                   TCPStore-compatible endpoint (--tcpstore_address);
        ep-memory  the same against the memory-only coordinator's endpoint;
        etcd       with --etcd: collserve's gRPC store API against a coordinator keeping the
                   store in etcd (--etcd_endpoints; one etcd member started by the bench
                   with its data under --dir, Debian's etcd-server), the replicated backend;
        ep-etcd    torch's TCPStore clients against that coordinator's endpoint.
      Target: durable writes with 16 clients >= torch with 16 clients, judged on the
      endpoint (the same client and wire protocol as torch's; the gRPC column adds the cost
      of gRPC and the Python SDK, which the memory column shows).
  (b) one client's durable add() latency (median of --latency_ops sequential adds), through
      the endpoint (torch's TCPStore client) and through gRPC (collserve.Store), against
      the median of as many 64-byte write + fdatasync pairs on a file in the same
      directory, measured in the same run; and, for scale, the same client's add() against
      torch's own (memory-only) TCPStore server. Target: at most one fdatasync + 200 us.

Each part runs --reps paired repetitions (torch and collserve alternate; the ratio is
taken per repetition and the median reported), since these VMs drift from run to run.

    PYTHONPATH=build/python /usr/bin/python3 bench/store_bench.py [--clients 1,16]
        [--seconds 3] [--reps 3] [--latency_ops 300] [--dir DIR] [--build build] [--etcd]
"""
import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(kind, address, seconds, ready, go, token):
    """One client process: connect, say ready, wait for go, add for `seconds`, print the count."""
    host, port = address.rsplit(":", 1)
    key = f"bench/{os.getpid()}"
    if kind in ("torch", "endpoint"):
        import datetime
        from torch.distributed import TCPStore
        store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    else:
        import collserve
        store = collserve.Store(address=address, token=token)
    store.add(key, 1)
    open(ready, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise SystemExit("no go")
        time.sleep(0.002)
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        store.add(key, 1)
        n += 1
    print(n)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc):
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Etcd:
    """One etcd member (Debian's etcd-server) on loopback, its data in a fresh directory."""

    def __init__(self, work):
        self.dir = tempfile.mkdtemp(prefix="etcd.", dir=work)
        client, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{client}"
        self.proc = subprocess.Popen(
            ["etcd", "--name=bench", f"--data-dir={self.dir}/data", f"--listen-client-urls=http://{self.endpoint}",
             f"--advertise-client-urls=http://{self.endpoint}", f"--listen-peer-urls=http://127.0.0.1:{peer}",
             f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
             f"--initial-cluster=bench=http://127.0.0.1:{peer}", "--log-level=error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", client), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("etcd did not start (is Debian's etcd-server installed?)")
                time.sleep(0.05)

    def stop(self):
        stop_process(self.proc)


class Coordinator:
    """A collserve coordinator with a gRPC port and a TCPStore endpoint: durable (--data_dir),
    in memory, or with its store in etcd (etcd_endpoint)."""

    def __init__(self, build, work, durable, etcd_endpoint=None, extra_args=(), env=None):
        sys.path.insert(0, os.path.join(build, "python"))
        from collserve.launch import embedded_credentials
        self.dir = tempfile.mkdtemp(prefix="coord.", dir=work)
        self.token, flags = embedded_credentials(self.dir, "default")
        argv = [os.path.join(build, "server", "collserve-coordinator"), "--listen_address=127.0.0.1:0",
                "--metrics_address=", "--log_level=warning", f"--port_file={self.dir}/port",
                "--tcpstore_address=127.0.0.1:0", f"--tcpstore_port_file={self.dir}/tcpport", *flags]
        if durable:
            argv.append(f"--data_dir={self.dir}/data")
        if etcd_endpoint:
            argv.append(f"--etcd_endpoints={etcd_endpoint}")
        argv.extend(extra_args)  # later flags win (absl): e.g. a --metrics_address
        self.proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 30
        # The TCPStore port file is written first (each is renamed into place whole).
        while not os.path.exists(f"{self.dir}/port"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("collserve-coordinator did not start")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{open(f'{self.dir}/port').read().strip()}"
        self.tcpstore = f"127.0.0.1:{open(f'{self.dir}/tcpport').read().strip()}"

    def stop(self):
        stop_process(self.proc)


def throughput(build, work, kind, address, clients, seconds, token=""):
    """Adds per second of `clients` processes together."""
    d = tempfile.mkdtemp(prefix=f"{kind}.", dir=work)
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", kind, address, str(seconds),
                               f"{d}/ready{i}", f"{d}/go", token], stdout=subprocess.PIPE, text=True, env=env)
             for i in range(clients)]
    try:
        deadline = time.monotonic() + 120
        while sum(os.path.exists(f"{d}/ready{i}") for i in range(clients)) < clients:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise SystemExit(f"{kind}: a client did not start")
            time.sleep(0.01)
        open(f"{d}/go", "w").close()
        total = 0
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 120)
            if p.returncode != 0:
                raise SystemExit(f"{kind}: a client failed")
            total += int(out.strip())
        return total / seconds
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def fsync_latency(directory, n):
    """Median seconds of a 64-byte append + fdatasync on a file in `directory`."""
    path = os.path.join(directory, "fsync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    times = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            os.write(fd, b"x" * 64)
            os.fdatasync(fd)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        os.unlink(path)
    return statistics.median(times)


def add_latency(address, token, n):
    """Median seconds of one add(): torch's TCPStore client when token is None."""
    if token is None:
        import datetime
        from torch.distributed import TCPStore
        host, port = address.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    else:
        import collserve
        store = collserve.Store(address=address, token=token)
    store.add("latency", 1)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        store.add("latency", 1)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, address, seconds, ready, go, token = sys.argv[2:8]
        worker(kind, address, float(seconds), ready, go, token)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=os.path.join(os.path.dirname(HERE), "build"))
    p.add_argument("--clients", default="1,16")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--latency_ops", type=int, default=300)
    p.add_argument("--dir", default=None, help="where the durable store's data_dir goes")
    p.add_argument("--etcd", action="store_true", help="also measure the store in etcd (etcd and ep-etcd)")
    a = p.parse_args()
    build = os.path.abspath(a.build)
    sys.path.insert(0, os.path.join(build, "python"))
    from torch.distributed import TCPStore
    import datetime

    work = tempfile.mkdtemp(prefix="collserve-store-bench.", dir=a.dir)
    try:
        print(f"# store_bench: {a.reps} paired repetitions, {a.seconds:g} s per measurement, data in {work}")
        print("## (a) add() per second, all clients together")
        print(f"{'clients':>7} | {'torch':>9} | {'durable':>9} | {'memory':>9} | {'endpoint':>9} | {'ep-memory':>9} | "
              f"endpoint/torch per rep | median | target" + (" | etcd | ep-etcd" if a.etcd else ""))
        for clients in [int(c) for c in a.clients.split(",")]:
            results = {"torch": [], "durable": [], "memory": [], "endpoint": [], "ep-memory": [], "etcd": [],
                       "ep-etcd": []}
            for _ in range(a.reps):
                port = free_port()
                server = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60),
                                  wait_for_workers=False)
                results["torch"].append(throughput(build, work, "torch", f"127.0.0.1:{port}", clients, a.seconds))
                del server
                for kind, durable in (("durable", True), ("memory", False)):
                    coord = Coordinator(build, work, durable)
                    try:
                        results[kind].append(throughput(build, work, kind, coord.address, clients, a.seconds,
                                                        coord.token))
                        results["endpoint" if durable else "ep-memory"].append(
                            throughput(build, work, "endpoint", coord.tcpstore, clients, a.seconds))
                    finally:
                        coord.stop()
                if a.etcd:
                    etcd = Etcd(work)
                    try:
                        coord = Coordinator(build, work, False, etcd.endpoint)
                        try:
                            results["etcd"].append(throughput(build, work, "etcd", coord.address, clients, a.seconds,
                                                              coord.token))
                            results["ep-etcd"].append(throughput(build, work, "endpoint", coord.tcpstore, clients,
                                                                 a.seconds))
                        finally:
                            coord.stop()
                    finally:
                        etcd.stop()
            ratios = [d / t for d, t in zip(results["endpoint"], results["torch"])]
            med = {k: statistics.median(v) for k, v in results.items() if v}
            target = ">= 1" if clients >= 16 else "-"
            print(f"{clients:>7} | {med['torch']:>9.0f} | {med['durable']:>9.0f} | {med['memory']:>9.0f} | "
                  f"{med['endpoint']:>9.0f} | {med['ep-memory']:>9.0f} | {' '.join(f'{r:.2f}' for r in ratios):<22} | "
                  f"{statistics.median(ratios):.2f} | {target}" +
                  (f" | {med['etcd']:>6.0f} | {med['ep-etcd']:>7.0f}" if a.etcd else ""))
        print("## (b) one client's durable add() latency against one fdatasync on the same disk")
        print(f"{'rep':>3} | {'fdatasync':>9} | {'torch (memory)':>14} | {'endpoint':>8} | {'gRPC':>6} | "
              f"endpoint - fdatasync | gRPC - fdatasync | target (us)")
        for rep in range(a.reps):
            port = free_port()
            server = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60),
                              wait_for_workers=False)
            torch_add = add_latency(f"127.0.0.1:{port}", None, a.latency_ops)
            del server
            coord = Coordinator(build, work, True)
            try:
                sync = fsync_latency(coord.dir, a.latency_ops)
                endpoint = add_latency(coord.tcpstore, None, a.latency_ops)
                grpc = add_latency(coord.address, coord.token, a.latency_ops)
            finally:
                coord.stop()
            us = lambda s: s * 1e6
            print(f"{rep:>3} | {us(sync):>9.0f} | {us(torch_add):>14.0f} | {us(endpoint):>8.0f} | {us(grpc):>6.0f} | "
                  f"{us(endpoint - sync):>20.0f} | {us(grpc - sync):>16.0f} | <= 200")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
