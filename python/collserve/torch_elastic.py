"""In-place recovery and the process group lifecycle for torch programs on the "collserve"
backend; collserve.torch exports every public name here.

Recovery (the Python SDK's reconfigure(), for torch.distributed's own process groups): when
a rank dies, the survivors' next collective fails (RuntimeError "collserve <op>: UNAVAILABLE:
... rank R ... left"); each survivor calls reconfigure(), which agrees on the survivors (and
any restarted rank waiting to join) through the coordinator's store, ends the old groups'
sessions, and initializes torch's default process group again with the new rank and world
size: no process restarts, no state is lost. The training loop then rebuilds what holds the
old group (DistributedDataParallel), takes the state from the new rank 0, and redoes the step
that failed (docs/torch.md, "Recovering in place", and examples/ddp_elastic.py):

    import collserve.torch as cst
    if cst.joining():                       # a rank started again into the running job
        cst.join_running_group()
    else:
        dist.init_process_group("collserve")
    ...
    except RuntimeError as e:               # a collective failed: a rank or host is gone
        cst.reconfigure()                   # the survivors re-form; get_rank()/get_world_size() change
        model = rebuild(model)              # DDP over the new group, state from rank 0

It needs services that outlive any rank: a coordinator named by COLLSERVE_COORDINATOR and
this host's sidecar by COLLSERVE_SIDECAR (collserve launch sets both; so does a pod next to
the chart's sidecar), not the embedded default that rank 0 starts in its own process.

Lifecycle: abort(), shutdown(), get_error(), set_timeout(), split_group() and shrink_group()
do for a collserve group what torch's _abort_process_group, destroy_process_group,
Backend.getError, _set_pg_timeout, split_group and shrink_group do for NCCL (torch 2.6 runs
those only for NCCL or Gloo; on torch 2.x the import of collserve.torch makes
_abort_process_group, destroy_process_group's backend shutdown and _set_pg_timeout handle
collserve groups too).

Thread safety: like torch.distributed's own init and destroy, none of these may run
concurrently with other calls on the groups they change.
"""
import collections
import datetime
import os

import torch
import torch.distributed as dist

from . import _collserve_torch, _elastic
from .distributed_c10d import Reconfigured
from .store import Store

# This launch's re-formations of the default group: `generation` counts them (0: the group
# init_process_group formed), as collserve.reconfigure counts its own.
_state = {"generation": 0, "default_name": None, "timeout": None, "next_registry_generation": 0}


def _note_created(group_name, timeout, default):
    """collserve.torch's creator tells this module about the groups it makes; returns the
    coordinator generation to form (what reconfigure or join_running_group asked for the
    default group, else 0: whichever forms next)."""
    if not default:
        return 0
    _state["default_name"] = group_name
    _state["timeout"] = timeout
    generation, _state["next_registry_generation"] = _state["next_registry_generation"], 0
    return generation


def joining():
    """True in a rank started to join a running job (COLLSERVE_ELASTIC_JOIN=1: `collserve
    launch --survive_failures --max_restarts N` sets it for a rank it started again): such a
    rank calls join_running_group() instead of init_process_group."""
    return os.environ.get("COLLSERVE_ELASTIC_JOIN") == "1"


def _services():
    coordinator, sidecar = os.environ.get("COLLSERVE_COORDINATOR", ""), os.environ.get("COLLSERVE_SIDECAR", "")
    if not coordinator or not sidecar:
        raise RuntimeError("collserve recovery needs a coordinator and sidecar that outlive the ranks: set "
                           "COLLSERVE_COORDINATOR and COLLSERVE_SIDECAR (collserve launch does); the embedded default "
                           "lives in rank 0's process")
    return coordinator


def _seconds(timeout, default):
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _init_timeout_s(timeout):
    own = _state["timeout"]
    fallback = own.total_seconds() if isinstance(own, datetime.timedelta) else float(os.environ.get(
        "COLLSERVE_INIT_TIMEOUT_S", "300"))
    return _seconds(timeout, fallback)


