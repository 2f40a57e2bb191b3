#!/usr/bin/env python3
"""Side-by-side: torch.distributed's Gloo (bench/torch_perf.py) and collserve
(build/bench/collserve-perf) in one run, same sizes, same ranks, same machine. Prints the
busbw of both and the ratio collserve / torch Gloo against issue 5's targets:

  (a) one host, 4 ranks (each tool under `collserve launch`, which gives torch its env://
      store and collserve its sidecar): all_reduce, all_gather, broadcast and
      reduce_scatter at 1 MiB and 64 MiB, and the 8-byte all_reduce latency. collserve's
      tensors live in the session's shared-memory arena (collserve-perf -m arena, the
      SDK's AllocateShared); the "heap" column is the same run with ordinary memory, which
      the SDK copies through a staging segment (what a torch tensor gets).
      Then the memory-bandwidth bound for that 64 MiB all_reduce, from this machine's copy and
      sum bandwidth measured in the same run (build/bench/collserve-membw; derivation in
      RESULTS.md), and the fraction of it collserve reached. Last, the all_reduce written
      against torch.distributed with the "collserve" backend (bench/torch_perf.py), with
      torch.zeros tensors (copied through staging) and collserve.torch.empty ones (arena).
  (b) the sidecar's peak resident memory (VmHWM) during a 64 MiB all_reduce among 4 local
      ranks, against the limit 2 x tensor bytes x local ranks + 64 MiB.
  (c) two hosts made with network namespaces (a bridge, one veth per host, needs root and
      `ip`), 2 ranks each: all_reduce from 256 KiB to 64 MiB (target 2.5x), then the 8-byte
      all_reduce against a bare Gloo allreduce between the same two hosts
      (build/bench/collserve-gloo-latency: Gloo alone, one process per host; target 1.5x
      its latency at most). Each host runs its own
      `collserve launch --nnodes 2` (its own sidecar); a coordinator with a TCPStore
      endpoint runs on host 1 and serves torch's env:// rendezvous too. Torch's Gloo
      binds to the hosts' eth0 (GLOO_SOCKET_IFNAME). Messages between the namespaces cost a few
      hundred microseconds with spikes of tens of milliseconds on a small VM, so (c) runs at
      least 20 iterations per size and --reps paired repetitions, and judges the median ratio.
  (d) four such hosts, 1 rank each: all_reduce from 1 MiB to 64 MiB (target 1.5x), with the
      algorithm the sidecars chose.
  (f) the MPI column (issue 45): two and four such hosts, 1 rank each, all_reduce from 1 KiB
      to 64 MiB: collserve over MPI (the sidecars started by one mpirun as one MPI world,
      each in its host's namespace; collserve-perf --backend mpi) against collserve over
      Gloo between the same sidecars (--backend gloo) and against Open MPI's own
      MPI_Allreduce between the same namespaces with no collserve code
      (build/bench/collserve-mpi-allreduce-perf, one process per host), --reps repetitions
      rotating which goes first; in-place busbw medians. Needs a build with MPI and mpirun.
  (e) DistributedDataParallel training (bench/ddp_step.py, a ~25M-parameter MLP, 4 ranks on
      one host, unmodified torch code) with backend "collserve" against "gloo": the median
      step time of each, --reps paired repetitions (target: collserve's steps 1.5x faster).

    PYTHONPATH=build/python /usr/bin/python3 bench/compare.py [-n 10] [-w N (default -n)] [--reps 3]
        [--skip one_host,rss,two_hosts,four_hosts,mpi,ddp]
        [--sidecar_flag=--ring_segment_bytes=N ...]  (flags for the sidecars of (c))
"""
import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# (op, sizes as -b/-e/-f, target busbw ratio in the arena, target with ordinary memory)
CASES = [("all_reduce", "1M", "64M", 64, 3.0, 4.0), ("all_gather", "1M", "64M", 64, 2.0, 2.0),
         ("broadcast", "1M", "64M", 64, 2.0, 2.0), ("reduce_scatter", "1M", "64M", 64, 2.0, 2.0)]


