"""One rank of tests/python/test_sdk.py, run as its own process with env:// variables.

Modes (argv[1]): api (every call, checked), desync (the last rank calls a different count),
timeout (rank 0 waits for a rank that never calls), badrank (init with rank >= world_size),
sidecar_gone (rank 0 reports the error after the sidecar is stopped).
Prints "ok" lines or "error <ExceptionType>: <message>".
"""
import sys

import numpy as np

import collserve as dist


def api():
    dist.init_process_group("gloo", init_method="env://")
    assert dist.is_initialized()
    rank, world = dist.get_rank(), dist.get_world_size()
    # all_reduce in place on several dtypes, sync and async.
    for dtype in ("float32", "float64", "int32", "int64", "float16", "int8", "uint8"):
        t = np.arange(4, dtype=dtype) + rank
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        want = sum(np.arange(4, dtype=dtype) + r for r in range(world))
        assert np.array_equal(t, want.astype(dtype)), (dtype, t, want)
    b = np.array([rank % 2 == 0, True])
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    assert b.tolist() == [world == 1, True], b
    t = np.full(1000, float(rank + 1))
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    assert work.wait(timeout=30)
    assert work.is_completed()
    assert t[0] == world and t[-1] == world
    # A view: in place through a contiguous slice.
    big = np.zeros(10, dtype=np.float32)
    view = big[2:6]
    view[:] = rank
    dist.all_reduce(view)
    assert big[2] == sum(range(world)) and big[0] == 0
    # broadcast, reduce, all_gather, barrier.
    t = np.array([1, 2, 3, 4], dtype=np.int64) if rank == 0 else np.zeros(4, dtype=np.int64)
    dist.broadcast(t, src=0)
    assert t.tolist() == [1, 2, 3, 4]
    t = np.array([rank + 1.0])
    dist.reduce(t, dst=0, op=dist.ReduceOp.PRODUCT)
    if rank == 0:
        assert t[0] == np.prod(np.arange(1, world + 1)), t
    else:
        assert t[0] == rank + 1.0
    out = [np.zeros(2, dtype=np.int64) for _ in range(world)]
    dist.all_gather(out, np.arange(2, dtype=np.int64) + 1 + 2 * rank)
    assert [o.tolist() for o in out] == [[1 + 2 * r, 2 + 2 * r] for r in range(world)]
    dist.barrier()
    # Point-to-point: a ring with isend / recv, and recv from any source.
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        req = dist.isend(np.array([rank], dtype=np.int32), dst=right)
        got = np.zeros(1, dtype=np.int32)
        src = dist.recv(got, src=left)
        req.wait()
        assert got[0] == left and src == left
        if rank == 0:
            seen = set()
            for _ in range(world - 1):
                v = np.zeros(1, dtype=np.int64)
                source = dist.recv(v, tag=3)
                assert v[0] == 10 * source, (v, source)
                seen.add(source)
            assert seen == set(range(1, world))
        else:
            dist.send(np.array([10 * rank], dtype=np.int64), dst=0, tag=3)
    # Bad inputs: clear Python errors, nothing sent.
    for bad, exc in ((np.zeros((4, 4))[:, 1], ValueError), ([1.0, 2.0], TypeError),
                     (np.zeros(2, dtype=np.complex64), TypeError)):
        try:
            dist.all_reduce(bad)
        except exc:
            pass
        else:
            raise AssertionError(f"{bad!r} did not raise {exc.__name__}")
    try:
        dist.all_reduce(np.zeros(2, dtype=np.float32), op=dist.ReduceOp.BXOR)
    except dist.DistArgumentError as e:
        assert "BXOR" in str(e)
    dist.barrier()
    dist.destroy_process_group()
    assert not dist.is_initialized()
    print("ok api")


def report(fn):
    try:
        fn()
        print("ok")
    except dist.DistError as e:
        kinds = [c.__name__ for c in type(e).__mro__ if c.__module__ == "collserve"]
        print(f"error {'/'.join(kinds)}: {e}")


def desync():
    dist.init_process_group(init_method="env://")
    n = 7 if dist.get_rank() == dist.get_world_size() - 1 else 16
    report(lambda: dist.all_reduce(np.ones(n, dtype=np.float32)))


def timeout():
    dist.init_process_group(init_method="env://")
    if dist.get_rank() == 0:
        report(lambda: dist.all_reduce(np.ones(3)))
    else:
        import time
        time.sleep(6)


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


if __name__ == "__main__":
    {"api": api, "desync": desync, "timeout": timeout, "badrank": badrank, "sidecar_gone": sidecar_gone}[sys.argv[1]]()
