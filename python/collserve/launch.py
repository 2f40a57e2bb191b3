"""collserve launch: starts the ranks of a job on this host, like `torchrun --standalone`.

    collserve launch --nproc_per_node 4 train.py --epochs 3      # or: python -m collserve.launch ...

Unless told where they are (--coordinator, --sidecar), it starts an embedded coordinator
and one sidecar on loopback, in a private temporary directory. It spawns --nproc_per_node
ranks of `python -u script args...` (or `-m module`, or any command with --no_python), each
with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK/NODE_RANK, MASTER_ADDR,
MASTER_PORT, COLLSERVE_COORDINATOR, COLLSERVE_SIDECAR and COLLSERVE_JOB set, prefixes every
line a rank prints with "[rank<R>]: ", forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT to the ranks,
and exits with the first failing rank's exit code (128 + signal for a rank killed by a
signal; 0 if all succeed). When a rank fails, the others get --failure_grace_s seconds to
finish (they see the group fail), then SIGTERM. Everything it started is stopped before it
exits.

MASTER_ADDR:MASTER_PORT is the coordinator's TCPStore endpoint and
TORCHELASTIC_USE_AGENT_STORE=True, so torch.distributed's own env:// rendezvous (any
backend, "collserve" included) goes through the coordinator's store, as under torchrun's
agents. With --coordinator, give its endpoint's port as --tcpstore_port; without it,
MASTER_PORT is the coordinator's gRPC port (enough for the collserve SDK, not for torch).
A torch 2.x built without libuv (Debian 13's 2.6) cannot take that path: its TCPStore
refuses to start unless given use_libuv=False, which torch's agent-store path never passes.
With such a torch the ranks get USE_LIBUV=0 and torch's other env:// path instead: rank 0
hosts torch's own TCPStore at MASTER_ADDR:MASTER_PORT (a free port of node 0, which node 0's
launcher publishes to the other nodes through the coordinator's store), as under torchrun
with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.

Several hosts: run one launcher per host with the same --nnodes, --nproc_per_node, --job and
--coordinator HOST:PORT (a running collserve-coordinator), and --node_rank 0..nnodes-1.
Each starts its own sidecar, reachable by the other hosts at --gloo_hostname.

torchrun's interface where it fits: --rdzv_endpoint and --rdzv_id are --coordinator and
--job; --rdzv_backend, --standalone and --start_method are accepted; --nproc_per_node takes
cpu/gpu/auto; --nnodes takes MIN:MAX (elastic formation); --max_restarts restarts every rank of this host after a
failure (TORCHELASTIC_RESTART_COUNT counts the attempts); --redirects/--tee write the
ranks' output to LOG_DIR/attempt_<n>/<local_rank>/{stdout,stderr}.log; every option's
default can come from PET_<OPTION> (PET_NPROC_PER_NODE=4, PET_MAX_RESTARTS=2, ...).
--master_addr/--master_port (PET_MASTER_ADDR/PET_MASTER_PORT, as Kubeflow's PyTorchJob sets
them) are torchrun's static rendezvous: with several nodes and no --coordinator, node 0
starts the coordinator there (every node needs the job's token). --rdzv_conf (join_timeout,
last_call_timeout), --role, --monitor_interval, --run_path, --local_addr and
--local_ranks_filter are torchrun's too. The ranks also get GROUP_WORLD_SIZE, ROLE_NAME,
ROLE_RANK, ROLE_WORLD_SIZE, TORCHELASTIC_ERROR_FILE (LOG_DIR/attempt_<n>/<local_rank>/
error.json, where torch's @record writes the exception that ended a rank; the launcher
prints torchrun's "Root Cause" summary from it) and, with several ranks and no
OMP_NUM_THREADS of the caller's, OMP_NUM_THREADS=1. A job stopped by a signal the launcher
received (and forwarded) is reported as stopped, not failed.
"""
import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

# The probe for a torch whose TCPStore needs use_libuv=False (see the module docstring).
_TORCH_LIBUV_PROBE = """
import datetime, torch.distributed as d
try:
    d.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False, use_libuv=True)
except Exception as e:
    print("without libuv" in str(e))
"""


