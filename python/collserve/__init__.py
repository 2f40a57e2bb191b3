"""collserve: torch.distributed-style collectives through the collserve service.

    import collserve as dist
    dist.init_process_group("env://")          # RANK, WORLD_SIZE, MASTER_ADDR/PORT, COLLSERVE_SIDECAR
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # numpy arrays, in place
    work = dist.isend(x, dst=1); work.wait()

Names and semantics follow torch.distributed (../shared/reference/torch_distributed_api_docs.md).
Tensors are C-contiguous, writable numpy arrays of float16, float32, float64, int8, uint8,
int32, int64 or bool; anything else raises TypeError (unsupported type or dtype) or
ValueError (non-contiguous). Errors from the service raise the DistError hierarchy below,
shaped like torch.distributed's.

This is the first increment of the Python SDK (issue 4): init, rank/world size, all_reduce,
reduce, broadcast, all_gather, barrier, send/recv/isend/irecv, async Work.
"""
import datetime as _datetime
import os as _os

from . import _collserve

__all__ = [
    "DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "DistTimeoutError",
    "ReduceOp", "Work", "init_process_group", "is_initialized", "get_rank", "get_world_size",
    "destroy_process_group", "all_reduce", "reduce", "broadcast", "all_gather", "barrier",
    "send", "recv", "isend", "irecv",
]


