"""A torch program in which rank 1 skips one collective, for the call-site check
(tests/python/test_torch_backend.py). RANK/WORLD_SIZE/MASTER_* from the environment; backend
"collserve". Each case runs on a group of its own; every rank numbers its calls and prints
    case CASE: caught at call K: <the error's first line>
(or "case CASE: not caught") and, at the end, "rank R: skips ok".
Cases:
  lines     the calls come from three lines; rank 1 skips the second
  helper    every call goes through one helper function (`def ar(t): dist.all_reduce(t)`)
            from three lines; rank 1 skips the second
  loop      a loop calls the helper from two lines per iteration; rank 1 skips the first
            call of iteration 1
  last      a loop calls the helper once per iteration and the helper is called once more
            after it; rank 1 skips the last iteration's call
  shifted   a loop calls all_reduce from one line; rank 1 skips iteration 1's call and
            issues iteration 2's in its place, the same stack: caught where the loop ends
  named     rank 0 and the others call all_reduce from different stacks inside
            collserve.torch.call_site("sync"): not caught, the sum is right
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

import collserve.torch  # noqa: F401  registers the "collserve" backend


def ar(t, group):
    dist.all_reduce(t, group=group)


class Calls:
    """Numbers a rank's calls; remembers the first that failed."""

    def __init__(self):
        self.n = 0
        self.caught = None

    def __call__(self, fn, *args):
        if self.caught is not None:
            return
        try:
            fn(*args)
        except RuntimeError as e:
            self.caught = (self.n, str(e).splitlines()[0])
        self.n += 1


def run(case, rank, group):
    calls = Calls()
    skip = rank == 1
    t = torch.ones(2)
    if case == "lines":
        calls(dist.all_reduce, t, dist.ReduceOp.SUM, group)
        if not skip:
            calls(dist.all_reduce, t, dist.ReduceOp.SUM, group)
        calls(dist.all_reduce, t, dist.ReduceOp.SUM, group)
    elif case == "helper":
        calls(ar, t, group)
        if not skip:
            calls(ar, t, group)
        calls(ar, t, group)
    elif case == "loop":
        for i in range(3):
            if not (skip and i == 1):
                calls(ar, t, group)
            calls(ar, t, group)
    elif case == "last":
        for i in range(3):
            if not (skip and i == 2):
                calls(ar, t, group)
        calls(ar, t, group)
    elif case == "shifted":
        for i in range(3):
            if not (skip and i == 1):
                calls(dist.all_reduce, t, dist.ReduceOp.SUM, group)
        calls(dist.all_reduce, t, dist.ReduceOp.SUM, group)
    elif case == "named":  # different stacks on purpose, under one name: no error
        with collserve.torch.call_site("sync"):
            if rank == 0:
                calls(ar, t, group)
            else:
                calls(dist.all_reduce, t, dist.ReduceOp.SUM, group)
        assert t.tolist() == [float(dist.get_world_size())] * 2, t
    if calls.caught is None:
        print(f"case {case}: not caught", flush=True)
    else:
        print(f"case {case}: caught at call {calls.caught[0]}: {calls.caught[1]}", flush=True)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("collserve", timeout=datetime.timedelta(seconds=60))
    for case in sys.argv[1:]:
        run(case, rank, dist.new_group(list(range(world))))
        dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: skips ok", flush=True)


if __name__ == "__main__":
    main()
