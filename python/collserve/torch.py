"""collserve.torch: the "collserve" backend of torch.distributed (torch 1.13, and 2.2 or later).

    import torch.distributed as dist
    import collserve.torch                       # registers the backend
    dist.init_process_group("collserve", rank=rank, world_size=world_size)

After the import, `init_process_group("collserve", ...)` works with every init method torch
offers (env://, tcp://, file://, or store=...), and torch.distributed's collectives,
point-to-point calls, new_group, barrier, monitored_barrier, async_op Work objects (wait,
is_completed, get_future) and DistributedDataParallel run through the collserve sidecar
(python/c10d/collserve_c10d.h: dense contiguous CPU tensors, one per call, as torch's Gloo).
Each torch process group is its own collserve group, named "torch/<torch's group name>" in
the job COLLSERVE_JOB (default "default").

Where the service is, in this order:
  * COLLSERVE_SIDECAR names this host's sidecar ("unix:/path" or "host:port"). `collserve
    launch` sets it; so does a Kubernetes pod next to its sidecar.
  * Otherwise the backend starts an embedded default, sharing addresses through torch's store
    (the one init_process_group rendezvouses with):
      - without COLLSERVE_COORDINATOR, rank 0 starts a coordinator on loopback and this
        host's sidecar; every rank must then be on rank 0's host (else RuntimeError);
      - with COLLSERVE_COORDINATOR=host:port (a running coordinator), the first rank of
        each host (COLLSERVE_HOST_ID, default the hostname) starts that host's sidecar,
        reachable by the other hosts at COLLSERVE_GLOO_HOSTNAME (default: this host's
        address).
    The process that started them stops them when it exits, once the other ranks of its host
    have exited (bounded by the operation timeout); if it is killed they get SIGTERM.
    Start the ranks from the main thread (the servers end with the thread that started them).

Timeouts: init_process_group's `timeout` (torch's default: 30 minutes) bounds the
rendezvous and each operation; COLLSERVE_INIT_TIMEOUT_S and COLLSERVE_OP_TIMEOUT_S override.
Errors surface as RuntimeError, as torch's own backends raise them; messages start with
"collserve <op>: <status code>:".

MPI: on a torch without MPI of its own (Debian 12's 1.13, pip's wheels), `init_process_group("mpi")` and
`new_group(backend="mpi")` run as "collserve" with MPI between the sidecars (sidecars started
as one MPI world with --mpi; see docs/guide.md, "The MPI backend"); COLLSERVE_BACKEND=mpi
does the same for "collserve" groups.

Recovery in place and the group lifecycle (reconfigure, should_reconfigure,
join_running_group, abort, shutdown, get_error, set_timeout, split_group, shrink_group):
collserve/torch_elastic.py and docs/torch.md.

Zero-copy tensors: `collserve.torch.empty(size, dtype=..., group=None)` allocates a tensor
in the group's shared-memory arena, which the sidecar maps; that group's collectives on it
move no bytes between the process and the sidecar. Other tensors are copied through a
staging segment (COLLSERVE_MAX_STAGING_BYTES bounds those in flight).
"""
import atexit
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _collserve_torch, torch_elastic
from .distributed_c10d import call_site  # noqa: F401  collserve.torch.call_site: see distributed_c10d
# In-place recovery and the lifecycle calls (torch_elastic's docstring).
from .torch_elastic import (GroupError, abort, get_error, join_running_group, joining,  # noqa: F401
                            last_completed_seq, reconfigure, set_timeout, should_reconfigure, shrink_group, shutdown,
                            split_group)
from .launch import _host_address, _stop, embedded_credentials, embedded_token_file, find_binary, start_server

BACKEND = "collserve"


