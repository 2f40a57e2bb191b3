#!/usr/bin/env python
"""digits_sgd.py made elastic: a rank that dies does not end the job. The survivors catch
the failed collective (collserve.DistError), re-form the default group in place with
collserve.reconfigure() (new rank and world size, no process restarted), take the model
and optimizer state from rank 0 of the new group (every survivor holds the last step's
state; a broadcast makes them agree exactly even if the failure hit between two of a
step's all_reduces), re-partition the data for the new world size, and go on from the
start of the epoch that failed.

    collserve launch --nproc_per_node 4 examples/digits_sgd_elastic.py --die_rank 2 --die_epoch 5

(--die_rank/--die_epoch make that rank kill itself with SIGKILL halfway through that
epoch: the failure to survive. tests/python/test_elastic.py runs it.) Under `collserve
launch --survive_failures --max_restarts 1` the launcher starts the lost rank again; it
joins at the start of the next epoch (should_reconfigure) and the job ends with 4 ranks.
"""
import argparse
import os
import signal
import time
from math import ceil

import torch
import torch.nn.functional as F
import torch.optim as optim

import collserve as dist
import digits_sgd as base  # the tutorial's Net, data partitioning and evaluation


def sync_state(model, optimizer, epoch):
    """Every rank takes rank 0's parameters, momentum buffers and epoch. Joiners and survivors
    call it from different places on purpose: one call-site name for both (collserve's check
    for a skipped collective compares the callers' stacks)."""
    with dist.call_site("sync_state"):
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
            state = optimizer.state[p]
            if "momentum_buffer" not in state or state["momentum_buffer"] is None:
                state["momentum_buffer"] = torch.zeros_like(p.data)
            dist.broadcast(state["momentum_buffer"], src=0)
        e = torch.tensor([epoch], dtype=torch.int64)
        dist.broadcast(e, src=0)
        return int(e[0])


def wait_for_joiners(world, timeout):
    """Whether ranks wait to join, polling (should_reconfigure) until one does while the group
    has fewer than `world` ranks, for at most `timeout` seconds of rank 0's clock (it decides
    for every rank, so all stop polling together). False at once when the group is complete."""
    deadline = time.monotonic() + timeout
    while dist.get_world_size() < world:
        if dist.should_reconfigure():
            return True
        give_up = torch.tensor([int(time.monotonic() >= deadline)], dtype=torch.int64)
        with dist.call_site("wait_for_joiners"):
            dist.broadcast(give_up, src=0)
        if give_up[0]:
            return False
        time.sleep(0.1)
    return False


def train(epochs, lr, die_rank, die_epoch, epoch_time=0.0, wait_for_world=0, wait_timeout=120.0):
    torch.manual_seed(1234)
    train_data, test = base.digits()
    model = base.Net()
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    first_rank = dist.get_rank()  # this process's rank at the start, for --die_rank
    restarted = os.environ.get("COLLSERVE_ELASTIC_JOIN") == "1"
    epoch = 0
    if restarted:  # started again into the running job: take its state
        epoch = sync_state(model, optimizer, epoch)
        print(f"joined the running job at epoch {epoch} as rank {dist.get_rank()} of {dist.get_world_size()}")
    while epoch < epochs:
        started = time.monotonic()
        try:
            # A restarted rank waits to join; at the last epoch the group may wait for it.
            if dist.should_reconfigure() or (epoch == epochs - 1 and wait_for_joiners(wait_for_world, wait_timeout)):
                rank, world = dist.reconfigure(join_window=3.0)
                epoch = sync_state(model, optimizer, epoch)
                print(f"admitted a joiner at epoch {epoch}: now rank {rank} of {world}")
            train_set, bsz = base.partition_dataset(train_data)
            num_batches = ceil(len(train_set.dataset) / float(bsz))
            epoch_loss = 0.0
            for b, (data, target) in enumerate(train_set):
                if first_rank == die_rank and not restarted and epoch == die_epoch and b == num_batches // 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                loss = F.nll_loss(model(data), target)
                epoch_loss += loss.item()
                loss.backward()
                base.average_gradients(model)
                optimizer.step()
            print(f"Rank {dist.get_rank()} of {dist.get_world_size()}, epoch {epoch}: {epoch_loss / num_batches}")
            epoch += 1
            time.sleep(max(0.0, epoch_time - (time.monotonic() - started)))
        except dist.DistError as e:
            old = (dist.get_rank(), dist.get_world_size())
            mine = dist.last_completed_seq()
            new = dist.reconfigure(join_window=3.0)
            rank, world = new
            # Survivors may disagree on the failed collective (done on some, not others):
            # the epoch is redone from rank 0's state, whose step every survivor had.
            epoch = sync_state(model, optimizer, epoch)
            print(f"reconfigured after {type(e).__name__} in epoch {epoch}: rank {old[0]} of {old[1]} is now "
                  f"rank {rank} of {world}; collectives 0..{new.last_common_seq} of the old group completed on "
                  f"every survivor, this rank completed 0..{mine}")
    return base.evaluate(model, test)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--die_rank", type=int, default=-1, help="this rank kills itself (SIGKILL) ...")
    p.add_argument("--die_epoch", type=int, default=5, help="... halfway through this epoch")
    p.add_argument("--epoch_time", type=float, default=0.0,
                   help="seconds each epoch takes at least (sleeps the rest): the digits model's epochs take a "
                   "fraction of a second, a restarted rank needs seconds to start")
    p.add_argument("--wait_for_world", type=int, default=0,
                   help="at the start of the last epoch, wait (up to --wait_timeout s) for ranks to join while the "
                        "group has fewer than this many (a restarted rank then always rejoins before the end)")
    p.add_argument("--wait_timeout", type=float, default=120.0, help="see --wait_for_world")
    p.add_argument("--min_accuracy", type=float, default=0.0, help="exit 1 if the test accuracy is lower (0-1)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    accuracy = train(args.epochs, args.lr, args.die_rank, args.die_epoch, args.epoch_time,
                     args.wait_for_world, args.wait_timeout)
    print(f"Rank {dist.get_rank()} of {dist.get_world_size()}, test accuracy: {100 * accuracy:.2f}%")
    dist.destroy_process_group()
    if accuracy < args.min_accuracy:
        raise SystemExit(f"test accuracy {accuracy:.4f} is below --min_accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()
