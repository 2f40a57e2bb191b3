"""A rank that keeps its job going through a lost host (issue 17): all_reduce of ones in a
loop, each result checked against the world size; on a DistError it re-forms the group
with collserve.reconfigure and goes on. Exits 0 after argv[1] successful iterations in a
re-formed group. Used by tests/fault/multihost_netns_test.cc (ranks in network namespaces)."""
import sys
import time

import numpy as np

import collserve as dist


def main(iters_after):
    dist.init_process_group("gloo")
    print(f"init: rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    reformed, after, i = False, 0, 0
    while not reformed or after < iters_after:
        try:
            t = np.ones(1024, dtype=np.int64)
            dist.all_reduce(t)
            if not (t == dist.get_world_size()).all():
                print(f"wrong sum {t[0]} for world {dist.get_world_size()}", flush=True)
                sys.exit(1)
            i += 1
            after += reformed
            if i % 20 == 0 or reformed:
                print(f"iter {i} ok: world {dist.get_world_size()}", flush=True)
            time.sleep(0.005)
        except dist.DistError as e:
            print(f"failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            start = time.monotonic()
            rank, world = dist.reconfigure(join_window=3.0)
            print(f"reformed after {time.monotonic() - start:.1f} s: rank {rank} of {world}", flush=True)
            reformed = True
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
