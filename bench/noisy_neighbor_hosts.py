#!/usr/bin/env python3
"""Noisy neighbor across two hosts over a shaped link (issue 43): the one-host benchmark
(bench/noisy_neighbor.py) with each job's 4 ranks on two network-namespace hosts (ranks 0-1
on host 1, ranks 2-3 on host 2), one sidecar per host, and every byte between the hosts
through one link shaped to --rate (tc tbf on each host's egress: a FIFO bottleneck, the
case where a small message can wait behind another job's bulk bytes). Job A (the Python
SDK) times 8-byte and 256 KiB all_reduces one at a time; job B (collserve-perf, arena
tensors) runs 64 MiB all_reduces back to back. In one run, --reps paired repetitions of:

  alone       A alone, then B alone
  classes     A and B at once, A PRIORITY_CLASS_LATENCY_CRITICAL and B PRIORITY_CLASS_BULK
  equal       A and B at once, both of the default class
  gloo        the same pair on torch's Gloo over the same link (A alone, B alone, shared):
              each job's own processes and TCP connections, nothing shared but the link
              and the cores

Prints A's p50/p99 per size and B's busbw (medians over the repetitions) and the ratios the
issue sets targets for: A's p99 shared / alone (at most 2 with A in the better class) and
B's busbw shared / alone (at least 0.7).

--link priority: the bottleneck queues by class instead (tc htb at --rate on each host's
egress, a u32 filter on the DSCP sending EF packets to a class served first, CS1 to one
served last, the rest to the default one, each class its own queue), and the sidecars mark
each job's connections with its class (--traffic_dscp=46,0,8: latency-critical EF, default
0, bulk CS1). The Gloo pair is not marked (all in the default class).

Needs root (ip netns, tc). Every namespace it makes is deleted at exit.

    PYTHONPATH=build/python /usr/bin/python3 bench/noisy_neighbor_hosts.py [--rate 1gbit] [--seconds 6] [--reps 3]
        [--link fifo|priority] [--no-gloo] [--compare-whole]

The sidecars run with their default scheduler of steps between hosts (--link_piece_bytes:
over the FIFO link, while A's latency-critical collectives run between hosts, B's all_reduce
goes in 512 KiB pieces, each waiting for A's collective on its host; off with --link
priority, where the sidecars mark their traffic; --piece-bytes sets it); --compare-whole adds
the classes with it off (classes_whole), in the same run.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402  (Hosts: the namespaces and their bridge)
import noisy_neighbor as nn  # noqa: E402  (the jobs' loops and their parsing)

COORD_PORT = 29400


# The sidecars' --traffic_dscp with --link priority: latency-critical EF, default 0, bulk CS1.
TRAFFIC_DSCP = "46,0,8"


def shape(net, rate, link="fifo"):
    """Each host's egress (its side of the link) at `rate`: one FIFO, or (link "priority") an
    htb whose classes take the packets by DSCP: EF (0xb8) first, CS1 (0x20) last."""
    for h in range(1, net.n + 1):
        tc = f"ip netns exec {net.host(h)} tc"
        if link == "fifo":
            compare.sh(f"{tc} qdisc add dev eth0 root tbf rate {rate} burst 256kb latency 50ms")
            continue
        compare.sh(f"{tc} qdisc add dev eth0 root handle 1: htb default 20 r2q 1000")
        compare.sh(f"{tc} class add dev eth0 parent 1: classid 1:1 htb rate {rate} ceil {rate} burst 256kb cburst 256kb")
        for cls, prio, share in ((10, 0, 20), (20, 1, 60), (30, 2, 20)):
            # each class guaranteed `share`% of the link, and the whole link when the others are idle
            compare.sh(f"{tc} class add dev eth0 parent 1:1 classid 1:{cls} htb rate {_percent(rate, share)} "
                       f"ceil {rate} burst 256kb cburst 256kb prio {prio}")
            compare.sh(f"{tc} qdisc add dev eth0 parent 1:{cls} handle {cls}: pfifo limit 1000")
        compare.sh(f"{tc} filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip tos 0xb8 0xfc flowid 1:10")
        compare.sh(f"{tc} filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip tos 0x20 0xfc flowid 1:30")


def _percent(rate, share):
    """`share` percent of a tc rate such as 1gbit or 500mbit, in kbit."""
    units = {"kbit": 1, "mbit": 1000, "gbit": 1000000}
    for unit, k in units.items():
        if rate.endswith(unit):
            return f"{int(float(rate[:-len(unit)]) * k * share / 100)}kbit"
    raise SystemExit(f"--rate {rate}: use kbit, mbit or gbit")


def wait_file(path, proc, what, timeout=30):
    end = time.monotonic() + timeout
    while not os.path.exists(path) or os.path.getsize(path) == 0:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode}) before it served")
        if time.monotonic() > end:
            raise SystemExit(f"{what} did not serve within {timeout} s")
        time.sleep(0.05)


def start_ranks(net, cmd, job, token, d, env_extra):
    """Job `job`'s 4 ranks, 2 per host, each in its host's namespace."""
    procs = []
    for r in range(4):
        h = 1 + r // 2
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE="2",
                   COLLSERVE_SIDECAR=f"unix:{d}/s{h}.sock", COLLSERVE_JOB=job, COLLSERVE_TOKEN=token,
                   COLLSERVE_COORDINATOR=f"{net.ip(1)}:{COORD_PORT}", COLLSERVE_INIT_TIMEOUT_S="60",
                   COLLSERVE_OP_TIMEOUT_S="300", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0", **env_extra)
        procs.append(subprocess.Popen(["ip", "netns", "exec", net.host(h), *cmd], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def run(a, net, build, policy, with_a, with_b, b_iters, sidecar_flags=()):
    """One configuration through collserve: (A's {size: [p50, p99, n]} or None, B's busbw or None).
    `sidecar_flags`: more flags of both sidecars."""
    daemons = nn.daemons_module(build)
    d = tempfile.mkdtemp(prefix="collserve-noisy2.")
    started = []
    try:
        flags, tokens = daemons.credentials(d, ("a", "b"))
        with open(os.path.join(d, "policies.json"), "w") as f:
            json.dump({"jobs": policy}, f)
        coord = subprocess.Popen(["ip", "netns", "exec", net.host(1), os.path.join(build, "server", "collserve-coordinator"),
                                  f"--listen_address={net.ip(1)}:{COORD_PORT}", "--metrics_address=",
                                  "--log_level=warning", f"--port_file={d}/coord.port",
                                  f"--job_policies_file={d}/policies.json", *flags],
                                 stderr=open(os.path.join(d, "coord.log"), "w"))
        started.append(coord)
        wait_file(f"{d}/coord.port", coord, "collserve-coordinator")
        for h in (1, 2):
            s = subprocess.Popen(["ip", "netns", "exec", net.host(h), os.path.join(build, "server", "collserve-sidecar"),
                                  f"--coordinator={net.ip(1)}:{COORD_PORT}", f"--unix_socket={d}/s{h}.sock",
                                  f"--gloo_hostname={net.ip(h)}", f"--host_id=host{h}", "--metrics_address=",
                                  "--log_level=warning", f"--port_file={d}/s{h}.port",
                                  *([f"--traffic_dscp={TRAFFIC_DSCP}"] if a.link == "priority" else []),
                                  *([f"--link_piece_bytes={a.piece_bytes}"] if a.piece_bytes is not None else []),
                                  *sidecar_flags],
                                 stderr=open(os.path.join(d, f"s{h}.log"), "w"))
            started.append(s)
            wait_file(f"{d}/s{h}.port", s, f"collserve-sidecar on host {h}")
        b_procs = a_procs = []
        if with_b:
            perf = [os.path.join(build, "bench", "collserve-perf"), "-b", str(nn.BULK_BYTES), "-e", str(nn.BULK_BYTES),
                    "-n", str(b_iters), "-w", "1", "-o", "all_reduce", "-d", "float", "-m", "arena"]
            b_procs = start_ranks(net, perf, "b", tokens["b"], d, {})
        if with_a:
            if with_b:
                time.sleep(1.0)  # B's ranks attach and start their loop first
            a_procs = start_ranks(net, [sys.executable, os.path.join(HERE, "noisy_neighbor.py"), "--rank_a",
                                        str(a.seconds)], "a", tokens["a"], d, {})
        lat = json.loads(nn.finish(a_procs, "job A").strip().splitlines()[-1]) if with_a else None
        bw = nn.busbw(nn.finish(b_procs, "job B")) if with_b else None
        return lat, bw
    except BaseException:
        for name in ("coord.log", "s1.log", "s2.log"):
            p = os.path.join(d, name)
            if os.path.exists(p):
                print(f"--- {name}\n{open(p, errors='replace').read()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for p in reversed(started):
            p.kill()
            p.wait()
        shutil.rmtree(d, ignore_errors=True)


def run_gloo(a, net, with_a, with_b, b_iters):
    """The pair on torch's Gloo over the same link; each job rendezvouses through its own
    TCPStore on host 1 (MASTER_PORT)."""
    b_procs = a_procs = []
    me = os.path.join(HERE, "noisy_neighbor.py")
    if with_b:
        b_procs = start_ranks(net, [sys.executable, me, "--rank_b_gloo", str(b_iters)], "b", "", "",
                              {"MASTER_ADDR": net.ip(1), "MASTER_PORT": "29411"})
    if with_a:
        if with_b:
            time.sleep(1.0)
        a_procs = start_ranks(net, [sys.executable, me, "--rank_a_gloo", str(a.seconds)], "a", "", "",
                              {"MASTER_ADDR": net.ip(1), "MASTER_PORT": "29412"})
    lat = json.loads(nn.finish(a_procs, "job A (gloo)").strip().splitlines()[-1]) if with_a else None
    bw = float(nn.finish(b_procs, "job B (gloo)").strip().splitlines()[-1]) if with_b else None
    return lat, bw


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    p.add_argument("--rate", default="1gbit", help="the link's rate (tc's syntax)")
    p.add_argument("--seconds", type=float, default=6.0, help="how long job A runs in each configuration")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-gloo", dest="gloo", action="store_false", help="leave out the pair on torch's Gloo")
    p.add_argument("--link", choices=("fifo", "priority"), default="fifo",
                   help="the bottleneck: one FIFO (tbf), or classes by DSCP (htb) with the jobs' connections marked")
    p.add_argument("--piece-bytes", dest="piece_bytes", type=int, default=None,
                   help="the sidecars' --link_piece_bytes (default: theirs: 512 KiB over the FIFO link, off "
                        "with --link priority, where they mark their traffic)")
    p.add_argument("--compare-whole", dest="compare_whole", action="store_true",
                   help="also run the classes with the sidecars' scheduler of steps between hosts off "
                        "(--link_piece_bytes=0: B's transfers go whole), configuration classes_whole")
    a = p.parse_args()
    build = os.path.abspath(a.build)
    classes = {"a": {"priority_class": "PRIORITY_CLASS_LATENCY_CRITICAL"}, "b": {"priority_class": "PRIORITY_CLASS_BULK"}}
    with compare.Hosts(2) as net:
        shape(net, a.rate, a.link)
        _, bw0 = run(a, net, build, {}, False, True, 2)
        op_s = 2 * 3 / 4 * nn.BULK_BYTES / (bw0 * 1e9)
        b_iters = max(4, int((a.seconds + 2) / op_s))
        print(f"# link {a.rate} ({a.link}); B alone: {bw0:.3f} GB/s busbw, {op_s * 1e3:.0f} ms per 64 MiB all_reduce; "
              f"B runs {b_iters} ops per configuration", flush=True)
        names = ("a_alone", "b_alone", "classes", "equal") + (("classes_whole",) if a.compare_whole else ()) + (
            ("gloo_a_alone", "gloo_b_alone", "gloo_shared") if a.gloo else ())
        results = {k: [] for k in names}
        for rep in range(a.reps):
            results["a_alone"].append(run(a, net, build, classes, True, False, b_iters))
            results["b_alone"].append(run(a, net, build, classes, False, True, b_iters))
            results["classes"].append(run(a, net, build, classes, True, True, b_iters))
            results["equal"].append(run(a, net, build, {}, True, True, b_iters))
            if a.compare_whole:
                results["classes_whole"].append(run(a, net, build, classes, True, True, b_iters,
                                                    ("--link_piece_bytes=0",)))
            if a.gloo:
                results["gloo_a_alone"].append(run_gloo(a, net, True, False, b_iters))
                results["gloo_b_alone"].append(run_gloo(a, net, False, True, b_iters))
                results["gloo_shared"].append(run_gloo(a, net, True, True, b_iters))
            print(f"# repetition {rep + 1} of {a.reps} done", flush=True)
    med = statistics.median
    print(f"\n{'configuration':<13} {'A 8 B p50/p99 us':>18} {'A 256 KiB p50/p99 us':>22} {'B busbw GB/s':>13}")
    for k, rows in results.items():
        cols = ["-" if rows[0][0] is None else
                f"{med([r[0][str(s)][0] for r in rows]):.0f}/{med([r[0][str(s)][1] for r in rows]):.0f}"
                for s in nn.SIZES]
        bw = f"{med([r[1] for r in rows]):.3f}" if rows[0][1] is not None else "-"
        print(f"{k:<13} {cols[0]:>18} {cols[1]:>22} {bw:>13}")
    pairs = [("classes", "a_alone", "b_alone"), ("equal", "a_alone", "b_alone")]
    if a.compare_whole:
        pairs.append(("classes_whole", "a_alone", "b_alone"))
    if a.gloo:
        pairs.append(("gloo_shared", "gloo_a_alone", "gloo_b_alone"))
    for k, a_alone, b_alone in pairs:
        for s in nn.SIZES:
            ratio = med([r[0][str(s)][1] for r in results[k]]) / med([r[0][str(s)][1] for r in results[a_alone]])
            print(f"{k}: A's p99 at {s} B shared / alone: {ratio:.2f} (target at most 2.0 for classes)")
        bw = med([r[1] for r in results[k]]) / med([r[1] for r in results[b_alone]])
        print(f"{k}: B's busbw shared / alone: {bw:.2f} (target at least 0.70)")


if __name__ == "__main__":
    main()