def rows(text):
    """{size: (time_us, busbw, algorithm)} from a collserve-perf/torch_perf table (the filled
    column: out-of-place where there is one, else in-place)."""
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split()
        cols = f[5:9] if f[5] != "N/A" else f[9:13]
        if cols[3] not in ("0", "N/A"):
            raise SystemExit(f"wrong results: {line}")
        out[int(f[0])] = (float(cols[0]), float(cols[2]), f[13] if len(f) > 13 else "")
    return out


def launch(cmd, nproc, build, extra=(), prefix=(), env=None, timeout=1200):
    env = dict(env or os.environ, PYTHONPATH=os.path.join(build, "python"))
    return subprocess.Popen([*prefix, sys.executable, "-m", "collserve.launch", "--nproc_per_node", str(nproc),
                             "--no_prefix", *extra, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def credentials(build, directory):
    """A job token for a coordinator this script starts, as collserve launch makes one for
    its embedded coordinator: (the token, the coordinator's flags)."""
    sys.path.insert(0, os.path.join(build, "python"))
    from collserve.launch import embedded_credentials
    return embedded_credentials(directory, "default")


def finish(p, what, timeout=1200):
    out, err = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out}\n{err}")
    return out


def tools(build):
    ours = ["--no_python", os.path.join(build, "bench", "collserve-perf")]
    torch = [os.path.join(HERE, "torch_perf.py"), "--backend", "gloo"]
    return ours, torch


def membw(build):
    """GB/s (1e9 bytes) of collserve-membw's benchmarks, by name: the median of 3 repetitions
    (one noisy repetition moves the bound by half otherwise)."""
    r = subprocess.run([os.path.join(build, "bench", "collserve-membw"), "--benchmark_format=json",
                        "--benchmark_min_time=0.5", "--benchmark_repetitions=3",
                        "--benchmark_report_aggregates_only=true"],
                       capture_output=True, text=True, timeout=600, check=True)
    return {b["run_name"]: b["bytes_per_second"] / 1e9 for b in json.loads(r.stdout)["benchmarks"]
            if b.get("aggregate_name") == "median"}


def bound(a, build, measured_busbw):
    n = a.nproc
    m = membw(build)
    copy = m["BM_Memcpy/real_time"]
    sums = max(m["BM_Sum/threads:1/real_time"], m["BM_Sum/threads:2/real_time"])
    in_place = max(m["BM_SumInPlace/threads:1/real_time"], m["BM_SumInPlace/threads:2/real_time"])
    kernel = m[f"BM_LocalAllReduce/ranks:4/threads:2/real_time"]
    # Memory traffic per second the machine sustains (buffers of 128 MiB: at least the
    # all_reduce's working set, so caches do not flatter it). glibc's memcpy streams its
    # stores past the cache (non-temporal): 2 bytes of traffic per byte copied. The sum's
    # ordinary stores first read each destination line (write-allocate): 4 bytes of traffic
    # per byte of c (a, b, c read, c written). The in-place sum a += b: exactly 3 (a and b
    # read, a written back). The strictest (largest) of the three is the bound's traffic.
    traffic = max(2 * copy, 4 * sums, 3 * in_place)
    # An in-place all_reduce of n separate tensors of S bytes must read each once and write
    # each once; writing a line just read costs no extra read: 2 n S bytes of traffic at
    # best, so algbw <= traffic / (2 n), busbw = algbw x 2(n-1)/n.
    algbw = traffic / (2 * n)
    busbw = algbw * 2 * (n - 1) / n
    print(f"# bound (64 MiB all_reduce, {n} local ranks): memcpy {copy:.2f} GB/s, sum {sums:.2f} GB/s, in-place sum "
          f"{in_place:.2f} GB/s (best of 1 and 2 threads) -> memory traffic max(2 x {copy:.1f}, 4 x {sums:.1f}, "
          f"3 x {in_place:.1f}) = {traffic:.1f} GB/s; 2 x {n} x S bytes of traffic per op -> algbw "
          f"<= {algbw:.2f} GB/s, busbw <= {busbw:.2f} GB/s. The sidecar's kernel alone: algbw {kernel:.2f} GB/s.")
    print(f"# collserve 64 MiB all_reduce busbw {measured_busbw:.3f} GB/s = {measured_busbw / busbw:.0%} of the bound "
          f"(target >= 60%)")


def one_host(a, build):
    ours, torch = tools(build)
    print(f"## (a) one host, {a.nproc} ranks, -n {a.n} -w {a.w}; busbw in GB/s (nccl-tests' definition)")
    print(f"{'op':<16}{'size':>10}{'torch gloo':>12}{'collserve':>12}{'ratio':>8}{'target':>8}"
          f"{'heap':>10}{'ratio':>8}{'target':>8}")
    for op, b, e, f, target, heap_target in CASES:
        common = ["-b", b, "-e", e, "-f", str(f), "-n", str(a.n), "-w", str(a.w), "-o", op]
        theirs = rows(finish(launch([*torch, *common], a.nproc, build), "torch_perf"))
        mine = rows(finish(launch([*ours, *common, "-m", "arena"], a.nproc, build), "collserve-perf"))
        heap = rows(finish(launch([*ours, *common, "-m", "heap"], a.nproc, build), "collserve-perf -m heap"))
        if op == "all_reduce":
            big = mine[max(mine)][1]
            gloo_all_reduce = theirs
        for size in sorted(mine):
            t, m, h = theirs[size][1], mine[size][1], heap[size][1]
            print(f"{op:<16}{size:>10}{t:>12.3f}{m:>12.3f}{m / t:>8.2f}{'>=' + str(target):>8}{h:>10.3f}{h / t:>8.2f}"
                  f"{'>=' + str(heap_target):>8}", flush=True)
    common = ["-b", "8", "-e", "8", "-n", str(a.n * 10), "-w", str(a.w), "-o", "all_reduce"]
    t = rows(finish(launch([*torch, *common], a.nproc, build), "torch_perf"))[8][0]
    m = rows(finish(launch([*ours, *common], a.nproc, build), "collserve-perf"))[8][0]
    print(f"# 8-byte all_reduce, ops back to back (mean per op): torch gloo {t:.1f} us, collserve {m:.1f} us, "
          f"collserve / gloo = {m / t:.2f} (target <= 0.25)")
    # The same op's latency: each waited for before the next (-z 1). Torch's Gloo is much
    # slower back to back than one at a time, so the ratio above flatters collserve.
    t = rows(finish(launch([*torch, *common, "-z", "1"], a.nproc, build), "torch_perf -z 1"))[8][0]
    m = rows(finish(launch([*ours, *common, "-z", "1"], a.nproc, build), "collserve-perf -z 1"))[8][0]
    print(f"# 8-byte all_reduce latency (-z 1, each op waited for): torch gloo {t:.1f} us, collserve {m:.1f} us, "
          f"collserve / gloo = {m / t:.2f}")
    bound(a, build, big)
    # The same all_reduce written against torch.distributed, with the collserve backend.
    common = ["-b", "1M", "-e", "64M", "-f", "64", "-n", str(a.n), "-w", str(a.w), "-o", "all_reduce"]
    print(f"# torch.distributed with backend \"collserve\" (bench/torch_perf.py --backend collserve): "
          f"torch.zeros tensors, then collserve.torch.empty ones")
    print(f"{'op':<16}{'size':>10}{'torch gloo':>12}{'torch.zeros':>12}{'ratio':>8}{'.empty':>10}{'ratio':>8}")
    via = {m: rows(finish(launch([*torch[:-1], "collserve", *common, "-m", m], a.nproc, build), f"torch_perf -m {m}"))
           for m in ("heap", "arena")}
    for size in sorted(via["arena"]):
        t, h, e = gloo_all_reduce[size][1], via["heap"][size][1], via["arena"][size][1]
        print(f"{'all_reduce':<16}{size:>10}{t:>12.3f}{h:>12.3f}{h / t:>8.2f}{e:>10.3f}{e / t:>8.2f}", flush=True)


def wait_file(path, proc, what):
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.05)


