"""The torch.distributed-shaped API of collserve (torch/distributed/distributed_c10d.py).

Every function follows its torch.distributed namesake
(https://pytorch.org/docs/stable/distributed.html): the same names, argument names and defaults, ranks given as
global ranks (ranks of the default group) and translated for subgroups, async_op=True
returning a Work. Tensors are numpy arrays or torch CPU tensors used in place (see
_tensors.py); all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor also
take torch CUDA tensors (docs/gpu.md: ordered after the work queued on the tensor's current
stream; wait() makes that stream wait for the result). Service errors raise the errors.py hierarchy; Python-side argument errors
raise TypeError/ValueError (DistArgumentError is a ValueError).

Thread safety: the functions may be called from several threads; as with torch, every
rank must issue a group's collectives in the same order.
"""
import atexit as _atexit
import contextlib as _contextlib
import datetime as _datetime
import enum as _enum
import os as _os
import pickle as _pickle
import sys as _sys
import time as _time

from . import _collserve
from . import _elastic
from . import _tensors
from .errors import DistArgumentError, raise_for
from .store import Store

_DEFAULT_TIMEOUT_S = 300.0
# This package's directory: frames inside it are not a call's call site.
_PACKAGE_DIR = _os.path.dirname(_os.path.abspath(__file__)) + _os.sep
# COLLSERVE_CALL_SITES=0 turns the call-site check off for this process.
_CALL_SITES = _os.environ.get("COLLSERVE_CALL_SITES", "1") not in ("0", "false")


_collserve.set_package_dir(_PACKAGE_DIR)


@_contextlib.contextmanager
def call_site(name):
    """Within the block, this thread's collectives carry `name` as their call site instead of
    the caller's stack (counted per name): for a program that issues one collective from
    different code paths on different ranks on purpose, e.g. rank 0 from a background thread.
    Works for the Python SDK and for torch programs on the "collserve" backend
    (collserve.torch). Blocks nest; the innermost name wins."""
    previous = _collserve.call_site_override()
    _collserve.set_call_site_override(str(name))
    try:
        yield
    finally:
        _collserve.set_call_site_override(previous)


class ReduceOp(_enum.IntEnum):
    """torch.distributed.ReduceOp (values are collserve.v1.ReduceOp's). AVG and PREMUL_SUM
    take floating-point tensors; BAND/BOR/BXOR integer and bool ones."""

    SUM = 1
    AVG = 2
    PRODUCT = 3
    MIN = 4
    MAX = 5
    BAND = 6
    BOR = 7
    BXOR = 8
    PREMUL_SUM = 9


class _PremulSum:
    """ReduceOp.PREMUL_SUM with this rank's factor: sum over ranks of factor * tensor."""

    def __init__(self, factor):
        self.factor = float(factor)

    def __repr__(self):
        return f"PREMUL_SUM({self.factor})"


def _make_nccl_premul_sum(factor):
    """torch.distributed._make_nccl_premul_sum: a PREMUL_SUM op with a scalar factor."""
    return _PremulSum(factor)


def _op(op, premul_factor=None):
    if isinstance(op, _PremulSum):
        return int(ReduceOp.PREMUL_SUM), op.factor
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown ReduceOp {op!r}") from None
    return int(op), 1.0 if premul_factor is None else float(premul_factor)


class Work:
    """An asynchronous operation (torch.distributed.Work). Its tensors stay alive until the
    operation completes, even if the Work is dropped."""

    def __init__(self, work, keep):
        self._work = work
        self._keep = keep  # tensors the operation reads or writes
        self._group = None  # the ProcessGroup, to translate source_rank()

    def wait(self, timeout=None):
        """Blocks until done (or `timeout`, a timedelta or seconds, passes: DistTimeoutError,
        the operation goes on) and raises the operation's error. Returns True."""
        code, message = self._work.wait(-1.0 if timeout is None else _seconds(timeout))
        if self._work.is_completed():
            self._keep = None
        raise_for(code, message)
        return True

    def is_completed(self):
        """True once the operation finished (successfully or not). Never blocks."""
        return self._work.is_completed()

    def source_rank(self):
        """recv/irecv: the global rank the message came from (-1 before it completes)."""
        r = self._work.source_rank()
        return self._group.ranks[r] if r >= 0 and self._group is not None else r


class _Pending:
    """Works whose tensors must outlive a dropped Work object: pruned on every new call."""

    def __init__(self):
        self.works = []

    def add(self, work):
        self.works = [w for w in self.works if not w.is_completed()]
        self.works.append(work)


_pending = _Pending()


