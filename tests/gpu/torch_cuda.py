"""GPU check of the torch 2.x backend (collserve.torch_pg) with CUDA tensors, run by
tests/gpu/run.sh under `python -m collserve launch --nproc_per_node N` on a machine with a GPU
and torch >= 2: torch.distributed's own calls under init_process_group("collserve"), every
rank on cuda:0 (the layout one GPU allows: ranks sharing it through the sidecar, or one rank
with COLLSERVE_CUDA_PATH=nccl). Every element of every result is checked:

  all_reduce (SUM, AVG, PRODUCT, MIN, MAX on float32; SUM on int64 and bfloat16; async), with
  the input produced behind a GPU sleep on the current stream (a collective that did not wait
  for the caller's stream would read the old values); reduce to every root (the others' tensors
  unchanged); broadcast from every root; all_gather
  and all_gather_into_tensor; reduce_scatter and reduce_scatter_tensor; all_to_all_single with
  uneven splits and all_to_all; gather and scatter to and from every root; send/recv,
  isend/irecv and batch_isend_irecv in a ring, and recv from any source (sidecar path only:
  NCCL has none); barrier.

Prints "torch_cuda: OK (<checks> checks, <N> ranks, <device>, <path>)" on rank 0; an assertion
names the call and the values otherwise. `--device cpu` runs the same checks on CPU tensors,
to try the script where there is no GPU (torch >= 2: torch_pg registers "collserve" there)."""
import argparse
import math
import os

import torch
import torch.distributed as dist

