#!/usr/bin/env python3
"""collserve over MPI against collserve over Gloo between the same sidecars (issue 45): a
coordinator and two sidecars that mpirun starts as one MPI world (--mpi, TCP on loopback,
as tests/integration/mpi_test.cc does), and collserve-perf with 4 ranks (2 per sidecar, so
every op crosses the sidecars) run --reps times alternately with COLLSERVE_BACKEND=mpi and
with the default (gloo), in one run. Prints, per op and size, the median in-place busbw
(out-of-place for all_gather, which runs in place only on arena tensors) of each backend and
their ratio mpi / gloo.

Loopback only: two sidecars on one machine, sharing its cores with the ranks. It measures
what the transport costs per op on this machine, not a network; bench/compare.py part (f)
runs network-namespace hosts against Open MPI's own MPI_Allreduce.

    PYTHONPATH=build/python /usr/bin/python3 bench/mpi_transport.py [--build build] [--reps 3]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from noisy_neighbor_hosts import wait_file  # noqa: E402

OPS = ("all_reduce", "all_gather", "broadcast")


def perf(build, d, port, token, op, backend, a):
    env_common = dict(os.environ, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), COLLSERVE_TOKEN=token, COLLSERVE_INIT_TIMEOUT_S="60",
                      COLLSERVE_OP_TIMEOUT_S="120", OMP_NUM_THREADS="1")
    if backend == "mpi":
        env_common["COLLSERVE_BACKEND"] = "mpi"
    else:
        env_common.pop("COLLSERVE_BACKEND", None)
    procs = []
    for r in range(4):
        env = dict(env_common, RANK=str(r), LOCAL_RANK=str(r // 2), COLLSERVE_SIDECAR=f"unix:{d}/s{r % 2}.sock")
        procs.append(subprocess.Popen([os.path.join(build, "bench", "collserve-perf"), "-b", a.begin, "-e", a.end,
                                       "-f", "4", "-n", str(a.iters), "-w", "5", "-o", op, "-d", "float"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, o in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"collserve-perf {op} over {backend} failed (exit {p.returncode}):\n{o}")
    rows = {}
    for line in outs[0].splitlines():
        f = line.split()
        if f and f[0].isdigit() and len(f) >= 12:
            col = 7 if op == "all_gather" else 11  # in-place busbw; all_gather: out-of-place
            if f[col] != "N/A":
                rows[int(f[0])] = float(f[col])
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--begin", default="1K")
    p.add_argument("--end", default="64M")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    build = os.path.abspath(a.build)
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
    os.environ.setdefault("COLLSERVE_BUILD_DIR", build)
    import daemons
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("no mpirun (scripts/install_deps.sh installs Open MPI)")
    d = tempfile.mkdtemp(prefix="collserve-mpibench.")
    coord = world = None
    try:
        flags, tokens = daemons.credentials(d, ("default",))
        coord = daemons.start_coordinator(d, *flags)
        argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]
        for i in range(2):
            argv += ([":"] if i else []) + ["-np", "1", os.path.join(build, "server", "collserve-sidecar"),
                                            f"--coordinator=127.0.0.1:{coord.port}", f"--unix_socket={d}/s{i}.sock",
                                            f"--host_id=host{i}", "--metrics_address=", "--log_level=warning",
                                            f"--port_file={d}/s{i}.port", "--mpi"]
        world = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2):
            wait_file(f"{d}/s{i}.port", world, f"sidecar {i} under mpirun")
        results = {(op, b): [] for op in OPS for b in ("mpi", "gloo")}
        for rep in range(a.reps):
            for op in OPS:
                for b in (("mpi", "gloo") if rep % 2 == 0 else ("gloo", "mpi")):
                    results[(op, b)].append(perf(build, d, coord.port, tokens["default"], op, b, a))
            print(f"# repetition {rep + 1} of {a.reps} done", flush=True)
        print(f"\n{'op':<11} {'bytes':>10} {'mpi busbw':>10} {'gloo busbw':>11} {'mpi/gloo':>9}   (GB/s, medians of {a.reps})")
        for op in OPS:
            for size in sorted(results[(op, "mpi")][0]):
                m = statistics.median(r[size] for r in results[(op, "mpi")])
                g = statistics.median(r[size] for r in results[(op, "gloo")])
                print(f"{op:<11} {size:>10} {m:>10.3f} {g:>11.3f} {m / g if g else float('nan'):>9.2f}")
    finally:
        if world is not None:
            world.terminate()
            try:
                world.wait(timeout=20)
            except subprocess.TimeoutExpired:
                world.kill()
        if coord is not None:
            coord.stop()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