class ProcessGroup:
    """A group of ranks (torch.distributed.ProcessGroup): rank() and size() are this
    process's rank in the group and the group's size; `ranks` are the members' global ranks."""

    def __init__(self, pg, ranks):
        self._pg = pg
        self.ranks = list(ranks)
        self._sites = _collserve.CallSites()  # occurrence counts of this group's call sites

    def rank(self):
        return self._live().rank

    def size(self):
        return self._live().world_size

    def name(self):
        return self._live().name

    def _live(self):
        if self._pg is None:
            raise ValueError("the process group has been destroyed")
        return self._pg

    def _issue(self):
        """_live(), after telling the SDK where the program issues the next collective from
        (the sidecars compare it across ranks: a rank that skipped or added a collective is
        named instead of silently pairing the wrong calls)."""
        pg = self._live()
        if _CALL_SITES:
            self._sites.mark()
        return pg

    def __repr__(self):
        return f"<collserve.ProcessGroup ranks={self.ranks}>" if self._pg else "<collserve.ProcessGroup destroyed>"


class GroupMember:
    """torch.distributed.GroupMember: WORLD is the default group (None also means it);
    new_group returns NON_GROUP_MEMBER on ranks outside the group, and calls given it do
    nothing and return None, as torch's."""

    WORLD = None
    NON_GROUP_MEMBER = object()


group = GroupMember  # torch.distributed.group.WORLD

_state = {"default": None, "groups": [], "timeout": _DEFAULT_TIMEOUT_S}


def _seconds(timeout, default=None):
    if timeout is None:
        return default
    if isinstance(timeout, _datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                       group_name="world", pg_options=None):
    """Joins the default group (torch.distributed.init_process_group); blocks until all
    world_size ranks have joined or the timeout passes (DistTimeoutError naming the missing).

    init_method: "env://" (the default: RANK, WORLD_SIZE, and the coordinator at
    COLLSERVE_COORDINATOR, else MASTER_ADDR:MASTER_PORT) or
    "collserve://host:port" (the coordinator), with rank/world_size as arguments or from the
    environment. `backend`: "mpi" asks for MPI between the sidecars (sidecars started as one
    MPI world with --mpi; it sets COLLSERVE_BACKEND=mpi, which every group of this process
    then asks for); any other value is accepted for torch compatibility and leaves the choice
    to the sidecar (Gloo for CPU tensors, NCCL for CUDA ones) or to COLLSERVE_BACKEND. The sidecar is COLLSERVE_SIDECAR (default unix:/run/collserve/sidecar.sock),
    the job COLLSERVE_JOB. timeout (timedelta or seconds) bounds the rendezvous and each
    operation (default COLLSERVE_INIT_TIMEOUT_S / COLLSERVE_OP_TIMEOUT_S, else 300 s).
    Raises ValueError for missing or bad arguments, RuntimeError if already initialized.

    COLLSERVE_ELASTIC_JOIN=1 (set by `collserve launch --survive_failures --max_restarts`
    for a rank it restarted) joins a running job instead: the rank waits until the running
    ranks admit it (should_reconfigure, then reconfigure) and gets the rank and world size
    of that generation; RANK and WORLD_SIZE are not used then.

    Elastic formation: with COLLSERVE_MIN_WORLD_SIZE=MIN below WORLD_SIZE (`collserve launch
    --nnodes MIN:MAX` sets it), the group forms with the ranks that arrived once WORLD_SIZE
    of them did, or once COLLSERVE_JOIN_WINDOW_S (default 5) passed after the first with
    at least MIN there: ranks renumbered in the order of their RANK, get_world_size() the
    number that came. Later ranks wait to be admitted, as restarted ones do.
    """
    del pg_options
    if backend is not None and str(backend).lower() == "mpi":
        _os.environ["COLLSERVE_BACKEND"] = "mpi"  # read by the SDK's InitOptions (ReadTuningFromEnv)
    if _state["default"] is not None:
        raise RuntimeError("trying to initialize the default process group twice")
    if store is not None:
        raise ValueError("collserve rendezvous goes through its coordinator: pass init_method, not store")
    env = _os.environ
    if rank is None or rank < 0:
        rank = int(env.get("RANK", "-1"))
    if world_size is None or world_size < 0:
        world_size = int(env.get("WORLD_SIZE", "-1"))
    if rank < 0 or world_size <= 0:
        raise ValueError("rank and world_size must be given or set in RANK and WORLD_SIZE")
    init_method = init_method or "env://"
    if init_method.startswith("collserve://"):
        coordinator = init_method[len("collserve://"):]
    elif init_method == "env://":
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        coordinator = env.get("COLLSERVE_COORDINATOR") or (f"{addr}:{port}" if addr and port else "")
    else:
        raise ValueError(f"unsupported init_method {init_method!r} (env:// or collserve://host:port)")
    op_timeout = _seconds(timeout, float(env.get("COLLSERVE_OP_TIMEOUT_S", _DEFAULT_TIMEOUT_S)))
    init_timeout = _seconds(timeout, float(env.get("COLLSERVE_INIT_TIMEOUT_S", _DEFAULT_TIMEOUT_S)))
    _state.update(timeout=op_timeout, generation=0, registry_generation=0,
                  init=dict(local_rank=int(env.get("LOCAL_RANK", "-1")), sidecar=env.get("COLLSERVE_SIDECAR", ""),
                            coordinator=coordinator, job=env.get("COLLSERVE_JOB", ""), group_name=group_name,
                            init_timeout=init_timeout, op_timeout=op_timeout))
    min_world = int(env.get("COLLSERVE_MIN_WORLD_SIZE", "0") or 0)
    if env.get("COLLSERVE_ELASTIC_JOIN") == "1":
        # A rank restarted into a running job: admitted at a later generation (reconfigure).
        _form(*_join_running(init_timeout), init_timeout)
    elif 0 < min_world < world_size:
        # Elastic: the group forms with the ranks that come within the join window.
        _form(*_elastic_init(min_world, world_size, float(env.get("COLLSERVE_JOIN_WINDOW_S", "5")), init_timeout),
              init_timeout)
    else:
        code, message, pg = _collserve.init(rank, world_size, int(env.get("LOCAL_RANK", "-1")),
                                            env.get("COLLSERVE_SIDECAR", ""), coordinator,
                                            env.get("COLLSERVE_JOB", ""), group_name, init_timeout, op_timeout)
        raise_for(code, message)
        _state.update(default=ProcessGroup(pg, range(world_size)), groups=[], registry_generation=pg.generation)
    if env.get("COLLSERVE_EXIT_DIR") and not _state.get("exit_hook"):
        _state["exit_hook"] = True
        _atexit.register(_note_exit, env["COLLSERVE_EXIT_DIR"], rank)


