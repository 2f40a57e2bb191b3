#!/usr/bin/env python
"""DistributedDataParallel on the digits data through torch.distributed's "collserve"
backend, surviving a lost rank without restarting the others.

    collserve launch --nproc_per_node 4 --survive_failures --max_restarts 1 \\
        examples/ddp_elastic.py --die_rank 2 --die_step 100

Rank 2 kills itself (SIGKILL) at the start of step 100. The three survivors' step 100 fails
in DDP's gradient all_reduce (RuntimeError); each calls collserve.torch.reconfigure(), which
re-forms torch's default process group among them in place (new ranks and world size, no
process restarted), builds DDP again over it (its constructor broadcasts rank 0's
parameters), takes the step counter and momentum buffers from the new rank 0, and redoes step
100: nothing completed is lost or redone. The launcher starts rank 2 again (--max_restarts);
the new process calls collserve.torch.join_running_group(), and the survivors admit it at
their next check (should_reconfigure() every --rejoin_every steps): from then on the job
runs with four ranks again.

The same program recovers the usual way with --recovery restart: under `collserve launch
--max_restarts 3` (no --survive_failures) the launcher stops every rank when one fails and
starts them all again; they resume from the last checkpoint (--checkpoint_every steps, in
--checkpoint_dir), redoing the steps after it. bench/recovery.py times both.

Every global step takes 64 samples of a fixed per-epoch shuffle, split among the ranks of
that step's world (rank r takes every world_size-th), so a step means the same data at any
world size. Each rank prints one "EVENT {json}" line per completed step (its step, rank,
world size, wall time, and a checksum of the parameters: DDP keeps every replica equal, so
every rank of a step prints the same one) and for a kill, a recovery and an admission.
"""
import argparse
import json
import os
import signal
import sys
import time
from random import Random

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import collserve.torch as cst
import digits_sgd as base  # the tutorial's Net and the digits data

base.dist = dist  # its evaluate() on torch.distributed

GLOBAL_BATCH = 64


def event(kind, **fields):
    print("EVENT " + json.dumps(dict(kind=kind, time=time.time(), **fields)), flush=True)


def checksum(model):
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def batch(train, step, rank, world):
    """Rank `rank`'s share of global step `step`'s samples."""
    per_epoch = len(train) // GLOBAL_BATCH
    epoch, i = divmod(step, per_epoch)
    order = list(range(len(train)))
    Random(1000 + epoch).shuffle(order)
    picked = order[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH][rank::world]
    return torch.stack([train[k][0] for k in picked]), torch.stack([train[k][1] for k in picked])


def make_ddp(module):
    """DDP over the current default group. Survivors build it after reconfigure and joiners
    after join_running_group, from different lines: one call-site name for both (collserve
    checks that every rank issues a collective from the same place)."""
    with cst.call_site("ddp_elastic.make_ddp"):
        return DDP(module)


def sync(step, optimizer):
    """Every rank takes the new rank 0's step counter and momentum buffers (DDP's
    constructor already gave it rank 0's parameters)."""
    with cst.call_site("ddp_elastic.sync"):
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p.data)
                dist.broadcast(state["momentum_buffer"], src=0)
        s = torch.tensor([step], dtype=torch.int64)
        dist.broadcast(s, src=0)
        return int(s[0])


def wait_for_joiners(world, timeout):
    """Whether ranks wait to join, polling (should_reconfigure) until one does while the group
    has fewer than `world` ranks, for at most `timeout` seconds of rank 0's clock (it decides
    for every rank, so all stop polling together). False at once when the group is complete."""
    deadline = time.monotonic() + timeout
    while dist.get_world_size() < world:
        if cst.should_reconfigure():
            return True
        give_up = torch.tensor([int(time.monotonic() >= deadline)], dtype=torch.int64)
        dist.broadcast(give_up, src=0)
        if give_up[0]:
            return False
        time.sleep(0.1)
    return False


