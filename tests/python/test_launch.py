"""`collserve launch` and what runs under it: the tutorial's programs, the main job (digits
SGD, >= 90% test accuracy), exact gradient averaging, exit codes, signals, several nodes.

Every test bounds its time (subprocess timeouts) and checks that the servers the launcher
started are gone afterwards.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import collserve

from daemons import readline
from test_sdk import Cluster

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
WORKER = os.path.join(HERE, "launch_worker.py")


_made_dirs = []


def new_log_dir():
    """A fresh --log_dir for one launcher run, removed when this module's tests are done."""
    d = tempfile.mkdtemp(prefix="collserve-launch-test-")
    _made_dirs.append(d)
    return d


@pytest.fixture(autouse=True, scope="module")
def _remove_log_dirs():
    yield
    for d in _made_dirs:
        shutil.rmtree(d, ignore_errors=True)


def launcher_env(log_dir, **extra):
    """The environment of a launcher run with --log_dir `log_dir` (which this makes): TMPDIR
    is `log_dir`, so the private directory the launcher keeps its servers' sockets, port files
    and token in (a tempfile.mkdtemp) is under it too, and every process it started has
    `log_dir` on its command line for assert_none_left."""
    os.makedirs(log_dir, exist_ok=True)
    return {**os.environ, "TMPDIR": log_dir, **extra}


