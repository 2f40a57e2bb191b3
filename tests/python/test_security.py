"""The main job and the c10d backend under TLS and job tokens together (issue 15).

A coordinator with mutual TLS and a job tokens directory (certificates made here with
openssl, in the test's own temp dir), the TCPStore endpoint on loopback with an allow-list;
`collserve launch` against it with its own sidecar, which reaches the coordinator with a
client certificate; the ranks present the job's token and a client certificate. Without
the token, or without TLS, the same job fails with a clear error. Every test bounds its time
and checks that nothing it started is left.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from test_launch import ROOT, assert_none_left, launcher_env, lines_of
from daemons import credentials, start_coordinator

HERE = os.path.dirname(os.path.abspath(__file__))


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d):
    """ca.pem, and server/client certificates for 127.0.0.1 signed by it, in `d`."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem", cwd=d)


@pytest.fixture(scope="module")
def secure():
    """A coordinator with mutual TLS and job "secure"'s token; yields a dict of what the
    launcher and the ranks need."""
    d = tempfile.mkdtemp(prefix="collserve-secure-")
    make_pki(d)
    flags, tokens = credentials(d, ("secure",))
    coordinator = start_coordinator(
        d, f"--tls_cert={d}/server.pem", f"--tls_key={d}/server.key", f"--tls_ca={d}/ca.pem", "--tls_client_auth",
        "--tcpstore_address=127.0.0.1:0", f"--tcpstore_port_file={d}/tcpstore.port", "--tcpstore_job=secure",
        "--tcpstore_allow=127.0.0.1/32", *flags, extra_port_files=("tcpstore.port",))
    try:
        yield {"dir": d, "port": coordinator.port, "tcpstore_port": coordinator.ports["tcpstore.port"],
               "token": tokens["secure"]}
    finally:
        coordinator.stop()
        shutil.rmtree(d, ignore_errors=True)


def launch_secure(secure, nproc, program, token=True, sidecar_tls=True, timeout=300):
    """`collserve launch` against the secure coordinator: its sidecar with a client
    certificate towards the coordinator (unless sidecar_tls is false), the ranks with the
    token (unless token is false) and TLS settings for their own coordinator calls (their
    session with the sidecar is its unix socket). Returns (exit code, stdout, stderr)."""
    d = secure["dir"]
    log_dir = tempfile.mkdtemp(prefix="collserve-secure-launch-")
    env = {k: v for k, v in launcher_env(log_dir).items() if not k.startswith("COLLSERVE_") or k == "COLLSERVE_BUILD_DIR"}
    if token:
        env["COLLSERVE_TOKEN"] = secure["token"]
    env.update(COLLSERVE_TLS_CA=f"{d}/ca.pem", COLLSERVE_TLS_CERT=f"{d}/client.pem",
               COLLSERVE_TLS_KEY=f"{d}/client.key")
    sidecar = [f"--sidecar_flag=--coordinator_tls_ca={d}/ca.pem",
               f"--sidecar_flag=--coordinator_tls_cert={d}/client.pem",
               f"--sidecar_flag=--coordinator_tls_key={d}/client.key"] if sidecar_tls else []
    args = [sys.executable, "-m", "collserve.launch", "--log_dir", log_dir, "--nproc_per_node", str(nproc),
            "--coordinator", f"127.0.0.1:{secure['port']}", "--tcpstore_port", str(secure["tcpstore_port"]),
            "--job", "secure", "--server_start_timeout_s", "30", *sidecar, *program]
    try:
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        assert_none_left(log_dir)
        return proc.returncode, proc.stdout, proc.stderr
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def test_main_job_runs_under_tls_and_tokens(secure):
    code, out, err = launch_secure(secure, 4, ["examples/digits_sgd.py", "--min_accuracy", "0.9"])
    assert code == 0, (out, err)
    for r in range(4):
        assert any(line.startswith("Rank") and "accuracy" in line.lower() for line in lines_of(out, r)), out


def test_c10d_backend_runs_under_tls_and_tokens(secure):
    pytest.importorskip("torch")
    code, out, err = launch_secure(secure, 4, [os.path.join(HERE, "torch_worker.py"), "collectives", "collserve",
                                               "env"], timeout=200)
    assert code == 0, (out, err)
    for r in range(4):
        assert f"rank {r}: collectives ok" in lines_of(out, r), out


def test_without_the_token_or_without_tls_the_job_is_refused(secure):
    # The launcher's first call to the coordinator's store (it deletes torch's keys of
    # earlier runs before starting the ranks) is refused, so no rank starts.
    code, out, err = launch_secure(secure, 2, ["examples/digits_sgd.py"], token=False, timeout=120)
    assert code != 0
    assert "no token presented and this coordinator requires one" in err and "accuracy" not in out, (out, err)
    # A sidecar without a client certificate cannot reach the coordinator: the ranks fail
    # at init instead of training.
    code, out, err = launch_secure(secure, 2, ["examples/digits_sgd.py"], sidecar_tls=False, timeout=120)
    assert code != 0, (out, err)
    assert "accuracy" not in out, out


