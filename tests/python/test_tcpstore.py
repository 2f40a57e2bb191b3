"""torch's own TCPStore client (Debian python3-torch 1.13) against the coordinator's
TCPStore-compatible endpoint (--tcpstore_address): every call 1.13's Python client has,
timeouts, many concurrent clients, the job namespace, and a torch process group whose
rendezvous runs through it. The 2.x dialect and malformed frames are covered byte for byte
by tests/server/tcpstore_server_test.cc."""
import datetime
import os
import subprocess
import sys
import threading

import pytest

torch_dist = pytest.importorskip("torch.distributed")
import collserve  # noqa: E402
import forkserver  # noqa: E402
from daemons import bound, credentials  # noqa: E402
from torch_compat import agent_store_env, store_kwargs  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# The tokens of the jobs the coordinator fixture serves.
TOKENS = {}


@pytest.fixture
def coordinator(monkeypatch, start_daemons, daemon_dir):
    flags, tokens = credentials(daemon_dir, ("torchjob", "otherjob"))
    TOKENS.update(tokens)
    monkeypatch.setenv("COLLSERVE_TOKEN", tokens["torchjob"])  # this process's collserve.Store clients
    c = start_daemons.coordinator(daemon_dir, "--tcpstore_address=127.0.0.1:0",
                                  f"--tcpstore_port_file={daemon_dir}/tcpstore.port", "--tcpstore_job=torchjob", *flags,
                                  extra_port_files=("tcpstore.port",))
    yield c.port, c.ports["tcpstore.port"], c.proc


def client(port, timeout_s=10.0):
    return torch_dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=timeout_s),
                               **store_kwargs())


def test_every_call_of_torch_113_client(coordinator):
    _, port, _ = coordinator
    s = client(port)
    s.set("k", "v")
    assert s.get("k") == b"v"
    assert s.add("ctr", 5) == 5 and s.add("ctr", -2) == 3 and s.get("ctr") == b"3"
    assert s.compare_set("cas", "", "A") == b"A"
    assert s.compare_set("cas", "A", "B") == b"B"
    assert s.compare_set("cas", "X", "C") == b"B"
    assert s.compare_set("absent", "wrong", "new") == b"wrong"  # torch's documented behaviour
    assert s.num_keys() == 3
    s.wait(["k", "ctr"])
    s.wait(["cas"], datetime.timedelta(seconds=2))
    with pytest.raises(RuntimeError, match="Socket Timeout|wait timeout"):  # 1.13 | 2.x client
        s.wait(["never"], datetime.timedelta(seconds=0.3))
    assert s.delete_key("k") is True and s.delete_key("k") is False
    assert s.num_keys() == 2
    # get() waits for the key: another client sets it meanwhile.
    later = client(port)
    threading.Timer(0.3, lambda: later.set("late", "here")).start()
    assert client(port).get("late") == b"here"


def test_keys_live_in_the_job_namespace(coordinator):
    grpc_port, port, _ = coordinator
    client(port).set("shared", "from torch")
    mine = collserve.Store(address=f"127.0.0.1:{grpc_port}", job="torchjob", timeout=5)
    assert mine.get("/shared") == b"from torch"  # TCPStore prefixes "/"
    mine.set("/back", "from collserve")
    assert client(port).get("back") == b"from collserve"
    other = collserve.Store(address=f"127.0.0.1:{grpc_port}", job="otherjob", timeout=5, token=TOKENS["otherjob"])
    assert not other.check(["/shared"])


def test_many_concurrent_clients(coordinator):
    _, port, proc = coordinator
    errors = []

    def work(i):
        try:
            s = client(port)
            for _ in range(20):
                s.add("counter", 1)
            s.set(f"done/{i}", "1")
            s.wait([f"done/{j}" for j in range(24)])
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert client(port).get("counter") == b"480"
    assert proc.poll() is None


@pytest.mark.parametrize("init", ["tcp", "env"])
def test_torch_process_group_rendezvous_through_the_endpoint(coordinator, init):
    grpc_port, port, _ = coordinator
    world = 3
    procs = []
    for rank in range(world):
        env = agent_store_env(dict(os.environ, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                                   RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(port)))
        method = f"tcp://127.0.0.1:{port}?rank={rank}&world_size={world}" if init == "tcp" else "env://"
        procs.append(forkserver.popen([sys.executable, os.path.join(HERE, "tcpstore_worker.py"), method], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=bound(90))
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0 and f"rank {rank} of 3: sum 6.0" in out, out
    keys = collserve.Store(address=f"127.0.0.1:{grpc_port}", job="torchjob", timeout=5)
    assert keys.check(["init/"]) and keys.num_keys() > world  # the rendezvous keys landed in the job