def save(path, model, optimizer, step):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="global steps to train")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--die_rank", type=int, default=-1, help="this launch rank kills itself (SIGKILL) ...")
    p.add_argument("--die_step", type=int, default=100, help="... at the start of this step")
    p.add_argument("--recovery", choices=["inplace", "restart"], default="inplace")
    p.add_argument("--join_window", type=float, default=5.0,
                   help="reconfigure's join window: how long it waits for a rank that is alive but does not come")
    p.add_argument("--rejoin_every", type=int, default=10, help="steps between checks for ranks waiting to join")
    p.add_argument("--wait_for_world", type=int, default=0,
                   help="at the last check for joiners, wait (up to --wait_timeout s) for ranks to join while the "
                        "group has fewer than this many (a restarted rank then always rejoins before the end)")
    p.add_argument("--wait_timeout", type=float, default=120.0, help="see --wait_for_world")
    p.add_argument("--checkpoint_dir", default="", help="--recovery restart: where rank 0 checkpoints")
    p.add_argument("--checkpoint_every", type=int, default=30, help="--recovery restart: steps between checkpoints")
    p.add_argument("--step_time", type=float, default=0.0,
                   help="seconds each step takes at least (sleeps the rest): paces the tiny model like a larger one")
    p.add_argument("--min_accuracy", type=float, default=0.0, help="exit 1 if the test accuracy is lower (0-1)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    train, test = base.digits()
    model = base.Net(dropout=0.0)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    launch_rank = int(os.environ.get("RANK", "0"))
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or cst.joining()
    step = 0
    checked = -1  # the step whose check for joiners this group made (or is formed at)
    if args.recovery == "inplace" and cst.joining():
        joined = cst.join_running_group()
        ddp = make_ddp(model)
        step = checked = sync(step, optimizer)
        event("joined", step=step, rank=joined.rank, world=joined.world_size)
    else:
        dist.init_process_group("collserve")
        checkpoint = os.path.join(args.checkpoint_dir, "checkpoint.pt") if args.checkpoint_dir else ""
        if args.recovery == "restart" and checkpoint and os.path.exists(checkpoint):
            state = torch.load(checkpoint)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
            event("resumed", step=step, rank=dist.get_rank(), world=dist.get_world_size())
        ddp = make_ddp(model)
    while step < args.steps:
        try:
            # Every rank of the group checks at the same steps; a group formed at step s
            # (recovery, admission) does not check again at s.
            if args.recovery == "inplace" and step % args.rejoin_every == 0 and step != checked:
                checked = step
                last_check = step + args.rejoin_every >= args.steps
                if cst.should_reconfigure() or (last_check and wait_for_joiners(args.wait_for_world,
                                                                                 args.wait_timeout)):
                    new = cst.reconfigure(join_window=args.join_window)
                    ddp = make_ddp(model)
                    step = checked = sync(step, optimizer)
                    event("admitted", step=step, rank=new.rank, world=new.world_size)
            if launch_rank == args.die_rank and step == args.die_step and not restarted:
                event("kill", step=step, rank=dist.get_rank(), world=dist.get_world_size())
                os.kill(os.getpid(), signal.SIGKILL)
            started = time.monotonic()
            data, target = batch(train, step, dist.get_rank(), dist.get_world_size())
            optimizer.zero_grad()
            loss = F.nll_loss(ddp(data), target)
            loss.backward()
            optimizer.step()
            time.sleep(max(0.0, args.step_time - (time.monotonic() - started)))
            event("step", step=step, rank=dist.get_rank(), world=dist.get_world_size(), loss=float(loss),
                  checksum=checksum(model))
            step += 1
            if args.recovery == "restart" and args.checkpoint_dir and step % args.checkpoint_every == 0 \
                    and dist.get_rank() == 0:
                save(os.path.join(args.checkpoint_dir, "checkpoint.pt"), model, optimizer, step)
        except RuntimeError as e:
            if args.recovery != "inplace":
                raise
            failed = time.time()
            old = (dist.get_rank(), dist.get_world_size())
            new = cst.reconfigure(join_window=args.join_window)
            ddp = make_ddp(model)
            step = checked = sync(step, optimizer)
            event("recovered", step=step, rank=new.rank, world=new.world_size, old_rank=old[0], old_world=old[1],
                  last_common_seq=new.last_common_seq, reconfigure_s=time.time() - failed,
                  error=str(e).splitlines()[0][:200])
    accuracy = base.evaluate(model, test)
    print(f"Rank {dist.get_rank()} of {dist.get_world_size()}: test accuracy {100 * accuracy:.2f}% after {step} steps",
          flush=True)
    dist.destroy_process_group()
    if accuracy < args.min_accuracy:
        sys.exit(f"test accuracy {accuracy:.4f} is below --min_accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()