class _TorchStore(dist.Store):
    """torch.distributed.Store over the coordinator's store (collserve.store.Store), keys
    under `prefix`: the store torch's init_process_group gets when reconfigure forms the
    default group again (torch 1.13 runs its store-based barrier on it)."""

    def __init__(self, store, prefix):
        super().__init__()
        self._store, self._prefix = store, prefix

    def set(self, key, value):
        self._store.set(self._prefix + key, value)

    def get(self, key):
        return self._store.get(self._prefix + key)

    def add(self, key, amount):
        return self._store.add(self._prefix + key, amount)

    def compare_set(self, key, expected_value, desired_value):
        return self._store.compare_set(self._prefix + key, expected_value, desired_value)

    def check(self, keys):
        return self._store.check([self._prefix + k for k in keys])

    def wait(self, keys, timeout=None):
        self._store.wait([self._prefix + k for k in keys], timeout)

    def delete_key(self, key):
        return self._store.delete_key(self._prefix + key)

    def num_keys(self):
        return self._store.num_keys()


def _coordinator_store(timeout_s):
    return Store(address=_services(), job=os.environ.get("COLLSERVE_JOB") or None, timeout=timeout_s)


def _default_name():
    """The collserve group name of torch's default process group ("torch/<torch's name>")."""
    if _state["default_name"] is None:
        raise RuntimeError("collserve: no default process group of the collserve backend was created in this "
                           "process")
    return _state["default_name"]


def _all_groups():
    """Every torch process group of this process (the default one first)."""
    c10d = dist.distributed_c10d
    pg_map = c10d._world.pg_map if hasattr(c10d, "_world") else c10d._pg_map
    default = c10d._get_default_group() if dist.is_initialized() else None
    return ([default] if default is not None else []) + [g for g in pg_map if g is not default]


def _is_collserve(group):
    try:
        _collserve_torch.group_info(group)
        return True
    except (ValueError, RuntimeError):
        return False


def _group(group):
    return dist.distributed_c10d._get_default_group() if group is None or group is dist.GroupMember.WORLD else group


def _end_every_group():
    """Ends every collserve session of this process and torch's bookkeeping of its groups."""
    _collserve_torch.shutdown_all("this process group was replaced by collserve.torch.reconfigure (use the new "
                                  "default group: build DDP and subgroups again)")
    if dist.is_initialized():
        dist.destroy_process_group()


def _form(rank, size, generation, registry, timeout_s):
    """Initializes torch's default process group as generation `generation` of this
    launch's re-formations (the coordinator's generation `registry` of its name) with this
    process as `rank` of `size`."""
    name = _default_name()
    store = _TorchStore(_coordinator_store(timeout_s), _elastic.prefix(name) + f"{generation}/torch/")
    _state["next_registry_generation"] = registry
    dist.init_process_group("collserve", store=store, rank=rank, world_size=size,
                            timeout=_state["timeout"] or datetime.timedelta(seconds=timeout_s))
    _state["generation"] = generation


