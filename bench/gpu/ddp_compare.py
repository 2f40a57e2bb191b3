#!/usr/bin/env python3
"""GPU acceptance: DistributedDataParallel over collserve's pure-Python backend
(collserve.torch_pg, torch >= 2) trains to the same parameters as over NCCL or Gloo.

Train (mode A): N ranks train the same small MLP (64 -> 128 -> 10, float32, init from
torch.manual_seed(0) on the CPU), each on its own fixed synthetic data (a CPU generator seeded
by rank and step; identical whatever the device), with SGD lr 0.1 for --steps (20) steps,
DistributedDataParallel with its default bucket settings. Rank 0 writes the final parameters,
flattened, to --out (torch.save of a dict: params, backend, ranks, device, torch version).

    # collserve: N ranks on cuda:0 (several processes may share one GPU), started with the
    # collserve launcher (this script re-executes itself under `python -m collserve launch`
    # unless it already runs under it, i.e. RANK is set)
    python bench/gpu/ddp_compare.py --backend collserve --ranks 4 --out /tmp/cs4.pt
    # nccl: cuda:0 too, so one rank only (NCCL refuses two ranks on one GPU); mp.spawn + env://
    python bench/gpu/ddp_compare.py --backend nccl --ranks 1 --out /tmp/nccl1.pt
    # gloo: the CPU reference, any N; mp.spawn + env://
    python bench/gpu/ddp_compare.py --backend gloo --ranks 4 --out /tmp/gloo4.pt

Compare (mode B): prints the max absolute difference, the relative difference
max|a - b| / max|b| (the criterion) and the largest element-wise |a - b| / |b| (over elements
with |b| >= 1e-3, for information), then PASS or FAIL (exit code 1) against --rtol:

    python bench/gpu/ddp_compare.py --compare /tmp/cs4.pt /tmp/gloo4.pt --rtol 1e-5

CUDA matmuls run in full float32 (TF32 off), so a GPU run and a CPU run differ only by the
order of floating-point operations. --device cpu runs the collserve ranks on CPU tensors
(the SDK's CPU path), e.g. on torch 1.13 where the backend cannot be registered: the group
is then built directly (CollserveProcessGroup.connect) instead of by init_process_group.
"""
import argparse
import datetime
import os
import socket
import subprocess
import sys
import time

IN, HIDDEN, OUT = 64, 128, 10
BATCH = 32
LR = 0.1


def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def _batch(torch, rank, step):
    g = torch.Generator().manual_seed(10007 * (rank + 1) + step)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)


def _train(args, rank, world):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    timeout = datetime.timedelta(seconds=args.timeout_s)
    pg = None
    if args.backend == "collserve":
        import collserve
        try:
            from collserve import torch_pg
        except ImportError:  # a build tree that predates torch_pg.py: take it from the sources
            collserve.__path__.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python",
                                                   "collserve"))
            from collserve import torch_pg
        if torch_pg.TORCH_MAJOR >= 2:
            dist.init_process_group("collserve", rank=rank, world_size=world, timeout=timeout)
        else:
            pg = torch_pg.CollserveProcessGroup.connect(rank, world, timeout=timeout, group="ddp_compare")
    else:
        dist.init_process_group(args.backend, rank=rank, world_size=world, timeout=timeout)
    if pg is None:
        print(f"rank {rank}: backend {dist.get_backend()} world {dist.get_world_size()} on {device}", flush=True)

    model = _model(torch).to(device)
    ddp = DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None, process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    start = time.monotonic()
    for step in range(args.steps):
        x, y = _batch(torch, rank, step)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    flat = torch.cat([p.detach().to("cpu").reshape(-1) for p in model.parameters()])
    if rank == 0:
        torch.save({"params": flat, "backend": args.backend, "ranks": world, "device": str(device),
                    "steps": args.steps, "torch": str(torch.__version__)}, args.out)
        print(f"rank 0: {args.steps} steps in {elapsed:.3f}s, last loss {loss.item():.6f}, "
              f"{flat.numel()} parameters written to {args.out}", flush=True)
    if pg is None:
        dist.barrier()
        dist.destroy_process_group()


def _spawned(local_rank, args, world):
    _train(args, local_rank, world)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args):
    if args.backend == "nccl" and args.ranks != 1:
        raise SystemExit("nccl: every rank runs on cuda:0 and NCCL cannot put one GPU twice in a communicator: "
                         "use --ranks 1")
    if args.backend == "gloo" and args.device != "cpu":
        args.device = "cpu"
    if args.backend == "collserve":
        if "RANK" in os.environ:  # under the launcher
            _train(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
            return 0
        cmd = [sys.executable, "-m", "collserve", "launch", "--nproc_per_node", str(args.ranks),
               os.path.abspath(__file__), *sys.argv[1:]]
        print("running:", " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    import torch.multiprocessing as mp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    mp.spawn(_spawned, args=(args, args.ranks), nprocs=args.ranks, join=True)
    return 0


def compare(a_path, b_path, rtol):
    import torch
    a, b = torch.load(a_path), torch.load(b_path)
    pa, pb = a["params"].double(), b["params"].double()
    print(f"A: {a_path}: {a['backend']} x{a['ranks']} on {a['device']}, {a['steps']} steps, torch {a['torch']}")
    print(f"B: {b_path}: {b['backend']} x{b['ranks']} on {b['device']}, {b['steps']} steps, torch {b['torch']}")
    if pa.shape != pb.shape or a["steps"] != b["steps"]:
        print(f"FAIL: not comparable (shapes {tuple(pa.shape)} vs {tuple(pb.shape)}, steps {a['steps']} vs "
              f"{b['steps']})")
        return 1
    if a["ranks"] != b["ranks"]:
        print(f"note: the runs have different rank counts ({a['ranks']} vs {b['ranks']}): they trained on "
              "different data and are not expected to match")
    diff = (pa - pb).abs()
    max_abs = diff.max().item()
    rel = max_abs / max(pb.abs().max().item(), 1e-30)
    big = pb.abs() >= 1e-3
    elem = (diff[big] / pb.abs()[big]).max().item() if big.any() else 0.0
    print(f"max abs diff {max_abs:.3e}; max relative diff (max|a-b|/max|b|) {rel:.3e}; "
          f"max element-wise relative diff (|b| >= 1e-3) {elem:.3e}; rtol {rtol:g}")
    ok = rel <= rtol
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["collserve", "nccl", "gloo"])
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--out", help="where rank 0 writes the final parameters (.pt)")
    p.add_argument("--device", default=None, help="cuda:0 (default; gloo: cpu) or cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout_s", type=float, default=300.0)
    p.add_argument("--compare", nargs=2, metavar=("A.pt", "B.pt"))
    p.add_argument("--rtol", type=float, default=1e-5)
    args = p.parse_args(argv)
    if args.compare:
        return compare(args.compare[0], args.compare[1], args.rtol)
    if not args.backend or not args.out:
        p.error("train mode needs --backend and --out (or use --compare A.pt B.pt)")
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if args.device is None:
        args.device = "cpu" if args.backend == "gloo" else "cuda:0"
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
