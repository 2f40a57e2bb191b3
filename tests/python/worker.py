"""One rank of the Python SDK tests (test_sdk.py), run as its own process with env://
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, COLLSERVE_SIDECAR).

Modes (argv[1]):
  api numpy|torch  every collective and point-to-point call, on numpy arrays or torch
                   tensors, checked for values and in-place semantics; bad inputs checked
  groups           new_group, subgroup collectives with global ranks, NON_GROUP_MEMBER
  store            Store and _get_default_store: every store call
  gil              a blocking call on one thread lets the main thread run
  desync           the last rank calls all_reduce with a different count
  timeout          rank 0 waits for a rank that never calls
  badrank          init with rank >= world_size
  sidecar_gone     the test stops the sidecar, then rank 0 calls all_reduce
  big_broadcast    8 MiB broadcasts of ordinary arrays from every root, blocking and back to
                   back (a root's copy that its readers follow: pipelined broadcast)
Prints "ok <mode>" or "error <ExceptionTypes>: <message>".
"""
import sys

import numpy as np

import collserve as dist


class Flavor:
    """Makes numpy arrays or torch tensors from lists, so one set of checks covers both."""

    def __init__(self, name):
        self.name = name
        if name == "torch":
            import torch
            torch.set_num_threads(1)
            self.torch = torch
        self.dtypes = ["float32", "float64", "int32", "int64", "float16", "int8", "uint8"]
        if name == "torch":
            self.dtypes.append("bfloat16")

    def t(self, values, dtype="float32"):
        if self.name == "torch":
            return self.torch.tensor(values, dtype=getattr(self.torch, dtype))
        return np.array(values, dtype=dtype)

    def full(self, n, value, dtype="float32", shape=None):
        return self.t(np.full(shape or n, value).tolist(), dtype)

    def zeros(self, n, dtype="float32"):
        return self.full(n, 0, dtype)

    def address(self, t):
        return t.data_ptr() if self.name == "torch" else t.__array_interface__["data"][0]


def expect_raises(exc, fn, text=""):
    try:
        fn()
    except exc as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"did not raise {exc.__name__}")


