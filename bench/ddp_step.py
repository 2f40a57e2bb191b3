#!/usr/bin/env python3
"""What users feel: the step time of unmodified DistributedDataParallel training, one
process per rank under a launcher (env://), with a torch.distributed backend chosen by name:

    collserve launch --nproc_per_node 4 bench/ddp_step.py --backend collserve
    collserve launch --nproc_per_node 4 bench/ddp_step.py --backend gloo

The model is an MLP of --width (default 4096) with a 1024-wide input and output: about 25.2M
float32 parameters (96 MiB of gradients per step), batch --batch (8) of random data, SGD.
Each rank runs -w warm-up steps, then -n timed steps; a step is forward, backward (DDP's
gradient all_reduces, in buckets of --bucket_cap_mb, DDP's default 25) and the optimizer
step. `--backend none` runs the same steps with no DDP and no communication, every rank on
its own at the same time (the same load on the cores): the step time of an infinitely fast
backend, which bounds the speed-up any backend can give. Rank 0 prints one line of JSON: the backend, the parameter count and the median and
mean step time in milliseconds over the timed steps (each step's time is the max over the
ranks, gathered after the timed loop). Every rank uses one intra-op thread, so the ranks do
not oversubscribe the cores whichever backend runs.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "collserve", "none"],
                   help="none: the same steps without DDP or any communication, every rank on its own (the "
                        "step time an infinitely fast backend would give, on the same loaded cores)")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bucket_cap_mb", type=float, default=25.0)
    p.add_argument("-n", type=int, default=10, help="timed steps")
    p.add_argument("-w", type=int, default=3, help="warm-up steps")
    a = p.parse_args()
    if a.backend == "collserve":
        import collserve.torch  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    if a.backend == "none":
        rank = int(os.environ.get("RANK", "0"))
    else:
        dist.init_process_group(a.backend)
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, a.width), nn.ReLU(), nn.Linear(a.width, a.width), nn.ReLU(),
                          nn.Linear(a.width, 1024))
    params = sum(p.numel() for p in model.parameters())
    ddp = model if a.backend == "none" else nn.parallel.DistributedDataParallel(model,
                                                                               bucket_cap_mb=a.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(a.batch, 1024, generator=g)
    y = torch.randn(a.batch, 1024, generator=g)
    times = []
    for step in range(a.w + a.n):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        if step >= a.w:
            times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    if a.backend == "none":
        if rank == 0:
            report(a, rank, int(os.environ.get("WORLD_SIZE", "1")), params, t)
        return
    # Each step's time is the slowest rank's.
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # The replicas must agree (DDP averaged the same gradients everywhere).
    first = next(model.parameters()).detach().flatten()[:1024].clone()
    ref = first.clone()
    dist.broadcast(ref, 0)
    if not torch.equal(first, ref):
        raise SystemExit(f"rank {rank}: parameters differ from rank 0's after training")
    if rank == 0:
        report(a, rank, dist.get_world_size(), params, t)
    dist.destroy_process_group()


def report(a, rank, world_size, params, t):
    ms = [v * 1e3 for v in t.tolist()]
    print(json.dumps({"backend": a.backend, "ranks": world_size, "parameters": params, "batch": a.batch,
                      "steps": a.n, "median_ms": statistics.median(ms), "mean_ms": statistics.mean(ms)}),
          flush=True)


if __name__ == "__main__":
    main()