def _note_exit(directory, rank):
    """Under `collserve launch`: records when this rank began to exit (before its sessions
    end and its peers' operations fail), so that the launcher reports the rank that failed
    first rather than a peer that finished dying sooner."""
    try:
        with open(_os.path.join(directory, str(rank)), "w") as f:
            f.write(repr(_time.monotonic()))
    except OSError:
        pass


def is_initialized():
    return _state["default"] is not None


def is_available():
    return True


def _default():
    if _state["default"] is None:
        raise RuntimeError("Default process group has not been initialized, please make sure to call "
                           "init_process_group.")
    return _state["default"]


def _group(g):
    """The ProcessGroup a call runs on, or None for NON_GROUP_MEMBER (the call is skipped)."""
    if g is GroupMember.NON_GROUP_MEMBER:
        return None
    if g is None:
        return _default()
    if not isinstance(g, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup from new_group, got {type(g).__name__}")
    _default()
    return g


def _local(g, global_rank, what):
    """The group rank of `global_rank` (ranks of the default group pass through unchecked:
    the service names a rank out of range)."""
    if not isinstance(global_rank, int) or isinstance(global_rank, bool):
        raise TypeError(f"{what} must be an int, got {type(global_rank).__name__}")
    if g is _state["default"]:
        return global_rank
    try:
        return g.ranks.index(global_rank)
    except ValueError:
        raise DistArgumentError(f"{what}={global_rank} is not a member of the group (its ranks are {g.ranks})",
                                3) from None


def get_rank(group=None):
    """This process's rank in `group` (default: the default group); -1 if not a member."""
    g = _group(group)
    return -1 if g is None else g.rank()


def get_world_size(group=None):
    """The number of ranks in `group`; -1 if this process is not a member."""
    g = _group(group)
    return -1 if g is None else g.size()


def get_backend(group=None):
    _group(group)
    return "collserve"


def get_process_group_ranks(group):
    """The global ranks of `group`'s members, in group-rank order."""
    g = _group(group)
    if g is None:
        raise ValueError("this process is not a member of the group")
    return list(g.ranks)


def get_global_rank(group, group_rank):
    """The global rank of `group_rank` in `group`."""
    ranks = get_process_group_ranks(group)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"group rank {group_rank} is out of range for a group of {len(ranks)}")
    return ranks[group_rank]


def get_group_rank(group, global_rank):
    """The rank in `group` of the process with global rank `global_rank`."""
    ranks = get_process_group_ranks(group)
    if global_rank not in ranks:
        raise ValueError(f"global rank {global_rank} is not part of the group {ranks}")
    return ranks.index(global_rank)


def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False):
    """A subgroup of the given global ranks (default: all), sorted as torch sorts them.

    Every rank of the default group must call new_group with the same ranks in the same
    order of new_group calls. Members block until all members joined (DistTimeoutError
    after the init timeout); others return GroupMember.NON_GROUP_MEMBER at once. `timeout`,
    `backend` and `pg_options` are accepted for torch compatibility; the subgroup uses the
    default group's timeouts. DistArgumentError for a rank out of range or listed twice.
    """
    del timeout, backend, pg_options, use_local_synchronization
    world = _default()
    ranks = sorted(range(world.size()) if ranks is None else ranks)
    code, message, pg = world._live().new_group(ranks)
    raise_for(code, message)
    if pg is None:
        return GroupMember.NON_GROUP_MEMBER
    g = ProcessGroup(pg, ranks)
    _state["groups"].append(g)
    return g