def api(flavor_name):
    f = Flavor(flavor_name)
    dist.init_process_group("gloo", init_method="env://")
    assert dist.is_initialized() and dist.is_available() and dist.get_backend() == "collserve"
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = range(world)

    # all_reduce: every dtype, in place (same memory before and after).
    for dtype in f.dtypes:
        t = f.t([1 + rank, 2, 3, 4], dtype)
        before = f.address(t)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        assert f.address(t) == before
        assert t.tolist() == [sum(1 + r for r in ranks), 2 * world, 3 * world, 4 * world], (dtype, t)
    b = f.t([rank % 2 == 0, True], "bool")
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    assert b.tolist() == [world == 1, True], b
    t = f.full(1000, rank + 1.0)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    assert work.wait(timeout=30) and work.is_completed()
    assert t[0] == world and t[-1] == world
    t = f.full(3, float(rank), "float64")
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.tolist() == [sum(ranks) / world] * 3, t
    t = f.full(2, 1.0)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(rank + 1.0))
    assert t.tolist() == [sum(r + 1.0 for r in ranks)] * 2, t
    big = f.zeros(10)
    view = big[2:6]  # a contiguous view: the base array changes in place
    view[:] = rank
    dist.all_reduce(view)
    assert big[2] == sum(ranks) and big[0] == 0

    # broadcast, reduce.
    t = f.t([1, 2, 3, 4], "int64") if rank == world - 1 else f.zeros(4, "int64")
    dist.broadcast(t, src=world - 1)
    assert t.tolist() == [1, 2, 3, 4]
    t = f.t([rank + 1.0])
    dist.reduce(t, dst=0, op=dist.ReduceOp.PRODUCT)
    assert t[0] == (np.prod(np.arange(1, world + 1)) if rank == 0 else rank + 1.0), t

    # all_gather (uneven sizes), all_gather_into_tensor, gather, scatter.
    out = [f.zeros(r + 1, "int64") for r in ranks]
    dist.all_gather(out, f.full(rank + 1, 10 + rank, "int64"))
    assert [o.tolist() for o in out] == [[10 + r] * (r + 1) for r in ranks], out
    out = f.zeros(3 * world, "int32")
    dist.all_gather_into_tensor(out, f.t([rank, rank, rank], "int32"))
    assert out.tolist() == [r for r in ranks for _ in range(3)], out
    dst = world - 1
    gathered = [f.zeros(r + 1) for r in ranks] if rank == dst else None
    dist.gather(f.full(rank + 1, float(rank)), gathered, dst=dst)
    if rank == dst:
        assert [g.tolist() for g in gathered] == [[float(r)] * (r + 1) for r in ranks], gathered
    piece = f.zeros(rank + 1, "float64")
    pieces = [f.full(r + 1, 3.0 * r, "float64") for r in ranks] if rank == 0 else None
    dist.scatter(piece, pieces, src=0)
    assert piece.tolist() == [3.0 * rank] * (rank + 1), piece

    # reduce_scatter (list, uneven) and reduce_scatter_tensor.
    out = f.zeros(rank + 1, "int64")
    dist.reduce_scatter(out, [f.full(j + 1, (rank + 1) * (j + 1), "int64") for j in ranks])
    assert out.tolist() == [sum((r + 1) * (rank + 1) for r in ranks)] * (rank + 1), out
    out = f.zeros(2, "float32")
    dist.reduce_scatter_tensor(out, f.t([float(i + rank) for i in range(2 * world)]))
    assert out.tolist() == [float(sum(2 * rank + i + r for r in ranks)) for i in range(2)], out

    # all_to_all (list, uneven) and all_to_all_single (row splits on a 2-D tensor).
    outs = [f.zeros(j + 1, "int32") for j in ranks]
    dist.all_to_all(outs, [f.full(rank + 1, 10 * rank + j, "int32") for j in ranks])
    assert [o.tolist() for o in outs] == [[10 * j + rank] * (j + 1) for j in ranks], outs
    in_rows = [rank + 2 * j + 1 for j in ranks]
    out_rows = [j + 2 * rank + 1 for j in ranks]
    data = f.t([[100 * rank + j] * 2 for j in ranks for _ in range(in_rows[j])], "int64")
    out = f.t(np.zeros((sum(out_rows), 2)).tolist(), "int64")
    dist.all_to_all_single(out, data, output_split_sizes=out_rows, input_split_sizes=in_rows)
    assert out.tolist() == [[100 * j + rank] * 2 for j in ranks for _ in range(out_rows[j])], out
    out = f.zeros(world, "float32")
    dist.all_to_all_single(out, f.t([float(10 * rank + j) for j in ranks]))
    assert out.tolist() == [float(10 * j + rank) for j in ranks], out

    # barrier, monitored_barrier, object collectives.
    assert dist.barrier() is None
    dist.barrier(async_op=True).wait()
    dist.monitored_barrier(timeout=20)
    objs = []
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in ranks], objs
    objs = [None, None] if rank else ["hello", (1, 2)]
    dist.broadcast_object_list(objs, src=0)
    assert objs == ["hello", (1, 2)], objs

    # Point-to-point: a ring with isend/recv, batch_isend_irecv, any-source recv with tags.
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        req = dist.isend(f.t([rank], "int32"), dst=right)
        got = f.zeros(1, "int32")
        assert dist.recv(got, src=left) == left
        req.wait()
        assert got[0] == left
        got = f.zeros(2, "float64")
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, f.t([rank, 1.5], "float64"), right),
                                        dist.P2POp(dist.irecv, got, left)])
        for w in works:
            w.wait()
        assert got.tolist() == [left, 1.5] and works[1].source_rank() == left, got
        if rank == 0:
            seen = set()
            for _ in range(world - 1):
                v = f.zeros(1, "int64")
                source = dist.recv(v, tag=3)
                assert v[0] == 10 * source, (v, source)
                seen.add(source)
            assert seen == set(range(1, world))
            w = dist.irecv(f.zeros(1, "int64"), src=1, tag=4)
            w.wait()
            assert w.source_rank() == 1
        else:
            dist.send(f.t([10 * rank], "int64"), dst=0, tag=3)
            if rank == 1:
                dist.send(f.t([7], "int64"), dst=0, tag=4)

    # Bad inputs: clear Python errors before anything is sent.
    non_contiguous = f.t(np.zeros((4, 4)).tolist())[:, 1]
    expect_raises(ValueError, lambda: dist.all_reduce(non_contiguous), "contiguous")
    expect_raises(TypeError, lambda: dist.all_reduce([1.0, 2.0]), "numpy.ndarray or a torch.Tensor")
    if f.name == "torch":
        expect_raises(TypeError, lambda: dist.all_reduce(f.torch.zeros(2, dtype=f.torch.complex64)), "complex64")
    else:
        expect_raises(TypeError, lambda: dist.all_reduce(np.zeros(2, dtype=np.complex64)), "complex64")
        ro = np.zeros(2, dtype=np.float32)
        ro.flags.writeable = False
        expect_raises(ValueError, lambda: dist.all_reduce(ro), "read-only")
    expect_raises(ValueError, lambda: dist.all_gather_into_tensor(f.zeros(world + 1), f.zeros(1)), "world_size")
    expect_raises(TypeError, lambda: dist.all_gather([f.zeros(1, "int32")] * world, f.zeros(1)), "dtype")
    expect_raises(dist.DistArgumentError, lambda: dist.all_reduce(f.zeros(2), op=dist.ReduceOp.BXOR), "BXOR")
    expect_raises(dist.DistArgumentError, lambda: dist.broadcast(f.zeros(2), src=world), "out of range")
    dist.barrier()
    dist.destroy_process_group()
    assert not dist.is_initialized()
    print(f"ok api {flavor_name}")


