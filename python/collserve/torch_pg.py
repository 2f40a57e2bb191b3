"""A pure-Python torch.distributed backend over the collserve Python SDK (torch >= 2.0).

    import collserve.torch_pg                        # registers "collserve" (torch >= 2)
    dist.init_process_group("collserve")             # under `python -m collserve launch`
    model = DistributedDataParallel(model.cuda())    # CPU or CUDA tensors

CollserveProcessGroup is a Python subclass of torch.distributed.ProcessGroup (torch's
PyProcessGroup trampoline): torch's Python API calls its methods directly, and C++ callers
(DistributedDataParallel's reducer, _broadcast_coalesced, _verify_params_across_processes)
call back into them. It serves CPU tensors through the SDK's CPU calls and CUDA tensors
through its *_cuda calls (a build with CUDA support), one tensor per call, on a group that
`_collserve.init` attaches to the sidecar named by COLLSERVE_SIDECAR. It does not start
servers: run the ranks with `python -m collserve launch` (or set COLLSERVE_SIDECAR and
COLLSERVE_COORDINATOR). The C++ c10d backend in collserve.torch is the torch 1.13 path.

Work objects follow torch's: wait() blocks (for CUDA work: makes the stream current at issue
wait for the result, without blocking the host on the GPU) and raises RuntimeError
"collserve <op>: <code>: <message>" on failure; get_future() waits, then returns a completed
torch.futures.Future of the output tensors (DistributedDataParallel's reducer chains on it,
so its buckets' all-reduces do not overlap the backward pass).

torch 1.13 has the ProcessGroup trampoline but not the Work one (C++ callers of a Python
Work subclass reach c10d::Work::wait, which never returns): there every call completes
before it returns, and its Work is torch's own, wrapping a completed future. The backend is
registered only on torch >= 2; on 1.13 CollserveProcessGroup can be built directly.
"""
import datetime
import itertools
import os
import threading

import torch
import torch.distributed as dist

from . import _collserve
from . import _tensors
from .distributed_c10d import _CALL_SITES
from .errors import raise_for

BACKEND = "collserve"
TORCH_MAJOR = int(torch.__version__.split(".")[0])
# torch >= 2: C++ callers reach a Python Work subclass's wait() and get_future().
_PY_WORK = TORCH_MAJOR >= 2
_DEFAULT_TIMEOUT_S = 300.0

_BaseWork = getattr(dist, "Work", None) or dist._Work

# torch.distributed.ReduceOp -> collserve.v1.ReduceOp (distributed_c10d.ReduceOp's values).
_OPS = [(name, code) for name, code in (("SUM", 1), ("AVG", 2), ("PRODUCT", 3), ("MIN", 4), ("MAX", 5),
                                        ("BAND", 6), ("BOR", 7), ("BXOR", 8))
        if hasattr(dist.ReduceOp, name)]


def _op_code(op):
    """The collserve code of a ReduceOp (a ReduceOp object, its RedOpType, or None = SUM)."""
    if op is None:
        return 1
    for name, code in _OPS:
        try:
            if op == getattr(dist.ReduceOp, name):
                return code
        except TypeError:
            pass
    raise ValueError(f"collserve: unsupported reduce op {op!r} (PREMUL_SUM's factor is not readable from "
                     "Python; supported: " + ", ".join(n for n, _ in _OPS) + ")")


def _seconds(timeout, env_name=None, default=_DEFAULT_TIMEOUT_S):
    value = os.environ.get(env_name) if env_name else None
    if value:
        return float(value)
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _wait_seconds(timeout):
    """Work.wait's timeout (a timedelta from C++ or Python, seconds, or None) in seconds;
    -1 = no timeout (torch's kNoTimeout is 0 ms)."""
    if timeout is None:
        return -1.0
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return -1.0 if s <= 0 else s


def _one(tensors, op, what="tensor_list"):
    if len(tensors) != 1:
        raise ValueError(f"collserve {op}: takes one tensor per call ({what} has {len(tensors)})")
    return tensors[0]


def _is_cuda(t):
    return t.device.type == "cuda"