def vm_hwm(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rss(a, build):
    """The sidecar's peak RSS while 4 local ranks run 64 MiB all_reduces."""
    size = 64 << 20
    limit = 2 * size * a.nproc + (64 << 20)
    print(f"## (b) sidecar peak RSS (VmHWM) during a 64 MiB all_reduce among {a.nproc} local ranks; "
          f"limit 2 x {size >> 20} MiB x {a.nproc} + 64 MiB = {limit >> 20} MiB")
    ours, _ = tools(build)
    for memory in ("arena", "heap"):
        d = tempfile.mkdtemp(prefix="collserve-rss.")
        procs = []
        try:
            token, flags = credentials(build, d)
            coord = subprocess.Popen([os.path.join(build, "server", "collserve-coordinator"),
                                      "--listen_address=127.0.0.1:0", "--metrics_address=", "--log_level=warning",
                                      f"--port_file={d}/coord.port", *flags], stderr=subprocess.DEVNULL)
            procs.append(coord)
            wait_file(f"{d}/coord.port", coord, "collserve-coordinator")
            port = open(f"{d}/coord.port").read().strip()
            sidecar = subprocess.Popen([os.path.join(build, "server", "collserve-sidecar"),
                                        f"--coordinator=127.0.0.1:{port}", f"--unix_socket={d}/s.sock",
                                        "--metrics_address=", "--log_level=warning", f"--port_file={d}/s.port"],
                                       stderr=subprocess.DEVNULL)
            procs.append(sidecar)
            wait_file(f"{d}/s.port", sidecar, "collserve-sidecar")
            idle = vm_hwm(sidecar.pid)
            out = finish(launch([*ours, "-b", "64M", "-e", "64M", "-n", str(a.n), "-w", str(a.w), "-o", "all_reduce",
                                 "-m", memory], a.nproc, build, env=dict(os.environ, COLLSERVE_TOKEN=token),
                                extra=["--coordinator", f"127.0.0.1:{port}", "--sidecar", f"unix:{d}/s.sock"]),
                         "collserve-perf")
            busbw = rows(out)[size][1]
            peak = vm_hwm(sidecar.pid)
            print(f"-m {memory:<6} peak {peak / 2**20:8.1f} MiB (idle {idle / 2**20:.1f} MiB), "
                  f"{peak / limit:.2f} of the limit ({'met' if peak <= limit else 'MISSED'}); busbw {busbw:.3f} GB/s")
        finally:
            for p in reversed(procs):
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            shutil.rmtree(d, ignore_errors=True)


def sh(cmd):
    subprocess.run(cmd, shell=True, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class Hosts:
    """Namespaces <p>sw (a bridge) and <p>h1 .. <p>h<n>, each with eth0 = 10.233.<x>.<i>/24.
    root_leg: this (the root) namespace gets <x>.254 on the bridge too (Open MPI's processes
    reach mpirun's PMIx server over TCP, see docs/guide.md)."""

    def __init__(self, n, root_leg=False):
        self.n = n
        self.root_leg = root_leg
        self.p = f"csb{os.getpid() % 100000}"
        self.subnet = f"10.233.{os.getpid() % 250}."
        self.made = []

    def host(self, i):
        return f"{self.p}h{i}"

    def ip(self, i):
        return f"{self.subnet}{i}"

    def __enter__(self):
        sw = f"{self.p}sw"
        sh(f"ip netns add {sw}")
        self.made.append(sw)
        sh(f"ip -n {sw} link add br0 type bridge && ip -n {sw} link set br0 up")
        for i in range(1, self.n + 1):
            ns = self.host(i)
            sh(f"ip netns add {ns}")
            self.made.append(ns)
            sh(f"ip link add {self.p}v{i} type veth peer name {self.p}p{i} netns {sw}")
            sh(f"ip link set {self.p}v{i} netns {ns}")
            sh(f"ip -n {ns} link set {self.p}v{i} name eth0")
            sh(f"ip -n {ns} addr add {self.ip(i)}/24 dev eth0 && ip -n {ns} link set eth0 up && "
               f"ip -n {ns} link set lo up")
            sh(f"ip -n {sw} link set {self.p}p{i} master br0 && ip -n {sw} link set {self.p}p{i} up")
        if self.root_leg:
            sh(f"ip link add {self.p}vr type veth peer name {self.p}pr netns {sw}")
            sh(f"ip addr add {self.subnet}254/24 dev {self.p}vr && ip link set {self.p}vr up")
            sh(f"ip -n {sw} link set {self.p}pr master br0 && ip -n {sw} link set {self.p}pr up")
        return self

    def __exit__(self, *exc):
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
        if self.root_leg:
            subprocess.run(["ip", "link", "del", f"{self.p}vr"], stderr=subprocess.DEVNULL)

    def mpirun(self, contexts, log):
        """mpirun (in this namespace) with one process per (host, argv) in `contexts`, each in
        its host's namespace, Open MPI's TCP transport and PMIx on the bridge's subnet."""
        net = f"{self.subnet}0/24"
        argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", net, "--mca", "oob_tcp_if_include", net]
        for i, (host, cmd) in enumerate(contexts):
            argv += ([":"] if i else []) + ["-np", "1", "ip", "netns", "exec", self.host(host), *cmd]
        env = dict(os.environ, PMIX_MCA_ptl_tcp_remote_connections="1", PMIX_MCA_ptl_tcp_if_include=net)
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if log is None else log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_hosts(net, build, cmd, nproc, sidecar_flags=()):
    """One launcher per host; a fresh coordinator (gRPC + TCPStore endpoint) on host 1."""
    d = tempfile.mkdtemp(prefix="collserve-hosts.")
    coord = None
    try:
        token, flags = credentials(build, d)
        coord = subprocess.Popen(["ip", "netns", "exec", net.host(1),
                                  os.path.join(build, "server", "collserve-coordinator"),
                                  f"--listen_address={net.ip(1)}:29400", f"--tcpstore_address={net.ip(1)}:29401",
                                  f"--tcpstore_allow={net.subnet}0/24",
                                  "--metrics_address=", "--log_level=warning", f"--port_file={d}/coord.port", *flags],
                                 stderr=subprocess.DEVNULL)
        wait_file(f"{d}/coord.port", coord, "collserve-coordinator")
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", COLLSERVE_TOKEN=token)
        hosts = range(1, net.n + 1)
        procs = [launch(cmd, nproc, build, env=env, prefix=["ip", "netns", "exec", net.host(h)],
                        extra=["--nnodes", str(net.n), "--node_rank", str(h - 1), "--coordinator",
                               f"{net.ip(1)}:29400", "--tcpstore_port", "29401", "--gloo_hostname", net.ip(h),
                               *[f"--sidecar_flag={f}" for f in sidecar_flags]])
                 for h in hosts]
        outs = [finish(p, f"{cmd[0]} on host {h}") for h, p in zip(hosts, procs)]
        return outs[0]
    finally:
        if coord is not None:
            coord.terminate()
            coord.wait(timeout=10)
        shutil.rmtree(d, ignore_errors=True)


def bare_gloo_latency(net, build, n):
    """Mean us per op of a bare 8-byte Gloo allreduce, one process per host (collserve-gloo-latency);
    the mean, like collserve-perf's time column."""
    d = tempfile.mkdtemp(prefix="collserve-gloo.")
    try:
        procs = [subprocess.Popen(["ip", "netns", "exec", net.host(h), os.path.join(build, "bench", "collserve-gloo-latency"),
                                   f"--store_dir={d}", f"--rank={h - 1}", f"--world_size={net.n}",
                                   f"--hostname={net.ip(h)}", "--bytes=8", f"-n={n}", "-w=20"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for h in range(1, net.n + 1)]
        outs = [finish(p, f"collserve-gloo-latency on host {h}", timeout=600) for h, p in enumerate(procs, 1)]
        fields = dict(kv.split("=") for kv in outs[0].split()[1:])
        return float(fields["mean_us"])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def paired(a, net, build, common, nproc, target, title):
    """--reps paired repetitions of torch_perf and collserve-perf on `net`; prints the table."""
    ours, torch = tools(build)
    print(f"{title}; {a.reps} paired repetitions (torch then collserve, alternating which goes first); the "
          f"target is judged on the median ratio")
    theirs, mine = [], []
    for rep in range(a.reps):
        pair = [("torch", torch), ("collserve", ours)]
        for name, tool in (pair if rep % 2 == 0 else pair[::-1]):
            flags = a.sidecar_flag if name == "collserve" else ()
            (theirs if name == "torch" else mine).append(rows(run_hosts(net, build, [*tool, *common], nproc, flags)))
    print(f"{'op':<12}{'size':>10}{'torch gloo':>12}{'collserve':>11}  {'ratio per repetition':<22}{'median':>7}"
          f"{'target':>8}  algorithm")
    for size in sorted(mine[0]):
        ratios = sorted(m[size][1] / t[size][1] for t, m in zip(theirs, mine))
        t = sorted(r[size][1] for r in theirs)[len(theirs) // 2]
        m = sorted(r[size][1] for r in mine)[len(mine) // 2]
        each = " ".join(f"{m[size][1] / t[size][1]:.2f}" for t, m in zip(theirs, mine))
        print(f"{'all_reduce':<12}{size:>10}{t:>12.3f}{m:>11.3f}  {each:<22}{ratios[len(ratios) // 2]:>7.2f}"
              f"{'>=' + str(target):>8}  {mine[0][size][2]}", flush=True)


def namespaces_ok(part):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print(f"## {part}: skipped (network namespaces need root and `ip`)")
        return False
    return True


def two_hosts(a, build):
    if not namespaces_ok("(c) two hosts"):
        return
    n = max(a.n, 20)  # per-message latency between the namespaces is noisy: more iterations
    common = ["-b", "256K", "-e", "64M", "-f", "4", "-n", str(n), "-w", str(a.w), "-o", "all_reduce"]
    with Hosts(2) as net:
        paired(a, net, build, common, 2, 2.5,
               f"## (c) two hosts (network namespaces over a veth bridge), 2 ranks each, all_reduce, -n {n} -w {a.w}")
        # The 8-byte all_reduce against a bare Gloo allreduce between the same two hosts:
        # latency (-z 1: each op waited for before the next, as collserve-gloo-latency does),
        # then the mean of ops issued back to back (pipelined).
        ours, _ = tools(build)
        small = ["-b", "8", "-e", "8", "-n", "200", "-w", "20", "-o", "all_reduce"]
        gloo, blocking, pipelined = [], [], []
        for rep in range(a.reps):
            gloo.append(bare_gloo_latency(net, build, 200))
            blocking.append(rows(run_hosts(net, build, [*ours, *small, "-z", "1"], 2, a.sidecar_flag))[8][0])
            pipelined.append(rows(run_hosts(net, build, [*ours, *small], 2, a.sidecar_flag))[8][0])
        g = sorted(gloo)[len(gloo) // 2]
        for what, mine, target in (("latency (-z 1)", blocking, " (target <= 1.5)"),
                                   ("back-to-back mean", pipelined, "")):
            each = " ".join(f"{m / g:.2f}" for g, m in zip(gloo, mine))
            m = sorted(mine)[len(mine) // 2]
            r = sorted(m / g for g, m in zip(gloo, mine))[len(mine) // 2]
            print(f"# 8-byte all_reduce, 2 hosts x 2 ranks, {what}: collserve {m:.1f} us per op (median of {a.reps}); "
                  f"bare Gloo allreduce between the two hosts (collserve-gloo-latency, 1 process per host, each op "
                  f"waited for) {g:.1f} us; collserve / Gloo per repetition {each}, median {r:.2f}{target}", flush=True)


def four_hosts(a, build):
    if not namespaces_ok("(d) four hosts"):
        return
    n = max(a.n, 20)
    common = ["-b", "1M", "-e", "64M", "-f", "4", "-n", str(n), "-w", str(a.w), "-o", "all_reduce"]
    with Hosts(4) as net:
        paired(a, net, build, common, 1, 1.5,
               f"## (d) four hosts (network namespaces over a veth bridge), 1 rank each, all_reduce, -n {n} -w {a.w}")


def in_place(text):
    """{size: in-place time in us per op} of a collserve-perf / collserve-mpi-allreduce-perf
    table (the time, not the printed busbw: small sizes print 0.000 GB/s)."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 13 and f[0].isdigit() and f[9] != "N/A":
            if f[12] not in ("0", "N/A"):
                raise SystemExit(f"wrong results: {line}")
            out[int(f[0])] = float(f[9])
    return out


def mpi_hosts(a, build):
    """(f): collserve over MPI, collserve over Gloo and Open MPI's MPI_Allreduce on 2 and 4 hosts."""
    if not namespaces_ok("(f) the MPI column"):
        return
    ours = os.path.join(build, "bench", "collserve-perf")
    theirs = os.path.join(build, "bench", "collserve-mpi-allreduce-perf")
    if shutil.which("mpirun") is None or not os.path.exists(theirs):
        print("## (f) the MPI column: skipped (needs mpirun and a build with MPI: collserve-mpi-allreduce-perf)")
        return
    n = max(a.n, 20)
    sizes = ["-b", "1K", "-e", "64M", "-f", "4", "-n", str(n), "-w", "5"]
    for hosts in (2, 4):
        with Hosts(hosts, root_leg=True) as net:
            d = tempfile.mkdtemp(prefix="collserve-mpi.")
            coord = world = None
            try:
                token, flags = credentials(build, d)
                coord = subprocess.Popen(["ip", "netns", "exec", net.host(1),
                                          os.path.join(build, "server", "collserve-coordinator"),
                                          f"--listen_address={net.ip(1)}:29400", "--metrics_address=",
                                          "--log_level=warning", f"--port_file={d}/coord.port", *flags],
                                         stderr=subprocess.DEVNULL)
                wait_file(f"{d}/coord.port", coord, "collserve-coordinator")
                world = net.mpirun([(h, [os.path.join(build, "server", "collserve-sidecar"),
                                         f"--coordinator={net.ip(1)}:29400", f"--unix_socket={d}/s{h}.sock",
                                         f"--gloo_hostname={net.ip(h)}", f"--host_id=host{h}", "--metrics_address=",
                                         "--log_level=warning", f"--port_file={d}/s{h}.port", "--mpi"])
                                    for h in range(1, hosts + 1)], open(f"{d}/sidecars.log", "w"))
                for h in range(1, hosts + 1):
                    wait_file(f"{d}/s{h}.port", world, "the sidecars under mpirun")

                def collserve(backend):
                    procs = []
                    for h in range(1, hosts + 1):
                        env = dict(os.environ, RANK=str(h - 1), WORLD_SIZE=str(hosts), LOCAL_RANK="0",
                                   MASTER_ADDR=net.ip(1), MASTER_PORT="29400", COLLSERVE_TOKEN=token,
                                   COLLSERVE_SIDECAR=f"unix:{d}/s{h}.sock", COLLSERVE_OP_TIMEOUT_S="120")
                        procs.append(subprocess.Popen(["ip", "netns", "exec", net.host(h), ours, *sizes,
                                                       "-o", "all_reduce", "--backend", backend],
                                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True))
                    return in_place([finish(p, f"collserve-perf --backend {backend} on host {h}")
                                     for h, p in enumerate(procs, 1)][0])

                def mpi():
                    p = net.mpirun([(h, [theirs, *sizes]) for h in range(1, hosts + 1)], None)
                    return in_place(finish(p, "collserve-mpi-allreduce-perf"))

                runs = {"mpi": [], "gloo": [], "MPI_Allreduce": []}
                order = [("mpi", lambda: collserve("mpi")), ("gloo", lambda: collserve("gloo")),
                         ("MPI_Allreduce", mpi)]
                for rep in range(a.reps):
                    for name, run in order[rep % 3:] + order[:rep % 3]:
                        runs[name].append(run())
            finally:
                if world is not None and world.poll() is None:
                    world.terminate()
                    try:
                        world.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        os.killpg(world.pid, 9)
                        world.wait()
                if coord is not None:
                    coord.terminate()
                    coord.wait(timeout=10)
                shutil.rmtree(d, ignore_errors=True)
        print(f"## (f) the MPI column: {hosts} hosts (network namespaces over a veth bridge), 1 rank each, "
              f"all_reduce float in place, us per op (busbw GB/s = size / time x 2(n-1)/n), median of {a.reps} "
              f"(rotating order), -n {n} -w 5; collserve-perf in the arena. Speed ratios: mpi/gloo = gloo's time "
              f"/ collserve-over-MPI's; mpi/MPI = MPI_Allreduce's time / collserve-over-MPI's")
        print(f"{'size':>10}{'collserve/mpi':>15}{'collserve/gloo':>16}{'MPI_Allreduce':>15}{'mpi busbw':>11}"
              f"{'mpi/gloo':>10}{'mpi/MPI':>9}")
        med = {k: {size: statistics.median(r[size] for r in v) for size in v[0]} for k, v in runs.items()}
        for size in sorted(med["mpi"]):
            m, g, o = med["mpi"][size], med["gloo"][size], med["MPI_Allreduce"][size]
            busbw = size / (m * 1e3) * 2 * (hosts - 1) / hosts
            print(f"{size:>10}{m:>15.1f}{g:>16.1f}{o:>15.1f}{busbw:>11.3f}{g / m:>10.2f}{o / m:>9.2f}", flush=True)


def ddp(a, build):
    """DDP training steps (bench/ddp_step.py), backend collserve against gloo, paired."""
    script = os.path.join(HERE, "ddp_step.py")
    print(f"## (e) DistributedDataParallel step time, {a.nproc} ranks on one host, unmodified torch code, "
          f"backend \"collserve\" against \"gloo\" (bench/ddp_step.py: ~25M-parameter MLP, batch 8); "
          f"{a.reps} paired repetitions")
    res = {"gloo": [], "collserve": [], "none": []}
    for rep in range(a.reps):
        order = ["gloo", "collserve", "none"] if rep % 2 == 0 else ["none", "collserve", "gloo"]
        for backend in order:
            out = finish(launch([script, "--backend", backend], a.nproc, build), f"ddp_step --backend {backend}")
            res[backend].append(json.loads(out.strip().splitlines()[-1]))
    g = [r["median_ms"] for r in res["gloo"]]
    c = [r["median_ms"] for r in res["collserve"]]
    each = " ".join(f"{x / y:.2f}" for x, y in zip(g, c))
    speedups = sorted(x / y for x, y in zip(g, c))
    print(f"# {res['gloo'][0]['parameters']} parameters; median step: gloo {sorted(g)[len(g) // 2]:.1f} ms, "
          f"collserve {sorted(c)[len(c) // 2]:.1f} ms; gloo / collserve per repetition {each}, median "
          f"{speedups[len(speedups) // 2]:.2f} (target >= 1.5)", flush=True)
    z = sorted(r["median_ms"] for r in res["none"])[len(res["none"]) // 2]
    print(f"# the same steps with no communication at all (--backend none, 4 ranks at once): {z:.1f} ms; the "
          f"most any backend can speed gloo's step up here: {sorted(g)[len(g) // 2] / z:.2f}x", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    p.add_argument("-n", type=int, default=10)
    p.add_argument("-w", type=int, default=None,
                   help="warm-up ops before the timed ones, issued back to back as they are (default: -n, "
                        "so the heap runs time reused staging segments, as a training loop's steps do)")
    p.add_argument("--sidecar_flag", action="append", default=[],
                   help="a flag for collserve's sidecars in (c), e.g. --sidecar_flag=--ring_segment_bytes=4194304")
    p.add_argument("--reps", type=int, default=3, help="paired repetitions in (c), (d) and (e)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: one_host, rss, two_hosts, "
                                              "four_hosts, mpi, ddp")
    a = p.parse_args()
    if a.w is None:
        a.w = a.n
    build = os.path.abspath(a.build)
    skip = set(filter(None, a.skip.split(",")))
    if "one_host" not in skip:
        one_host(a, build)
    if "rss" not in skip:
        rss(a, build)
    if "two_hosts" not in skip:
        two_hosts(a, build)
    if "four_hosts" not in skip:
        four_hosts(a, build)
    if "mpi" not in skip:
        mpi_hosts(a, build)
    if "ddp" not in skip:
        ddp(a, build)


if __name__ == "__main__":
    main()
