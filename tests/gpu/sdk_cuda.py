"""GPU check of the Python SDK's CUDA tensors (docs/gpu.md), run by tests/gpu/run.sh under
`python -m collserve launch --nproc_per_node N` on a machine with a GPU and torch: every rank
on cuda:0. Checks all_reduce (SUM, AVG, MAX; sync and async), broadcast, all_gather_into_tensor
and reduce_scatter_tensor results in float32, bfloat16 and int64, and the stream ordering: the
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