def reconfigure(join_window=5.0, min_world_size=1, timeout=None, exclude=()):
    """Re-forms torch's default process group in place after it lost ranks (a collective
    failed because a rank died, left, hung, or its host or link failed), or to admit ranks
    waiting to join (should_reconfigure), without restarting this process: collserve's
    reconfigure() (docs/guide.md) for torch.distributed. Every surviving rank calls it.

    The survivors agree through the coordinator's store on the ranks of the next generation:
    the list closes as soon as every rank of the current group is on it or has left it at
    the coordinator (its process exited or died, its host was lost), else `join_window`
    seconds after this call (a rank that is alive but does not come: hung or cut off) with at
    least `min_world_size` ranks on it; ranks in `exclude` (ranks of the current group) are
    neither waited for nor admitted. Then every collserve group of this process ends (the
    default group, its subgroups; operations still in flight fail), torch's process groups
    are destroyed (dist.destroy_process_group()), and torch's default group is initialized
    again: the survivors keep their order (old rank order), restarted ranks come after.
    get_rank() and get_world_size() say the new values from then on. Subgroups (new_group)
    and everything that holds a group (DistributedDataParallel, DeviceMesh) must be made
    again. A rank that calls after the list closed (it was taken for lost) is admitted at
    the next re-formation, as a restarted rank is.

    Returns Reconfigured (rank, world_size) with `.last_common_seq`: the last collective of
    the old group that every survivor completed (-1: none, or this rank came as a joiner);
    ranks that completed more than that redo the step from there.

    Raises RuntimeError without COLLSERVE_COORDINATOR/COLLSERVE_SIDECAR or before
    init_process_group; collserve.DistError when fewer than min_world_size ranks remain;
    collserve.DistTimeoutError when the group does not re-form within `timeout` (default:
    the init timeout of the default group)."""
    group = dist.distributed_c10d._get_default_group()
    rank, size, registry, completed = _collserve_torch.group_info(group)
    timeout_s = _init_timeout_s(timeout)
    coordinator, name = _services(), _default_name()
    store = _coordinator_store(timeout_s)
    prefix = _elastic.prefix(name)
    generation = _state["generation"] + 1
    excluded = {int(r) for r in exclude}
    left = _elastic.left_ranks(coordinator, os.environ.get("COLLSERVE_JOB", ""), name, registry, size)
    members, common = _elastic.quorum(store, prefix, generation, str(rank), size, completed, registry, join_window,
                                      min_world_size, timeout_s, name, left, exclude=excluded)
    _end_every_group()
    me = str(rank)
    if me in members:
        _form(members.index(me), len(members), generation, registry + 1, timeout_s)
        return Reconfigured(members.index(me), len(members), common)
    # Too late for this generation (or excluded): join a later one as a newcomer.
    new_rank, new_size, generation, registry = _elastic.join_running(store, prefix, timeout_s, name)
    _form(new_rank, new_size, generation, registry, timeout_s)
    return Reconfigured(new_rank, new_size)


def should_reconfigure():
    """Whether ranks wait to join the default group (restarted ranks: join_running_group):
    rank 0 looks in the coordinator's store and broadcasts the answer, so every rank gets the
    same one. A collective: every rank calls it at the same point of its loop (e.g. every N
    steps), and all call reconfigure() when it is True."""
    flag = torch.zeros(1, dtype=torch.int64)
    if dist.get_rank() == 0:
        flag[0] = int(_elastic.joiners_waiting(_coordinator_store(_init_timeout_s(None)),
                                               _elastic.prefix(_default_name()), _state["generation"] + 1))
    dist.broadcast(flag, 0)
    return bool(flag[0])


def join_running_group(timeout=None, default_group_name=None):
    """For a rank started to join a running job (joining() is True) instead of
    init_process_group: waits until the running ranks admit it (they call reconfigure()
    when should_reconfigure() says so), then initializes torch's default process group with
    the rank and world size it was given. `default_group_name` is the collserve name of the
    running job's default group (default: the one torch gives it, "torch/0").
    Returns Reconfigured (rank, world_size). Raises collserve.DistTimeoutError when not
    admitted within `timeout` (default COLLSERVE_INIT_TIMEOUT_S, else 300 s)."""
    if dist.is_initialized():
        raise RuntimeError("join_running_group: the default process group is initialized already")
    _state["default_name"] = default_group_name or _state["default_name"] or _torch_default_name()
    timeout_s = _init_timeout_s(timeout)
    store = _coordinator_store(timeout_s)
    rank, size, generation, registry = _elastic.join_running(store, _elastic.prefix(_state["default_name"]),
                                                             timeout_s, _state["default_name"])
    _form(rank, size, generation, registry, timeout_s)
    return Reconfigured(rank, size)