def _check_pybind11(module):
    """Raises ImportError when the c10d module `module` (_collserve_torch) does not share
    pybind11's type registry with the torch imported here: it was built against another
    pybind11 (another internals version or ABI) than this torch's, and torch would refuse every
    process group it returns ("Unregistered type"). The message names both registries."""
    if module.shares_torch_types(dist.HashStore()):
        return
    ours = module.PYBIND11_INTERNALS_ID
    others = [k for k in module.pybind11_internals_ids() if k != ours]
    raise ImportError(
        f"collserve.torch: the c10d module ({module.__file__}) was built with pybind11 internals {ours!r}, but "
        f"torch {torch.__version__} ({os.path.dirname(torch.__file__)}) uses "
        f"{' / '.join(repr(k) for k in others) or 'another registry'}: they cannot share types. Rebuild collserve "
        "against this torch (CMake uses the pybind11 headers torch ships under <torch>/include/pybind11 when it "
        "has them: pip wheels do; Debian's torch uses Debian's pybind11).")


_check_pybind11(_collserve_torch)
# Frames of this package are not call sites (python/common/call_sites.h).
_collserve_torch.set_package_dir(os.path.dirname(os.path.abspath(__file__)) + os.sep)
_KEY = "collserve/embedded"

# Embedded servers this process started, the directory they live in, and the sidecar address.
_embedded = {"sidecar": None, "servers": [], "dir": None, "registered": False, "lock": threading.Lock(),
             "stopped": False, "wait_s": 300.0}


def _seconds(timeout, env_name):
    value = os.environ.get(env_name)
    if value:
        return float(value)
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _start(name, argv, directory, timeout_s):
    if not _embedded["servers"]:
        # multiprocessing's fork children leave through os._exit, which skips atexit; its
        # finalizers run there (registered here: a fork child starts with none).
        from multiprocessing import util
        util.Finalize(None, _stop_embedded, exitpriority=-100)
    port_file = os.path.join(directory, f"{name}.port")
    # --parent_pid: the server ends when the thread that started it does (PR_SET_PDEATHSIG,
    # set by the server itself: code run between fork and exec of this multi-threaded
    # process, a preexec_fn, can deadlock on a lock another thread held at the fork).
    proc, port = start_server(name, argv + [f"--port_file={port_file}", f"--parent_pid={os.getpid()}"], port_file,
                              os.path.join(directory, f"{name}.log"), timeout_s, _embedded["servers"].append)
    return port


def _start_sidecar(coordinator, directory, gloo_hostname, host_id, timeout_s):
    sock = os.path.join(directory, "sidecar.sock")
    _start("sidecar", [find_binary("collserve-sidecar"), f"--coordinator={coordinator}", f"--unix_socket={sock}",
                       f"--host_id={host_id}-{os.getpid()}", f"--gloo_hostname={gloo_hostname}",
                       "--metrics_address=", "--log_level=warning"], directory, timeout_s)
    return f"unix:{sock}"


