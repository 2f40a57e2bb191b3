"""A rank that keeps its job going through a lost host (issue 17): all_reduce of ones in a
loop, each result checked against the world size; on a DistError it re-forms the group
with collserve.reconfigure and goes on; every 20 iterations it admits ranks waiting to
join (should_reconfigure). Exits 0 after 20 successful iterations in a group of argv[1]
ranks, one that was re-formed unless argv[2] is "any". Used by
tests/fault/multihost_netns_test.cc (ranks in network namespaces) and test_elastic.py."""
import sys
import time

import numpy as np

import collserve as dist


def main(final_world, any_group):
    dist.init_process_group("gloo")
    print(f"init: rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    # n: iterations in the current group; every member of a group counts alike, so they
    # all call should_reconfigure (a collective) at the same points and stop together.
    reformed, n = any_group, 0
    while not (reformed and dist.get_world_size() == final_world and n >= 20):
        try:
            if n % 20 == 19 and dist.should_reconfigure():
                rank, world = dist.reconfigure(join_window=3.0)
                print(f"admitted joiners: rank {rank} of {world}", flush=True)
                n = 0
            t = np.ones(1024, dtype=np.int64)
            dist.all_reduce(t)
            if not (t == dist.get_world_size()).all():
                print(f"wrong sum {t[0]} for world {dist.get_world_size()}", flush=True)
                sys.exit(1)
            n += 1
            if n % 20 == 0 or reformed:
                print(f"iter {n} ok: world {dist.get_world_size()}", flush=True)
            time.sleep(0.005)  # paces the loop; orders nothing
        except dist.DistError as e:
            print(f"failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            start = time.monotonic()
            rank, world = dist.reconfigure(join_window=3.0)
            print(f"reformed after {time.monotonic() - start:.1f} s: rank {rank} of {world}", flush=True)
            reformed, n = True, 0
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "any")
