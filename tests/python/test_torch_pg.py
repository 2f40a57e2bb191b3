"""collserve.torch_pg, the pure-Python torch.distributed ProcessGroup over the Python SDK,
against a real coordinator and sidecar on loopback: 2 ranks (subprocesses) build
CollserveProcessGroup directly (CPU tensors) and check allreduce, reduce, broadcast, allgather,
all_gather_into_tensor, reduce_scatter(_tensor), gather, scatter, all_to_all_single (uneven
splits), all_to_all (lists, uneven), barrier, send/recv/recv_anysource and coalescing, errors, and a 5-step
DistributedDataParallel training that must equal a single-process reference.

On torch 1.13 (this repository's CPU test machine) the ProcessGroup trampoline works but
the Work one does not; torch_pg then completes each call before returning (see its
docstring), which this test also covers. The CUDA path needs a GPU and a CUDA build of the
SDK: bench/gpu/ddp_compare.py checks it.

Run as a script (`test_torch_pg.py worker SCENARIO`), this file is one rank.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _import_torch_pg():
    """collserve.torch_pg from the build tree's package, or from the source tree when the build
    predates torch_pg.py (the build copies python/collserve/*.py into <build>/python)."""
    import collserve
    src = os.path.join(ROOT, "python", "collserve")
    if not os.path.exists(os.path.join(os.path.dirname(collserve.__file__), "torch_pg.py")):
        collserve.__path__.append(src)
    from collserve import torch_pg
    return torch_pg


# ------------------------------------------------------------------------------------------
# The rank (run as a script)
# ------------------------------------------------------------------------------------------

def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(torch, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)


DDP_STEPS = 5


def _collectives(torch, dist, pg, rank, world):
    def equal(a, b):
        assert torch.equal(a, b), f"{a} != {b}"

    assert pg.rank() == rank and pg.size() == world and pg.name() == "collserve", (pg.rank(), pg.size(), pg.name())
    # allreduce, several ops and dtypes, in place, through torch's Python API and directly.
    t = torch.full((5,), float(rank + 1))
    ptr = t.data_ptr()
    dist.all_reduce(t, group=pg)
    equal(t, torch.full((5,), float(sum(range(1, world + 1)))))
    assert t.data_ptr() == ptr
    for op, dtype, expected in [(dist.ReduceOp.MAX, torch.int64, world), (dist.ReduceOp.MIN, torch.int32, 1),
                                (dist.ReduceOp.PRODUCT, torch.float64, 2.0),
                                (dist.ReduceOp.AVG, torch.float32, 1.5), (dist.ReduceOp.BOR, torch.int64, 3)]:
        x = torch.full((3,), rank + 1, dtype=dtype)
        dist.all_reduce(x, op=op, group=pg)
        equal(x, torch.full((3,), expected, dtype=dtype))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    y = torch.arange(4, dtype=torch.float32) * (rank + 1)
    w = pg.allreduce([y], opts)
    assert w.wait() is True
    assert w.is_completed() and w.is_success()
    equal(y, torch.arange(4, dtype=torch.float32) * 3)
    fut = pg.allreduce([torch.ones(2)], opts).get_future()
    equal(fut.wait()[0], torch.full((2,), 2.0))
    # async_op through torch's API: a Work whose wait returns True.
    z = torch.ones(3)
    work = dist.all_reduce(z, group=pg, async_op=True)
    assert work.wait()
    equal(z, torch.full((3,), 2.0))
    # broadcast from each root (torch's dist.broadcast translates src through the registered
    # groups of init_process_group/new_group: call the group's method).
    for root in range(world):
        b = torch.full((4,), float(rank * 10))
        bo = dist.BroadcastOptions()
        bo.rootRank = root
        pg.broadcast([b], bo).wait()
        equal(b, torch.full((4,), float(root * 10)))
    # allgather (separate outputs), all_gather_into_tensor.
    outs = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), float(rank)), group=pg)
    for r in range(world):
        equal(outs[r], torch.full((3,), float(r)))
    flat = torch.zeros(world * 2, dtype=torch.int64)
    pg._allgather_base(flat, torch.full((2,), rank, dtype=torch.int64)).wait()
    equal(flat, torch.tensor([r for r in range(world) for _ in range(2)]))
    # reduce_scatter (list and tensor forms).
    out = torch.zeros(2)
    rs = dist.ReduceScatterOptions()
    rs.reduceOp = dist.ReduceOp.SUM
    pg.reduce_scatter([out], [[torch.full((2,), float(10 * j + rank)) for j in range(world)]], rs).wait()
    equal(out, torch.full((2,), float(sum(10 * rank + r for r in range(world)))))
    out2 = torch.zeros(3)
    pg._reduce_scatter_base(out2, torch.arange(3 * world, dtype=torch.float32), rs).wait()
    equal(out2, torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) * world)
    # gather / scatter to and from each root (torch passes [] off the root), and
    # all_to_all_single with uneven split sizes in rows (each row 2 elements).
    for root in range(world):
        go = dist.GatherOptions()
        go.rootRank = root
        gathered = [torch.zeros(rank_ + 1) for rank_ in range(world)]
        pg.gather([gathered] if rank == root else [], [torch.full((rank + 1,), float(rank + 10))], go).wait()
        if rank == root:
            for r in range(world):
                equal(gathered[r], torch.full((r + 1,), float(r + 10)))
        so = dist.ScatterOptions()
        so.rootRank = root
        got = torch.zeros(rank + 2)
        pieces = [torch.full((r + 2,), float(100 * root + r)) for r in range(world)]
        pg.scatter([got], [pieces] if rank == root else [], so).wait()
        equal(got, torch.full((rank + 2,), float(100 * root + rank)))
    # rank s sends (s + d + 1) rows to rank d.
    ins = torch.cat([torch.full((rank + d + 1, 2), float(10 * rank + d)) for d in range(world)])
    outs = torch.zeros(sum(s + rank + 1 for s in range(world)), 2)
    pg.alltoall_base(outs, ins, [s + rank + 1 for s in range(world)], [rank + d + 1 for d in range(world)],
                     dist.AllToAllOptions()).wait()
    equal(outs, torch.cat([torch.full((s + rank + 1, 2), float(10 * s + rank)) for s in range(world)]))
    # all_to_all with lists of tensors of any sizes (torch's dist.all_to_all calls alltoall):
    # rank s sends s + d + 1 elements to rank d.
    got = [torch.zeros(s + rank + 1) for s in range(world)]
    pg.alltoall(got, [torch.full((rank + d + 1,), float(10 * rank + d)) for d in range(world)],
                dist.AllToAllOptions()).wait()
    for s in range(world):
        equal(got[s], torch.full((s + rank + 1,), float(10 * s + rank)))
    # reduce to each root (torch's dist.reduce calls reduce): the others' tensors stay.
    for root in range(world):
        ro = dist.ReduceOptions()
        ro.rootRank = root
        ro.reduceOp = dist.ReduceOp.MAX
        r = torch.full((4,), float(rank + 1))
        pg.reduce([r], ro).wait()
        equal(r, torch.full((4,), float(world if rank == root else rank + 1)))
    pg.barrier(dist.BarrierOptions()).wait()
    # Point-to-point (torch's isend/irecv call these methods): a ring of sends of different
    # sizes, a receive from any source, and the coalescing calls torch's batch_isend_irecv
    # makes for CUDA tensors (here on CPU tensors: the same methods).
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(3 + prv)
    sent, received = pg.send([torch.full((3 + rank,), float(rank))], nxt, 5), pg.recv([got], prv, 5)
    assert sent.wait() and received.wait()
    equal(got, torch.full((3 + prv,), float(prv)))
    anyone = torch.zeros(2)
    sent, received = pg.send([torch.full((2,), float(rank + 50))], nxt, 6), pg.recv_anysource([anyone], 6)
    assert received.wait() and sent.wait()
    assert received._source_rank() == prv, received._source_rank()
    equal(anyone, torch.full((2,), float(prv + 50)))
    pg._start_coalescing(torch.device("cpu"))
    batch = torch.zeros(4, dtype=torch.int64)
    in_batch = [pg.send([torch.full((4,), rank, dtype=torch.int64)], nxt, 7), pg.recv([batch], prv, 7)]
    try:  # issued only at _end_coalescing, as one batch of the SDK
        in_batch[1].wait()
    except RuntimeError as e:
        assert "not yet issued" in str(e), e
    else:
        raise AssertionError("a deferred recv completed before its batch was issued")
    coalesced = pg._end_coalescing(torch.device("cpu"))
    assert coalesced.wait() and coalesced.is_completed() and coalesced.exception() is None
    equal(batch, torch.full((4,), prv, dtype=torch.int64))
    assert all(w.wait() for w in in_batch) and in_batch[1]._source_rank() == prv
    # Argument errors raise at the call.
    for call, exc in [(lambda: pg.allreduce([torch.ones(1), torch.ones(1)], opts), ValueError),
                      (lambda: pg.allreduce([torch.ones(2)[::2].expand(3)], opts), ValueError),
                      (lambda: pg.allreduce([torch.ones(2, dtype=torch.complex64)], opts), TypeError)]:
        try:
            call()
        except exc:
            pass
        else:
            raise AssertionError(f"expected {exc.__name__}")
    # A service error (ranks disagree on the count) raises RuntimeError "collserve <op>: <code>: ...".
    try:
        pg.allreduce([torch.ones(3 + rank)], opts).wait()
    except RuntimeError as e:
        assert str(e).startswith("collserve allreduce: 3: "), str(e)
    else:
        raise AssertionError("a desynchronized allreduce did not raise")
    # The group stays usable.
    ok = torch.ones(1)
    dist.all_reduce(ok, group=pg)
    equal(ok, torch.full((1,), float(world)))


def _ddp(torch, pg, rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _model(torch)
    if rank == 1:  # DDP broadcasts rank 0's parameters at construction
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    ddp = DDP(model, process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        x, y = _data(torch, rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    # The reference: one process, the gradient averaged over the ranks' batches.
    ref = _model(torch)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        ref_opt.zero_grad()
        for r in range(world):
            x, y = _data(torch, r, step)
            (torch.nn.functional.mse_loss(ref(x), y) / world).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"{name}: max diff {(p - q).abs().max().item()}"


def worker(scenario):
    import torch
    import torch.distributed as dist
    torch_pg = _import_torch_pg()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pg = torch_pg.CollserveProcessGroup.connect(rank, world, timeout=30.0, group=f"pg-test-{scenario}")
    if scenario == "collectives":
        _collectives(torch, dist, pg, rank, world)
    elif scenario == "ddp":
        _ddp(torch, pg, rank, world)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print(f"rank {rank}: {scenario} ok", flush=True)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "worker":
    worker(sys.argv[2])
    sys.exit(0)

# ------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
from test_sdk import Cluster, outputs  # noqa: E402


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.stop()


def _ranks(cluster, scenario, world=2):
    import subprocess
    import forkserver
    return [forkserver.popen([sys.executable, os.path.abspath(__file__), "worker", scenario],
                             env=cluster.env(r, world), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for r in range(world)]


def test_collectives_on_cpu_tensors(cluster):
    for code, text in outputs(_ranks(cluster, "collectives"), limit=120):
        assert code == 0 and "collectives ok" in text, text


def test_ddp_matches_a_single_process_reference(cluster):
    for code, text in outputs(_ranks(cluster, "ddp"), limit=120):
        assert code == 0 and "ddp ok" in text, text


def test_registration_and_creator_without_sidecar(monkeypatch):
    torch_pg = _import_torch_pg()
    monkeypatch.delenv("COLLSERVE_SIDECAR", raising=False)
    with pytest.raises(RuntimeError, match="python -m collserve launch"):
        torch_pg.create(None, 0, 1, __import__("datetime").timedelta(seconds=5))
    if torch_pg.TORCH_MAJOR >= 2:
        torch_pg.register()  # idempotent
        assert "COLLSERVE" in torch.distributed.Backend._plugins
    else:
        with pytest.raises(RuntimeError, match="torch >= 2.0"):
            torch_pg.register()


def test_reduce_op_mapping():
    torch_pg = _import_torch_pg()
    d = torch.distributed
    assert [torch_pg._op_code(getattr(d.ReduceOp, n)) for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX")] == [1, 2, 3,
                                                                                                           4, 5]
    assert torch_pg._op_code(None) == 1
    opts = d.AllreduceOptions()
    opts.reduceOp = d.ReduceOp.MAX
    assert torch_pg._op_code(opts.reduceOp) == 5