import collserve.torch_pg  # noqa: F401  registers backend "collserve"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    dist.init_process_group("collserve")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    in_rank = os.environ.get("COLLSERVE_CUDA_PATH", "") == "nccl" and dev.type == "cuda"
    checks = [0]

    def check(ok, what):
        assert ok, f"rank {rank}: {what}"
        checks[0] += 1

    def full(n, value, dtype=torch.float32):
        return torch.full((n,), value, dtype=dtype, device=dev)

    # all_reduce: every ReduceOp on float32.
    for op, want in ((dist.ReduceOp.SUM, world * (world + 1) / 2), (dist.ReduceOp.AVG, (world + 1) / 2),
                     (dist.ReduceOp.PRODUCT, float(math.factorial(world))), (dist.ReduceOp.MIN, 1.0),
                     (dist.ReduceOp.MAX, float(world))):
        x = full(1001, float(rank + 1))
        if dev.type == "cuda":
            x.zero_()
            torch.cuda._sleep(100_000_000)  # GPU time on the current stream ...
            x.fill_(float(rank + 1))        # ... that the fill waits behind
        dist.all_reduce(x, op=op)
        check(torch.allclose(x, full(1001, want)), f"all_reduce {op}: {x[:4].tolist()} != {want}")
    for dtype in (torch.int64, torch.bfloat16):
        x = full(4097, rank + 1, dtype)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        check(bool(torch.all(x == world * (world + 1) // 2)), f"{dtype} all_reduce: {x[:4].tolist()}")
    # reduce to every root: the others' tensors stay as they were.
    for root in range(world):
        r = full(2049, float(rank + 1))
        dist.reduce(r, dst=root, op=dist.ReduceOp.SUM)
        want = world * (world + 1) / 2 if rank == root else rank + 1
        check(bool(torch.all(r == want)), f"reduce to {root}: {r[:4].tolist()} != {want}")
    # broadcast from every root.
    for root in range(world):
        b = full(12345, float(rank))
        dist.broadcast(b, src=root)
        check(bool(torch.all(b == root)), f"broadcast from {root}: {b[:4].tolist()}")
    # all_gather (a list) and all_gather_into_tensor.
    mine = torch.arange(777, dtype=torch.float32, device=dev) + 1000 * rank
    outs = [torch.empty(777, device=dev) for _ in range(world)]
    dist.all_gather(outs, mine)
    for q in range(world):
        want = torch.arange(777, dtype=torch.float32, device=dev) + 1000 * q
        check(torch.equal(outs[q], want), f"all_gather from {q}: {outs[q][:4].tolist()}")
    flat = torch.empty(777 * world, device=dev)
    dist.all_gather_into_tensor(flat, mine)
    check(torch.equal(flat, torch.cat(outs)), "all_gather_into_tensor")
    # reduce_scatter (a list) and reduce_scatter_tensor: rank r's piece q is r + q.
    pieces = [full(333, float(rank + q)) for q in range(world)]
    got = torch.empty(333, device=dev)
    dist.reduce_scatter(got, pieces)
    want = sum(r + rank for r in range(world))
    check(bool(torch.all(got == want)), f"reduce_scatter: {got[:4].tolist()} != {want}")
    got2 = torch.empty(333, device=dev)
    dist.reduce_scatter_tensor(got2, torch.cat(pieces))
    check(torch.equal(got2, got), "reduce_scatter_tensor")
    # all_to_all_single, uneven: rank s sends s + d + 1 elements of 100 s + d to rank d.
    send = torch.cat([full(rank + d + 1, float(100 * rank + d)) for d in range(world)])
    in_splits = [rank + d + 1 for d in range(world)]
    out_splits = [s + rank + 1 for s in range(world)]
    recv = torch.empty(sum(out_splits), device=dev)
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits)
    want = torch.cat([full(s + rank + 1, float(100 * s + rank)) for s in range(world)])
    check(torch.equal(recv, want), f"all_to_all_single: {recv[:4].tolist()}")
    # all_to_all with a list of tensors (equal sizes).
    outs = [torch.empty(5, device=dev) for _ in range(world)]
    dist.all_to_all(outs, [full(5, float(10 * rank + d)) for d in range(world)])
    for s in range(world):
        check(bool(torch.all(outs[s] == 10 * s + rank)), f"all_to_all from {s}: {outs[s].tolist()}")
    # gather and scatter to and from every root.
    for root in range(world):
        gl = [torch.empty(64, device=dev) for _ in range(world)] if rank == root else None
        dist.gather(full(64, float(rank * 7)), gather_list=gl, dst=root)
        if rank == root:
            for q in range(world):
                check(bool(torch.all(gl[q] == q * 7)), f"gather to {root} from {q}: {gl[q][:4].tolist()}")
        out = torch.empty(64, device=dev)
        sl = [full(64, float(root * 100 + q)) for q in range(world)] if rank == root else None
        dist.scatter(out, scatter_list=sl, src=root)
        check(bool(torch.all(out == root * 100 + rank)), f"scatter from {root}: {out[:4].tolist()}")
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank + world - 1) % world
        # send/recv in a ring (even ranks send first, so that blocking calls pair up).
        out, back = full(300 + rank, float(rank)), torch.empty(300 + prv, device=dev)
        if rank % 2 == 0:
            dist.send(out, nxt)
            dist.recv(back, prv)
        else:
            dist.recv(back, prv)
            dist.send(out, nxt)
        check(bool(torch.all(back == prv)), f"send/recv ring: {back[:4].tolist()}")
        back.zero_()
        works = [dist.isend(out, nxt), dist.irecv(back, prv)]
        for w in works:
            w.wait()
        check(bool(torch.all(back == prv)), f"isend/irecv ring: {back[:4].tolist()}")
        back.zero_()
        ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, back, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        check(bool(torch.all(back == prv)), f"batch_isend_irecv ring: {back[:4].tolist()}")
        if not in_rank:
            # recv from any source: rank 0 hears from every other rank, in any order.
            if rank == 0:
                heard = set()
                for _ in range(world - 1):
                    t = torch.empty(3, device=dev)
                    src = dist.recv(t)
                    check(bool(torch.all(t == src)), f"recv from any source: {src} sent {t.tolist()}")
                    heard.add(src)
                check(heard == set(range(1, world)), f"recv from any source heard {sorted(heard)}")
            else:
                dist.send(full(3, float(rank)), 0)
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    late = None
    if in_rank:
        # NCCL's calls are queued on the stream: one still behind GPU work when the process
        # group is destroyed finishes (the communicator is aborted once it drained), as with
        # torch's NCCL backend, rather than being cut off with its output half written.
        late = torch.full((world * 65536,), -1.0, device=dev)
        torch.cuda._sleep(500_000_000)
        dist.all_gather_into_tensor(late, full(65536, float(rank + 1)))
    dist.destroy_process_group()
    if late is not None:
        torch.cuda.synchronize()
        want = torch.arange(1, world + 1, device=dev, dtype=torch.float32).repeat_interleave(65536)
        check(bool(torch.equal(late, want)), f"all_gather queued before destroy_process_group: {late[::65536].tolist()}")
    if rank == 0:
        path = "nccl in the rank" if in_rank else "sidecar" if dev.type == "cuda" else "cpu"
        print(f"torch_cuda: OK ({checks[0]} checks, {world} ranks, {dev}, {path})", flush=True)


if __name__ == "__main__":
    main()