def launch(*args, timeout=300, log_dir=None, expect=0):
    """Runs `python -m collserve.launch args`; returns (stdout, stderr). Checks the exit code
    and that no process the launcher started (they all use log_dir) is left."""
    log_dir = log_dir or new_log_dir()
    proc = subprocess.run([sys.executable, "-m", "collserve.launch", "--log_dir", log_dir, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=launcher_env(log_dir))
    assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
    assert_none_left(log_dir)
    return proc.stdout, proc.stderr


def assert_none_left(log_dir):
    left = subprocess.run(["pgrep", "-f", log_dir], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines_of(stdout, rank):
    prefix = f"[rank{rank}]: "
    return [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]


def test_tutorial_point_to_point_examples():
    out, _ = launch("--nproc_per_node", "2", "examples/tutorial/p2p_blocking.py")
    for r in (0, 1):
        assert lines_of(out, r) == [f"Rank  {r}  has data  tensor(1.)"], out
    out, _ = launch("--nproc_per_node", "2", "examples/tutorial/p2p_nonblocking.py")
    assert lines_of(out, 0) == ["Rank 0 started sending", "Rank  0  has data  tensor(1.)"], out
    assert lines_of(out, 1) == ["Rank 1 started receiving", "Rank  1  has data  tensor(1.)"], out


def test_tutorial_all_reduce_on_a_group():
    out, _ = launch("--nproc_per_node", "2", "examples/tutorial/all_reduce_group.py")
    for r in (0, 1):
        assert lines_of(out, r) == [f"Rank  {r}  has data  tensor(2.)"], out


def test_tutorial_ring_all_reduce():
    out, _ = launch("--nproc_per_node", "4", "examples/tutorial/ring_all_reduce.py")
    for r in range(4):
        assert lines_of(out, r) == [f"Rank  {r}  has data  [60.0, 64.0, 68.0, 72.0] correct"], out


def test_main_job_trains_digits_to_90_percent():
    out, _ = launch("--nproc_per_node", "4", "examples/digits_sgd.py", "--min_accuracy", "0.9", timeout=300)
    for r in range(4):
        lines = lines_of(out, r)
        assert [line.split(":")[0] for line in lines[:20]] == [f"Rank  {r} , epoch  {e} " for e in range(20)], out
        assert lines[-1].startswith(f"Rank  {r} , test accuracy: "), out
        assert float(lines[-1].split(": ")[1].split("%")[0]) >= 90.0, out


def test_gradient_averaging_is_exact(tmp_path):
    launch("--nproc_per_node", "4", os.path.join(HERE, "sgd_exact.py"), "ranks", str(tmp_path))
    subprocess.run([sys.executable, os.path.join(HERE, "sgd_exact.py"), "reference", str(tmp_path)], check=True,
                   timeout=120)
    ref, alone = np.load(tmp_path / "reference.npz"), np.load(tmp_path / "alone.npz")
    for r in range(4):
        got = np.load(tmp_path / f"rank{r}.npz")
        for name in ref.files:
            assert got[name].dtype == np.float64
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-9, atol=0, err_msg=f"rank {r} {name}")
    # The control: without averaging the parameters differ far beyond the tolerance.
    assert max(np.max(np.abs(alone[n] - ref[n]) / np.abs(ref[n])) for n in ref.files) > 1e-3


def test_environment_and_output_prefixes():
    out, err = launch("--nproc_per_node", "3", "--job", "envjob", WORKER, "env")
    run_ids = set()
    for r in range(3):
        (line,) = lines_of(out, r)
        env = dict(kv.split("=", 1) if "=" in kv else (kv, "") for kv in line.split())
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (
            str(r), "3", str(r), "3", "0"), line
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0, line
        assert env["COLLSERVE_SIDECAR"].startswith("unix:") and env["COLLSERVE_JOB"] == "envjob", line
        assert f"[rank{r}]: to stderr" in err.splitlines(), err
        run_ids.add(env["COLLSERVE_RUN_ID"])
    # One run id for the launch's ranks (reconfigure's keys), ending in the attempt; another
    # launch of the same job name gets another (its keys never meet this one's).
    (run_id,) = run_ids
    assert run_id.endswith(".0") and len(run_id) > 2, run_id
    out, _ = launch("--nproc_per_node", "1", "--job", "envjob", WORKER, "env")
    assert f"COLLSERVE_RUN_ID={run_id}" not in out and "COLLSERVE_RUN_ID=" in out, (run_id, out)


def test_exit_code_is_the_first_failing_ranks():
    start = time.monotonic()
    out, err = launch("--nproc_per_node", "3", "--failure_grace_s", "90", WORKER, "fail", expect=3)
    assert "rank 1 exited with code 3 (the first rank to fail)" in err, err
    # The surviving ranks learn of the failure from the service (a rank the launcher stopped at
    # the end of the grace period would print nothing), well before the grace period (a bound
    # far above the 2-3 s this takes, since starting 3 Pythons took 22 s on a loaded machine).
    assert lines_of(out, 0) == ["barrier failed: DistNetworkError"], (out, err)
    assert time.monotonic() - start < 90


def test_signals_are_forwarded_and_everything_stops():
    log_dir = new_log_dir()
    proc = subprocess.Popen([sys.executable, "-m", "collserve.launch", "--log_dir", log_dir, "--nproc_per_node", "2",
                             WORKER, "sigterm"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launcher_env(log_dir))
    try:
        ready = [readline(proc.stdout, 120, "ready line") for _ in range(2)]
        assert sorted(ready) == ["[rank0]: ready\n", "[rank1]: ready\n"], ready
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 7, (proc.returncode, out, err)
    for r in (0, 1):
        assert lines_of(out, r) == ["got SIGTERM"], out
    # Stopped from outside: reported as such, not as a failure.
    assert "the job was stopped by SIGTERM, which the launcher forwarded to its ranks; rank" in err, err
    assert "the first rank to fail" not in err and "Root Cause" not in err, err
    assert_none_left(log_dir)


def communicate_all(procs, timeout):
    """Each launcher's (stdout, stderr), read in turn, each within `timeout` seconds; one
    still running after its wait is killed."""
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        finally:
            if p.poll() is None:
                p.kill()
    return outs


def test_two_nodes_against_one_coordinator():
    """Two launchers (--nnodes 2, two "nodes" on loopback) against one long-lived coordinator,
    each starting its own sidecar: the all_reduce crosses them. Then the same job name twice
    more: within a launch every rank of both nodes gets one COLLSERVE_RUN_ID (the launchers'
    formation of "collserve.launch"), and the next launch another, so its reconfigure lists
    and torch master key are not the earlier run's. The ranks get the coordinator's TCPStore
    endpoint: before each launch's ranks start, node 0 deletes the keys torch's ranks of
    earlier runs left there (here planted ones) and says so, and node 1 waits for its word."""
    cluster = Cluster(jobs=("twonodes",), tcpstore=True)  # each launcher starts its own sidecar
    try:
        def two_nodes(mode):
            common = ["--nnodes", "2", "--nproc_per_node", "2", "--coordinator", f"127.0.0.1:{cluster.port}",
                      "--tcpstore_port", str(cluster.tcpstore_port), "--gloo_hostname", "127.0.0.1", "--job",
                      "twonodes"]
            logs = [new_log_dir() for _ in range(2)]
            procs = [subprocess.Popen([sys.executable, "-m", "collserve.launch", "--log_dir", logs[n], *common,
                                       "--node_rank", str(n), WORKER, mode], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env=launcher_env(logs[n], COLLSERVE_TOKEN=cluster.token)) for n in range(2)]
            outs = communicate_all(procs, 90)
            for n, (p, (out, err)) in enumerate(zip(procs, outs)):
                assert p.returncode == 0, (out, err)
                assert_none_left(logs[n])
            return [out for out, _ in outs], [err for _, err in outs]

        outs, _ = two_nodes("allreduce")
        for n, out in enumerate(outs):
            for r in (2 * n, 2 * n + 1):
                assert lines_of(out, r) == ["world 4 sum 6"], out
        store = collserve.Store(address=f"127.0.0.1:{cluster.port}", job="twonodes", token=cluster.token, timeout=5)
        stale = ["//worker/attempt_0/default_pg/0/rank_0", "/default_pg/0/rank_0", "/rpc_prefix_0/x"]
        runs = []
        for _ in range(2):
            store.multi_set(stale + ["/mine"], ["127.0.0.1:1"] * 4)
            outs, errs = two_nodes("env")
            ids = {re.search(r"COLLSERVE_RUN_ID=(\S*)", lines_of(outs[r // 2], r)[0]).group(1) for r in range(4)}
            (run_id,) = ids
            assert re.fullmatch(r"\d+\.[0-9a-f]{16}", run_id), run_id
            runs.append(run_id)
            assert not any(store.check([k]) for k in stale) and store.check(["/mine"])
            assert "deleted 3 key(s) that torch's ranks of earlier runs of job twonodes left" in errs[0], errs[0]
            # This launch's word from node 0 is there; an earlier launch's was deleted.
            marker = "collserve/launch/torch_store_reset/"
            assert store.check([marker + run_id]) and not any(store.check([marker + r]) for r in runs[:-1])
    finally:
        cluster.stop()


def test_a_kubeflow_pytorchjob_command_line_runs_a_torch_program_on_two_nodes(tmp_path):
    """What Kubeflow's PyTorchJob gives each replica: PET_NNODES, PET_NPROC_PER_NODE,
    PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT (and the command `torchrun train.py`),
    here `collserve launch` with --local_addr; node 0 starts the coordinator at the master's
    port, every node holds the job token (a Secret in Kubernetes), and an unmodified torch
    program (every collective, backend "collserve") runs across the two nodes."""
    pytest.importorskip("torch")
    token = tmp_path / "token"
    token.write_text("pytorchjob-token\n")
    token.chmod(0o600)
    port = str(_free_port())
    worker = os.path.join(HERE, "torch_worker.py")
    logs = [str(tmp_path / f"node{n}") for n in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "collserve.launch", "--log_dir", logs[n], "--local_addr",
                               "127.0.0.1", worker, "collectives", "collserve", "env"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=launcher_env(logs[n], PET_NNODES="2", PET_NPROC_PER_NODE="2", PET_NODE_RANK=str(n),
                                               PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port,
                                               COLLSERVE_TOKEN_FILE=str(token), WORKER_TIMEOUT_S="60"))
             for n in (1, 0)]  # node 1 first: it waits for node 0's coordinator
    outs = communicate_all(procs, 150)
    for p, (out, err), log in zip(procs, outs, reversed(logs)):
        assert p.returncode == 0, (out, err)
        assert_none_left(log)
    for r in range(4):
        assert f"[rank{r}]: rank {r}: collectives ok" in outs[0][0] + outs[1][0], outs
    # Without a token on every node there is no coordinator for the other hosts to reach.
    proc = subprocess.run([sys.executable, "-m", "collserve.launch", WORKER, "env"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**launcher_env(str(tmp_path / "notoken")), "PET_NNODES": "2",
                                                      "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port})
    assert proc.returncode == 1 and "give every node the same job token" in proc.stderr, proc.stderr


def test_torch_error_files_give_the_root_cause(tmp_path):
    """torch's @record writes the exception that ended a rank to TORCHELASTIC_ERROR_FILE; the
    launcher prints torchrun's summary of the first failure with its traceback."""
    pytest.importorskip("torch")
    log_dir = str(tmp_path / "logs")
    _, err = launch("--nproc_per_node", "2", WORKER, "record", log_dir=log_dir, expect=1)
    assert "rank 1 exited with code 1 (the first rank to fail)" in err, err
    summary = err[err.index("Root Cause (first observed failure):"):]
    assert "  rank      : 1 (local_rank: 1)" in summary and "  exitcode  : 1 (pid: " in summary, summary
    error_file = os.path.join(log_dir, "attempt_0", "1", "error.json")
    assert f"  error_file: {error_file}" in summary, summary
    assert "ValueError: rank 1 gives up" in summary, summary


def test_max_restarts_starts_every_rank_again_after_a_failure():
    out, err = launch("--nproc_per_node", "3", "--max_restarts", "1", WORKER, "fail_once")
    assert "restarting the 3 ranks of this host (restart 1 of 1)" in err, err
    for r in range(3):
        assert lines_of(out, r) == ["attempt 1 of 1: world 3 sum 3"], (out, err)
    # Without restarts the first failure ends the job.
    _, err = launch("--nproc_per_node", "3", WORKER, "fail_once", expect=3)
    assert "rank 1 exited with code 3 (the first rank to fail)" in err, err


def test_torchrun_names_pet_variables_and_redirects(tmp_path):
    log_dir = str(tmp_path / "logs")
    proc = subprocess.run([sys.executable, "-m", "collserve.launch", "--log_dir", log_dir, "--rdzv_id", "petjob",
                           "--rdzv_backend", "c10d", "--standalone", "--start_method", "spawn", "--nnodes", "1:1",
                           "--redirects", "3", "--tee", "0:1", WORKER, "env"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=launcher_env(log_dir, PET_NPROC_PER_NODE="2"))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert_none_left(log_dir)
    # Rank 0's stdout is teed (console and file); the rest only in the files.
    (line,) = lines_of(proc.stdout, 0)
    assert "WORLD_SIZE=2" in line and "COLLSERVE_JOB=petjob" in line, line
    assert lines_of(proc.stdout, 1) == [], proc.stdout
    assert "[rank0]: to stderr" not in proc.stderr, proc.stderr
    for r in (0, 1):
        with open(os.path.join(log_dir, "attempt_0", str(r), "stdout.log")) as f:
            assert f"RANK={r} WORLD_SIZE=2" in f.read()
        with open(os.path.join(log_dir, "attempt_0", str(r), "stderr.log")) as f:
            assert f.read() == "to stderr\n"
    out, _ = launch("--nproc_per_node", "cpu", WORKER, "env")
    assert len([l for l in out.splitlines() if "WORLD_SIZE=" in l]) == os.cpu_count(), out
    # torchrun's other flags and the variables its ranks get.
    out, err = launch("--nproc_per_node", "3", "--role", "trainer", "--rdzv_conf", "join_timeout=77,last_call_timeout=2",
                      "--monitor_interval", "0.5", "--run_path", "--local_ranks_filter", "0,2", WORKER, "env",
                      log_dir=str(tmp_path / "flags"))
    assert lines_of(out, 1) == [], out
    assert "setting OMP_NUM_THREADS=1 for each rank" in err, err
    for r in (0, 2):
        (line,) = lines_of(out, r)
        env = dict(kv.split("=", 1) for kv in line.split())
        assert (env["GROUP_WORLD_SIZE"], env["ROLE_NAME"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == (
            "1", "trainer", str(r), "3"), line
        assert env["TORCHELASTIC_ERROR_FILE"] == os.path.join(str(tmp_path / "flags"), "attempt_0", str(r),
                                                              "error.json"), line
        assert env["OMP_NUM_THREADS"] == "1" and env["COLLSERVE_INIT_TIMEOUT_S"] == "77.0", line
    out, _ = launch("--nproc_per_node", "2", WORKER, "env", log_dir=str(tmp_path / "omp"))
    (line,) = lines_of(out, 0)
    assert "OMP_NUM_THREADS=1" in line, line


def test_the_job_token_reaches_the_ranks_as_a_private_file_outside_the_log_dir():
    """Issue 41, finding 3: the embedded coordinator's job token was in every rank's
    environment (COLLSERVE_TOKEN) and under --log_dir (job-tokens/default). Now the ranks get
    COLLSERVE_TOKEN_FILE, a 0600 file in a 0700 directory of the launcher's own (removed at
    exit), and nothing under --log_dir holds it."""
    log_dir = tempfile.mkdtemp(prefix="collserve-launch-test-")
    run_tmp = tempfile.mkdtemp(prefix="collserve-launch-test-run-")
    try:
        proc = subprocess.run([sys.executable, "-m", "collserve.launch", "--log_dir", log_dir, "--nproc_per_node", "2",
                               WORKER, "token"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TMPDIR": run_tmp, "COLLSERVE_TOKEN": "inherited-not-used"})
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        assert_none_left(log_dir)
        assert_none_left(run_tmp)
        files = set()
        for r in (0, 1):
            first, sums = lines_of(proc.stdout, r)
            assert sums == "world 2 sum 1", proc.stdout
            assert first.startswith("COLLSERVE_TOKEN unset file ") and first.endswith(" modes 600 700"), first
            path = first.split(" ")[3]
            assert path.startswith(run_tmp + os.sep) and not path.startswith(log_dir), path
            files.add(path)
        assert len(files) == 1 and not os.path.exists(files.pop()), "the token file outlived the launcher"
        for parent, _, names in os.walk(log_dir):
            assert "job-tokens" not in parent and not any(n.endswith(".sock") for n in names), (parent, names)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
        shutil.rmtree(run_tmp, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (uid 65534)")
def test_another_user_cannot_reach_a_launched_jobs_tcpstore_endpoint():
    """Issue 41, finding 2: during an embedded launch, uid nobody read and overwrote the job's
    keys with raw TCPStore requests on 127.0.0.1:$MASTER_PORT (the coordinator's TCPStore
    endpoint takes no token). Now the endpoint admits only connections whose other end
    belongs to the coordinator's uid (or root): the rank reads the key, nobody is closed."""
    from collserve.launch import torch_without_libuv
    if torch_without_libuv(sys.executable):
        pytest.skip("this torch has no libuv: MASTER_PORT is rank 0's own torch TCPStore, not the coordinator's")
    out, _ = launch("--nproc_per_node", "2", WORKER, "intruder")
    assert lines_of(out, 0) == ["owner: got v1", "nobody: closed"], out


def test_a_slow_rendezvous_reports_who_is_missing():
    out, err = launch("--nproc_per_node", "2", WORKER, "late")
    assert ("collserve launch: waiting for the job's groups (5s): group \"world\" generation 1: 1 of 2 ranks joined; "
            "missing ranks [1]" in err), err
    for r in (0, 1):
        assert lines_of(out, r) == ["world 2 sum 1"], out


def test_bad_arguments_are_refused():
    for args, text in ((["--nnodes", "2", WORKER, "env"], "needs --coordinator"),
                       (["--nnodes", "2", "--node_rank", "2", "--coordinator", "h:1", WORKER, "env"], "out of range"),
                       (["--nproc_per_node", "0", WORKER, "env"], "at least 1"),
                       (["--nproc_per_node", "many", WORKER, "env"], "must be a number, cpu, gpu or auto"),
                       (["--nnodes", "3:2", WORKER, "env"], "MIN must be at least 1 and at most MAX"),
                       (["--standalone", "--coordinator", "h:1", WORKER, "env"], "--standalone"),
                       (["--redirects", "7", WORKER, "env"], "--redirects '7' must be 0..3"),
                       (["--rdzv_conf", "join_timeout", WORKER, "env"], "is not KEY=VALUE"),
                       (["--rdzv_conf", "join_timeout=soon", WORKER, "env"], "must be a number of seconds"),
                       (["--master_port", "70000", WORKER, "env"], "must be a port number"),
                       (["--nnodes", "2", "--master_addr", "h", "--master_port", "1", "--coordinator", "h:2", WORKER,
                         "env"], "cannot go with --coordinator")):
        proc = subprocess.run([sys.executable, "-m", "collserve.launch", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 2 and text in proc.stderr, (args, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "collserve", "launch", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and "--nproc_per_node" in proc.stdout, proc.stdout


def test_one_process_per_gpu_runs_nccl_in_the_ranks(monkeypatch):
    """--nproc_per_node gpu with two or more GPUs: one GPU per rank, which the sidecar's
    CUDA path does not serve; the ranks get COLLSERVE_CUDA_PATH=nccl (docs/gpu.md). With one
    GPU, a number, or no GPU, nothing changes."""
    import argparse
    import types
    from collserve import launch as launch_mod
    parser = argparse.ArgumentParser()
    for gpus, value, want in ((8, "gpu", (8, True)), (8, "auto", (8, True)), (1, "gpu", (1, False)),
                              (8, "4", (4, False)), (0, "auto", (os.cpu_count() or 1, False))):
        fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda g=gpus: g > 0,
                                                                     device_count=lambda g=gpus: g))
        monkeypatch.setitem(sys.modules, "torch", fake_torch)
        assert launch_mod._nproc_per_node(parser, value) == want, (gpus, value)


def test_a_later_node_starts_its_ranks_only_after_node_0_reset_the_torch_store(start_daemons, daemon_dir, monkeypatch):
    """Several nodes: node 0's launcher deletes what torch's ranks of earlier runs left on the
    coordinator's store and then sets this run's marker; every other node's launcher waits
    for that marker (up to the init timeout) before it starts its ranks, and fails naming it
    when it never comes. Called on Launcher.reset_torch_keys directly: two launchers on
    loopback always find node 0 done first, so only a node 0 that never gets there shows the
    wait."""
    import argparse
    from collserve import launch as launch_mod
    port = start_daemons.coordinator(daemon_dir, "--allow_unauthenticated").port
    coordinator = f"127.0.0.1:{port}"
    monkeypatch.setenv("COLLSERVE_INIT_TIMEOUT_S", "1")
    launchers = []

    def launcher(node_rank, run_id):
        args = argparse.Namespace(nnodes=2, min_nodes=2, node_rank=node_rank, job="resetjob", log_dir=daemon_dir,
                                  rdzv_conf={})
        lr = launch_mod.Launcher(args)
        lr.run_id = run_id
        launchers.append(lr)
        return lr

    try:
        store = collserve.Store(address=coordinator, job="resetjob", timeout=5)
        marker = "collserve/launch/torch_store_reset/"
        # Node 0 has not reset this run's keys: node 1 waits, then fails naming the marker.
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="torch_store_reset/run2"):
            launcher(1, "run2").reset_torch_keys(coordinator)
        assert time.monotonic() - start >= 0.9
        # Node 0 resets: the earlier runs' keys and markers go, this run's marker is set, and node 1 goes on.
        store.multi_set(["/default_pg/0/rank_0", marker + "run1", "/mine"], ["x", "0", "y"])
        launcher(0, "run2").reset_torch_keys(coordinator)
        assert not store.check(["/default_pg/0/rank_0"]) and not store.check([marker + "run1"])
        assert store.check(["/mine"]) and store.get(marker + "run2") == b"1"
        launcher(1, "run2").reset_torch_keys(coordinator)
    finally:
        for lr in launchers:
            shutil.rmtree(lr.run_dir, ignore_errors=True)