def _torch_default_name():
    """The collserve name torch's default process group gets: torch names it "0" (the first
    group of the process; 1.13 and 2.x alike) unless init_process_group was given a group_name."""
    return "torch/0"


def last_completed_seq(group=None):
    """The seq of the last collective of `group` (default: the default group) this rank
    completed, with every earlier one, without error (collserve.last_completed_seq); -1
    before the first."""
    return _collserve_torch.group_info(_group(group))[3]


GroupError = collections.namedtuple("GroupError", "kind code message")
GroupError.__doc__ = """get_error()'s answer: `kind` as torch's c10d ErrorType names it
("TIMEOUT" for DEADLINE_EXCEEDED, "REMOTE_ERROR" when a rank, host or the sidecar went away:
UNAVAILABLE or ABORTED, "COMM_ERROR" for anything else), `code` the status code's name,
`message` the first failed operation's error."""


def get_error(group=None):
    """None while every operation of `group` (default: the default group) succeeded, else a
    GroupError naming the first failure: the group stays failed until it is re-formed
    (reconfigure) or destroyed, as a NCCL communicator does."""
    error = _collserve_torch.get_error(_group(group))
    if error is None:
        return None
    code, message = error
    kind = "TIMEOUT" if code == "DEADLINE_EXCEEDED" else "REMOTE_ERROR" if code in ("UNAVAILABLE", "ABORTED") \
        else "COMM_ERROR"
    return GroupError(kind, code, message)


def set_timeout(timeout, group=None):
    """The deadline (timedelta or seconds) of `group`'s operations issued from now on, and
    monitored_barrier's default (torch's _set_pg_timeout). With group None or WORLD, of
    every collserve group of this process. Raises ValueError for a timeout <= 0."""
    seconds = _seconds(timeout, None)
    if seconds is None or seconds <= 0:
        raise ValueError(f"set_timeout: {timeout!r} (must be > 0)")
    groups = _all_groups() if group is None or group is dist.GroupMember.WORLD else [group]
    for g in groups:
        if _is_collserve(g):
            _collserve_torch.set_timeout(g, seconds)


def abort(group=None):
    """Ends `group`'s session now (default, or WORLD: every collserve group of this
    process): its operations in flight fail, later calls on it raise RuntimeError naming the
    abort. The torch ProcessGroup objects stay (destroy_process_group removes them); a
    program re-forms with reconfigure() or destroy_process_group + init_process_group."""
    groups = _all_groups() if group is None or group is dist.GroupMember.WORLD else [group]
    for g in groups:
        if _is_collserve(g):
            _collserve_torch.abort(g)


def shutdown(group=None, timeout=None):
    """Waits up to `timeout` (default: the init timeout) for `group`'s operations in flight
    (default, or WORLD: every collserve group of this process), then ends its session as
    abort() does. Returns True when nothing was still in flight."""
    timeout_s = _init_timeout_s(timeout)
    groups = _all_groups() if group is None or group is dist.GroupMember.WORLD else [group]
    drained = True
    for g in groups:
        if _is_collserve(g):
            drained = _collserve_torch.shutdown(g, timeout_s) and drained
    return drained


def split_group(parent_pg=None, split_ranks=None, timeout=None, group_desc=None):
    """torch's split_group for collserve groups: every rank of the default group calls it
    with the same `split_ranks` (lists of ranks of `parent_pg`, disjoint); returns the new
    group holding this rank, or None when no split holds it. Each split is a new_group of
    its ranks' global ranks (made in the order given, by every rank of the default group, as
    torch's new_group requires, whether `parent_pg` is the default group or a subgroup). The
    sidecar forms each one as a group of its own (there is no communicator to split:
    forming one costs a rendezvous at the coordinator). Raises ValueError for overlapping,
    empty or out-of-range splits."""
    del group_desc
    if split_ranks is None:
        raise ValueError("split_ranks cannot be None")
    parent = _group(parent_pg)
    parent_ranks = dist.get_process_group_ranks(parent) if parent is not _group(None) \
        else list(range(dist.get_world_size()))
    seen = set()
    for split in split_ranks:
        if not split:
            raise ValueError("split_group: a split cannot be empty")
        for r in split:
            if not 0 <= r < len(parent_ranks):
                raise ValueError(f"split_group: rank {r} is not a rank of the parent group of {len(parent_ranks)}")
            if r in seen:
                raise ValueError(f"split_group: rank {r} is in two splits")
            seen.add(r)
    mine = None
    for split in split_ranks:
        kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=_seconds(timeout, None))}
        group = dist.new_group([parent_ranks[r] for r in sorted(split)], **kwargs)
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            mine = group
    return mine


