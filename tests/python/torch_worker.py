"""One rank of an unmodified torch.distributed program, for tests/python/test_torch_backend.py.

    torch_worker.py SCENARIO BACKEND INIT [OUT]

SCENARIO: collectives | errors | ddp | fsdp | checkpoint | hosts | idle | arena | monitored_zero | live_at_exit | reinit |
reinit_loop.
BACKEND: collserve or gloo. INIT: env
(env://), tcp (tcp://MASTER_ADDR:MASTER_PORT), file:<path> (file://), store:<path> (an
explicit FileStore). RANK and WORLD_SIZE come from the environment. Checks raise
AssertionError; success prints "rank R: SCENARIO ok".
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import collserve.torch  # noqa: F401  registers the "collserve" backend

TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def init(backend, how):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(os.environ.get("WORKER_TIMEOUT_S", "60")))
    if how == "env":
        dist.init_process_group(backend, timeout=timeout)
    elif how == "tcp":
        url = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group(backend, init_method=url, rank=rank, world_size=world, timeout=timeout)
    elif how.startswith("file:"):
        dist.init_process_group(backend, init_method="file://" + how[5:], rank=rank, world_size=world,
                                timeout=timeout)
    elif how.startswith("store:"):
        store = dist.FileStore(how[6:], world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        raise SystemExit(f"unknown init {how!r}")
    return rank, world


def equal(a, b):
    assert torch.equal(a, b), f"{a} != {b}"


def collectives(rank, world):
    assert dist.get_backend() == "collserve" and dist.get_world_size() == world and world == 4
    # all_reduce: every ReduceOp, several dtypes, in place.
    t = torch.full((5,), float(rank + 1))
    ptr = t.data_ptr()
    dist.all_reduce(t)
    equal(t, torch.full((5,), 10.0))
    assert t.data_ptr() == ptr
    for op, dtype, expected in [(dist.ReduceOp.MAX, torch.int64, 4), (dist.ReduceOp.MIN, torch.int32, 1),
                                (dist.ReduceOp.PRODUCT, torch.float64, 24.0), (dist.ReduceOp.AVG, torch.float64, 2.5),
                                (dist.ReduceOp.BOR, torch.int64, 7), (dist.ReduceOp.BAND, torch.int32, 0),
                                (dist.ReduceOp.BXOR, torch.uint8, 4), (dist.ReduceOp.SUM, torch.float16, 10.0),
                                (dist.ReduceOp.SUM, torch.bfloat16, 10.0), (dist.ReduceOp.SUM, torch.int8, 10)]:
        x = torch.full((3,), rank + 1, dtype=dtype)
        dist.all_reduce(x, op=op)
        equal(x, torch.full((3,), expected, dtype=dtype))
    b = torch.tensor([rank % 2 == 1, False])
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    equal(b, torch.tensor([True, False]))
    x = torch.ones(2)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(float(rank)))
    equal(x, torch.full((2,), 6.0))
    # A 2-D view (contiguous) writes through to its base.
    base = torch.zeros(4, 3)
    view = base[1:3]
    view.fill_(rank)
    dist.all_reduce(view)
    equal(base[1:3], torch.full((2, 3), 6.0))
    equal(base[0], torch.zeros(3))
    # A transposed tensor (autograd gives those for Linear weights): one dense block, as Gloo.
    tr = torch.arange(6, dtype=torch.float32).reshape(3, 2).t()
    assert not tr.is_contiguous()
    dist.all_reduce(tr)
    equal(tr, torch.arange(6, dtype=torch.float32).reshape(3, 2).t() * world)
    # A stepped slice (staged and copied back; its neighbours untouched) and an expanded
    # tensor (autograd's gradient of a summed output's bias; its one element receives the sum).
    grid = torch.full((4, 4), -1.0)
    grid[:, ::2] = float(rank)
    dist.all_reduce(grid[:, ::2])
    equal(grid[:, ::2], torch.full((4, 2), 6.0))
    equal(grid[:, 1::2], torch.full((4, 2), -1.0))
    one = torch.full((1,), float(rank + 1))
    expanded = one.expand(5)
    dist.all_reduce(expanded)
    equal(one, torch.full((1,), 10.0))
    equal(expanded, torch.full((5,), 10.0))
    # broadcast / reduce
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.broadcast(t, src=2)
    equal(t, torch.arange(6, dtype=torch.float32) * 3)
    t = torch.full((2,), float(rank))
    dist.reduce(t, dst=1)
    if rank == 1:
        equal(t, torch.full((2,), 6.0))
    # all_gather (uneven sizes), all_gather_into_tensor, gather, scatter
    out = [torch.zeros(r + 1) for r in range(world)]
    dist.all_gather(out, torch.full((rank + 1,), float(rank)))
    for r in range(world):
        equal(out[r], torch.full((r + 1,), float(r)))
    flat = torch.zeros(world * 2, dtype=torch.int64)
    dist.all_gather_into_tensor(flat, torch.full((2,), rank, dtype=torch.int64))
    equal(flat, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    g = [torch.zeros(2) for _ in range(world)] if rank == 3 else None
    dist.gather(torch.full((2,), float(rank * 10)), gather_list=g, dst=3)
    if rank == 3:
        equal(torch.stack(g), torch.tensor([[0.0, 0.0], [10.0, 10.0], [20.0, 20.0], [30.0, 30.0]]))
    s = torch.zeros(3)
    dist.scatter(s, scatter_list=[torch.full((3,), float(r + 100)) for r in range(world)] if rank == 0 else None,
                 src=0)
    equal(s, torch.full((3,), float(rank + 100)))
    # reduce_scatter (list and tensor forms)
    o = torch.zeros(2)
    dist.reduce_scatter(o, [torch.full((2,), float(rank * world + j)) for j in range(world)])
    equal(o, torch.full((2,), float(sum(r * world + rank for r in range(world)))))
    o = torch.zeros(2)
    dist.reduce_scatter_tensor(o, torch.arange(world * 2, dtype=torch.float32))
    equal(o, torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32) * world)
    # all_to_all (list) and all_to_all_single with uneven row splits of 2-column rows
    outs = [torch.zeros(2) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), float(rank * 10 + j)) for j in range(world)])
    for j in range(world):
        equal(outs[j], torch.full((2,), float(j * 10 + rank)))
    in_splits = [j + 1 for j in range(world)]       # rank sends j+1 rows to rank j
    out_splits = [rank + 1] * world                   # and receives rank+1 rows from each
    inp = torch.cat([torch.full((j + 1, 2), float(rank * 10 + j)) for j in range(world)])
    out = torch.zeros(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    equal(out, torch.cat([torch.full((rank + 1, 2), float(j * 10 + rank)) for j in range(world)]))
    # point-to-point: a ring with send/recv, isend/irecv, any-source recv, batch_isend_irecv
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    r = torch.zeros(3)
    if rank % 2 == 0:
        dist.send(torch.full((3,), float(rank)), dst=nxt)
        dist.recv(r, src=prv)
    else:
        dist.recv(r, src=prv)
        dist.send(torch.full((3,), float(rank)), dst=nxt)
    equal(r, torch.full((3,), float(prv)))
    req = dist.isend(torch.full((2,), float(rank)), dst=nxt, tag=7)
    r = torch.zeros(2)
    dist.irecv(r, src=prv, tag=7).wait()
    req.wait()
    equal(r, torch.full((2,), float(prv)))
    if rank == 0:
        got = set()
        for _ in range(world - 1):
            r = torch.zeros(1)
            sender = dist.recv(r, tag=5)  # any source
            assert r.item() == sender * 100, (r, sender)
            got.add(sender)
        assert got == {1, 2, 3}, got
    else:
        dist.send(torch.full((1,), float(rank * 100)), dst=0, tag=5)
    r = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), nxt), dist.P2POp(dist.irecv, r, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    equal(r, torch.full((2,), float(prv)))
    # Work objects: wait, is_completed, get_future (value and then-callbacks)
    t = torch.full((4,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    assert work.wait() is True and work.is_completed()
    equal(fut.wait()[0], torch.full((4,), 6.0))
    assert fut.wait()[0].data_ptr() == t.data_ptr()
    equal(doubled.wait(), torch.full((4,), 12.0))
    # new_group with global ranks; non-members skip
    sub = dist.new_group([1, 3])
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=sub)
    if rank in (1, 3):
        assert dist.get_rank(sub) == (0 if rank == 1 else 1) and dist.get_world_size(sub) == 2
        equal(t, torch.full((2,), 4.0))
        t = torch.full((1,), float(rank))
        dist.broadcast(t, src=3, group=sub)
        equal(t, torch.full((1,), 3.0))
        if rank == 1:
            r = torch.zeros(1)
            assert dist.recv(r, group=sub) == 3 and r.item() == 33.0  # any source: the global rank
        else:
            dist.send(torch.full((1,), 33.0), dst=1, group=sub)
    else:
        equal(t, torch.full((2,), float(rank)))
    # coalesced all_reduce, objects, barriers
    a, c = torch.full((2, 2), float(rank)), torch.full((3,), 1.0)
    dist.all_reduce_coalesced([a, c])
    equal(a, torch.full((2, 2), 6.0))
    equal(c, torch.full((3,), 4.0))
    # sparse all_reduce (SUM, as Gloo): COO entries of every rank summed; rank 3 has none
    s = torch.sparse_coo_tensor([[rank, 4]], [1.0, float(rank)], (6,))
    dist.all_reduce(s)
    equal(s.to_dense(), torch.tensor([1.0, 1.0, 1.0, 1.0, 6.0, 0.0]))
    rows = torch.sparse_coo_tensor([[rank]] if rank < 3 else torch.zeros((1, 0), dtype=torch.long),
                                   [[1.0, 2.0]] if rank < 3 else torch.zeros((0, 2)), (4, 2))
    dist.all_reduce(rows)
    equal(rows.to_dense(), torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [0.0, 0.0]]))
    # all_gather_coalesced: every rank passes the same shapes, one dtype; outputs[r][i] is
    # rank r's inputs[i] (tests/python/test_conformance.py compares it with Gloo's)
    outs = [[torch.zeros(2, 2), torch.zeros(3)] for _ in range(world)]
    dist.all_gather_coalesced(outs, [torch.full((2, 2), float(rank)), torch.arange(3.0) + rank])
    for r in range(world):
        equal(outs[r][0], torch.full((2, 2), float(r)))
        equal(outs[r][1], torch.arange(3.0) + r)
    if TORCH2:
        torch2_calls(rank, world)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)], objs
    lst = [f"from {rank}", rank]
    dist.broadcast_object_list(lst, src=1)
    assert lst == ["from 1", 1], lst
    # torch 1.13's dist.monitored_barrier refuses every backend but gloo; the method is there.
    dist.distributed_c10d._get_default_group().monitored_barrier(datetime.timedelta(seconds=30))
    dist.barrier()


def torch2_calls(rank, world):
    """What torch 2.x adds: _coalescing_manager's fast path (all_reduce, all_gather_into_tensor,
    reduce_scatter_tensor each coalesced into one call), coalescing with a device (the
    backend's start/endCoalescing), barrier with device_ids."""
    group = dist.distributed_c10d._get_default_group()
    a, b = torch.full((2,), float(rank)), torch.full((3,), 1.0)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    equal(a, torch.full((2,), 6.0))
    equal(b, torch.full((3,), 4.0))
    outs = [torch.zeros(world * 2), torch.zeros(world * 3, 1)]
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(outs[0], torch.full((2,), float(rank)))
        dist.all_gather_into_tensor(outs[1], torch.arange(3.0).reshape(3, 1) + 10 * rank)
    equal(outs[0], torch.arange(world, dtype=torch.float32).repeat_interleave(2))
    equal(outs[1], torch.cat([torch.arange(3.0).reshape(3, 1) + 10 * r for r in range(world)]))
    rs = [torch.zeros(2), torch.zeros(1, 3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(rs[0], torch.arange(world * 2, dtype=torch.float32))
        dist.reduce_scatter_tensor(rs[1], torch.full((world, 3), float(rank + 1)))  # one ReduceOp per block
    cm.wait()
    equal(rs[0], torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32) * world)
    equal(rs[1], torch.full((1, 3), float(sum(range(1, world + 1)))))
    x, y = torch.full((2,), float(rank)), torch.zeros(world)
    group._start_coalescing(torch.device("cpu"))
    dist.all_reduce(x)
    dist.all_gather_into_tensor(y, torch.full((1,), float(rank)))
    work = group._end_coalescing(torch.device("cpu"))
    work.wait()
    equal(x, torch.full((2,), 6.0))
    equal(y, torch.arange(world, dtype=torch.float32))
    assert [t.numel() for t in work.get_future().wait()] == [2, world]
    dist.barrier(device_ids=[0])


def monitored_zero(rank, world):
    """monitored_barrier with a zero timeout times out at once (as Gloo's) unless every rank
    is there: rank 0 waits for the others, who come 2 s late."""
    import time
    group = dist.distributed_c10d._get_default_group()
    if rank != 0:
        time.sleep(2)  # the late arrival the scenario is about
    start = time.monotonic()
    try:
        group.monitored_barrier(datetime.timedelta(0))
        raise AssertionError("a zero-timeout monitored barrier passed with ranks missing")
    except RuntimeError as e:
        assert "DEADLINE_EXCEEDED" in str(e), e
    assert rank != 0 or time.monotonic() - start < 1.5, time.monotonic() - start


def errors(rank, world):
    # Bad input fails at the call, on this rank only.
    try:
        dist.all_reduce(torch.zeros(5).as_strided((3, 3), (1, 1)))
        raise AssertionError("a tensor overlapping itself was accepted")
    except RuntimeError as e:
        assert "share memory" in str(e), e
    try:
        dist.all_gather_into_tensor(torch.zeros(8, 2).t(), torch.zeros(4))
        raise AssertionError("a non-contiguous output was accepted")
    except RuntimeError as e:
        assert "not contiguous" in str(e), e
    try:
        dist.all_reduce(torch.zeros(2, dtype=torch.int16))
        raise AssertionError("int16 was accepted")
    except RuntimeError as e:
        assert "does not support" in str(e), e
    # Ranks that disagree on the size: every rank gets an error naming the ranks.
    try:
        dist.all_reduce(torch.zeros(7 if rank == 2 else 16))
        raise AssertionError("mismatched sizes were accepted")
    except RuntimeError as e:
        assert "INVALID_ARGUMENT" in str(e) and "ranks [2]" in str(e), e
    # The group stays usable.
    t = torch.ones(3)
    dist.all_reduce(t)
    equal(t, torch.full((3,), float(world)))
    # A Work wait() with a timeout: a recv nobody answers.
    work = dist.irecv(torch.zeros(1), src=(rank + 1) % world, tag=99)
    try:
        work.wait(datetime.timedelta(seconds=0.3))
        raise AssertionError("an unanswered recv completed")
    except RuntimeError as e:
        assert "DEADLINE_EXCEEDED" in str(e), e
    assert not work.is_completed()
    # Nobody sends before every rank's wait timed out (a rank descheduled for 0.3 s would
    # otherwise find its message already there).
    dist.barrier()
    dist.send(torch.full((1,), 5.0), dst=(rank - 1) % world, tag=99)
    work.wait()
    dist.barrier()


def train(model, rank, steps):
    """`steps` SGD steps (momentum 0.9) of a 16 -> 4 regression, each rank on its own data."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def ddp(rank, world, out):
    """20 steps of DistributedDataParallel training; rank 0 saves the parameters to `out`.
    WORKER_NO_DDP=1: without DDP (a control); WORKER_COMM_HOOK=fp16: with DDP's fp16
    compression comm hook (gradients all-reduced as float16 through the Work's future)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    if os.environ.get("WORKER_NO_DDP") != "1":
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
        if os.environ.get("WORKER_COMM_HOOK") == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    train(model, rank, 20)
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out)


def reinit(rank, world, how):
    """init_process_group again after destroy_process_group, on a fresh FileStore (HOW is
    store:<path>; round 2 uses <path>.2): torch names the new default group as the old one,
    so this passes only if destroying the group ended its session at the sidecar."""
    for round_ in (1, 2):
        if round_ == 2:
            # Every rank has destroyed its group before any inits again (reinit_loop covers
            # re-init at full speed, a rank coming back while others are still leaving).
            done = dist.FileStore(how[6:] + ".destroyed", world)
            done.set(f"destroyed/{rank}", "1")
            done.wait([f"destroyed/{r}" for r in range(world)], datetime.timedelta(seconds=60))
            init("collserve", how + ".2")
        t = torch.full((3,), float(rank + round_))
        dist.all_reduce(t)
        equal(t, torch.full((3,), float(sum(range(world)) + world * round_)))
        dist.destroy_process_group()


def reinit_loop(rank, world, how):
    """REINIT_CYCLES (default 100) cycles of init_process_group, all_reduce, destroy_process_group
    in a loop, at full speed: a rank that comes back while its host's other ranks are still
    leaving the previous generation is held until they have, not refused. HOW is env
    (torch's env://; its TCPStore is made anew each cycle, on the same port) or store:<path>
    (a FileStore per cycle)."""
    cycles = int(os.environ.get("REINIT_CYCLES", "100"))
    for i in range(cycles):
        if i > 0:  # main() made the first
            init("collserve", how if how == "env" else f"{how}.{i}")
        t = torch.full((2,), float(rank + i))
        dist.all_reduce(t)
        equal(t, torch.full((2,), float(sum(range(world)) + world * i)))
        dist.destroy_process_group()
    print(f"rank {rank}: {cycles} cycles", flush=True)


def live_at_exit(rank, world, how):
    """A collserve group alive at exit (on 1.13 one that outlives destroy_process_group:
    DistributedDataParallel keeps a reference to its group), with an operation left in
    flight on rank 0. HOW=call: rank 0
    runs _collserve_torch.shutdown_all (what collserve.torch's atexit hook runs) itself: the
    operation fails (as when the group is destroyed) and later calls
    raise FAILED_PRECONDITION. HOW=exit: the
    operation is dropped and the process exits; the hook must end the session before Python
    finalizes (the test checks that every rank exits 0)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    train(model, rank, 2)
    group = dist.distributed_c10d._get_default_group()
    if not TORCH2:
        # torch 1.13's destroy leaves the group to its references (DDP's); on 2.x collserve.torch
        # ends it at destroy, as torch shuts NCCL down there: there the group stays registered.
        dist.destroy_process_group()
    if rank != 0:
        return
    t = torch.ones(1024)
    work = group.allreduce([t])  # rank 1 never calls it
    if how == "exit":
        del t, work
        return
    collserve.torch._collserve_torch.shutdown_all()
    try:
        work.wait()
        raise AssertionError("the operation in flight completed after shutdown_all")
    except RuntimeError as e:
        # UNAVAILABLE, CANCELLED or FAILED_PRECONDITION ("session ... ended"), by timing, as
        # for an operation in flight when its group is destroyed
        assert str(e).startswith("collserve allreduce: ") and "shut down" not in str(e), e
    try:
        group.allreduce([t])
        raise AssertionError("a group shut down took another operation")
    except RuntimeError as e:
        assert "collserve allreduce: FAILED_PRECONDITION" in str(e) and "shut down" in str(e), e


def fsdp(rank, world, out):
    """10 steps of FullyShardedDataParallel (torch 2.x, CPU: parameters sharded over the
    ranks, all_gather_into_tensor before each use, reduce_scatter_tensor of the gradients);
    rank 0 saves the full parameters to `out`."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 31), nn.Tanh(), nn.Linear(31, 4))
    model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    train(model, rank, 10)
    # Every rank gathers the full state. (offload_to_cpu=True does not clone CPU tensors: the
    # values would view the unsharded parameters FSDP frees when the context ends.)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        state = model.state_dict()
    if rank == 0:
        torch.save([v.detach().clone() for v in state.values()], out)


def checkpoint(rank, world, directory):
    """torch.distributed.checkpoint: every rank saves its part of a sharded state (the
    planner's gather/scatter of the plans and the barrier go through the backend), then
    loads it back into zeroed tensors."""
    import torch.distributed.checkpoint as dcp
    state = {"weight": torch.arange(12.0).reshape(3, 4) * (rank + 1), "step": torch.tensor([rank])}
    keyed = {f"rank{rank}": state}
    dcp.save(keyed, checkpoint_id=directory)
    restored = {f"rank{rank}": {"weight": torch.zeros(3, 4), "step": torch.tensor([-1])}}
    dcp.load(restored, checkpoint_id=directory)
    equal(restored[f"rank{rank}"]["weight"], state["weight"])
    equal(restored[f"rank{rank}"]["step"], state["step"])


def arena(rank, world):
    """collserve.torch.empty tensors in collectives (2 ranks). Bytes by path, per rank:
    arena 24000 + 32, staged 16 + 20 (test_arena_tensors_move_no_bytes checks the sum)."""
    t = collserve.torch.empty(1000, 3, dtype=torch.float64)
    assert t.shape == (1000, 3) and t.dtype == torch.float64 and t.is_contiguous(), t
    assert t.data_ptr() % 64 == 0 and not t.any()
    t.fill_(rank + 1)
    dist.all_reduce(t)  # in place in the arena: 24000 bytes
    equal(t, torch.full((1000, 3), float(sum(range(1, world + 1))), dtype=torch.float64))
    out = collserve.torch.empty((world * 4,), dtype=torch.int32)
    dist._all_gather_base(out, torch.full((4,), rank, dtype=torch.int32))  # output arena 32, input staged 16
    equal(out, torch.arange(world, dtype=torch.int32).repeat_interleave(4))
    zero = collserve.torch.empty(0)
    dist.all_reduce(zero)
    assert zero.numel() == 0 and zero.dtype == torch.float32
    # The default group's arena, used with another group: an ordinary (staged) tensor there.
    other = dist.new_group(list(range(world)))
    t2 = collserve.torch.empty(5, dtype=torch.float32)
    t2.fill_(rank)
    dist.all_reduce(t2, group=other)  # staged 20
    equal(t2, torch.full((5,), float(sum(range(world)))))
    try:
        collserve.torch.empty(4, group=dist.new_group(list(range(world)), backend="gloo"))
        raise AssertionError("empty() accepted a gloo group")
    except ValueError as e:
        assert "not a collserve group" in str(e), e
    del t, out, t2  # frees the arena memory (the sidecar unmaps it on the next call)
    dist.barrier()


def main():
    scenario, backend, how = sys.argv[1:4]
    rank, world = init(backend, how)
    if scenario == "collectives":
        collectives(rank, world)
    elif scenario == "errors":
        errors(rank, world)
    elif scenario == "hosts":  # COLLSERVE_HOST_ID splits the ranks over "hosts"
        t = torch.full((3,), float(rank))
        dist.all_reduce(t)
        equal(t, torch.full((3,), float(sum(range(world)))))
        print(f"rank {rank}: started {len(collserve.torch._embedded['servers'])} servers", flush=True)
        dist.barrier()
    elif scenario == "idle":  # rendezvous, say so, then wait to be killed
        print(f"rank {rank}: ready", flush=True)
        import time
        time.sleep(300)  # idle until the test kills it
    elif scenario == "arena":
        arena(rank, world)
    elif scenario == "monitored_zero":
        monitored_zero(rank, world)
        print(f"rank {rank}: {scenario} ok", flush=True)
        return  # the group is unusable after a failed monitored barrier (as torch's)
    elif scenario in ("reinit", "reinit_loop"):
        (reinit if scenario == "reinit" else reinit_loop)(rank, world, how)
        print(f"rank {rank}: {scenario} ok", flush=True)
        return  # destroyed inside
    elif scenario == "live_at_exit":
        live_at_exit(rank, world, sys.argv[4])
        print(f"rank {rank}: {scenario} ok", flush=True)
        return  # destroyed inside (the group lives on)
    elif scenario == "ddp":
        ddp(rank, world, sys.argv[4])
        dist.barrier()
    elif scenario == "fsdp":
        fsdp(rank, world, sys.argv[4])
        dist.barrier()
    elif scenario == "checkpoint":
        checkpoint(rank, world, sys.argv[4])
        dist.barrier()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    dist.destroy_process_group()
    print(f"rank {rank}: {scenario} ok", flush=True)
    if backend == "gloo":
        # The reference runs skip the interpreter's teardown: torch 2.6's ProcessGroupGloo
        # sometimes aborts there after FSDP ("terminate called without an active exception",
        # after the group was destroyed). The collserve runs keep it.
        os._exit(0)


if __name__ == "__main__":
    main()