def _cuda_view(t, op, what):
    """(address, element count, dtype code, stream) of a CUDA tensor."""
    if not _collserve.cuda_available():
        raise TypeError(f"collserve {op}: {what} is on {t.device}, but this collserve build has no CUDA support "
                        "(move it with .cpu(), or build collserve with CUDA)")
    code = _tensors._TORCH.get(str(t.dtype).replace("torch.", ""))
    if code is None:
        raise TypeError(f"collserve {op}: {what} has dtype {t.dtype}, which collserve does not support "
                        f"(supported: {', '.join(sorted(_TORCH_NAMES))})")
    if not t.is_contiguous():
        raise ValueError(f"collserve {op}: {what} is not contiguous; pass t.contiguous() and copy the result back")
    return t.data_ptr(), t.numel(), code, torch.cuda.current_stream(t.device).cuda_stream


_TORCH_NAMES = tuple(_tensors._TORCH)


def _same_device(op, tensors):
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"collserve {op}: the tensors must be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


class CollserveWork(_BaseWork):
    """One collective (torch.distributed.Work). `result` is the output tensor list that
    get_future() resolves with; `keep` the tensors the operation reads or writes (alive until
    it completes); `finish`, if given, runs once after a successful wait (copies out of a
    staging tensor, queued on the current stream for CUDA work)."""

    def __init__(self, op, work, result, keep=(), finish=None, device=None):
        super().__init__()
        self._op = op
        self._work = work  # the SDK's Work, or None for work that is already done
        self._result = result
        self._keep = list(keep)
        self._finish = finish
        self._device = device
        self._status = None if work is not None else (0, "")
        self._future = None
        self._lock = threading.Lock()

    def _status_now(self, timeout_s):
        if self._status is not None:
            return self._status
        code, message = self._work.wait(timeout_s)
        if self._work.is_completed():
            with self._lock:
                if self._status is None:
                    self._status = (code, message)
                    self._keep = None
                    if code == 0 and self._finish is not None:
                        finish, self._finish = self._finish, None
                        finish()
            return self._status
        return code, message

    def wait(self, timeout=None):
        """Blocks until the operation is done (CUDA work: the stream current at issue waits
        for it); raises RuntimeError on failure or timeout. Returns True."""
        code, message = self._status_now(_wait_seconds(timeout))
        if code != 0:
            raise RuntimeError(f"collserve {self._op}: {code}: {message}")
        return True

    def is_completed(self):
        return self._status is not None or self._work.is_completed()

    def is_success(self):
        return self.is_completed() and self._status_now(0.0)[0] == 0

    def exception(self):
        if not self.is_completed():
            return None
        code, message = self._status_now(0.0)
        return None if code == 0 else RuntimeError(f"collserve {self._op}: {code}: {message}")

    def result(self):
        return self._result

    def _source_rank(self):
        """recv: the rank the message came from (torch's recv() of any source reads it)."""
        return self._work.source_rank() if self._work is not None else -1

    source_rank = _source_rank

    def synchronize(self):
        self.wait()

    def get_future(self):
        """A torch.futures.Future of the output tensors, completed here after wait() (for
        CUDA tensors: on the current stream, which the result is ready on)."""
        if self._future is None:
            devices = [self._device] if self._device is not None and self._device.type == "cuda" else None
            future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
            try:
                self.wait()
            except RuntimeError as e:
                future.set_exception(e)
            else:
                future.set_result(self._result)
            self._future = future
        return self._future


class _CoalescedWork(_BaseWork):
    """The Work of a coalesced batch (torch's _coalescing_manager around batch_isend_irecv of
    CUDA tensors: _start_coalescing, the sends and receives, _end_coalescing): waits for each
    of them; fails with the first failure."""

    def __init__(self, works):
        super().__init__()
        self._works = list(works)

    def wait(self, timeout=None):
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def is_success(self):
        return all(w.is_success() for w in self._works)

    def exception(self):
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None

    def result(self):
        return []

    def synchronize(self):
        self.wait()

    def get_future(self):
        future = torch.futures.Future()
        try:
            self.wait()
        except RuntimeError as e:
            future.set_exception(e)
        else:
            future.set_result([])
        return future


