"""What the Python suites share: where the build is, wait_for (the one way a test waits for
something: a condition it can observe, with a deadline, never a sleep that orders events),
and the daemons a test starts by hand (a coordinator, a sidecar), started from their port
files and always stopped. conftest.py turns these into fixtures (docs/testing.md)."""
import os
import random
import signal
import socket
import subprocess
import threading
import time

BUILD = os.environ.get("COLLSERVE_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
# Sanitized runs (scripts/sanitizers.sh sets it for the ASan stage: 3) stretch the bounds of
# waits on whole programs, which run several times slower there, beside other test steps.
TIMEOUT_SCALE = float(os.environ.get("COLLSERVE_TEST_TIMEOUT_SCALE", "1"))


def bound(seconds):
    """`seconds`, a test's bound on a program it waits for, stretched by TIMEOUT_SCALE."""
    return seconds * TIMEOUT_SCALE


def wait_for(condition, timeout, what="the condition", poll=0.02):
    """Calls `condition` until it returns something true, and returns that; pauses `poll`
    seconds between calls and checks once more at the deadline, `timeout` seconds from now.
    Raises TimeoutError naming `what` when it never held."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not hold within {timeout} s")
        time.sleep(max(0.0, min(poll, deadline - time.monotonic() + 0.001)))


def readline(stream, timeout, what="a line"):
    """One line of a child's text stream (stdout=PIPE), waiting at most `timeout` seconds
    (""at its end). Raises TimeoutError naming `what` when none came: a child that hangs
    without writing or exiting must not hold the test until ctest's limit kills it (its
    cleanup then never runs). The read runs on a thread of its own (a line may already sit in
    the stream's buffer, where select cannot see it); left blocked, it ends with the child."""
    got = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        raise TimeoutError(f"no {what} within {timeout} s")
    return got[0]


def free_port():
    """A port that is free now, for a server some rank binds later. It is drawn below the
    kernel's ephemeral range (ip_local_port_range), so the ports other tests' processes get
    from bind(0) and connect() meanwhile cannot take it (CI once lost a torch TCPStore's
    port that way)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))  # where torch's TCPStore server binds
            return port
        except OSError:
            continue
    raise RuntimeError("no free port below the ephemeral range")


def read_port(path, proc, timeout=20):
    """The port a daemon wrote to `path` (its --port_file; 0 when that listener is off);
    RuntimeError with its exit code if `proc` exits first, TimeoutError if no port comes
    within `timeout` seconds."""
    def port():
        try:
            with open(path) as f:
                text = f.read().strip()
        except FileNotFoundError:
            text = ""
        if text:
            return [int(text)]  # a list, true even for port 0
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before writing {path}")
        return None
    return wait_for(port, timeout, what=f"a port in {path}")[0]


def credentials(directory, jobs=("default",)):
    """Tokens for a test's coordinator, as an embedded one gets them: a fresh token per job in
    `jobs` under `directory`. Returns (the coordinator's flags, {job: token})."""
    from collserve.launch import embedded_credentials
    tokens, flags = {}, []
    for job in jobs:
        tokens[job], flags = embedded_credentials(directory, job)
    return flags, tokens


class Daemon:
    """A coordinator or sidecar started by a test: .proc, .port (from its port file), .dir,
    and the ports of any further port files it was asked for (.ports[name])."""

    def __init__(self, binary, directory, name, flags, extra_port_files=()):
        self.dir = directory
        self.log = os.path.join(directory, f"{name}.log")
        port_file = os.path.join(directory, f"{name}.port")
        self.proc = subprocess.Popen([os.path.join(BUILD, "server", binary), f"--port_file={port_file}", *flags],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        try:
            self.port = read_port(port_file, self.proc)
            self.ports = {f: read_port(os.path.join(directory, f), self.proc) for f in extra_port_files}
        except BaseException:
            self.stop()
            raise

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_coordinator(directory, *flags, name="coordinator", extra_port_files=()):
    """A coordinator on 127.0.0.1 (an ephemeral port, no metrics, warnings only) with `flags`."""
    return Daemon("collserve-coordinator", directory, name,
                  ["--listen_address=127.0.0.1:0", "--metrics_address=", "--log_level=warning", *flags],
                  extra_port_files)


def start_sidecar(directory, coordinator_port, *flags, name="sidecar"):
    """A sidecar of the coordinator on `coordinator_port` (no metrics, warnings only) with `flags`."""
    return Daemon("collserve-sidecar", directory, name,
                  [f"--coordinator=127.0.0.1:{coordinator_port}", "--metrics_address=", "--log_level=warning", *flags])


def mpi_missing():
    """Why sidecars cannot run under mpirun here ("" when they can): no mpirun on PATH, or a
    build without MPI (the sidecar's --mpi says so)."""
    import shutil
    if shutil.which("mpirun") is None:
        return "no mpirun (Open MPI) on PATH"
    r = subprocess.run([os.path.join(BUILD, "server", "collserve-sidecar"), "--mpi"], capture_output=True, text=True,
                       timeout=60)
    return "this build has no MPI backend" if "no MPI backend" in r.stderr + r.stdout else ""


class MpiSidecars:
    """`n` sidecars of the coordinator on `coordinator_port`, started by one mpirun as one MPI
    world (--mpi; TCP between them on loopback), as "hosts" host0..host{n-1}: .socket(i) is
    sidecar i's unix socket, .ports its TCP ports. Needs mpirun (Open MPI) on PATH and a build
    with MPI: callers skip otherwise."""

    def __init__(self, directory, coordinator_port, n, *flags):
        self.dir = directory
        self.log = os.path.join(directory, "mpirun.log")
        argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]
        for i in range(n):
            if i > 0:
                argv.append(":")
            argv += ["-np", "1", os.path.join(BUILD, "server", "collserve-sidecar"),
                     f"--coordinator=127.0.0.1:{coordinator_port}", f"--unix_socket={self.socket(i)}",
                     f"--host_id=host{i}", "--metrics_address=", "--log_level=warning", "--listen_address=127.0.0.1:0",
                     f"--port_file={directory}/mpi_sidecar{i}.port", "--mpi", *flags]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"),
                                     start_new_session=True)
        try:
            self.ports = [read_port(f"{directory}/mpi_sidecar{i}.port", self.proc, timeout=60) for i in range(n)]
        except BaseException:
            self.stop()
            raise

    def socket(self, i):
        return f"{self.dir}/mpi_sidecar{i}.sock"

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self):
        """SIGTERM to mpirun (which passes it to its sidecars), then SIGKILL to its session
        after 20 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