def _embedded_sidecar(store, rank, init_timeout_s):
    """Starts or finds the embedded services (see the module docstring); returns the sidecar."""
    host_id = os.environ.get("COLLSERVE_HOST_ID") or socket.gethostname()
    coordinator = os.environ.get("COLLSERVE_COORDINATOR", "")
    if not coordinator:
        if rank == 0:
            directory = _embedded["dir"] = tempfile.mkdtemp(prefix="collserve-embedded-")
            # The embedded coordinator requires this job token; the other ranks (on this host,
            # as this user) read it from the directory (mode 0700), never from torch's store.
            _, credential_flags = embedded_credentials(directory, os.environ.get("COLLSERVE_JOB", ""))
            # The SDK reads the token from that file (COLLSERVE_TOKEN_FILE): it is in no
            # process's environment, where env dumps and log shippers would collect it.
            os.environ.pop("COLLSERVE_TOKEN", None)
            os.environ["COLLSERVE_TOKEN_FILE"] = embedded_token_file(directory, os.environ.get("COLLSERVE_JOB", ""))
            port = _start("coordinator", [find_binary("collserve-coordinator"), "--listen_address=127.0.0.1:0",
                                          "--metrics_address=", "--log_level=warning", *credential_flags],
                          directory, init_timeout_s)
            sidecar = _start_sidecar(f"127.0.0.1:{port}", directory, "127.0.0.1", host_id, init_timeout_s)
            store.set(_KEY, f"{host_id}\n{sidecar}")
        owner_host, _, sidecar = _text(store.get(_KEY)).partition("\n")
        if owner_host != host_id:
            raise RuntimeError(f"collserve: rank {rank} runs on host {host_id!r} but the embedded coordinator and "
                               f"sidecar are on rank 0's host {owner_host!r}: for ranks on several hosts, set "
                               "COLLSERVE_COORDINATOR to a running coordinator (or COLLSERVE_SIDECAR)")
        if rank != 0:
            token_file = embedded_token_file(os.path.dirname(sidecar[len("unix:"):]), os.environ.get("COLLSERVE_JOB", ""))
            try:
                with open(token_file):
                    pass
                os.environ.pop("COLLSERVE_TOKEN", None)
                os.environ["COLLSERVE_TOKEN_FILE"] = token_file
            except OSError as e:
                raise RuntimeError(f"collserve: rank {rank} cannot read the embedded coordinator's job token "
                                   f"{token_file}: {e} (the ranks of an embedded default run as one user)") from e
        return sidecar
    key = f"{_KEY}/{host_id}"
    if store.add(f"{key}/starters", 1) == 1:
        directory = _embedded["dir"] = tempfile.mkdtemp(prefix="collserve-embedded-")
        gloo_hostname = os.environ.get("COLLSERVE_GLOO_HOSTNAME") or _host_address()
        store.set(key, _start_sidecar(coordinator, directory, gloo_hostname, host_id, init_timeout_s))
    return _text(store.get(key))


def _register_rank(sidecar):
    """Notes this process in the embedded services' directory, so that their owner waits for it."""
    if _embedded["registered"] or not sidecar.startswith("unix:"):
        return
    ranks = os.path.join(os.path.dirname(sidecar[len("unix:"):]), "ranks")
    os.makedirs(ranks, exist_ok=True)
    with open(os.path.join(ranks, str(os.getpid())), "w"):
        pass
    _embedded["registered"] = True


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _stop_embedded():
    """At exit of the process that started the embedded services: waits (up to the operation
    timeout) for the other ranks on this host to exit, then stops the services."""
    with _embedded["lock"]:
        if _embedded["stopped"] or not _embedded["servers"]:
            return
        _embedded["stopped"] = True
    ranks = os.path.join(_embedded["dir"], "ranks")
    deadline = time.monotonic() + _embedded["wait_s"]
    while time.monotonic() < deadline:
        try:
            others = [int(p) for p in os.listdir(ranks) if int(p) != os.getpid()]
        except (OSError, ValueError):
            others = []
        if not any(_alive(p) for p in others):
            break
        time.sleep(0.05)
    clean = True
    for _, proc in reversed(_embedded["servers"]):
        _stop(proc, 10.0)
        clean = clean and proc.returncode in (0, -signal.SIGTERM)
    _embedded["servers"].clear()
    if clean:  # else the servers' logs stay there
        shutil.rmtree(_embedded["dir"], ignore_errors=True)


def _sidecar(store, rank, init_timeout_s, op_timeout_s):
    sidecar = os.environ.get("COLLSERVE_SIDECAR")
    if sidecar:
        return sidecar
    if _embedded["sidecar"] is None:
        _embedded["wait_s"] = op_timeout_s
        _embedded["sidecar"] = _embedded_sidecar(store, rank, init_timeout_s)
        _register_rank(_embedded["sidecar"])
    return _embedded["sidecar"]


def _create(options, pg_options=None):
    """torch.distributed's creator for "collserve" (register_backend with extended_api=True):
    attaches this rank to the group and returns the c10d ProcessGroup."""
    del pg_options
    init_timeout_s = _seconds(options.timeout, "COLLSERVE_INIT_TIMEOUT_S")
    op_timeout_s = _seconds(options.timeout, "COLLSERVE_OP_TIMEOUT_S")
    sidecar = _sidecar(options.store, options.group_rank, init_timeout_s, op_timeout_s)
    name = f"torch/{options.group_id}"
    # The default group (torch sets it once its creator returns) may be a re-formation's,
    # at the generation reconfigure agreed on (torch_elastic).
    generation = torch_elastic._note_created(name, options.timeout, default=not dist.is_initialized())
    return _collserve_torch.create(options.group_rank, options.group_size, int(os.environ.get("LOCAL_RANK", "-1")),
                                   sidecar, os.environ.get("COLLSERVE_JOB", ""), name, init_timeout_s, op_timeout_s,
                                   generation=generation)