def shrink_group(ranks_to_exclude, group=None, timeout=None):
    """torch's shrink_group for the default collserve group: re-forms it without
    `ranks_to_exclude` (ranks of the current group, e.g. the ones a failure named), with
    reconfigure(exclude=...): the other ranks all call it and are renumbered in order.
    Returns the new default group. Raises ValueError for another group than the default."""
    if _group(group) is not _group(None):
        raise ValueError("shrink_group: collserve shrinks the default group (re-form subgroups with new_group)")
    reconfigure(join_window=_init_timeout_s(timeout), timeout=timeout, exclude=ranks_to_exclude)
    return dist.distributed_c10d._get_default_group()


def _monitored_barrier(torch_monitored_barrier):
    """torch.distributed.monitored_barrier, which torch runs for Gloo groups only (ValueError
    or RuntimeError "only implemented for GLOO backend" otherwise), for collserve groups too:
    blocks until every rank of `group` arrives, or raises RuntimeError naming the first rank
    (every rank with wait_all_ranks) that did not arrive within `timeout` (default: the
    group's op timeout). The group is failed afterwards: reconfigure() re-forms it without
    the missing ranks."""
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        if group is dist.GroupMember.NON_GROUP_MEMBER or not _is_collserve(_group(group)):
            return torch_monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
        pg = _group(group)
        if timeout is None:
            return pg.monitored_barrier(wait_all_ranks=wait_all_ranks)
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
    monitored_barrier.__doc__ = _monitored_barrier.__doc__
    return monitored_barrier


def _patch_torch():
    """Makes torch's calls that name their backends work for collserve groups: monitored_barrier
    (Gloo only in torch), and on torch 2.x _abort_process_group, destroy_process_group's
    backend shutdown and _set_pg_timeout (NCCL, and Gloo, only). Every other backend is left
    to torch."""
    c10d = dist.distributed_c10d
    if getattr(c10d, "_collserve_patched", False):
        return
    c10d._collserve_patched = True
    barrier = _monitored_barrier(c10d.monitored_barrier)
    c10d.monitored_barrier = barrier
    dist.monitored_barrier = barrier
    if int(torch.__version__.split(".")[0]) < 2:
        return
    shutdown_backend, abort_process_group, set_pg_timeout = (
        getattr(c10d, "_shutdown_backend", None), getattr(c10d, "_abort_process_group", None),
        getattr(c10d, "_set_pg_timeout", None))
    if shutdown_backend is not None:
        def _shutdown_backend(pg):
            if _is_collserve(pg):
                # destroy_process_group: end the session now, as torch shuts NCCL down here
                _collserve_torch.abort(pg, "this process group was destroyed (destroy_process_group)")
                return None
            return shutdown_backend(pg)
        c10d._shutdown_backend = _shutdown_backend
    if abort_process_group is not None:
        def _abort_process_group(group=None):
            pg = _group(group)
            if _is_collserve(pg):
                abort(group)
                return dist.destroy_process_group(group)
            return abort_process_group(group)
        c10d._abort_process_group = _abort_process_group
    if set_pg_timeout is not None:
        def _set_pg_timeout(timeout, group=None):
            if _is_collserve(_group(group)):
                return set_timeout(timeout, group)
            return set_pg_timeout(timeout, group)
        c10d._set_pg_timeout = _set_pg_timeout