class _BatchedWork(_BaseWork):
    """What send/recv return between _start_coalescing and _end_coalescing (torch's
    batch_isend_irecv drops them and waits for _end_coalescing's Work): the op's own Work
    once the batch is issued."""

    def __init__(self, op):
        super().__init__()
        self._op = op
        self._target = None

    def _issued(self):
        if self._target is None:
            raise RuntimeError(f"collserve {self._op}: part of a batch not yet issued (wait for _end_coalescing's Work)")
        return self._target

    def wait(self, timeout=None):
        return self._issued().wait(timeout)

    def is_completed(self):
        return self._target is not None and self._target.is_completed()

    def is_success(self):
        return self._target is not None and self._target.is_success()

    def exception(self):
        return None if self._target is None else self._target.exception()

    def _source_rank(self):
        return self._issued()._source_rank()

    source_rank = _source_rank

    def result(self):
        return self._issued().result()

    def synchronize(self):
        self.wait()

    def get_future(self):
        return self._issued().get_future()


def _done_work(result):
    """torch < 2: a torch Work wrapping a completed future (see the module docstring)."""
    future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


class CollserveProcessGroup(dist.ProcessGroup):
    """A torch.distributed ProcessGroup over a collserve SDK group (`sdk_pg`, a
    collserve._collserve.ProcessGroup); see the module docstring. connect() attaches one."""

    def __init__(self, sdk_pg, rank=None, world_size=None):
        rank = sdk_pg.rank if rank is None else rank
        world_size = sdk_pg.world_size if world_size is None else world_size
        super().__init__(rank, world_size)
        self._pg = sdk_pg
        self._rank = rank
        self._world = world_size
        self._group_name = sdk_pg.name
        self._group_desc = ""
        self._pending = []  # works the caller may have dropped: their tensors stay alive
        self._coalesced = None  # between _start_coalescing and _end_coalescing: their works
        self._sites = _collserve.CallSites()  # occurrence counts of this group's call sites

    @classmethod
    def connect(cls, rank, world_size, timeout=None, group="torch/0", sidecar=None, coordinator=None, job=None):
        """Attaches rank `rank` of `world_size` to collserve group `group` through the sidecar
        (default COLLSERVE_SIDECAR); blocks until all ranks joined. timeout: a timedelta or
        seconds for the rendezvous and each operation (COLLSERVE_INIT_TIMEOUT_S and
        COLLSERVE_OP_TIMEOUT_S override)."""
        env = os.environ
        sidecar = sidecar if sidecar is not None else env.get("COLLSERVE_SIDECAR", "")
        if not sidecar:
            raise RuntimeError("collserve: COLLSERVE_SIDECAR is not set; run the ranks under "
                               "`python -m collserve launch --nproc_per_node N script.py` or set COLLSERVE_SIDECAR "
                               "(and COLLSERVE_COORDINATOR) to running collserve servers")
        coordinator = coordinator if coordinator is not None else env.get("COLLSERVE_COORDINATOR", "")
        job = job if job is not None else env.get("COLLSERVE_JOB", "")
        init_s = _seconds(timeout, "COLLSERVE_INIT_TIMEOUT_S")
        op_s = _seconds(timeout, "COLLSERVE_OP_TIMEOUT_S")
        code, message, pg = _collserve.init(int(rank), int(world_size), int(env.get("LOCAL_RANK", "-1")), sidecar,
                                            coordinator, job, group, init_s, op_s)
        raise_for(code, message)
        return cls(pg, rank, world_size)

    # ---- identity ----
    def getBackendName(self):
        return BACKEND

    def _get_backend_name(self):
        return BACKEND

    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    def __repr__(self):
        return f"<CollserveProcessGroup {self._group_name!r} rank={self._rank} size={self._world}>"

    # ---- plumbing ----
    def _live(self):
        """The SDK's process group, after telling it where the program issues the next
        collective from (the sidecars compare call sites across ranks: distributed_c10d)."""
        pg = self._open()
        if _CALL_SITES:
            self._sites.mark()
        return pg

    def _open(self):
        """The SDK's process group (point-to-point: no call site, only two ranks take part)."""
        if self._pg is None:
            raise RuntimeError("collserve: the process group has been shut down")
        return self._pg

    def _work(self, op, work, result, keep, finish=None, device=None, p2p=False):
        w = CollserveWork(op, work, result, keep, finish, device)
        # Point-to-point is called from Python only (torch's isend/irecv/batch_isend_irecv):
        # the Python Work works on every torch, and waiting here would deadlock a ring of isends.
        if not p2p and not _PY_WORK:
            # torch 1.13: C++ would call c10d::Work::wait on a Python Work (see the docstring).
            w.wait()
            return _done_work(result)
        self._pending = [p for p in self._pending if not p.is_completed()]
        self._pending.append(w)
        return w

    # ---- collectives ----
    def allreduce(self, tensor_list, opts=None):
        t = _one(tensor_list, "allreduce")
        op = _op_code(getattr(opts, "reduceOp", None))
        if _is_cuda(t):
            p, n, d, stream = _cuda_view(t, "allreduce", "tensor")
            work = self._live().all_reduce_cuda(p, n, d, op, 1.0, stream)
        else:
            p, n, d = _tensors.view(t)
            work = self._live().all_reduce(p, n, d, op, 1.0)
        return self._work("allreduce", work, tensor_list, [t], device=t.device)

    def reduce(self, tensor_list, opts=None):
        """reduce: the reduction of every rank's tensor into rank rootRank's (in place); the
        others' tensors are left as they were. On CUDA tensors the others reduce a copy (an
        all_reduce: the CUDA paths have no reduce of their own)."""
        t = _one(tensor_list, "reduce")
        op = _op_code(getattr(opts, "reduceOp", None))
        root = int(getattr(opts, "rootRank", 0))
        if int(getattr(opts, "rootTensor", 0)) != 0:
            raise ValueError("collserve reduce: rootTensor must be 0 (one tensor per call)")
        if not 0 <= root < self._world:
            raise ValueError(f"collserve reduce: rootRank {root} is not a rank of the group (world_size {self._world})")
        if _is_cuda(t):
            target = t if self._rank == root else t.clone()  # on the current stream, before the op
            p, n, d, stream = _cuda_view(target, "reduce", "tensor")
            work = self._live().all_reduce_cuda(p, n, d, op, 1.0, stream)
            return self._work("reduce", work, tensor_list, [t, target], device=t.device)
        p, n, d = _tensors.view(t)
        work = self._live().reduce(p, n, d, op, 1.0, root)
        return self._work("reduce", work, tensor_list, [t], device=t.device)

    def broadcast(self, tensor_list, opts=None):
        t = _one(tensor_list, "broadcast")
        root = int(getattr(opts, "rootRank", 0))
        if int(getattr(opts, "rootTensor", 0)) != 0:
            raise ValueError("collserve broadcast: rootTensor must be 0 (one tensor per call)")
        if _is_cuda(t):
            p, n, d, stream = _cuda_view(t, "broadcast", "tensor")
            work = self._live().broadcast_cuda(p, n, d, root, stream)
        else:
            p, n, d = _tensors.view(t)
            work = self._live().broadcast(p, n, d, root)
        return self._work("broadcast", work, tensor_list, [t], device=t.device)

    def allgather(self, output_lists, input_list, opts=None):
        t = _one(input_list, "allgather", "input_list")
        outs = _one(output_lists, "allgather", "output_lists")
        if len(outs) != self._world:
            raise ValueError(f"collserve allgather: needs {self._world} output tensors, got {len(outs)}")
        device = _same_device("allgather", [t, *outs])
        if device.type == "cuda":
            # No CUDA all_gather with separate outputs: gather into one staging tensor, then
            # copy its blocks out (queued on the current stream after wait()).
            if any(o.numel() != t.numel() or o.dtype != t.dtype for o in outs):
                raise ValueError("collserve allgather: CUDA outputs must each have the input's size and dtype")
            src = t.contiguous()
            flat = torch.empty(self._world * t.numel(), dtype=t.dtype, device=t.device)
            po, _, d, stream = _cuda_view(flat, "allgather", "output")
            pi, n, _, _ = _cuda_view(src, "allgather", "input")
            work = self._live().all_gather_into_tensor_cuda(po, pi, n, d, stream)

            def finish():
                for o, block in zip(outs, flat.view(self._world, -1)):
                    o.copy_(block.view_as(o))
            return self._work("allgather", work, output_lists, [src, flat, *outs], finish, device)
        p, n, d = _tensors.view(t, writable=False, what="input")
        ptrs, counts, od = _tensors.views(outs, True, "output_tensors")
        if od is not None and od != d:
            raise TypeError("collserve allgather: the outputs must have the input's dtype")
        work = self._live().all_gather(ptrs, counts, p, n, d)
        return self._work("allgather", work, output_lists, [t, *outs], device=device)

    def _allgather_base(self, output, input, opts=None):
        """all_gather_into_tensor: output (world_size x input's elements) gets every rank's input."""
        device = _same_device("_allgather_base", [output, input])
        if output.numel() != input.numel() * self._world:
            raise ValueError(f"collserve all_gather_into_tensor: output has {output.numel()} elements, needs "
                             f"world_size * {input.numel()}")
        if output.dtype != input.dtype:
            raise TypeError("collserve all_gather_into_tensor: output and input must share a dtype")
        if device.type == "cuda":
            po, _, d, stream = _cuda_view(output, "all_gather_into_tensor", "output")
            pi, n, _, _ = _cuda_view(input, "all_gather_into_tensor", "input")
            work = self._live().all_gather_into_tensor_cuda(po, pi, n, d, stream)
        else:
            po, _, d = _tensors.view(output, what="output")
            pi, n, _ = _tensors.view(input, writable=False, what="input")
            work = self._live().all_gather_into_tensor(po, pi, n, d)
        return self._work("all_gather_into_tensor", work, [output], [output, input], device=device)

    all_gather_single = _allgather_base  # its name in newer torch

    def reduce_scatter(self, output_list, input_lists, opts=None):
        out = _one(output_list, "reduce_scatter", "output_list")
        ins = _one(input_lists, "reduce_scatter", "input_lists")
        if len(ins) != self._world:
            raise ValueError(f"collserve reduce_scatter: needs {self._world} input tensors, got {len(ins)}")
        op = _op_code(getattr(opts, "reduceOp", None))
        device = _same_device("reduce_scatter", [out, *ins])
        if device.type == "cuda":
            if any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
                raise ValueError("collserve reduce_scatter: CUDA inputs must each have the output's size and dtype")
            flat = torch.cat([i.reshape(-1) for i in ins])  # on the current stream, before the op
            po, n, d, stream = _cuda_view(out, "reduce_scatter", "output")
            pi, _, _, _ = _cuda_view(flat, "reduce_scatter", "input")
            work = self._live().reduce_scatter_tensor_cuda(po, pi, n, d, op, 1.0, stream)
            return self._work("reduce_scatter", work, output_list, [out, flat], device=device)
        p, n, d = _tensors.view(out, what="output")
        ptrs, counts, idt = _tensors.views(ins, False, "input_tensors")
        if idt is not None and idt != d:
            raise TypeError("collserve reduce_scatter: the inputs must have the output's dtype")
        work = self._live().reduce_scatter(p, n, ptrs, counts, d, op, 1.0)
        return self._work("reduce_scatter", work, output_list, [out, *ins], device=device)

    def _reduce_scatter_base(self, output, input, opts=None):
        """reduce_scatter_tensor: output (n elements) gets the reduction of block `rank` of
        every rank's input (world_size * n elements)."""
        device = _same_device("_reduce_scatter_base", [output, input])
        if input.numel() != output.numel() * self._world:
            raise ValueError(f"collserve reduce_scatter_tensor: input has {input.numel()} elements, needs "
                             f"world_size * {output.numel()}")
        if output.dtype != input.dtype:
            raise TypeError("collserve reduce_scatter_tensor: output and input must share a dtype")
        op = _op_code(getattr(opts, "reduceOp", None))
        if device.type == "cuda":
            po, n, d, stream = _cuda_view(output, "reduce_scatter_tensor", "output")
            pi, _, _, _ = _cuda_view(input, "reduce_scatter_tensor", "input")
            work = self._live().reduce_scatter_tensor_cuda(po, pi, n, d, op, 1.0, stream)
        else:
            po, n, d = _tensors.view(output, what="output")
            pi, _, _ = _tensors.view(input, writable=False, what="input")
            work = self._live().reduce_scatter_tensor(po, pi, n, d, op, 1.0)
        return self._work("reduce_scatter_tensor", work, [output], [output, input], device=device)

    reduce_scatter_single = _reduce_scatter_base  # its name in newer torch

    def gather(self, output_tensors, input_tensors, opts=None):
        """gather: on the root, output_tensors[0] (world_size tensors) gets every rank's input
        (output_tensors is [] on the other ranks, as torch passes it)."""
        t = _one(input_tensors, "gather", "input_tensors")
        root = int(getattr(opts, "rootRank", 0))
        outs = _one(output_tensors, "gather", "output_tensors") if self._rank == root else []
        if self._rank == root and len(outs) != self._world:
            raise ValueError(f"collserve gather: needs {self._world} output tensors, got {len(outs)}")
        if self._rank != root and output_tensors:
            raise ValueError("collserve gather: only the destination rank passes output tensors")
        device = _same_device("gather", [t, *outs])
        if device.type == "cuda":
            # Into one staging tensor on the root, whose pieces are copied out after wait().
            if any(o.dtype != t.dtype for o in outs):
                raise TypeError("collserve gather: the outputs must have the input's dtype")
            src = t.contiguous()
            pi, n, d, stream = _cuda_view(src, "gather", "input")
            counts = [o.numel() for o in outs]
            flat = torch.empty(sum(counts), dtype=t.dtype, device=t.device) if outs else None
            po = _cuda_view(flat, "gather", "output")[0] if outs else 0
            work = self._live().gather_cuda(po, pi, n, counts, d, root, stream)

            def finish():
                for o, piece in zip(outs, torch.split(flat, counts)):
                    o.copy_(piece.view_as(o))
            keep = [src, *outs] + ([flat] if outs else [])
            return self._work("gather", work, output_tensors, keep, finish if outs else None, device)
        p, n, d = _tensors.view(t, writable=False, what="input")
        ptrs, counts, od = _tensors.views(outs, True, "output_tensors")
        if od is not None and od != d:
            raise TypeError("collserve gather: the outputs must have the input's dtype")
        work = self._live().gather(p, n, ptrs, counts, d, root)
        return self._work("gather", work, output_tensors, [t, *outs], device=device)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """scatter: output_tensors[0] of rank r gets the root's input_tensors[0][r]
        (input_tensors is [] off the root, as torch passes it)."""
        out = _one(output_tensors, "scatter", "output_tensors")
        root = int(getattr(opts, "rootRank", 0))
        ins = _one(input_tensors, "scatter", "input_tensors") if self._rank == root else []
        if self._rank == root and len(ins) != self._world:
            raise ValueError(f"collserve scatter: needs {self._world} input tensors, got {len(ins)}")
        if self._rank != root and input_tensors:
            raise ValueError("collserve scatter: only the source rank passes input tensors")
        device = _same_device("scatter", [out, *ins])
        if device.type == "cuda":
            if any(i.dtype != out.dtype for i in ins):
                raise TypeError("collserve scatter: the inputs must have the output's dtype")
            counts = [i.numel() for i in ins]
            flat = torch.cat([i.reshape(-1) for i in ins]) if ins else None  # on the current stream, before the op
            po, n, d, stream = _cuda_view(out, "scatter", "output")
            pi = _cuda_view(flat, "scatter", "input")[0] if ins else 0
            work = self._live().scatter_cuda(po, n, pi, counts, d, root, stream)
            return self._work("scatter", work, output_tensors, [out] + ([flat] if ins else []), device=device)
        p, n, d = _tensors.view(out, what="output")
        ptrs, counts, idt = _tensors.views(ins, False, "input_tensors")
        if idt is not None and idt != d:
            raise TypeError("collserve scatter: the inputs must have the output's dtype")
        work = self._live().scatter(p, n, ptrs, counts, d, root)
        return self._work("scatter", work, output_tensors, [out, *ins], device=device)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """all_to_all_single: `input` is cut along dim 0 by input_split_sizes (rows; empty =
        equal parts) and part j goes to rank j; `output` is filled the same way."""
        device = _same_device("alltoall_base", [output, input])
        if output.dtype != input.dtype:
            raise TypeError("collserve all_to_all_single: output and input must share a dtype")
        out_splits = [int(s) * _tensors.rows(output) for s in output_split_sizes or []]
        in_splits = [int(s) * _tensors.rows(input) for s in input_split_sizes or []]
        if device.type == "cuda":
            po, no, d, stream = _cuda_view(output, "all_to_all_single", "output")
            pi, ni, _, _ = _cuda_view(input, "all_to_all_single", "input")
            work = self._live().all_to_all_single_cuda(po, no, pi, ni, out_splits, in_splits, d, stream)
        else:
            po, no, d = _tensors.view(output, what="output")
            pi, ni, _ = _tensors.view(input, writable=False, what="input")
            work = self._live().all_to_all_single(po, no, pi, ni, out_splits, in_splits, d)
        return self._work("all_to_all_single", work, [output], [output, input], device=device)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """all_to_all: input_tensors[j] goes to rank j, output_tensors[i] comes from rank i (any
        sizes; every tensor of one dtype and device)."""
        if len(output_tensors) != self._world or len(input_tensors) != self._world:
            raise ValueError(f"collserve all_to_all: needs {self._world} output and {self._world} input tensors, got "
                             f"{len(output_tensors)} and {len(input_tensors)}")
        device = _same_device("alltoall", [*output_tensors, *input_tensors])
        if len({t.dtype for t in (*output_tensors, *input_tensors)}) != 1:
            raise TypeError("collserve all_to_all: every tensor must share one dtype")
        if device.type == "cuda":
            # One all_to_all_single over the inputs side by side (copied on the current
            # stream, before the op); the outputs are copied out after wait().
            src = torch.cat([t.reshape(-1) for t in input_tensors])
            flat = torch.empty(sum(o.numel() for o in output_tensors), dtype=src.dtype, device=src.device)
            out_splits = [o.numel() for o in output_tensors]
            po, no, d, stream = _cuda_view(flat, "all_to_all", "output")
            pi, ni, _, _ = _cuda_view(src, "all_to_all", "input")
            work = self._live().all_to_all_single_cuda(po, no, pi, ni, out_splits,
                                                       [t.numel() for t in input_tensors], d, stream)

            def finish():
                for o, block in zip(output_tensors, flat.split(out_splits)):
                    o.copy_(block.view_as(o))
            return self._work("all_to_all", work, output_tensors, [src, flat, *output_tensors], finish, device)
        optrs, ocounts, d = _tensors.views(output_tensors, True, "output_tensors")
        iptrs, icounts, _ = _tensors.views(input_tensors, False, "input_tensors")
        work = self._live().all_to_all(optrs, ocounts, iptrs, icounts, d)
        return self._work("all_to_all", work, output_tensors, [*output_tensors, *input_tensors], device=device)

    def barrier(self, opts=None):
        return self._work("barrier", self._live().barrier(), [], [])

    # ---- point-to-point ----
    def send(self, tensors, dstRank, tag=0):
        """isend/send: a CPU or CUDA tensor to group rank dstRank (docs/gpu.md for CUDA)."""
        t = _one(tensors, "send", "tensors")
        if self._coalesced is not None:
            return self._defer("send", t, int(dstRank), tag, tensors)
        if _is_cuda(t):
            p, n, d, stream = _cuda_view(t, "send", "tensor")
            work = self._open().send_cuda(p, n, d, int(dstRank), int(tag), stream)
        else:
            p, n, d = _tensors.view(t, writable=False)
            work = self._open().send(p, n, d, int(dstRank), int(tag))
        return self._work("send", work, tensors, [t], device=t.device, p2p=True)

    def recv(self, tensors, srcRank, tag=0):
        """irecv/recv from group rank srcRank (-1: any source; the Work's _source_rank())."""
        t = _one(tensors, "recv", "tensors")
        if self._coalesced is not None:
            return self._defer("recv", t, int(srcRank), tag, tensors)
        if _is_cuda(t):
            p, n, d, stream = _cuda_view(t, "recv", "tensor")
            work = self._open().recv_cuda(p, n, d, int(srcRank), int(tag), stream)
        else:
            p, n, d = _tensors.view(t)
            work = self._open().recv(p, n, d, int(srcRank), int(tag))
        return self._work("recv", work, tensors, [t], device=t.device, p2p=True)

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, -1, tag)

    recvAnysource = recv_anysource

    def _start_coalescing(self, device):
        """torch's batch_isend_irecv of CUDA tensors: the sends and receives until
        _end_coalescing are collected and issued there as one batch of the SDK
        (batch_isend_irecv: with COLLSERVE_CUDA_PATH=nccl one NCCL group, so that a ring of
        them cannot deadlock), waited for together through the Work _end_coalescing returns."""
        if self._coalesced is not None:
            raise RuntimeError("collserve: _start_coalescing while already coalescing")
        self._coalesced = []

    def _defer(self, op, t, peer, tag, result):
        work = _BatchedWork(op)
        self._coalesced.append((op, t, peer, tag, result, work))
        return work

    def _end_coalescing(self, device):
        deferred, self._coalesced = self._coalesced or [], None
        if not deferred:
            return _CoalescedWork([])
        ops = []
        for op, t, peer, tag, _, _ in deferred:
            if _is_cuda(t):
                p, n, d, stream = _cuda_view(t, op, "tensor")
                ops.append((op == "send", p, n, d, peer, int(tag), True, stream))
            else:
                p, n, d = _tensors.view(t, writable=op == "recv")
                ops.append((op == "send", p, n, d, peer, int(tag), False, 0))
        sdk_works = self._open().batch_isend_irecv(ops)
        works = []
        for (op, t, _, _, result, batched), sdk in zip(deferred, sdk_works):
            w = self._work(op, sdk, result, [t], device=t.device, p2p=True)
            batched._target = w
            works.append(w)
        return _CoalescedWork(works)

    def shutdown(self):
        self._pg = None

    def abort(self):
        self._pg = None