def empty(*size, dtype=None, group=None):
    """A tensor of `size` (ints or one sequence) and `dtype` (default torch's default dtype),
    contiguous, zero-filled, in the shared-memory arena of `group` (default: the default
    group), a group of the "collserve" backend; like torch.empty, with the memory NCCL users
    get from ncclMemAlloc. That group's collectives on it (or on a slice of it: one tensor
    per call) run with no copy between this process and the sidecar: inputs are read and
    results written in place while the operation runs. With another group it is an ordinary
    CPU tensor (copied). The memory is freed with the tensor's storage.
    Raises ValueError when `group` is not a collserve group, RuntimeError when the arena
    cannot grow (e.g. /dev/shm full)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    dtype = dtype or torch.get_default_dtype()
    nbytes = math.prod(size) * torch.empty((), dtype=dtype).element_size()
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    raw = _collserve_torch.empty_shared(pg, max(nbytes, 1))
    return raw[:nbytes].view(dtype).view(size)


def _backend_arg(args, kwargs, position):
    """The `backend` argument of a torch call (keyword, or positional at `position`)."""
    if "backend" in kwargs:
        return kwargs["backend"]
    return args[position] if len(args) > position else None


def _route_mpi(function, position):
    """Wraps torch.distributed's `function` (init_process_group: backend first; new_group:
    third) so that backend "mpi" runs as "collserve" with MPI between the sidecars
    (COLLSERVE_BACKEND=mpi, read by every group this process creates afterwards)."""
    def routed(*args, **kwargs):
        backend = _backend_arg(args, kwargs, position)
        if isinstance(backend, str) and backend.lower() == "mpi":
            os.environ["COLLSERVE_BACKEND"] = "mpi"
            if "backend" in kwargs:
                kwargs["backend"] = BACKEND
            else:
                args = args[:position] + (BACKEND,) + args[position + 1:]
        return function(*args, **kwargs)
    routed.__wrapped__ = function
    routed.__doc__ = function.__doc__
    return routed


def _patch_mpi():
    """A torch built without MPI (Debian 12's 1.13, pip's wheels: is_mpi_available() is
    False) refuses backend "mpi"; with collserve.torch imported, init_process_group("mpi")
    and new_group(backend="mpi") run through collserve instead, over MPI between the
    sidecars (docs/guide.md, "The MPI backend"). A torch with MPI of its own (Debian 13's
    2.6) keeps it."""
    c10d = dist.distributed_c10d
    if dist.is_mpi_available() or getattr(c10d, "_collserve_mpi_routed", False):
        return
    c10d._collserve_mpi_routed = True
    for name, position in (("init_process_group", 0), ("new_group", 2)):
        routed = _route_mpi(getattr(c10d, name), position)
        setattr(c10d, name, routed)
        setattr(dist, name, routed)


def _register():
    if BACKEND.upper() in dist.Backend._plugins:
        return
    _patch_mpi()
    if int(torch.__version__.split(".")[0]) >= 2:
        # torch 2.x: the creator returns a c10d Backend, which torch wraps in a ProcessGroup
        # for the devices named here (CPU tensors; CUDA ones go to collserve.torch_pg).
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    else:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True)
    torch_elastic._patch_torch()
    atexit.register(_stop_embedded)
    # Runs first (atexit is last in, first out): every collserve group still alive, such as
    # one DistributedDataParallel keeps past destroy_process_group, ends its session while
    # Python can still take back the tensors of operations in flight (see
    # _collserve_torch.shutdown_all), and before the embedded sidecar stops.
    atexit.register(_collserve_torch.shutdown_all)


_register()
