"""collserve-perf (bench/collserve_perf.cc) and bench/torch_perf.py under `collserve launch`: every op checks its
results (#wrong 0), prints nccl-tests' columns with its bus-bandwidth factors, and refuses
bad flags. Speed is not asserted here (bench/RESULTS.md holds the measurements)."""
import os
import shutil
import subprocess
import sys

import pytest

from daemons import BUILD, credentials

PERF = os.path.join(BUILD, "bench", "collserve-perf")
FACTORS = {"all_reduce": 2 * 3 / 4, "all_gather": 3 / 4, "reduce_scatter": 3 / 4, "broadcast": 1.0, "reduce": 1.0,
           "all_to_all": 3 / 4, "send_recv": 1.0}


def perf(*args, nproc=4):
    return subprocess.run([sys.executable, "-m", "collserve.launch", "--nproc_per_node", str(nproc), "--no_prefix",
                           "--no_python", PERF, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("memory", ["arena", "heap"])
@pytest.mark.parametrize("op", sorted(FACTORS))
def test_every_op_checks_its_results_and_reports_nccl_tests_columns(op, memory):
    r = perf("-b", "64", "-e", "256K", "-f", "8", "-n", "3", "-w", "1", "-o", op, "-d", "int32", "-m", memory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# Out of bounds values : 0 OK" in r.stdout, r.stdout
    assert f"-m {memory}" in r.stdout.splitlines()[0], r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == [64, 512, 4096, 32768, 262144], r.stdout
    for row in rows:
        assert row[2] == "int32" and len(row) == 14, row
        # One host: the sidecar ran it in shared memory; send/recv has no algorithm.
        assert row[13] == ("-" if op == "send_recv" else "local"), row
        for time, algbw, busbw, wrong in (row[5:9], row[9:13]):
            if time == "N/A":
                continue
            assert wrong == "0" and float(time) > 0, row
            assert float(algbw) == pytest.approx(int(row[0]) / (float(time) * 1e3), rel=0.02, abs=2e-3), row
            assert float(busbw) == pytest.approx(float(algbw) * FACTORS[op], rel=0.02, abs=2e-3), row


@pytest.mark.parametrize("op", ["all_reduce", "send_recv"])
def test_blocking_mode_waits_for_each_op_and_checks_its_results(op):
    # -z 1 (nccl-tests' blocking mode: latency); send_recv waits for its send too.
    r = perf("-b", "8", "-e", "64K", "-f", "64", "-n", "5", "-w", "2", "-z", "1", "-o", op, "-m", "heap", nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "-z 1 -m heap" in r.stdout.splitlines()[0] and "# Out of bounds values : 0 OK" in r.stdout, r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == [8, 512, 32768], r.stdout


def test_bad_flags_are_refused():
    r = subprocess.run([PERF, "-o", "all_everything"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "unknown -o" in r.stderr
    r = subprocess.run([PERF, "-b", "1M", "-e", "1K"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    r = perf("-m", "gpu", "-b", "8", "-e", "8", nproc=1)
    assert r.returncode != 0 and "-m must be arena or heap" in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("backend,memory", [("gloo", "heap"), ("collserve", "heap"), ("collserve", "arena")])
def test_torch_side_of_the_comparison_checks_its_results(backend, memory):
    pytest.importorskip("torch")
    if backend == "collserve" and not any(
            f.startswith("_collserve_torch") for f in os.listdir(os.path.join(BUILD, "python", "collserve"))):
        pytest.skip("the c10d backend was not built")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                          "torch_perf.py")
    for op, blocking in (("all_reduce", "0"), ("all_gather", "1"), ("reduce_scatter", "0")):
        r = subprocess.run([sys.executable, "-m", "collserve.launch", "--nproc_per_node", "2", "--no_prefix", script,
                            "--backend", backend, "-m", memory, "-b", "64", "-e", "4K", "-f", "8", "-n", "2", "-w", "1",
                            "-o", op, "-z", blocking],
                           capture_output=True, text=True, timeout=120)
        assert f"-z {blocking}" in r.stdout.splitlines()[0], r.stdout + r.stderr
        assert r.returncode == 0 and "# Out of bounds values : 0 OK" in r.stdout, r.stdout + r.stderr
        assert len([line for line in r.stdout.splitlines() if line and not line.startswith("#")]) == 3, r.stdout


@pytest.mark.parametrize("algorithm", ["direct", "ring", "bcube"])
def test_two_hosts_report_the_all_reduce_algorithm_the_sidecars_ran(algorithm, tmp_path, start_daemons):
    """Two launchers (--nnodes 2, each with its own sidecar) on loopback, the algorithm forced
    through `collserve launch --sidecar_flag`: results check, and the column names it."""
    flags, tokens = credentials(str(tmp_path))
    port = start_daemons.coordinator(str(tmp_path), *flags).port
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "collserve.launch", "--nproc_per_node", "2", "--nnodes", "2", "--node_rank", str(h),
         "--coordinator", f"127.0.0.1:{port}", "--gloo_hostname", "127.0.0.1", "--no_prefix",
         f"--sidecar_flag=--allreduce_algorithm={algorithm}", "--no_python", PERF,
         "-b", "8", "-e", "64K", "-f", "32", "-n", "2", "-w", "1", "-o", "all_reduce"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "COLLSERVE_TOKEN": tokens["default"]}) for h in (0, 1)]
    outs = [p.communicate(timeout=120) for p in launchers]
    for p, (out, err) in zip(launchers, outs):
        assert p.returncode == 0, out + err
    out = outs[0][0]
    assert "4 ranks on 2 host(s)" in out and "# Out of bounds values : 0 OK" in out, out
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    # An all_reduce of at most 1 KiB travels with the argument exchange whatever the flag.
    want = lambda size: "local+gloo_fused" if size <= 1024 else f"local+gloo_{algorithm}"
    assert len(rows) == 3 and all(row[13] == want(int(row[0])) for row in rows), out


def test_store_bench_measures_every_column():
    """bench/store_bench.py (bench/RESULTS.md, the durable store against torch's TCPStore) on a
    tiny run: every column is a positive rate or latency. Speed is not asserted."""
    pytest.importorskip("torch")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                          "store_bench.py")
    etcd = ["--etcd"] if shutil.which("etcd") else []
    r = subprocess.run([sys.executable, script, "--build", BUILD, "--reps", "1", "--seconds", "0.3", "--clients", "2",
                        "--latency_ops", "20", *etcd], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python")))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines() if line and not line.startswith("#")]
    rates = [row for row in rows if row[0].strip() == "2"]
    assert len(rates) == 1, r.stdout
    assert all(float(v) > 0 for v in rates[0][1:6]), r.stdout  # torch, durable, memory, endpoint, ep-memory
    if etcd:
        assert all(float(v) > 0 for v in rates[0][9:11]), r.stdout  # etcd, ep-etcd
    latencies = [row for row in rows if row[0].strip() == "0"]
    assert len(latencies) == 1, r.stdout
    assert all(float(v) > 0 for v in latencies[0][1:5]), r.stdout  # fdatasync, torch, endpoint, gRPC


def test_rendezvous_bench_at_64_ranks():
    """bench/rendezvous_bench.py (bench/RESULTS.md, issue 18's rendezvous at scale) at K = 64:
    both rendezvous complete (each checks every rank's answer) and report a time. Speed is
    not asserted."""
    pytest.importorskip("torch")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                          "rendezvous_bench.py")
    r = subprocess.run([sys.executable, script, "--build", BUILD, "--reps", "1", "--ranks", "64", "--timeout_s", "60"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python")))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines() if line and not line.startswith("#")]
    measured = [row for row in rows if row[0].strip() == "64"]
    assert len(measured) == 1, r.stdout
    assert float(measured[0][1]) > 0 and float(measured[0][2]) > 0, r.stdout  # torch, collserve seconds
    assert int(measured[0][3]) > 0, r.stdout  # one answer's bytes