_counter = itertools.count()


def create(store, rank, world_size, timeout):
    """torch.distributed's creator for "collserve" (register_backend's plain API): attaches
    this rank to collserve group "torch/<n>", n counting the groups this process created.
    Every rank must create the same groups in the same order (as with new_group over all
    ranks); register() uses _create_extended, which names groups after torch's group name."""
    del store
    return CollserveProcessGroup.connect(rank, world_size, timeout=timeout, group=f"torch/{next(_counter)}")


def _create_extended(options, pg_options=None):
    """The creator register() installs (extended_api=True): the collserve group is named
    after torch's group name, which every member agrees on, also for subgroups that only
    some ranks create."""
    del pg_options
    return CollserveProcessGroup.connect(options.group_rank, options.group_size, timeout=options.timeout,
                                         group=f"torch/{options.group_id}")


def register():
    """Registers the "collserve" backend for CPU and CUDA tensors (idempotent). Needs torch >= 2
    (ProcessGroup subclasses returned by a creator, devices=)."""
    if TORCH_MAJOR < 2:
        raise RuntimeError(f"collserve.torch_pg needs torch >= 2.0 (this is {torch.__version__}); "
                           "use collserve.torch, the C++ c10d backend, with torch 1.13")
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create_extended, extended_api=True, devices=["cpu", "cuda"])


if TORCH_MAJOR >= 2:
    register()