def destroy_process_group(group=None):
    """Destroys `group`, or (None) every group and the default one. The other members'
    pending and later operations fail with DistNetworkError."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    if group is None or group is _state["default"]:
        for g in _state["groups"] + [_state["default"]]:
            if g is not None:
                g._pg = None
        _state.update(default=None, groups=[])
        return
    group._pg = None
    _state["groups"] = [g for g in _state["groups"] if g is not group]


def _run(g, work, keep, async_op):
    w = Work(work, keep)
    w._group = g
    if async_op:
        _pending.add(w)
        return w
    w.wait()
    return None


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, premul_factor=None):
    """Reduces `tensor` across the group's ranks, in place on every rank."""
    g = _group(group)
    if g is None:
        return None
    code, factor = _op(op, premul_factor)
    cuda = _tensors.cuda_view(tensor)
    if cuda is not None:
        p, n, d, stream = cuda
        return _run(g, g._issue().all_reduce_cuda(p, n, d, code, factor, stream), [tensor], async_op)
    p, n, d = _tensors.view(tensor)
    return _run(g, g._issue().all_reduce(p, n, d, code, factor), [tensor], async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, premul_factor=None):
    """Reduces `tensor` across the group into rank `dst`'s tensor; others' are unchanged."""
    g = _group(group)
    if g is None:
        return None
    p, n, d = _tensors.view(tensor)
    code, factor = _op(op, premul_factor)
    return _run(g, g._issue().reduce(p, n, d, code, factor, _local(g, dst, "dst")), [tensor], async_op)


