"""GPU check of the Python SDK's CUDA tensors (docs/gpu.md), run by tests/gpu/run.sh under
`python -m collserve launch --nproc_per_node N` on a machine with a GPU and torch: every rank
on cuda:0. Checks all_reduce (SUM, AVG, MAX; sync and async), broadcast, all_gather_into_tensor
and reduce_scatter_tensor results in float32, bfloat16 and int64, all_to_all_single (uneven),
gather and scatter (uneven, SDK calls) in float32, send/recv/batch_isend_irecv (CUDA to
CUDA, CUDA to CPU and back), and the stream ordering: the
input is produced on the current stream behind a long GPU sleep, so a collective that did not
wait for the caller's stream would read the old values. Prints "sdk_cuda: OK" on rank 0."""
import sys

import torch

import collserve.distributed_c10d as dist


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    want_sum = world * (world + 1) / 2
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = torch.zeros(1 << 20, dtype=dtype, device=dev)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
        x.fill_(rank + 1)               # queued behind the sleep
        dist.all_reduce(x)              # must wait for the fill
        assert torch.all(x == want_sum), f"{dtype} all_reduce: {x[:4]} != {want_sum}"
        y = torch.full((4097,), float(rank + 1), dtype=dtype, device=dev)
        work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        assert torch.all(y == world), f"{dtype} MAX: {y[:4]}"
    a = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    assert torch.allclose(a, torch.full_like(a, (world + 1) / 2)), f"AVG: {a[:4]}"
    for root in range(world):
        b = torch.full((12345,), float(rank), device=dev)
        dist.broadcast(b, src=root)
        assert torch.all(b == root), f"broadcast from {root}: {b[:4]}"
    inp = torch.full((777,), float(rank), device=dev)
    out = torch.empty(777 * world, device=dev)
    dist.all_gather_into_tensor(out, inp)
    assert torch.equal(out, torch.arange(world, device=dev).repeat_interleave(777).float()), "all_gather"
    big = torch.arange(world * 333, dtype=torch.float32, device=dev) + rank
    part = torch.empty(333, device=dev)
    dist.reduce_scatter_tensor(part, big)
    expect = (torch.arange(333, device=dev) + rank * 333) * world + want_sum - world
    assert torch.equal(part, expect.float()), f"reduce_scatter: {part[:4]} != {expect[:4]}"
    # all_to_all_single with uneven splits (rank s sends s + d + 1 rows of 3 to rank d), and
    # gather / scatter from each root with uneven sizes through the SDK's CUDA calls: every
    # element checked (issue 44; one host: device copies on the sidecar's stream).
    send = torch.cat([torch.full((rank + d + 1, 3), float(10 * rank + d), device=dev) for d in range(world)])
    recv = torch.full((sum(s + rank + 1 for s in range(world)), 3), -1.0, device=dev)
    dist.all_to_all_single(recv, send, [s + rank + 1 for s in range(world)], [rank + d + 1 for d in range(world)])
    want = torch.cat([torch.full((s + rank + 1, 3), float(10 * s + rank), device=dev) for s in range(world)])
    assert torch.equal(recv, want), f"all_to_all_single: {recv[:, 0]} != {want[:, 0]}"
    pg = dist._group(None)._issue()  # the SDK group: gather_cuda / scatter_cuda
    stream = torch.cuda.current_stream(dev).cuda_stream
    f32 = 1  # collserve.v1 DataType FLOAT32 (collserve._tensors)
    for root in range(world):
        mine = torch.full((rank + 1,), float(rank + 10), device=dev)
        counts = [r + 1 for r in range(world)] if rank == root else []
        flat = torch.full((sum(counts),), -1.0, device=dev) if rank == root else None
        w = pg.gather_cuda(flat.data_ptr() if flat is not None else 0, mine.data_ptr(), rank + 1, counts, f32, root,
                           stream)
        code, message = w.wait(120.0)
        assert code == 0, f"gather_cuda: {code} {message}"
        if rank == root:
            want = torch.cat([torch.full((r + 1,), float(r + 10), device=dev) for r in range(world)])
            assert torch.equal(flat, want), f"gather to {root}: {flat} != {want}"
        pieces = torch.cat([torch.full((r + 2,), float(100 * root + r), device=dev) for r in range(world)])
        got = torch.full((rank + 2,), -1.0, device=dev)
        counts = [r + 2 for r in range(world)] if rank == root else []
        w = pg.scatter_cuda(got.data_ptr(), rank + 2, pieces.data_ptr() if rank == root else 0, counts, f32, root,
                            stream)
        code, message = w.wait(120.0)
        assert code == 0, f"scatter_cuda: {code} {message}"
        assert torch.all(got == 100 * root + rank), f"scatter from {root}: {got}"
    # Point-to-point on CUDA tensors (issue 44: pipeline parallelism), every element checked:
    # a ring of isend/irecv of different sizes with the sender's tensor produced behind a GPU
    # sleep (the copy must wait for it), a recv from any source, batch_isend_irecv, and a
    # CUDA tensor received into a CPU one and back. One host: copies on the sidecar's GPU.
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for n in (1, 4097, 3 << 20):
            out_t = torch.zeros(n + rank, device=dev)
            torch.cuda._sleep(100_000_000)
            out_t.fill_(float(rank + 1))  # queued behind the sleep
            in_t = torch.full((n + prv,), -1.0, device=dev)
            works = [dist.isend(out_t, nxt, tag=n), dist.irecv(in_t, prv, tag=n)]
            for w in works:
                w.wait()
            assert torch.all(in_t == prv + 1), f"p2p {n}: {in_t[:4]} from {prv}"
        anyone = torch.full((5,), -1, dtype=torch.int64, device=dev)
        w = dist.isend(torch.full((5,), rank, dtype=torch.int64, device=dev), nxt, tag=99)
        assert dist.recv(anyone, tag=99) == prv
        w.wait()
        assert torch.all(anyone == prv), f"recv from any source: {anyone}"
        got = torch.full((6,), -1.0, device=dev)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((6,), float(rank), device=dev), nxt),
                                       dist.P2POp(dist.irecv, got, prv)])
        for r in reqs:
            r.wait()
        assert torch.all(got == prv), f"batch_isend_irecv: {got}"
        host = torch.full((7,), -1.0)
        w = dist.isend(torch.full((7,), float(rank), device=dev), nxt, tag=5)
        dist.recv(host, prv, tag=5)  # a CUDA tensor into a CPU one
        w.wait()
        assert torch.all(host == prv), f"CUDA -> CPU: {host}"
        back = torch.full((7,), -1.0, device=dev)
        w = dist.isend(torch.full((7,), float(rank + 100)), nxt, tag=6)  # and a CPU tensor into a CUDA one
        dist.recv(back, prv, tag=6)
        w.wait()
        assert torch.all(back == prv + 100), f"CPU -> CUDA: {back}"
    # A CPU tensor with a CUDA one in one call is a clear TypeError.
    try:
        dist.all_gather_into_tensor(out.cpu(), inp)
        raise AssertionError("mixed devices were accepted")
    except TypeError as e:
        assert "both be CUDA tensors" in str(e), e
    dist.barrier()
    torch.cuda.synchronize()
    if rank == 0:
        print(f"sdk_cuda: OK ({world} ranks)")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
