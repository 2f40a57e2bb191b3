"""One rank of a torch program using collserve.torch's recovery and lifecycle calls, for
tests/python/test_torch_backend.py (4 ranks; a coordinator and sidecar that outlive the
ranks, named by COLLSERVE_COORDINATOR and COLLSERVE_SIDECAR; RANK/WORLD_SIZE set).

    torch_lifecycle_worker.py SCENARIO INIT_DIR

SCENARIO:
  lifecycle      split_group; set_timeout (torch's _set_pg_timeout on 2.x) then a collective
                 rank 3 skips: DEADLINE_EXCEEDED within the new timeout and get_error() says
                 TIMEOUT; shrink_group([3]) after rank 3 exits: ranks 0-2 re-form
  abort          abort() (torch's _abort_process_group on 2.x) fails an operation in flight
                 at once; shutdown() waits for one in flight; later calls name the reason
  monitored      monitored_barrier times out naming rank 3 (alive, late); ranks 0-2
                 reconfigure() into 3; rank 3 then finds its group over, calls reconfigure()
                 too late and is admitted at the next re-formation (should_reconfigure): 4 again
INIT_DIR: a directory for the FileStore of the first init. Success prints "rank R: SCENARIO ok".
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import collserve.torch as cst
from collserve.store import Store

TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def raises(fn, *words):
    """Runs fn; returns the RuntimeError's text, which must contain every word."""
    try:
        fn()
    except RuntimeError as e:
        text = str(e)
        for w in words:
            check(w in text, f"{w!r} not in {text!r}")
        return text
    raise AssertionError(f"no RuntimeError (wanted one with {words})")


def all_reduce_sum(value):
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    return t.item()


def store():
    return Store(address=os.environ["COLLSERVE_COORDINATOR"], timeout=60)


def lifecycle(rank):
    # split_group: two splits, then one that leaves ranks 1 and 3 out.
    pair = cst.split_group(split_ranks=[[0, 1], [2, 3]])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=pair)
    check(t.item() == (1.0 if rank < 2 else 5.0), f"split all_reduce gave {t.item()}")
    odd = cst.split_group(split_ranks=[[0, 2]])
    check((odd is None) == (rank in (1, 3)), f"rank {rank} got {odd}")
    if odd is not None:
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=odd)
        check(t.item() == 2.0, "split [0, 2]")
    check(cst.get_error() is None, "no error yet")
    # A shorter timeout: rank 3 skips a collective, the others fail within it.
    if TORCH2:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=1.5))
    else:
        cst.set_timeout(1.5)
    if rank == 3:
        store().get("test/timed_out")  # until the others failed
    else:
        start = time.monotonic()
        raises(lambda: all_reduce_sum(1), "DEADLINE_EXCEEDED")
        took = time.monotonic() - start
        check(took < 15, f"the all_reduce failed after {took:.1f} s, not within the 1.5 s timeout")
        error = cst.get_error()
        check(error is not None and error.kind == "TIMEOUT" and error.code == "DEADLINE_EXCEEDED", f"{error}")
        if rank == 0:
            store().set("test/timed_out", "1")
    # shrink_group: rank 3 leaves for good; the others re-form without it.
    if rank == 3:
        print(f"rank {rank}: lifecycle ok", flush=True)
        os._exit(0)
    group = cst.shrink_group([3])
    check(dist.get_world_size() == 3 and dist.get_rank() == rank and group.size() == 3, "shrunk to 3")
    cst.set_timeout(60)
    check(all_reduce_sum(rank) == 3.0, "all_reduce after shrink")
    check(cst.get_error() is None, "a new group has no error")
    dist.destroy_process_group()
    print(f"rank {rank}: lifecycle ok", flush=True)


def abort(rank):
    # An operation in flight on rank 0 only (the others never issue it): abort fails it now.
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), async_op=True)
        time.sleep(0.2)
        start = time.monotonic()
        if TORCH2:
            dist.distributed_c10d._abort_process_group()  # also destroys torch's bookkeeping
        else:
            cst.abort()
        raises(work.wait, "collserve")
        check(time.monotonic() - start < 10, "abort did not end the operation at once")
        if not TORCH2:
            raises(lambda: all_reduce_sum(1), "aborted")
        store().set("test/aborted", "1")
    else:
        store().get("test/aborted")
        if TORCH2:
            dist.distributed_c10d._abort_process_group()
        else:
            cst.abort()
    if dist.is_initialized():
        dist.destroy_process_group()
    # Again, then a graceful shutdown with an operation in flight on every rank: it completes.
    dist.init_process_group("collserve", store=dist.FileStore(sys.argv[2] + "/again", 4), rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.full((4,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    check(cst.shutdown(timeout=30), "shutdown found an operation still in flight")
    work.wait()
    check(torch.equal(t, torch.full((4,), 6.0)), f"{t}")
    raises(lambda: all_reduce_sum(1), "shut down")
    dist.destroy_process_group()
    print(f"rank {rank}: abort ok", flush=True)


def monitored(rank):
    if rank == 3:
        store().get("test/reformed")  # late: the others time out, re-form and run without it
        raises(lambda: all_reduce_sum(1), "collserve")  # its old group is over
        new = cst.reconfigure(join_window=1.0)
        check(new.world_size == 4 and new.rank == 3 and new.last_common_seq == -1, f"{new}")
    else:
        text = raises(lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=2)), "3")
        check("monitored_barrier" in text or "Rank" in text, text)
        new = cst.reconfigure(join_window=1.0)
        check(new.world_size == 3 and new.rank == rank, f"{new}")
        check(all_reduce_sum(1) == 3.0, "all_reduce of the three")
        if rank == 0:
            store().set("test/reformed", "1")
        # Rank 3 comes back as a joiner: every rank checks until it is there, then admits it.
        deadline = time.monotonic() + 60
        while not cst.should_reconfigure():
            check(time.monotonic() < deadline, "rank 3 never asked to join")
            time.sleep(0.05)
        new = cst.reconfigure(join_window=5.0)
        check(new.world_size == 4 and new.rank == rank, f"{new}")
    check(dist.get_world_size() == 4, "four again")
    check(all_reduce_sum(rank) == 6.0, "all_reduce of the four")
    dist.destroy_process_group()
    print(f"rank {rank}: monitored ok", flush=True)


def main():
    scenario, init_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    dist.init_process_group("collserve", store=dist.FileStore(init_dir + "/init", 4), rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    {"lifecycle": lifecycle, "abort": abort, "monitored": monitored}[scenario](rank)


if __name__ == "__main__":
    main()