def groups():
    dist.init_process_group(init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    g01 = dist.new_group([0, 1])
    g31 = dist.new_group([3, 1])  # sorted, as torch: group ranks 0 -> global 1, 1 -> global 3
    everyone = dist.new_group()
    assert dist.get_process_group_ranks(everyone) == [0, 1, 2, 3]
    t = np.ones(2)
    if rank in (0, 1):
        assert dist.get_rank(g01) == rank and dist.get_world_size(g01) == 2
        dist.all_reduce(t, group=g01)
        assert t.tolist() == [2.0, 2.0]
    else:
        assert g01 is dist.GroupMember.NON_GROUP_MEMBER
        assert dist.all_reduce(t, group=g01) is None and t.tolist() == [1.0, 1.0]
        assert dist.get_rank(g01) == -1 and dist.get_world_size(g01) == -1
    if rank in (1, 3):
        assert dist.get_process_group_ranks(g31) == [1, 3]
        assert dist.get_rank(g31) == (0 if rank == 1 else 1)
        assert dist.get_global_rank(g31, 1) == 3 and dist.get_group_rank(g31, 3) == 1
        b = np.array([rank], dtype=np.int64)
        dist.broadcast(b, src=3, group=g31)  # src is a global rank
        assert b[0] == 3
        r = np.array([float(rank)])
        dist.reduce(r, dst=3, op=dist.ReduceOp.SUM, group=g31)
        assert r[0] == (4.0 if rank == 3 else 1.0)
        if rank == 1:
            dist.send(np.array([42], dtype=np.int32), dst=3, group=g31)
        else:
            got = np.zeros(1, dtype=np.int32)
            assert dist.recv(got, src=None, group=g31) == 1 and got[0] == 42  # the global rank of the sender
        expect_raises(dist.DistArgumentError, lambda: dist.broadcast(b, src=0, group=g31), "not a member")
        dist.destroy_process_group(g31)
        expect_raises(ValueError, lambda: dist.barrier(group=g31), "destroyed")
    t = np.array([rank], dtype=np.int64)
    dist.all_reduce(t, group=everyone)
    assert t[0] == 6
    expect_raises(dist.DistArgumentError, lambda: dist.new_group([0, 9]), "out of range")
    dist.barrier()
    print("ok groups")


def store():
    import datetime
    import os
    # The coordinator given in the URL (MASTER_ADDR/PORT are empty; RANK/WORLD_SIZE are set).
    host, port = os.environ["TEST_COORDINATOR"].split(":")
    dist.init_process_group(init_method=f"collserve://{host}:{port}", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    s = dist._get_default_store()
    other = dist.Store(host, int(port), timeout=datetime.timedelta(seconds=20))
    s.set(f"rank/{rank}", f"value {rank}")
    other.wait([f"rank/{r}" for r in range(world)])
    assert s.check([f"rank/{r}" for r in range(world)])
    assert other.get(f"rank/{(rank + 1) % world}") == f"value {(rank + 1) % world}".encode()
    assert s.multi_get([f"rank/{r}" for r in range(world)]) == [f"value {r}".encode() for r in range(world)]
    total = s.add("counter", rank + 1)
    assert 1 <= total <= sum(range(1, world + 1))
    s.append("log", f"[{rank}]")
    dist.barrier()
    assert s.add("counter", 0) == sum(range(1, world + 1))
    assert sorted(s.get("log").decode().replace("]", "] ").split()) == sorted(f"[{r}]" for r in range(world))
    if rank == 0:
        assert s.compare_set("cas", "", "first") == b"first"
        assert s.compare_set("cas", "wrong", "second") == b"first"
        assert s.compare_set("cas", "first", b"second") == b"second"
        s.multi_set(["m/a", "m/b"], ["1", b"\x00\xff"])
        assert s.multi_get(["m/a", "m/b"]) == [b"1", b"\x00\xff"]
        n = s.num_keys()
        assert s.delete_key("m/a") and not s.delete_key("m/a")
        assert s.num_keys() == n - 1
        assert not s.check(["missing"])
        s.set_timeout(datetime.timedelta(seconds=0.5))
        expect_raises(dist.DistStoreTimeoutError, lambda: s.get("missing"), "missing")
        expect_raises(TimeoutError, lambda: other.wait(["missing"], timeout=0.3), "missing")
        s.set("not_a_number", "x")
        expect_raises(dist.DistStoreError, lambda: s.add("not_a_number", 1))
    dist.barrier()
    print("ok store")


def gil():
    """Rank 0 blocks in all_reduce on a second thread while rank 1 holds back for 1 s: the
    main thread must keep running Python meanwhile (the call released the GIL)."""
    import threading
    import time
    dist.init_process_group(init_method="env://")
    dist.barrier()

    def reduce(t):  # rank 0 calls it from a thread, rank 1 from main: one name for both stacks
        with dist.call_site("reduce"):
            dist.all_reduce(t)
    if dist.get_rank() == 0:
        done = threading.Event()
        t = np.ones(4)

        def blocked():
            reduce(t)
            done.set()
        threading.Thread(target=blocked).start()
        ticks = 0
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)  # ticks while the other thread blocks: the GIL is free
        assert t.tolist() == [2.0] * 4 and ticks > 100, (t, ticks)
    else:
        time.sleep(1.0)  # the late rank the mode is about
        reduce(np.ones(4))
    dist.barrier()
    print("ok gil")


def report(fn):
    try:
        fn()
        print("ok")
    except dist.DistError as e:
        kinds = [c.__name__ for c in type(e).__mro__ if c.__module__.startswith("collserve")]
        print(f"error {'/'.join(kinds)}: {e}")


def desync():
    dist.init_process_group(init_method="env://")
    n = 7 if dist.get_rank() == dist.get_world_size() - 1 else 16
    report(lambda: dist.all_reduce(np.ones(n, dtype=np.float32)))


def skip():
    """The last rank skips the first of two identical all_reduces (same op, count and dtype:
    no signature check can see it): the call sites disagree."""
    dist.init_process_group(init_method="env://")
    t = np.ones(8, dtype=np.float32)
    if dist.get_rank() != dist.get_world_size() - 1:
        report(lambda: dist.all_reduce(t))  # worker.py: the first all_reduce
    else:
        report(lambda: dist.all_reduce(t))  # every rank: the second all_reduce
    # Nothing moved: the group goes on.
    dist.barrier()
    print("barrier ok")


def timeout():
    dist.init_process_group(init_method="env://")
    if dist.get_rank() == 0:
        report(lambda: dist.all_reduce(np.ones(3)))
    else:
        import time
        time.sleep(6)  # never calls, past the others' timeout: the mode's point


def badrank():
    try:
        dist.init_process_group(init_method="env://", rank=5, world_size=2)
    except dist.DistError as e:
        print(f"error {type(e).__name__}: {e}")


def sidecar_gone():
    dist.init_process_group(init_method="env://")
    dist.barrier()
    print("ready", flush=True)
    sys.stdin.readline()  # the test stops the sidecar, then writes a line
    report(lambda: dist.all_reduce(np.ones(3)))


def big_broadcast():
    """Every rank is root in turn of 8 MiB float32 broadcasts of ordinary (heap) arrays: one
    waited for at once, then three back to back; each receiver checks every element."""
    dist.init_process_group(init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 2 << 20  # 8 MiB of float32: above the SDK's pipelined-broadcast threshold (4 MiB)

    def pattern(root, i):
        return np.arange(n, dtype=np.float32) * (root + 1) + i

    for root in range(world):
        arrays = [pattern(root, i) if rank == root else np.full(n, -1, dtype=np.float32) for i in range(4)]
        dist.broadcast(arrays[0], root)
        works = [dist.broadcast(a, root, async_op=True) for a in arrays[1:]]
        for w in works:
            w.wait()
        for i, a in enumerate(arrays):
            assert np.array_equal(a, pattern(root, i)), (root, i, a[:4], a[-4:])
    print("ok big_broadcast", flush=True)


if __name__ == "__main__":
    modes = {"api": api, "groups": groups, "store": store, "gil": gil, "desync": desync, "skip": skip, "timeout": timeout, "badrank": badrank,
             "sidecar_gone": sidecar_gone, "big_broadcast": big_broadcast}
    modes[sys.argv[1]](*sys.argv[2:])