def broadcast(tensor, src, group=None, async_op=False):
    """Copies rank `src`'s tensor into every rank's tensor."""
    g = _group(group)
    if g is None:
        return None
    cuda = _tensors.cuda_view(tensor)
    if cuda is not None:
        p, n, d, stream = cuda
        return _run(g, g._issue().broadcast_cuda(p, n, d, _local(g, src, "src"), stream), [tensor], async_op)
    p, n, d = _tensors.view(tensor)
    return _run(g, g._issue().broadcast(p, n, d, _local(g, src, "src")), [tensor], async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """tensor_list[r] receives rank r's tensor (sizes may differ across ranks)."""
    g = _group(group)
    if g is None:
        return None
    p, n, d = _tensors.view(tensor, writable=False)
    outs, counts, od = _tensors.views(tensor_list, True, "tensor_list")
    if od is not None and od != d:
        raise TypeError("all_gather: tensor_list must have the input tensor's dtype")
    return _run(g, g._issue().all_gather(outs, counts, p, n, d), list(tensor_list), async_op)


def _out_in(op, output, out_name, input, in_name):
    """Views of an out-of-place call's output (written) and input (read), which must share a
    dtype: (output address, output elements, input address, input elements, dtype)."""
    po, no, do = _tensors.view(output, what=out_name)
    pi, ni, di = _tensors.view(input, writable=False, what=in_name)
    if do != di:
        raise TypeError(f"{op}: {out_name} and {in_name} must share a dtype")
    return po, no, pi, ni, do


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output_tensor (world_size x input's elements) receives every rank's input in rank order."""
    g = _group(group)
    if g is None:
        return None
    cuda = _tensors.cuda_out_in("all_gather_into_tensor", output_tensor, "output_tensor", input_tensor,
                                "input_tensor")
    if cuda is not None:
        po, no, pi, ni, do, stream = cuda
    else:
        po, no, pi, ni, do = _out_in("all_gather_into_tensor", output_tensor, "output_tensor", input_tensor,
                                     "input_tensor")
    if no != ni * g.size():
        raise ValueError(f"all_gather_into_tensor: output_tensor has {no} elements, "
                         f"needs world_size * {ni} = {ni * g.size()}")
    if cuda is not None:
        return _run(g, g._issue().all_gather_into_tensor_cuda(po, pi, ni, do, stream), [output_tensor], async_op)
    return _run(g, g._issue().all_gather_into_tensor(po, pi, ni, do), [output_tensor], async_op)


def _root_list(g, root, tensors, writable, dtype, op, name, role):
    """The list only a rooted call's root passes (gather's outputs, scatter's inputs):
    (addresses, counts), empty on the other ranks."""
    if g.rank() != root:
        if tensors:
            raise ValueError(f"{op}: only the {role} rank passes {name}")
        return [], []
    if tensors is None:
        raise ValueError(f"{op}: the {role} rank must pass {name}")
    ptrs, counts, list_dtype = _tensors.views(tensors, writable, name)
    if list_dtype is not None and list_dtype != dtype:
        raise TypeError(f"{op}: {name} must have the dtype of `tensor`")
    return ptrs, counts


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """Rank `dst`'s gather_list[r] receives rank r's tensor; other ranks pass gather_list=None."""
    g = _group(group)
    if g is None:
        return None
    p, n, d = _tensors.view(tensor, writable=False)
    root = _local(g, dst, "dst")
    outs, counts = _root_list(g, root, gather_list, True, d, "gather", "gather_list", "destination")
    return _run(g, g._issue().gather(p, n, outs, counts, d, root), list(gather_list or []), async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """Rank r's tensor receives rank `src`'s scatter_list[r]; other ranks pass None."""
    g = _group(group)
    if g is None:
        return None
    p, n, d = _tensors.view(tensor)
    root = _local(g, src, "src")
    ins, counts = _root_list(g, root, scatter_list, False, d, "scatter", "scatter_list", "source")
    return _run(g, g._issue().scatter(p, n, ins, counts, d, root), [tensor], async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, premul_factor=None):
    """output receives the reduction over ranks of their input_list[this rank]."""
    g = _group(group)
    if g is None:
        return None
    p, n, d = _tensors.view(output, what="output")
    ins, counts, idt = _tensors.views(input_list, False, "input_list")
    if idt is not None and idt != d:
        raise TypeError("reduce_scatter: input_list must have the output's dtype")
    code, factor = _op(op, premul_factor)
    return _run(g, g._issue().reduce_scatter(p, n, ins, counts, d, code, factor), [output], async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False, premul_factor=None):
    """output (n elements) receives the reduction of block `rank` of every rank's input (world_size * n)."""
    g = _group(group)
    if g is None:
        return None
    cuda = _tensors.cuda_out_in("reduce_scatter_tensor", output, "output", input, "input")
    if cuda is not None:
        po, no, pi, ni, do, stream = cuda
    else:
        po, no, pi, ni, do = _out_in("reduce_scatter_tensor", output, "output", input, "input")
    if ni != no * g.size():
        raise ValueError(f"reduce_scatter_tensor: input has {ni} elements, needs world_size * {no} = {no * g.size()}")
    code, factor = _op(op, premul_factor)
    if cuda is not None:
        return _run(g, g._issue().reduce_scatter_tensor_cuda(po, pi, no, do, code, factor, stream), [output],
                    async_op)
    return _run(g, g._issue().reduce_scatter_tensor(po, pi, no, do, code, factor), [output], async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """input_tensor_list[j] goes to rank j, which receives it in output_tensor_list[this rank]."""
    g = _group(group)
    if g is None:
        return None
    outs, out_counts, od = _tensors.views(output_tensor_list, True, "output_tensor_list")
    ins, in_counts, idt = _tensors.views(input_tensor_list, False, "input_tensor_list")
    if od is not None and idt is not None and od != idt:
        raise TypeError("all_to_all: the output and input tensors must share a dtype")
    dtype = od if od is not None else (idt if idt is not None else 1)
    return _run(g, g._issue().all_to_all(outs, out_counts, ins, in_counts, dtype), list(output_tensor_list),
                async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """input is cut along dim 0 by input_split_sizes (rows; None = equal parts) and part j
    goes to rank j; output is filled the same way by output_split_sizes."""
    g = _group(group)
    if g is None:
        return None
    out_splits = [int(s) * _tensors.rows(output) for s in output_split_sizes or []]
    in_splits = [int(s) * _tensors.rows(input) for s in input_split_sizes or []]
    cuda = _tensors.cuda_out_in("all_to_all_single", output, "output", input, "input")
    if cuda is not None:
        po, no, pi, ni, do, stream = cuda
        return _run(g, g._issue().all_to_all_single_cuda(po, no, pi, ni, out_splits, in_splits, do, stream),
                    [output], async_op)
    po, no, pi, ni, do = _out_in("all_to_all_single", output, "output", input, "input")
    return _run(g, g._issue().all_to_all_single(po, no, pi, ni, out_splits, in_splits, do), [output], async_op)


def barrier(group=None, async_op=False, device_ids=None):
    """Blocks until every rank of the group has called barrier."""
    del device_ids
    g = _group(group)
    if g is None:
        return None
    return _run(g, g._issue().barrier(), None, async_op)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """A barrier that, if ranks are missing after `timeout` (default: the group's op
    timeout), raises DistTimeoutError naming the first missing rank (all with wait_all_ranks)."""
    g = _group(group)
    if g is None:
        return None
    t = _seconds(timeout, _state["timeout"])
    return _run(g, g._issue().monitored_barrier(t, bool(wait_all_ranks)), None, False)


def isend(tensor, dst, group=None, tag=0):
    """Starts sending `tensor` to rank `dst`; returns a Work. Do not modify the tensor before wait().
    A CUDA tensor is sent after the work queued on its device's current stream, and wait()
    makes that stream wait for the copy (docs/gpu.md)."""
    g = _group(group)
    if g is None:
        return None
    peer = _local(g, dst, "dst")
    cuda = _tensors.cuda_view(tensor)
    if cuda is not None:
        p, n, d, stream = cuda
        return _run(g, g._live().send_cuda(p, n, d, peer, int(tag), stream), [tensor], True)
    p, n, d = _tensors.view(tensor, writable=False)
    return _run(g, g._live().send(p, n, d, peer, int(tag)), [tensor], True)


def irecv(tensor, src=None, group=None, tag=0):
    """Starts receiving into `tensor` from rank `src` (None: any source); returns a Work
    whose source_rank() names the sender. A CUDA tensor is written on the GPU after the work
    queued on its device's current stream; wait() makes that stream wait for it."""
    g = _group(group)
    if g is None:
        return None
    peer = -1 if src is None else _local(g, src, "src")
    cuda = _tensors.cuda_view(tensor)
    if cuda is not None:
        p, n, d, stream = cuda
        return _run(g, g._live().recv_cuda(p, n, d, peer, int(tag), stream), [tensor], True)
    p, n, d = _tensors.view(tensor)
    return _run(g, g._live().recv(p, n, d, peer, int(tag)), [tensor], True)


def send(tensor, dst, group=None, tag=0):
    """Sends `tensor` to rank `dst` and waits until it is delivered (or the op timeout)."""
    w = isend(tensor, dst, group, tag)
    if w is not None:
        w.wait()


def recv(tensor, src=None, group=None, tag=0):
    """Receives into `tensor` from `src` (None: any source); returns the sender's rank."""
    w = irecv(tensor, src, group, tag)
    if w is None:
        return -1
    w.wait()
    return w.source_rank()


class P2POp:
    """One operation of batch_isend_irecv: P2POp(isend or irecv, tensor, peer, group, tag)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0):
        if op not in (isend, irecv):
            raise ValueError("P2POp's op must be collserve.isend or collserve.irecv")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list):
    """Issues every P2POp in order; returns their Works. A batch of CUDA tensors goes to the
    SDK as one batch (with COLLSERVE_CUDA_PATH=nccl: one NCCL group, so that a ring of sends
    and receives cannot deadlock); its ops must then share one group."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv takes a non-empty list of P2POp")
    views = [_tensors.cuda_view(p.tensor) for p in p2p_op_list]
    if all(v is None for v in views):
        return [p.op(p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]
    if any(v is None for v in views):
        raise TypeError("batch_isend_irecv: the tensors must all be CUDA tensors, or all CPU")
    groups = {id(p.group) for p in p2p_op_list}
    if len(groups) > 1:
        raise ValueError("batch_isend_irecv: the ops of a batch of CUDA tensors must share one group")
    g = _group(p2p_op_list[0].group)
    if g is None:
        return []
    ops = []
    for p, (ptr, n, d, stream) in zip(p2p_op_list, views):
        send = p.op is isend
        if p.peer is None and send:
            raise ValueError("batch_isend_irecv: an isend needs a peer")
        peer = -1 if p.peer is None else _local(g, p.peer, "peer")
        ops.append((send, ptr, n, d, peer, int(p.tag), True, stream))
    works = g._live().batch_isend_irecv(ops)
    return [_run(g, w, [p.tensor], True) for p, w in zip(p2p_op_list, works)]


def _object_bytes(obj):
    np = _numpy()
    return np.frombuffer(_pickle.dumps(obj), dtype=np.uint8).copy()


def _numpy():
    import numpy
    return numpy


def all_gather_object(object_list, obj, group=None):
    """object_list[r] receives rank r's picklable `obj` (torch.distributed.all_gather_object).
    Unpickling runs code from the other ranks: use it only among trusted ranks."""
    g = _group(group)
    if g is None:
        return
    np = _numpy()
    data = _object_bytes(obj)
    sizes = [np.zeros(1, dtype=np.int64) for _ in range(g.size())]
    all_gather(sizes, np.array([data.size], dtype=np.int64), group=g)
    outs = [np.zeros(int(s[0]), dtype=np.uint8) for s in sizes]
    all_gather(outs, data, group=g)
    object_list[:] = [_pickle.loads(o.tobytes()) for o in outs]


def broadcast_object_list(object_list, src=0, group=None):
    """Every rank's object_list receives rank `src`'s objects (the same length on every rank)."""
    g = _group(group)
    if g is None:
        return
    np = _numpy()
    is_src = g.rank() == _local(g, src, "src")
    data = _object_bytes(list(object_list)) if is_src else np.zeros(0, dtype=np.uint8)
    size = np.array([data.size], dtype=np.int64)
    broadcast(size, src, group=g)
    if not is_src:
        data = np.zeros(int(size[0]), dtype=np.uint8)
    broadcast(data, src, group=g)
    if not is_src:
        got = _pickle.loads(data.tobytes())
        if len(got) != len(object_list):
            raise ValueError(f"broadcast_object_list: rank {src} sent {len(got)} objects, this rank's list has "
                             f"{len(object_list)}")
        object_list[:] = got


class Reconfigured(tuple):
    """What reconfigure() returns: the tuple (rank, world_size) in the new group, with
    `last_common_seq`: the last collective seq of the old group that every member of the
    new one that was in it completed (-1: none, or this rank was admitted as a joiner)."""

    def __new__(cls, rank, world_size, last_common_seq=-1):
        self = super().__new__(cls, (rank, world_size))
        self.last_common_seq = last_common_seq
        return self

    @property
    def rank(self):
        return self[0]

    @property
    def world_size(self):
        return self[1]

    def __repr__(self):
        return f"Reconfigured(rank={self[0]}, world_size={self[1]}, last_common_seq={self.last_common_seq})"


def last_completed_seq(group=None):
    """The seq of the last collective of `group` (default: the default group) that this
    rank completed, with every earlier one, without error: collectives (not send/recv) are
    numbered 0, 1, ... in the order this rank issued them, as `collservectl diagnose` shows
    them; -1 before the first. A collective counts once its result is back (wait() returned,
    or the call did when not async_op). After a failure it stays at the last good one."""
    g = _group(group)
    if g is None:
        raise RuntimeError("last_completed_seq: this process is not a member of the group")
    return g._live().last_completed_seq


def reconfigure(join_window=5.0, min_world_size=1, timeout=None):
    """Re-forms the default group in place after it lost members (a rank died or left, its
    host or link failed), or to admit ranks waiting to join (should_reconfigure), without
    restarting this process: a quorum in the spirit of torchft's Manager. Every member
    calls it, typically in an `except DistError` around a training step, and then continues
    from the state the members hold (see examples/digits_sgd_elastic.py: rank 0 of the new
    group broadcasts it).

    The members agree through the coordinator's store: each appends its current rank to the
    next generation's member list, where ranks started to join a running job (a restarted
    rank: COLLSERVE_ELASTIC_JOIN=1, see init_process_group) also wait. The list is closed
    (compare_set, so every rank reads the same one) as soon as every member of the current
    group is on it or has left the group at the coordinator (its process exited or died, or
    its host was lost: a re-formation after a crash does not wait for the dead), else once
    `join_window` seconds passed since this rank's call (a rank that is alive but does not
    come, e.g. hung). The
    closed list is the new group: the current members in the order of their ranks, then
    the joiners in the order they came. It forms as the next generation of the same group
    name at the coordinator (which ends the old generation there for every member),
    through the sidecar, like init_process_group. Subgroups of the old group are
    destroyed; so is the old group (its session ends, so nothing of it stays half-used on
    the sidecar).

    A rank that calls after the list was closed (it was taken for lost, e.g. its host was
    cut off while the others re-formed) waits to join the following generation, as a
    restarted rank does: the members admit it when they call reconfigure again
    (should_reconfigure tells them).

    A partition can complete a collective on some members and fail it on others (one host
    finished its data step before another's link broke). Each member records its
    last_completed_seq() next to the list before it joins it, and every member of the new
    group gets the smallest among the old members on the list: the result's
    `last_common_seq`. Collectives 0..last_common_seq completed on every survivor, so the
    survivors redo the work after it (e.g. the step that includes collective
    last_common_seq + 1) and never continue out of step (docs/guide.md).

    Returns a Reconfigured: the tuple (rank, world_size) in the new group
    (get_rank()/get_world_size() say the same from now on) with `.last_common_seq` (-1 when
    no collective completed everywhere, or when this rank was admitted as a joiner). Raises
    DistError if fewer than `min_world_size` ranks joined;
    DistTimeoutError if the new group does not form, or this rank is not admitted, within
    `timeout` (default: the init timeout); RuntimeError before init_process_group. Not
    thread-safe with other calls on the default group.
    """
    init = _state["init"]
    generation = _state["generation"] + 1
    registry = _state["registry_generation"] + 1
    timeout_s = _seconds(timeout, init["init_timeout"])
    me = str(_default().rank())
    members, common = _quorum(generation, join_window, min_world_size, timeout_s)
    if me not in members:
        # Too late for this generation (e.g. cut off the network while it formed): join the
        # next one as a newcomer, admitted when the members call reconfigure again.
        destroy_process_group()
        return Reconfigured(*_form(*_join_running(timeout_s), timeout_s))
    return Reconfigured(*_form(members.index(me), len(members), generation, registry, timeout_s), common)


def should_reconfigure():
    """Whether ranks wait to join the default group (restarted ranks, see
    init_process_group): rank 0 looks at the coordinator's store and broadcasts the answer,
    so every rank gets the same one. A collective: every rank of the group calls it at the
    same point (e.g. at each epoch's start), and all call reconfigure() when it is True."""
    g = _default()
    waiting = 0
    if g.rank() == 0:
        waiting = int(_elastic.joiners_waiting(_elastic_store(g), _elastic_prefix(), _state["generation"] + 1))
    flag = _numpy().array([waiting], dtype=_numpy().int64)
    broadcast(flag, 0)
    return bool(flag[0])


def _elastic_prefix():
    """Where reconfigure's lists live: per launch (COLLSERVE_RUN_ID, set by collserve
    launch) and default group."""
    return _elastic.prefix(_state["init"]["group_name"])


def _elastic_store(group):
    client = group._live().store()
    if client is None:
        raise RuntimeError("reconfigure needs the coordinator's store: init_process_group had no coordinator")
    return Store._wrap(client)


def _form(rank, size, generation, registry, timeout_s):
    """Ends the current default group (its session closes), then forms generation
    `generation` of reconfigure's count, the coordinator's generation `registry` of the
    group's name (0 = whichever forms next), with this process as `rank` of `size`."""
    init = _state["init"]
    if _state["default"] is not None:
        destroy_process_group()
    code, message, pg = _collserve.init(rank, size, init["local_rank"], init["sidecar"], init["coordinator"],
                                        init["job"], init["group_name"], timeout_s, init["op_timeout"],
                                        generation=registry)
    raise_for(code, message)
    _state.update(default=ProcessGroup(pg, range(size)), groups=[], generation=generation,
                  registry_generation=pg.generation)
    return rank, size


def _quorum(generation, join_window, min_world_size, timeout_s):
    """reconfigure's agreement (_elastic.quorum): (the members of the next generation, the
    smallest last_completed_seq its old members recorded, -1 none). Its references to the
    old group's store end with it, so that the old group can be destroyed afterwards."""
    old = _default()
    store = _elastic_store(old)
    store.set_timeout(timeout_s)
    init = _state["init"]
    gone = _elastic.left_ranks(init["coordinator"], init["job"], init["group_name"], _state["registry_generation"],
                               old.size())
    return _elastic.quorum(store, _elastic_prefix(), generation, str(old.rank()), old.size(),
                           old._live().last_completed_seq, _state["registry_generation"], join_window,
                           min_world_size, timeout_s, init["group_name"], gone)


def _elastic_init(min_world, max_world, join_window, timeout_s):
    """init_process_group's elastic formation (COLLSERVE_MIN_WORLD_SIZE): (rank, size,
    generation, coordinator generation; 0 = the next) of the group this rank forms or, if
    it came after that closed, is admitted to."""
    init = _state["init"]
    store = Store(address=init["coordinator"], job=init["job"] or None, timeout=timeout_s)
    prefix = _elastic_prefix() + "1/"
    if store.check([prefix + "closed"]):
        return _join_running(timeout_s)  # the job runs: wait to be admitted
    me = f"j{_os.environ.get('RANK', '0')}.{_os.getpid()}.{_time.time_ns() % 1000000}"
    store.append(prefix + "members", f"{me},")
    store.compare_set(prefix + "start", "", repr(_time.time()))  # the window opens with the first rank
    start = float(store.get(prefix + "start"))
    deadline = _time.monotonic() + timeout_s
    while not store.check([prefix + "closed"]):
        members = [m for m in store.get(prefix + "members").decode().split(",") if m]
        if len(members) >= max_world or (_time.time() - start >= join_window and len(members) >= min_world):
            members = sorted(members[:max_world], key=lambda m: int(m[1:].split(".")[0] or 0))
            store.compare_set(prefix + "closed", "", ",".join(members))
            break
        if _time.monotonic() > deadline:
            raise_for(4, f"init_process_group: only {len(members)} of at least {min_world} ranks came within "
                         f"{timeout_s} s")
        _time.sleep(0.05)
    members = [m for m in store.get(prefix + "closed").decode().split(",") if m]
    store.set(_elastic_prefix() + "current", "1")
    if me not in members:
        return _join_running(timeout_s)
    return members.index(me), len(members), 1, 0


def _join_running(timeout_s):
    """init_process_group of a rank started to join a running job (COLLSERVE_ELASTIC_JOIN=1):
    waits on the next generation's member list until the members admit it (reconfigure),
    moving on to the following generation if it came too late; returns (rank, size,
    generation, coordinator generation) of the group it was admitted to."""
    init = _state["init"]
    store = Store(address=init["coordinator"], job=init["job"] or None, timeout=timeout_s)
    return _elastic.join_running(store, _elastic_prefix(), timeout_s, init["group_name"])


def _get_default_store():
    """The coordinator's store of the default group's job (a Store)."""
    client = _default()._live().store()
    if client is None:
        raise RuntimeError("no store: the default group was initialized without a coordinator address")
    return Store._wrap(client)