class DistError(RuntimeError):
    """Base of collserve's errors (torch.distributed.DistError)."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


class DistBackendError(DistError):
    """A collective or point-to-point operation failed (torch.distributed.DistBackendError)."""


class DistNetworkError(DistError):
    """The sidecar, a peer host or a rank is unreachable or went away (UNAVAILABLE)."""


class DistStoreError(DistError):
    """A store operation failed (torch.distributed.DistStoreError)."""


class DistTimeoutError(DistBackendError, TimeoutError):
    """An operation or the rendezvous did not complete in time (DEADLINE_EXCEEDED)."""


class DistArgumentError(DistBackendError, ValueError):
    """Invalid arguments, including ranks that disagree (desync): the message names them."""


# absl::StatusCode values.
_OK, _CANCELLED, _INVALID_ARGUMENT, _DEADLINE_EXCEEDED, _NOT_FOUND, _ALREADY_EXISTS = 0, 1, 3, 4, 5, 6
_FAILED_PRECONDITION, _UNAVAILABLE = 9, 14


def _raise_for(code, message):
    if code == _OK:
        return
    if code == _DEADLINE_EXCEEDED:
        raise DistTimeoutError(message, code)
    if code in (_INVALID_ARGUMENT, _NOT_FOUND, _ALREADY_EXISTS):
        raise DistArgumentError(message, code)
    if code in (_UNAVAILABLE, _CANCELLED):
        raise DistNetworkError(message, code)
    raise DistBackendError(message, code)


class ReduceOp:
    """torch.distributed.ReduceOp (values are collserve.v1.ReduceOp's)."""

    SUM = 1
    AVG = 2
    PRODUCT = 3
    MIN = 4
    MAX = 5
    BAND = 6
    BOR = 7
    BXOR = 8
    PREMUL_SUM = 9


_DTYPES = {
    "float32": 1, "float64": 2, "int32": 3, "int64": 4, "float16": 5, "int8": 7, "uint8": 8, "bool": 9,
}


def _tensor(t, writable=True):
    """Returns (pointer, element count, dtype code) of a numpy array."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if np is None or not isinstance(t, np.ndarray):
        raise TypeError(f"collserve needs a numpy.ndarray, got {type(t).__name__}")
    code = _DTYPES.get(t.dtype.name)
    if code is None:
        raise TypeError(f"dtype {t.dtype} is not supported (supported: {', '.join(sorted(_DTYPES))})")
    if not t.flags.c_contiguous:
        raise ValueError("the array is not C-contiguous; pass numpy.ascontiguousarray(a) and copy back")
    if writable and not t.flags.writeable:
        raise ValueError("the array is read-only")
    return t.__array_interface__["data"][0], t.size, code


class Work:
    """An asynchronous operation (torch.distributed.Work): wait(), is_completed()."""

    def __init__(self, work, keep):
        self._work = work
        self._keep = keep  # arrays the operation reads or writes

    def wait(self, timeout=None):
        """Blocks until done (or `timeout`, a timedelta or seconds) and raises its error."""
        if isinstance(timeout, _datetime.timedelta):
            timeout = timeout.total_seconds()
        code, message = self._work.wait(-1.0 if timeout is None else float(timeout))
        if code == _OK:
            self._keep = None
        _raise_for(code, message)
        return True

    def is_completed(self):
        return self._work.is_completed()

    def source_rank(self):
        """recv: the rank the message came from."""
        return self._work.source_rank()


_default_pg = None


def _seconds(timeout, default):
    if timeout is None:
        return default
    if isinstance(timeout, _datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def init_process_group(backend=None, init_method="env://", timeout=None, world_size=-1, rank=-1,
                       group_name="world"):
    """Joins the default group (torch.distributed.init_process_group).

    init_method: "env://" (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)
    or "collserve://host:port" (the coordinator). `backend` is accepted for torch
    compatibility and ignored (the sidecar picks Gloo/NCCL). The sidecar is
    COLLSERVE_SIDECAR (default unix:/tmp/collserve/sidecar.sock). Raises ValueError for
    missing or bad arguments and the DistError hierarchy for service errors.
    """
    global _default_pg
    del backend
    if _default_pg is not None:
        raise RuntimeError("trying to initialize the default process group twice")
    env = _os.environ
    if rank < 0:
        rank = int(env.get("RANK", "-1"))
    if world_size < 0:
        world_size = int(env.get("WORLD_SIZE", "-1"))
    if rank < 0 or world_size <= 0:
        raise ValueError("rank and world_size must be given or set in RANK and WORLD_SIZE")
    if init_method.startswith("collserve://"):
        coordinator = init_method[len("collserve://"):]
    elif init_method == "env://":
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        coordinator = f"{addr}:{port}" if addr and port else ""
    else:
        raise ValueError(f"unsupported init_method {init_method!r} (env:// or collserve://host:port)")
    op_timeout = _seconds(timeout, float(env.get("COLLSERVE_OP_TIMEOUT_S", "300")))
    init_timeout = _seconds(timeout, float(env.get("COLLSERVE_INIT_TIMEOUT_S", "300")))
    code, message, pg = _collserve.init(rank, world_size, env.get("COLLSERVE_SIDECAR", ""), coordinator,
                                        env.get("COLLSERVE_JOB", ""), group_name, init_timeout, op_timeout)
    _raise_for(code, message)
    _default_pg = pg


def is_initialized():
    return _default_pg is not None


def _pg():
    if _default_pg is None:
        raise RuntimeError("Default process group has not been initialized, please make sure to call "
                           "init_process_group.")
    return _default_pg


def get_rank():
    return _pg().rank


def get_world_size():
    return _pg().world_size


def destroy_process_group():
    """Leaves the default group; the other ranks' later operations fail."""
    global _default_pg
    _default_pg = None


def _run(work, keep, async_op):
    w = Work(work, keep)
    if async_op:
        return w
    w.wait()
    return None


def all_reduce(tensor, op=ReduceOp.SUM, async_op=False, premul_factor=1.0):
    p, n, d = _tensor(tensor)
    return _run(_pg().all_reduce(p, n, d, int(op), float(premul_factor)), [tensor], async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, async_op=False, premul_factor=1.0):
    p, n, d = _tensor(tensor)
    return _run(_pg().reduce(p, n, d, int(op), float(premul_factor), dst), [tensor], async_op)


def broadcast(tensor, src, async_op=False):
    p, n, d = _tensor(tensor)
    return _run(_pg().broadcast(p, n, d, src), [tensor], async_op)


def all_gather(tensor_list, tensor, async_op=False):
    p, n, d = _tensor(tensor, writable=False)
    outs = [_tensor(t) for t in tensor_list]
    if any(o[2] != d for o in outs):
        raise TypeError("all_gather: the output tensors must have the input's dtype")
    return _run(_pg().all_gather([o[0] for o in outs], [o[1] for o in outs], p, n, d),
                [tensor, list(tensor_list)], async_op)


def barrier(async_op=False):
    return _run(_pg().barrier(), None, async_op)


def isend(tensor, dst, tag=0):
    p, n, d = _tensor(tensor, writable=False)
    return Work(_pg().send(p, n, d, dst, tag), [tensor])


def irecv(tensor, src=None, tag=0):
    p, n, d = _tensor(tensor)
    return Work(_pg().recv(p, n, d, -1 if src is None else src, tag), [tensor])


def send(tensor, dst, tag=0):
    isend(tensor, dst, tag).wait()


def recv(tensor, src=None, tag=0):
    """Receives into `tensor`; returns the sender's rank (src=None: any source)."""
    w = irecv(tensor, src, tag)
    w.wait()
    return w.source_rank()