def test_per_job_quotas_refuse_the_job_over_its_limit_and_spare_its_neighbor():
    """Issue 43: the operator's --job_policies_file limits job "capped" to 2 sessions and
    3,000,000 bytes of shared memory on each sidecar. Its third session is refused with
    RESOURCE_EXHAUSTED naming max_sessions (and admitted once the others left), its 4 MiB
    staging segment is refused naming max_segment_bytes while its small collectives run;
    job "bounded" may have 4 requests in flight, and its requests past that are refused
    naming max_inflight_collectives while its group goes on (quota_worker.py bounded); and
    job "other", with no limits, runs 4 MiB all_reduces beside them untouched. Its policy's
    class (bulk, weight 2) reaches the sidecar: the per-job data-path counters name it; its
    CPU-thread quota of 1 holds its reductions to one thread at a time, and its results stay
    right."""
    import json
    import re
    import urllib.request
    from daemons import free_port, start_sidecar
    d = tempfile.mkdtemp(prefix="collserve-quota-")
    daemons = []
    procs = []
    try:
        flags, tokens = credentials(d, ("capped", "bounded", "other"))
        with open(os.path.join(d, "policies.json"), "w") as f:
            json.dump({"jobs": {"capped": {"max_sessions": 2, "max_segment_bytes": "3000000"},
                                "bounded": {"max_inflight_collectives": 4},
                                "other": {"priority_class": "PRIORITY_CLASS_BULK", "share_weight": 2,
                                          "max_data_threads": 1}}}, f)
        daemons.append(start_coordinator(d, *flags, f"--job_policies_file={d}/policies.json"))
        port = daemons[0].port
        metrics_port = free_port()
        daemons.append(start_sidecar(d, port, f"--unix_socket={d}/s.sock",
                                     f"--metrics_address=127.0.0.1:{metrics_port}"))
        worker = os.path.join(HERE, "quota_worker.py")

        def start(mode, job, rank, world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), COLLSERVE_SIDECAR=f"unix:{d}/s.sock",
                       COLLSERVE_JOB=job, COLLSERVE_TOKEN=tokens[job], COLLSERVE_COORDINATOR=f"127.0.0.1:{port}",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), COLLSERVE_INIT_TIMEOUT_S="30",
                       COLLSERVE_OP_TIMEOUT_S="30")
            procs.append(subprocess.Popen([sys.executable, worker, mode], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for r in range(4):
            start("other", "other", r, 4)
        for r in range(2):
            start("capped", "capped", r, 2)
        start("third", "capped", 0, 1)
        for r in range(2):
            start("bounded", "bounded", r, 2)
        outs = [p.communicate(timeout=120)[0] for p in procs]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            metrics = r.read().decode()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for daemon in reversed(daemons):
            daemon.stop()
        shutil.rmtree(d, ignore_errors=True)
    report = "\n".join(f"--- {i} (exit {p.returncode})\n{o}" for i, (p, o) in enumerate(zip(procs, outs)))
    modes = ["other"] * 4 + ["capped"] * 2 + ["third"] + ["bounded"] * 2
    for p, out, mode in zip(procs, outs, modes):
        assert p.returncode == 0 and f"{mode} ok" in out, report
    assert "sessions on sidecar" in outs[6] and "its quota (max_sessions 2" in outs[6], report
    assert "shared memory registered with sidecar" in outs[4], report
    assert "requests in flight on sidecar" in outs[7] and "max_inflight_collectives 4" in outs[7], report
    used = re.search(r'^collserve_job_data_path_seconds_total\{collserve_job="other",priority_class="bulk"\} (\S+)$',
                     metrics, re.M)
    assert used and float(used.group(1)) > 0, metrics
    assert re.search(r'^collserve_job_data_path_chunks_total\{collserve_job="other",priority_class="bulk"\} [1-9]',
                     metrics, re.M), metrics
    # The per-job stage counters (engine/stages.h): the job's collectives, at least 4 MiB per
    # local rank each, and time in the data step.
    def job_series(name, extra=""):
        m = re.search(r'^%s\{collserve_job="other",priority_class="bulk"%s\} (\S+)$' % (name, extra), metrics, re.M)
        assert m, (name, metrics)
        return float(m.group(1))
    collectives = job_series("collserve_job_collectives_total")
    assert collectives >= 1, metrics
    assert job_series("collserve_job_collective_bytes_total") >= collectives * 4 * (4 << 20), metrics
    assert job_series("collserve_job_stage_seconds_total", ',stage="execute"') > 0, metrics
    for stage in ("queued", "agree", "complete"):
        job_series("collserve_job_stage_seconds_total", f',stage="{stage}"')
    # The scheduler of steps between hosts reports every class; one host cuts nothing.
    for name in ("collserve_link_cut_transfers_total", "collserve_link_pieces_total", "collserve_link_waits_total",
                 "collserve_link_wait_seconds_total"):
        for cls in ("latency_critical", "default", "bulk"):
            assert re.search(r'^%s\{priority_class="%s"\} 0$' % (name, cls), metrics, re.M), (name, cls, metrics)
