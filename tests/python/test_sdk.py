"""The collserve Python package against a real coordinator and sidecar on loopback.

Run by ctest (tests/CMakeLists.txt) with COLLSERVE_BUILD_DIR set and PYTHONPATH=<build>/python.
Every test bounds its time and stops the processes it started.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from daemons import bound, credentials, readline, start_coordinator, start_sidecar

WORKER = os.path.join(os.path.dirname(__file__), "worker.py")


class Cluster:
    """A coordinator and one sidecar on loopback, in a temporary directory. The coordinator
    requires the token of each job in `jobs` (self.tokens); env() hands the first job's
    (self.token) to the ranks."""

    def __init__(self, jobs=("default",), tcpstore=False):
        """tcpstore: the coordinator also serves its TCPStore endpoint for the first job, on
        an ephemeral port (self.tcpstore_port)."""
        self.dir = tempfile.mkdtemp(prefix="collserve-py-")
        self.daemons = []
        try:
            flags, self.tokens = credentials(self.dir, jobs)
            self.token = self.tokens[jobs[0]]
            if tcpstore:
                flags = ["--tcpstore_address=127.0.0.1:0", f"--tcpstore_port_file={self.dir}/tcpstore.port",
                         f"--tcpstore_job={jobs[0]}", *flags]
            self.daemons.append(
                start_coordinator(self.dir, *flags, extra_port_files=("tcpstore.port",) if tcpstore else ()))
            self.tcpstore_port = self.daemons[0].ports.get("tcpstore.port")
            self.port = self.daemons[0].port
            self.coordinator = self.daemons[0].proc
            self.socket = f"{self.dir}/sidecar.sock"
            self.daemons.append(start_sidecar(self.dir, self.port, f"--unix_socket={self.socket}", "--host_id=host0"))
        except BaseException:
            self.stop()
            raise
        self.sidecar = self.daemons[1].proc

    def env(self, rank, world, **extra):
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                   COLLSERVE_SIDECAR=f"unix:{self.socket}", COLLSERVE_INIT_TIMEOUT_S="30",
                   COLLSERVE_OP_TIMEOUT_S="30", COLLSERVE_TOKEN=self.token)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def ranks(self, mode, world, stdin=None, args=(), **extra):
        return [subprocess.Popen([sys.executable, WORKER, mode, *args], env=self.env(r, world, **extra), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=stdin)
                for r in range(world)]

    def stop(self):
        """Stops the daemons and removes the temporary directory (their logs are read before)."""
        for d in reversed(self.daemons):
            d.stop()
        self.daemons = []
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.stop()


def outputs(procs, limit=60):
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=bound(limit))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\n[killed: timed out]"
        out.append((p.returncode, text))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_call_on_numpy_arrays(cluster, world):
    for code, text in outputs(cluster.ranks("api", world, args=["numpy"])):
        assert code == 0 and "ok api numpy" in text, text


@pytest.mark.parametrize("world", [1, 3])
def test_every_call_on_torch_tensors(cluster, world):
    pytest.importorskip("torch")
    for code, text in outputs(cluster.ranks("api", world, args=["torch"]), limit=120):
        assert code == 0 and "ok api torch" in text, text


@pytest.mark.parametrize("variant", ["pipelined", "rank1_without_peer_reads", "not_pipelined"])
def test_large_broadcasts_of_ordinary_arrays(cluster, variant):
    """Roots send the request before copying (COLLSERVE_PIPELINED_BROADCAST): peer readers follow
    the copy; a rank without peer reads makes the sidecar wait for it; and the plain staged path."""
    procs = []
    for r in range(4):
        extra = {}
        if variant == "not_pipelined":
            extra["COLLSERVE_PIPELINED_BROADCAST"] = "0"
        if variant == "rank1_without_peer_reads" and r == 1:
            extra["COLLSERVE_PEER_READS"] = "0"
        procs.append(subprocess.Popen([sys.executable, WORKER, "big_broadcast"], env=cluster.env(r, 4, **extra),
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for code, text in outputs(procs, limit=120):
        assert code == 0 and "ok big_broadcast" in text, text


def test_groups_translate_global_ranks(cluster):
    for code, text in outputs(cluster.ranks("groups", 4)):
        assert code == 0 and "ok groups" in text, text


def test_store_calls(cluster):
    for code, text in outputs(cluster.ranks("store", 3, MASTER_ADDR="", MASTER_PORT="",
                                           TEST_COORDINATOR=f"127.0.0.1:{cluster.port}")):
        assert code == 0 and "ok store" in text, text


def test_blocking_calls_release_the_gil(cluster):
    for code, text in outputs(cluster.ranks("gil", 2)):
        assert code == 0 and "ok gil" in text, text


def test_desync_raises_argument_error_naming_ranks(cluster):
    for code, text in outputs(cluster.ranks("desync", 3)):
        assert "error DistArgumentError/DistBackendError/DistError" in text, text
        assert "count=7 on ranks [2] but count=16 on ranks [0, 1]" in text, text


def test_a_skipped_collective_is_named_by_its_call_sites(cluster):
    """The skip no op/count/dtype check sees: every rank gets DistArgumentError naming the
    ranks and both places in the program; nothing moved, so the barrier after it works."""
    import re
    here = open(WORKER).read().splitlines()
    first = 1 + next(i for i, line in enumerate(here) if "# worker.py: the first all_reduce" in line)
    second = 1 + next(i for i, line in enumerate(here) if "# every rank: the second all_reduce" in line)
    for code, text in outputs(cluster.ranks("skip", 3)):
        assert "error DistArgumentError/DistBackendError/DistError" in text, text
        # A call site: "#<earlier calls from the stack> [<stack hash>] file:line < caller's file:line ...".
        site = r"#\d+ \[[0-9a-f]{16}\] worker\.py:%d(?: < [^\[\]]*)?"
        assert "ranks called it from different places" in text, text
        assert re.search(rf"at {site % first} on ranks \[0, 1\]", text), text
        assert re.search(rf"at {site % second} on ranks \[2\]", text), text
        assert "barrier ok" in text, text


def test_timeout_raises_timeout_error(cluster):
    (code, text), _ = outputs(cluster.ranks("timeout", 2, COLLSERVE_OP_TIMEOUT_S=2))
    assert "error DistTimeoutError/DistBackendError/DistError" in text, text
    assert "did not call it" in text, text


def test_bad_rank_is_argument_error(cluster):
    ((code, text),) = outputs(cluster.ranks("badrank", 1))
    assert "error DistArgumentError: rank 5 is out of range for world_size 2" in text, text


def test_stopped_sidecar_is_network_error(cluster):
    procs = cluster.ranks("sidecar_gone", 2, stdin=subprocess.PIPE)
    for p in procs:
        assert readline(p.stdout, bound(60), "ready line").strip() == "ready"
    cluster.sidecar.terminate()
    cluster.sidecar.wait(timeout=20)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for code, text in outputs(procs):
        assert "error DistNetworkError/DistError" in text, text


def test_init_process_group_mpi_asks_the_sidecars_for_mpi(cluster):
    """init_process_group("mpi") makes the group ask for the mpi backend (COLLSERVE_BACKEND):
    two ranks on two sidecars that were not started as an MPI world fail at init naming why
    (NOT_FOUND naming the backends in a build without MPI). Under "gloo" they would connect."""
    second = f"{cluster.dir}/sidecar1.sock"
    cluster.daemons.append(start_sidecar(cluster.dir, cluster.port, f"--unix_socket={second}", "--host_id=host1",
                                         name="sidecar1"))
    program = ("import collserve as dist\n"
               "try:\n"
               "    dist.init_process_group('mpi')\n"
               "    print('joined')\n"
               "except Exception as e:\n"
               "    print('refused:', e)\n")
    procs = []
    for r in range(2):
        env = cluster.env(r, 2, COLLSERVE_INIT_TIMEOUT_S=20)
        if r == 1:
            env["COLLSERVE_SIDECAR"] = f"unix:{second}"
        procs.append(subprocess.Popen([sys.executable, "-c", program], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for code, text in outputs(procs):
        assert code == 0 and "refused:" in text, text
        assert "mpirun or srun" in text or ("mpi" in text and "gloo" in text), text