def torch_without_libuv(python=sys.executable):
    """Whether `python`'s torch is 2.x built without libuv, so that its TCPStore cannot start
    unless given use_libuv=False (Debian 13's torch 2.6). False without torch or with torch
    1.x (no libuv option). Costs one torch import in a child process (about a second)."""
    try:
        import importlib.metadata
        if int(importlib.metadata.version("torch").split(".")[0]) < 2:
            return False
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return False
    try:
        r = subprocess.run([python, "-c", _TORCH_LIBUV_PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.stdout.strip() == "True"


# How often the launcher repeats collservectl wait's "the coordinator has no group of job J
# yet" (watch_formation), in seconds.
NO_GROUP_INTERVAL_S = 30
# The launchers' own keys in the job's namespace.
LAUNCH_KEYS = "collserve/launch/"
# The keys torch's ranks write to an agent store (TORCHELASTIC_USE_AGENT_STORE=True), as they
# arrive at the TCPStore endpoint: torch's TCPStore client puts "/" before every key; torch <=
# 2.3 puts every key under /worker/attempt_<restart count>/ (so "//worker/..." arrives); later
# torch adds no prefix (it counts on a new store per attempt), and its keys start with
# default_pg/ (init_process_group's PrefixStore, every process group's below it) or
# rpc_prefix_<n>/ (torch.distributed.rpc).
TORCH_AGENT_STORE_PREFIXES = ("//worker/", "/default_pg/", "/rpc_prefix_")


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def find_binary(name):
    """The path of a collserve server binary: $COLLSERVE_BIN_DIR, the package's bin/ (pip
    install), the CMake build tree the package was imported from, then PATH."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = []
    if os.environ.get("COLLSERVE_BIN_DIR"):
        candidates.append(os.path.join(os.environ["COLLSERVE_BIN_DIR"], name))
    candidates.append(os.path.join(here, "bin", name))
    candidates.append(os.path.join(here, "..", "..", "server", name))  # <build>/python/collserve
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"cannot find {name}: set COLLSERVE_BIN_DIR, pip install collserve, or build it "
                            f"(cmake --build build); looked in {', '.join(candidates)} and PATH")


def embedded_token_file(directory, job):
    """The file embedded_credentials(directory, job) writes job `job`'s token to."""
    return os.path.join(directory, "job-tokens", job or "default")


def embedded_credentials(directory, job):
    """A job token for an embedded coordinator (docs/security.md): writes a fresh random token
    for `job` to <directory>/job-tokens/<job> (the directory 0700, the file 0600) and returns
    (token, the coordinator flags that make it the job's token). The coordinator then refuses
    calls without it; the ranks read it from that file (COLLSERVE_TOKEN_FILE, see
    embedded_token_file), never from their environment. `directory` must be private (0700):
    not a log directory."""
    tokens = os.path.join(directory, "job-tokens")
    os.makedirs(tokens, mode=0o700, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(embedded_token_file(directory, job), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, [f"--job_tokens_dir={tokens}"]


def start_server(name, argv, port_file, log_path, timeout_s, started=None, **popen_args):
    """Starts a collserve server binary (argv) logging to log_path, and waits until it has
    written its bound port to port_file. Returns (Popen, port). `started(proc)`, if given,
    is called with (name, proc) right after it starts (so a caller can stop it if waiting fails).
    Raises RuntimeError if it exits first, TimeoutError after timeout_s."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, **popen_args)
    if started is not None:
        started((name, proc))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            try:
                with open(log_path, errors="replace") as f:
                    last = [line.strip() for line in f if line.strip()][-1:]
            except OSError:
                last = []
            raise RuntimeError(f"the embedded {name} exited with code {proc.returncode}"
                               f"{': ' + last[0] if last else ''}; its log: {log_path}")
        try:
            with open(port_file) as f:
                text = f.read().strip()
            if text:
                return proc, int(text)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"the embedded {name} did not start serving within {timeout_s}s")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="collserve launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc_per_node", "--nproc-per-node", default="1",
                   help="ranks on this host: N, 'cpu' (one per CPU), 'gpu' (one per CUDA device) or 'auto' "
                   "(gpu when CUDA is there, else cpu), as torchrun (default 1)")
    p.add_argument("--nnodes", default="1", help="hosts in the job: N, or MIN:MAX (torchrun's): the group forms "
                   "with the ranks that came within --join_window_s once MIN hosts' worth did (ranks renumbered), "
                   "later ones join when the running ranks admit them (collserve.should_reconfigure) (default 1)")
    p.add_argument("--join_window_s", type=float, default=5.0,
                   help="with --nnodes MIN:MAX: how long after the first rank the group waits for more (default 5)")
    p.add_argument("--node_rank", "--node-rank", type=int, default=0, help="this host's index in [0, nnodes)")
    p.add_argument("--coordinator", "--rdzv_endpoint", "--rdzv-endpoint", default="",
                   help="HOST:PORT of a running coordinator (default: start one on loopback; required with "
                   "--nnodes > 1); --rdzv_endpoint is torchrun's name")
    p.add_argument("--master_addr", "--master-addr", default="",
                   help="torchrun's static rendezvous: without --coordinator and with --nnodes > 1, node 0 starts the "
                   "job's coordinator on --master_port (every interface) and the other nodes reach it at "
                   "MASTER_ADDR:MASTER_PORT; every node then needs the same job token (COLLSERVE_TOKEN_FILE or "
                   "COLLSERVE_TOKEN, e.g. from a Kubernetes Secret). With one node it is loopback (default: "
                   "PET_MASTER_ADDR, as Kubeflow's PyTorchJob sets it)")
    p.add_argument("--master_port", "--master-port", type=int, default=0,
                   help="with --master_addr: the coordinator's port; with one node: the port of the embedded "
                   "coordinator's TCPStore endpoint, the ranks' MASTER_PORT (default: a free port)")
    p.add_argument("--rdzv_conf", "--rdzv-conf", default="",
                   help="torchrun's KEY=VALUE,... rendezvous settings: join_timeout (s) bounds the rendezvous "
                   "(COLLSERVE_INIT_TIMEOUT_S of the ranks), last_call_timeout (s) is --join_window_s; the others "
                   "(close_timeout, timeout, read_timeout, is_host, use_libuv, ...) are accepted and have no effect")
    p.add_argument("--role", default="default", help="the ranks' ROLE_NAME, as torchrun (default 'default')")
    p.add_argument("--monitor_interval", "--monitor-interval", type=float, default=0.1,
                   help="seconds between the launcher's checks of its ranks, as torchrun (default 0.1)")
    p.add_argument("--run_path", "--run-path", action="store_true",
                   help="accepted for torchrun's command lines: the script runs as `python -u SCRIPT` either way")
    p.add_argument("--local_addr", "--local-addr", default="",
                   help="torchrun's address of this node: the default of --gloo_hostname")
    p.add_argument("--local_ranks_filter", "--local-ranks-filter", default="",
                   help="show only these local ranks' output on the console (comma list, torchrun's); the files "
                   "of --redirects/--tee keep everything")
    p.add_argument("--tcpstore_port", type=int, default=0, help="with --coordinator: the port of its TCPStore "
                   "endpoint (collserve-coordinator --tcpstore_address), given to the ranks as MASTER_PORT so "
                   "that torch's env:// rendezvous uses it (the embedded coordinator always has one)")
    p.add_argument("--sidecar", default="", help="address of a running sidecar for this host, unix:/path or "
                   "host:port (default: start one)")
    p.add_argument("--sidecar_flag", action="append", default=[], metavar="--FLAG=VALUE",
                   help="a flag for the embedded sidecar (repeatable), e.g. --sidecar_flag=--allreduce_algorithm=ring")
    p.add_argument("--job", "--rdzv_id", "--rdzv-id", default="default",
                   help="job name: the namespace of keys and groups; --rdzv_id is torchrun's name (default 'default')")
    p.add_argument("--rdzv_backend", "--rdzv-backend", default="c10d",
                   help="accepted for torchrun's command lines (c10d, static, collserve): the coordinator is the "
                   "rendezvous either way")
    p.add_argument("--standalone", action="store_true", help="torchrun's single-host mode: the default here "
                   "(an embedded coordinator); refused with --coordinator or --nnodes > 1")
    p.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                   help="when a rank fails, stop every rank of this host and start them all again (a new "
                   "generation of their groups), at most this many times, as torchrun's agent (default 0). Ranks "
                   "see TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS. With --survive_failures only "
                   "the failed rank is started again, with COLLSERVE_ELASTIC_JOIN=1: it joins the running ranks "
                   "when they admit it (collserve.should_reconfigure and reconfigure)")
    p.add_argument("--redirects", "-r", default="0",
                   help="send ranks' output to files LOG_DIR/attempt_<n>/<local_rank>/{stdout,stderr}.log instead "
                   "of the console: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank '0:3,1:0' (torchrun's)")
    p.add_argument("--tee", "-t", default="0", help="like --redirects, but to the files and the console")
    p.add_argument("--start_method", "--start-method", default="spawn", choices=("spawn", "fork", "forkserver"),
                   help="accepted for torchrun's command lines: every rank is a new process (a script or module, "
                   "as torchrun starts them), whatever the method")
    p.add_argument("--gloo_hostname", default="", help="address the other hosts reach this host's sidecar at "
                   "(default 127.0.0.1 for one host, else this host's address)")
    p.add_argument("--survive_failures", action="store_true",
                   help="a failed rank does not stop the others, for programs that re-form their group in place "
                   "(collserve.reconfigure); the job succeeds if the ranks that did not fail all exit 0 and at "
                   "least one does (the failures are reported)")
    p.add_argument("--failure_grace_s", type=float, default=5.0,
                   help="after a rank fails, seconds the others get before SIGTERM (default 5)")
    p.add_argument("--server_start_timeout_s", type=float, default=30.0,
                   help="how long to wait for the embedded coordinator and sidecar to serve (default 30)")
    p.add_argument("--log_dir", default="", help="where the embedded servers write their logs (default: a "
                   "temporary directory, kept and named if something fails)")
    p.add_argument("--no_prefix", action="store_true", help="do not prefix the ranks' output lines")
    g = p.add_mutually_exclusive_group()
    g.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    g.add_argument("--no_python", "--no-python", action="store_true", help="run the script as a command")
    p.add_argument("script", help="the training script (or module, or command)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    # torchrun reads every option's default from PET_<OPTION> (e.g. PET_NPROC_PER_NODE=4),
    # as Kubernetes operators set them.
    for action in p._actions:
        env = os.environ.get("PET_" + action.dest.upper())
        if env is not None and action.option_strings and action.nargs is None and action.const is None:
            p.set_defaults(**{action.dest: env})
    args = p.parse_args(argv)
    args.nproc_per_node, args.one_gpu_per_rank = _nproc_per_node(p, args.nproc_per_node)
    low, _, high = str(args.nnodes).partition(":")
    if not low.isdigit() or (high and not high.isdigit()):
        p.error(f"--nnodes {args.nnodes!r} must be N or MIN:MAX")
    args.min_nodes = int(low)
    args.nnodes = int(high or low)
    if args.min_nodes < 1 or args.min_nodes > args.nnodes:
        p.error(f"--nnodes {args.nnodes!r}: MIN must be at least 1 and at most MAX")
    if args.standalone and (args.coordinator or args.nnodes > 1):
        p.error("--standalone starts its own coordinator: it cannot go with --coordinator or --nnodes > 1")
    if args.max_restarts < 0:
        p.error("--max_restarts must be at least 0")
    for name in ("redirects", "tee"):
        try:
            setattr(args, name, _std_streams(getattr(args, name), args.nproc_per_node))
        except ValueError:
            p.error(f"--{name} {getattr(args, name)!r} must be 0..3 or LOCAL_RANK:0..3 pairs joined by ','")
    if args.nproc_per_node < 1 or args.nnodes < 1:
        p.error("--nproc_per_node and --nnodes must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node_rank {args.node_rank} is out of range for --nnodes {args.nnodes}")
    if args.nnodes > 1 and not args.coordinator and not (args.master_addr and args.master_port):
        p.error("--nnodes > 1 needs --coordinator HOST:PORT (a coordinator every host reaches) or --master_addr "
                "and --master_port (node 0 starts one there)")
    if args.coordinator and (args.master_addr or args.master_port) and args.nnodes > 1:
        p.error("--master_addr/--master_port name where node 0 starts the coordinator: they cannot go with "
                "--coordinator and --nnodes > 1")
    if not 0 <= args.master_port <= 65535:
        p.error(f"--master_port {args.master_port} must be a port number (0..65535)")
    if args.monitor_interval <= 0:
        p.error("--monitor_interval must be above 0")
    args.gloo_hostname = args.gloo_hostname or args.local_addr
    try:
        args.rdzv_conf = _rdzv_conf(args.rdzv_conf)
    except ValueError as e:
        p.error(f"--rdzv_conf {args.rdzv_conf!r}: {e}")
    if "last_call_timeout" in args.rdzv_conf:
        args.join_window_s = args.rdzv_conf["last_call_timeout"]
    try:
        args.local_ranks_filter = (set(range(args.nproc_per_node)) if not args.local_ranks_filter else
                                   {int(r) for r in str(args.local_ranks_filter).split(",")})
    except ValueError:
        p.error(f"--local_ranks_filter {args.local_ranks_filter!r} must be local ranks joined by ','")
    if args.coordinator and args.coordinator.rpartition(":")[2].isdigit() is False:
        p.error(f"--coordinator {args.coordinator!r} must be HOST:PORT")
    return args


class Launcher:
    def __init__(self, args):
        self.args = args
        self.servers = []  # (name, Popen), stopped in reverse order
        self.ranks = []  # (rank, Popen)
        self.out_lock = threading.Lock()
        self.pumps = []
        self.failed_something = False
        self.token = None  # the embedded coordinator's job token, handed to the ranks
        self.no_libuv = False  # torch_without_libuv()
        self.attempt = 0  # the restart count of the ranks running now
        self.launch_id = secrets.token_hex(8)  # names this launch's elastic keys (run_id)
        self.run_id = ""  # COLLSERVE_RUN_ID of the ranks running now (start_ranks)
        self.signalled = None  # the first signal the launcher forwarded to its ranks
        self.pids = {}  # rank -> pid of its current process (for the root-cause summary)
        self.watchers = []  # collservectl wait (watch_formation)
        self.own_dir = not args.log_dir
        self.dir = args.log_dir or tempfile.mkdtemp(prefix="collserve-launch-")
        # The job token, the sidecar's sockets and the port files the launcher trusts live in
        # a private directory (0700) of their own, removed at exit, never in --log_dir: logs
        # get shipped, and whoever can write a directory can replace a socket or a port file.
        self.run_dir = tempfile.mkdtemp(prefix="collserve-run-")
        self.token_file = None
        os.makedirs(os.path.join(self.dir, "exits"), exist_ok=True)

    def say(self, text):
        with self.out_lock:
            sys.stderr.write(f"collserve launch: {text}\n")
            sys.stderr.flush()

    # ---- embedded servers ----
    def start_server(self, name, argv, port_file):
        proc, port = start_server(name, argv, port_file, os.path.join(self.dir, f"{name}.log"),
                                  self.args.server_start_timeout_s, self.servers.append)
        return port

    def start_servers(self):
        a = self.args
        coordinator = a.coordinator
        tcpstore_port = a.tcpstore_port
        if not coordinator and a.nnodes > 1:
            # torchrun's static rendezvous (--master_addr/--master_port): node 0 hosts the
            # coordinator, every node holds the job's token.
            self.token, token_flags = self.shared_credentials()
            coordinator = f"{a.master_addr}:{a.master_port}"
            if a.node_rank == 0:
                self.start_server("coordinator", [
                    find_binary("collserve-coordinator"), f"--listen_address=0.0.0.0:{a.master_port}",
                    f"--port_file={self.run_dir}/coordinator.port", "--metrics_address=", "--log_level=warning",
                    *token_flags], f"{self.run_dir}/coordinator.port")
            else:
                self.wait_for_coordinator(a.master_addr, a.master_port)
        elif not coordinator:
            # The embedded coordinator requires the job token it is given; the ranks get it.
            self.token, credential_flags = embedded_credentials(self.run_dir, a.job)
            self.token_file = embedded_token_file(self.run_dir, a.job)
            port = self.start_server("coordinator", [
                find_binary("collserve-coordinator"), "--listen_address=127.0.0.1:0",
                f"--port_file={self.run_dir}/coordinator.port", "--metrics_address=", "--log_level=warning",
                f"--tcpstore_address=127.0.0.1:{a.master_port}", f"--tcpstore_job={a.job}",
                f"--tcpstore_port_file={self.run_dir}/tcpstore.port", *credential_flags],
                f"{self.run_dir}/coordinator.port")
            coordinator = f"127.0.0.1:{port}"
            with open(f"{self.run_dir}/tcpstore.port") as f:  # written before coordinator.port
                tcpstore_port = int(f.read())
        sidecar = a.sidecar
        if not sidecar:
            gloo_hostname = a.gloo_hostname or ("127.0.0.1" if a.nnodes == 1 else _host_address())
            sock = os.path.join(self.run_dir, "sidecar.sock")
            self.start_server("sidecar", [
                find_binary("collserve-sidecar"), f"--coordinator={coordinator}", f"--unix_socket={sock}",
                f"--host_id={socket.gethostname()}-node{a.node_rank}-{os.getpid()}", f"--gloo_hostname={gloo_hostname}",
                "--metrics_address=", "--log_level=warning", f"--port_file={self.run_dir}/sidecar.port",
                *a.sidecar_flag], f"{self.run_dir}/sidecar.port")
            sidecar = f"unix:{sock}"
        return coordinator, sidecar, tcpstore_port

    def shared_credentials(self):
        """The job token every node of a --master_addr job holds (COLLSERVE_TOKEN_FILE, else
        COLLSERVE_TOKEN), written to this launcher's private directory for node 0's
        coordinator and the ranks; returns (token, the coordinator's credential flags).
        Raises RuntimeError when there is none: a coordinator every host reaches must not
        take calls without one."""
        token = None
        path = os.environ.get("COLLSERVE_TOKEN_FILE", "")
        if path:
            try:
                with open(path) as f:
                    token = f.read().strip()
            except OSError as e:
                raise RuntimeError(f"cannot read the job token COLLSERVE_TOKEN_FILE={path}: {e}") from e
        token = token or os.environ.get("COLLSERVE_TOKEN", "").strip()
        if not token:
            raise RuntimeError("--master_addr with --nnodes > 1 makes node 0 start a coordinator every host reaches: "
                               "give every node the same job token (COLLSERVE_TOKEN_FILE, e.g. a Kubernetes Secret, "
                               "or COLLSERVE_TOKEN)")
        tokens = os.path.join(self.run_dir, "job-tokens")
        os.makedirs(tokens, mode=0o700, exist_ok=True)
        fd = os.open(embedded_token_file(self.run_dir, self.args.job), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        self.token_file = embedded_token_file(self.run_dir, self.args.job)
        return token, [f"--job_tokens_dir={tokens}"]

    def wait_for_coordinator(self, host, port):
        """Waits until node 0's coordinator accepts connections at host:port (torchrun's other
        nodes wait for the master's store alike), at most COLLSERVE_INIT_TIMEOUT_S (default
        300 s, or --rdzv_conf join_timeout); raises TimeoutError naming the address."""
        timeout = self.init_timeout()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((host, port), timeout=2.0):
                    return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node 0's coordinator at {host}:{port} (--master_addr/--master_port) did not "
                                       f"accept connections within {timeout:g}s: {e}") from e
            time.sleep(0.2)

    def init_timeout(self):
        """The rendezvous bound: COLLSERVE_INIT_TIMEOUT_S, else --rdzv_conf join_timeout, else 300 s."""
        if os.environ.get("COLLSERVE_INIT_TIMEOUT_S"):
            return float(os.environ["COLLSERVE_INIT_TIMEOUT_S"])
        return float(self.args.rdzv_conf.get("join_timeout", 300))

    def stop_servers(self):
        for name, proc in reversed(self.servers):
            _stop(proc, 10.0)
            if proc.returncode not in (0, -signal.SIGTERM):
                self.failed_something = True
                self.say(f"the embedded {name} exited with code {proc.returncode}")
        shutil.rmtree(self.run_dir, ignore_errors=True)  # the token and the sockets

    # ---- ranks ----
    def command(self):
        a = self.args
        if a.no_python:
            return [a.script, *a.script_args]
        if a.module:
            return [sys.executable, "-u", "-m", a.script, *a.script_args]
        return [sys.executable, "-u", a.script, *a.script_args]

    def pump(self, rank, stream, sink, log):
        """Copies a rank's stream line by line to the console `sink` (prefixed; None: not
        there) and to the file `log` (None: no file)."""
        prefix = b"" if self.args.no_prefix else f"[rank{rank}]: ".encode()
        for line in iter(stream.readline, b""):
            line = line if line.endswith(b"\n") else line + b"\n"
            if log is not None:
                log.write(line)
                log.flush()
            if sink is not None:
                with self.out_lock:
                    sink.write(prefix + line)
                    sink.flush()
        stream.close()
        if log is not None:
            log.close()

    def start_ranks(self, coordinator, sidecar, tcpstore_port, attempt):
        a = self.args
        self.ranks, self.pumps = [], []
        # COLLSERVE_RUN_ID names the store keys of reconfigure and elastic joins
        # (collserve/reconfigure/<run_id>/...) and of node 0's torch master
        # (torch_master). A coordinator outlives launches, so a second launch of a job name
        # would read the first one's (a run of --survive_failures against a shared
        # --coordinator began by "admitting a joiner" from the run before): one launcher
        # gives each attempt a name of its own; several nodes' launchers agree on one
        # (agree_run_id). An elastic formation (--nnodes MIN:MAX) keeps the caller's
        # (default ""): its nodes need not all come (docs/guide.md).
        base = os.environ.get("COLLSERVE_RUN_ID", "")
        if a.nnodes == 1 and a.min_nodes == 1:
            self.run_id = f"{base or self.launch_id}.{attempt}"
        elif a.min_nodes == a.nnodes:
            self.run_id = self.agree_run_id(coordinator, sidecar, base)
        else:
            self.run_id = base
        exits = os.path.join(self.dir, "exits")
        for name in os.listdir(exits):  # the exit times of the previous attempt's ranks
            os.unlink(os.path.join(exits, name))
        host, _, port = coordinator.rpartition(":")
        torch_store = {}
        if not tcpstore_port or self.no_libuv:
            # No TCPStore endpoint the ranks reach (a coordinator of another host), or a torch
            # that cannot use it: rank 0 hosts torch's own store, as under torchrun.
            host, port = self.torch_master(coordinator, attempt)
            torch_store = {"USE_LIBUV": "0"} if self.no_libuv else {}
        elif tcpstore_port:
            # torch's env:// rendezvous reaches the coordinator's TCPStore endpoint, every rank
            # as a client (as under torchrun's agent store).
            port = str(tcpstore_port)
            torch_store = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
            self.reset_torch_keys(coordinator)
        self.rank_env = dict(host=host, port=port, coordinator=coordinator, sidecar=sidecar, exits=exits,
                             torch_store=torch_store)
        for local_rank in range(a.nproc_per_node):
            self.spawn(local_rank, attempt)

    def reset_torch_keys(self, coordinator):
        """Gives this attempt's ranks an empty torch store on the coordinator's TCPStore
        endpoint, as torchrun's agent does by starting a TCPStore per attempt: deletes what
        torch's ranks of the job's earlier launches and attempts wrote there
        (TORCH_AGENT_STORE_PREFIXES). Left there, a second launch of a job name against a
        long-lived coordinator met the first one's keys: Gloo dialed the old ranks' addresses
        (connection refused) and torch 1.13's store-based barrier counted past world_size
        until init_process_group's timeout. One node: before its ranks start. Several nodes
        (a static --nnodes N): node 0 deletes once the launchers' formation
        (agree_run_id) is complete, when no node still runs a rank of an earlier attempt, and
        then sets collserve/launch/torch_store_reset/<run id>; the other nodes wait for that
        key (up to the init timeout) before starting theirs. An elastic formation (--nnodes
        MIN:MAX) has no such formation: its keys are not reset (docs/guide.md)."""
        a = self.args
        if a.min_nodes != a.nnodes:
            return
        from .store import Store
        store = Store(address=coordinator, job=a.job, token=self.token, timeout=self.init_timeout())
        done = f"{LAUNCH_KEYS}torch_store_reset/{self.run_id}"
        if a.node_rank == 0:
            deleted = sum(store.delete_keys_with_prefix(p) for p in TORCH_AGENT_STORE_PREFIXES)
            if a.nnodes > 1:
                # The markers of earlier runs: no launcher waits for them any more.
                store.delete_keys_with_prefix(f"{LAUNCH_KEYS}torch_store_reset/")
                store.set(done, str(deleted))
            if deleted:
                self.say(f"deleted {deleted} key(s) that torch's ranks of earlier runs of job {a.job} left on the "
                         "coordinator's TCPStore endpoint")
        else:
            store.get(done)

    def agree_run_id(self, coordinator, sidecar, base):
        """The run id of this attempt on several nodes, the same at every node's launcher and
        at no earlier launch of the job name: the launchers form a group of their own
        ("collserve.launch" of the job, one member per node, through this node's sidecar) and
        name the run after that formation's generation and rendezvous id (the coordinator
        draws a new one at every formation, also after a restart), then leave the group.
        With a caller's COLLSERVE_RUN_ID `base`, "<base>.<generation>.<id>". Waits for the
        other nodes' launchers up to init_timeout() (as torchrun's rendezvous); raises
        collserve's DistError (a RuntimeError) naming why it could not form."""
        a = self.args
        from . import _collserve
        from .errors import raise_for
        if self.token_file is not None:  # the SDK reads the job token from the environment
            os.environ["COLLSERVE_TOKEN_FILE"] = self.token_file
            os.environ.pop("COLLSERVE_TOKEN", None)
        timeout = self.init_timeout()
        code, message, pg = _collserve.init(a.node_rank, a.nnodes, -1, sidecar, coordinator, a.job,
                                            "collserve.launch", timeout, timeout)
        raise_for(code, message)
        formation = f"{pg.generation}.{pg.rendezvous_id:016x}"
        del pg  # ends the session: the group's formation was all it was for
        return f"{base}.{formation}" if base else formation

    def torch_master(self, coordinator, attempt):
        """MASTER_ADDR and MASTER_PORT for a torch without libuv (see the module docstring):
        a free port of node 0, where rank 0 hosts torch's TCPStore in this attempt. Node 0
        publishes it under collserve/launch/torch_master/<run id> in the coordinator's
        store (the nodes agreed on the run id: a key no earlier launch wrote); the other
        nodes wait for it (COLLSERVE_INIT_TIMEOUT_S, default 300 s)."""
        a = self.args
        if a.nnodes == 1:
            return "127.0.0.1", str(_free_port())
        from .store import Store
        store = Store(address=coordinator, job=a.job, token=self.token,
                      timeout=self.init_timeout())
        key = f"{LAUNCH_KEYS}torch_master/{self.run_id or attempt}"
        if a.node_rank == 0:
            # The addresses of earlier runs: no launcher waits for them any more.
            store.delete_keys_with_prefix(f"{LAUNCH_KEYS}torch_master/")
            store.set(key, f"{a.gloo_hostname or _host_address()}:{_free_port()}")
        host, _, port = store.get(key).decode().rpartition(":")
        return host, port

    def spawn(self, local_rank, attempt, join=False):
        """Starts local rank `local_rank` (attempt `attempt`; `join`: into a running job,
        COLLSERVE_ELASTIC_JOIN=1) and the threads that copy its output."""
        a, e = self.args, self.rank_env
        host, port, coordinator, sidecar, exits, torch_store = (
            e["host"], e["port"], e["coordinator"], e["sidecar"], e["exits"], e["torch_store"])
        world = a.nnodes * a.nproc_per_node
        rank = a.node_rank * a.nproc_per_node + local_rank
        env = dict(os.environ)
        if join:
            env["COLLSERVE_ELASTIC_JOIN"] = "1"
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                   LOCAL_WORLD_SIZE=str(a.nproc_per_node), GROUP_RANK=str(a.node_rank),
                   NODE_RANK=str(a.node_rank), GROUP_WORLD_SIZE=str(a.nnodes), ROLE_NAME=a.role,
                   ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR=host, MASTER_PORT=port,
                   COLLSERVE_COORDINATOR=coordinator, COLLSERVE_SIDECAR=sidecar, COLLSERVE_JOB=a.job,
                   PYTHONUNBUFFERED="1", COLLSERVE_EXIT_DIR=exits, TORCHELASTIC_RESTART_COUNT=str(attempt),
                   TORCHELASTIC_MAX_RESTARTS=str(a.max_restarts), TORCHELASTIC_RUN_ID=a.job,
                   COLLSERVE_RUN_ID=self.run_id,
                   TORCHELASTIC_ERROR_FILE=self.error_file(local_rank, attempt), **torch_store)
        if getattr(a, "one_gpu_per_rank", False) and "COLLSERVE_CUDA_PATH" not in os.environ:
            # One process per GPU: the sidecar serves ranks that share one GPU; these run NCCL.
            env["COLLSERVE_CUDA_PATH"] = "nccl"
        if a.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: N ranks of N threads each would overload the host
        if "join_timeout" in a.rdzv_conf and "COLLSERVE_INIT_TIMEOUT_S" not in os.environ:
            env["COLLSERVE_INIT_TIMEOUT_S"] = str(a.rdzv_conf["join_timeout"])
        if a.min_nodes < a.nnodes:
            env.update(COLLSERVE_MIN_WORLD_SIZE=str(a.min_nodes * a.nproc_per_node),
                       COLLSERVE_JOIN_WINDOW_S=str(a.join_window_s))
        if self.token_file is not None:
            env["COLLSERVE_TOKEN_FILE"] = self.token_file
            env.pop("COLLSERVE_TOKEN", None)
        proc = subprocess.Popen(self.command(), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        self.ranks.append((rank, proc))
        self.pids[rank] = proc.pid
        for bit, name, stream, console in ((1, "stdout", proc.stdout, sys.stdout.buffer),
                                           (2, "stderr", proc.stderr, sys.stderr.buffer)):
            to_file = (a.redirects[local_rank] | a.tee[local_rank]) & bit
            log = None
            if to_file:
                rank_dir = os.path.join(self.dir, f"attempt_{attempt}", str(local_rank))
                os.makedirs(rank_dir, exist_ok=True)
                log = open(os.path.join(rank_dir, f"{name}.log"), "wb")
            sink = None if a.redirects[local_rank] & bit and not a.tee[local_rank] & bit else console
            if local_rank not in a.local_ranks_filter:
                sink = None
            t = threading.Thread(target=self.pump, args=(rank, stream, sink, log), daemon=True)
            t.start()
            self.pumps.append(t)

    def error_file(self, local_rank, attempt):
        """TORCHELASTIC_ERROR_FILE of a rank: where torch's @record (torch.distributed.elastic.
        multiprocessing.errors.record) writes the exception that ended it, as JSON."""
        rank_dir = os.path.join(self.dir, f"attempt_{attempt}", str(local_rank))
        os.makedirs(rank_dir, exist_ok=True)
        path = os.path.join(rank_dir, "error.json")
        if os.path.exists(path):
            os.unlink(path)
        return path

    def root_cause(self, rank, code, attempt):
        """torchrun's failure summary: which rank failed first, when, with what exit code, and
        the traceback from its error file when torch's @record wrote one."""
        local_rank = rank - self.args.node_rank * self.args.nproc_per_node
        path = os.path.join(self.dir, f"attempt_{attempt}", str(local_rank), "error.json")
        when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime())
        traceback = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        error_file = "<N/A>"
        try:
            with open(path) as f:
                data = json.load(f)
            error_file = path
            message = data.get("message", {})
            if isinstance(message, dict):
                extra = message.get("extraInfo", {})
                traceback = extra.get("py_callstack") or message.get("message") or traceback
                stamp = extra.get("timestamp")
                if stamp and str(stamp).isdigit():
                    when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(int(stamp)))
            elif message:
                traceback = str(message)
        except (OSError, ValueError, AttributeError):
            pass
        how = f"{-code} (signal: {signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() \
            else str(code)
        script = os.path.basename(self.args.script)
        lines = ["=" * 60, f"{script} FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60,
                 "Root Cause (first observed failure):", f"[0]:", f"  time      : {when}",
                 f"  host      : {socket.gethostname()}", f"  rank      : {rank} (local_rank: {local_rank})",
                 f"  exitcode  : {how} (pid: {self.pids.get(rank, '?')})", f"  error_file: {error_file}",
                 "  traceback : " + traceback.rstrip().replace("\n", "\n  "), "=" * 60]
        with self.out_lock:
            sys.stderr.write("\n".join(lines) + "\n")
            sys.stderr.flush()

    def watch_formation(self, coordinator):
        """Says every 5 s how far the job's rendezvous got while none of its groups has formed
        (collservectl wait without a group: "group G generation g: n of m ranks joined;
        missing ranks [...]", whatever the groups are named: "world" for the SDK, "torch/0"
        for the c10d backend); quiet when one forms within 5 s, and from then on. While no
        group of the job exists at all, only every NO_GROUP_INTERVAL_S: ranks that use
        another backend (torch's gloo or nccl under this launcher) form none, and a line
        every 5 s for their whole init timeout said nothing. Not with elastic formation (its
        ranks agree on the membership in the store before they join, so the registry's count
        says little)."""
        a = self.args
        if a.min_nodes < a.nnodes:
            return
        try:
            ctl = find_binary("collservectl")
        except FileNotFoundError:
            return
        env = dict(os.environ)
        if self.token_file is not None:
            env["COLLSERVE_TOKEN_FILE"] = self.token_file
            env.pop("COLLSERVE_TOKEN", None)
        timeout = os.environ.get("COLLSERVE_INIT_TIMEOUT_S", "300")
        proc = subprocess.Popen([ctl, f"--coordinator={coordinator}", f"--job={a.job}", f"--wait_timeout={timeout}s",
                                 "--progress_interval=5s", "wait"], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.watchers.append(proc)

        def say_progress():
            last = time.monotonic()  # of a "no group" line said (or the start)
            for line in iter(proc.stdout.readline, b""):
                if not line.startswith(b"waiting for"):
                    continue
                if b"has no group of job" in line:
                    if time.monotonic() - last < NO_GROUP_INTERVAL_S:
                        continue
                    last = time.monotonic()
                self.say(line.decode(errors="replace").rstrip())
            proc.stdout.close()
        threading.Thread(target=say_progress, daemon=True).start()

    def forward(self, signum, _frame):
        if self.signalled is None:
            self.signalled = signum
        for _, proc in self.ranks:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait_ranks(self):
        """Waits for every rank; returns (rank, exit code) of the first to fail (in the order
        they exited: one waiter thread per rank), or None."""
        exits, changed = [], threading.Condition()

        def waiter(rank, proc):
            code = proc.wait()
            with changed:
                exits.append((rank, code, time.monotonic(), proc.pid))
                changed.notify_all()
        for rank, proc in self.ranks:
            threading.Thread(target=waiter, args=(rank, proc), daemon=True).start()
        terminated = False
        failed_at = None
        restarted = 0
        joiners = []  # (rank, process) of the ranks started again into the running job
        unadmitted = set()  # pids of joiners stopped because the job ended before admitting them
        with changed:
            while len(exits) < len(self.ranks):
                failures = [e for e in exits if e[1] != 0 and e[3] not in unadmitted]
                if self.args.survive_failures:
                    self.stop_unadmitted(joiners, unadmitted)
                    # Restart failed ranks in place, into the running job (it admits them
                    # through collserve.should_reconfigure / reconfigure).
                    while restarted < min(len(failures), self.args.max_restarts):
                        rank = failures[restarted][0]
                        restarted += 1
                        self.say(f"rank {rank} failed (exit code {failures[restarted - 1][1]}); starting it again to "
                                 f"join the running ranks (restart {restarted} of {self.args.max_restarts})")
                        self.spawn(rank - self.args.node_rank * self.args.nproc_per_node, restarted, join=True)
                        joiners.append(self.ranks[-1])
                        threading.Thread(target=waiter, args=self.ranks[-1], daemon=True).start()
                if failures and failed_at is None:
                    failed_at = time.monotonic()
                if (failed_at is not None and not terminated and not self.args.survive_failures
                        and time.monotonic() - failed_at > self.args.failure_grace_s):
                    terminated = True
                    self.say(f"rank {failures[0][0]} failed; stopping the other ranks")
                    for _, proc in self.ranks:
                        if proc.poll() is None:
                            _stop(proc, 10.0, wait=False)
                changed.wait(timeout=self.args.monitor_interval)
            failures = [e for e in exits if e[1] != 0 and e[3] not in unadmitted]
        if not failures:
            return None
        if self.args.survive_failures and len(failures) < len(exits):
            for rank, code, *_ in failures:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                self.say(f"rank {rank} {how}; the other ranks went on without it (--survive_failures)")
            return None
        # A failing rank takes its peers down with it (its session ends, their operations fail),
        # and they may finish exiting first. As torchrun orders error files by time, order by
        # when each rank began to exit: the time the collserve package's atexit hook wrote
        # (see distributed_c10d._note_exit), else when the launcher saw it gone.
        rank, code, *_ = min(failures, key=lambda e: min(e[2], self.exit_time(e[0])))
        return rank, code

    def stop_unadmitted(self, joiners, unadmitted):
        """--survive_failures: once every rank but the restarted ones has exited and one of
        them succeeded, the job is over; a restarted rank that the others never admitted
        (it wrote no COLLSERVE_EXIT_DIR/admitted-<pid>, see collserve._elastic) would wait
        for them until its init timeout: stop it, and do not count its exit as a failure."""
        ended = {proc.pid for _, proc in self.ranks if proc.poll() is not None}
        others = [(rank, proc) for rank, proc in self.ranks if all(proc is not j for _, j in joiners)]
        if not joiners or any(proc.pid not in ended for _, proc in others) or \
                not any(proc.returncode == 0 for _, proc in others):
            return
        for rank, proc in joiners:
            admitted = os.path.exists(os.path.join(self.rank_env["exits"], f"admitted-{proc.pid}"))
            if proc.poll() is None and not admitted and proc.pid not in unadmitted:
                self.say(f"rank {rank}, started again, had not been admitted when the other ranks finished; "
                         "stopping it")
                _stop(proc, 10.0, wait=False)
                unadmitted.add(proc.pid)

    def exit_time(self, rank):
        try:
            with open(os.path.join(self.dir, "exits", str(rank))) as f:
                return float(f.read())
        except (OSError, ValueError):
            return float("inf")

    def run(self):
        previous = {s: signal.signal(s, self.forward) for s in _FORWARDED}
        try:
            coordinator, sidecar, tcpstore_port = self.start_servers()
            self.no_libuv = torch_without_libuv()
            if self.args.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
                self.say("setting OMP_NUM_THREADS=1 for each rank (as torchrun) so that the host is not "
                         "overloaded; set it yourself to tune it")
            self.watch_formation(coordinator)
            attempt = 0
            while True:
                self.attempt = attempt
                self.start_ranks(coordinator, sidecar, tcpstore_port, attempt)
                first = self.wait_ranks()
                for t in self.pumps:
                    t.join(timeout=5)
                if first is None or attempt >= self.args.max_restarts or self.args.survive_failures:
                    break
                attempt += 1
                self.say(f"rank {first[0]} failed (exit code {first[1]}); restarting the "
                         f"{len(self.ranks)} ranks of this host (restart {attempt} of {self.args.max_restarts})")
        except (RuntimeError, TimeoutError, FileNotFoundError, OSError) as e:
            self.say(str(e))
            first = (-1, 1)
            for _, proc in self.ranks:
                _stop(proc, 10.0)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            for proc in self.watchers:
                _stop(proc, 1.0)
            self.stop_servers()
        if first is None:
            keep = any(self.args.redirects.values()) or any(self.args.tee.values())
            if keep:
                self.say(f"the ranks' output files are in {self.dir}")
            if self.own_dir and not self.failed_something and not keep:
                shutil.rmtree(self.dir, ignore_errors=True)
            return 0
        rank, code = first
        exit_code = 128 - code if code < 0 else code
        if rank >= 0 and self.signalled is not None:
            # Stopped from outside (Kubernetes, a scheduler, ^C): not a failure of the job's own.
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            self.say(f"the job was stopped by {signal.Signals(self.signalled).name}, which the launcher forwarded to "
                     f"its ranks; rank {rank} {how}")
        elif rank >= 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            self.say(f"rank {rank} {how} (the first rank to fail)")
            self.root_cause(rank, code, self.attempt)
        if self.servers:
            self.say(f"server logs are in {self.dir}")
        return exit_code


def _nproc_per_node(parser, value):
    """torchrun's --nproc_per_node: N, cpu, gpu or auto (gpu when CUDA is there, else cpu).
    Returns (ranks, one_gpu_per_rank): the latter when it counted two or more GPUs, one rank
    each (the ranks then run NCCL themselves: COLLSERVE_CUDA_PATH=nccl, docs/gpu.md)."""
    if str(value).lstrip("-").isdigit():
        return int(value), False
    if value == "cpu":
        return os.cpu_count() or 1, False
    if value in ("gpu", "auto"):
        try:
            import torch  # only for these two: importing it takes a second
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:
            gpus = 0
        if gpus:
            return gpus, gpus > 1
        if value == "gpu":
            parser.error("--nproc_per_node gpu: no CUDA device is visible")
        return os.cpu_count() or 1, False
    parser.error(f"--nproc_per_node {value!r} must be a number, cpu, gpu or auto")


def _rdzv_conf(value):
    """torchrun's --rdzv_conf KEY=VALUE,...: a dict, join_timeout and last_call_timeout as
    seconds (float); raises ValueError for a malformed pair or timeout."""
    conf = {}
    for pair in filter(None, str(value).split(",")):
        key, eq, val = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{pair!r} is not KEY=VALUE")
        conf[key.strip()] = val.strip()
    for key in ("join_timeout", "last_call_timeout"):
        if key in conf:
            try:
                conf[key] = float(conf[key])
            except ValueError:
                raise ValueError(f"{key}={conf[key]!r} must be a number of seconds") from None
            if conf[key] <= 0:
                raise ValueError(f"{key} must be above 0")
    return conf


def _std_streams(value, nproc):
    """--redirects/--tee: {local_rank: bits} with bit 1 stdout, bit 2 stderr (torchrun's Std)."""
    value = str(value)
    if value.isdigit():
        if int(value) > 3:
            raise ValueError(value)
        return {r: int(value) for r in range(nproc)}
    streams = {r: 0 for r in range(nproc)}
    for pair in value.split(","):
        rank, _, bits = pair.partition(":")
        if not rank.isdigit() or not bits.isdigit() or int(bits) > 3:
            raise ValueError(value)
        streams[int(rank)] = int(bits)
    return streams


def _stop(proc, grace_s, wait=True):
    """SIGTERM, then SIGKILL after grace_s (in the background if not wait)."""
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
    except ProcessLookupError:
        return

    def reap():
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if wait:
        reap()
    else:
        threading.Thread(target=reap, daemon=True).start()


def _host_address():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def main(argv=None):
    return Launcher(parse_args(sys.argv[1:] if argv is None else argv)).run()


if __name__ == "__main__":
    sys.exit(main())
