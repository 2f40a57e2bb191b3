"""One rank of tests/python/test_security.py's per-job quota test (Python SDK; RANK,
WORLD_SIZE, COLLSERVE_SIDECAR, COLLSERVE_JOB, COLLSERVE_TOKEN and COLLSERVE_COORDINATOR set).

    quota_worker.py capped | third | other

capped  2 ranks of job "capped" (max_sessions 2, max_segment_bytes 3,000,000): a 1 KiB
        all_reduce runs; a 4 MiB one is refused (RESOURCE_EXHAUSTED naming max_segment_bytes)
        while the ranks' small segments stay; they stay attached until "third" was refused.
third   a third session of job "capped" (group "extra"): refused naming max_sessions, then,
        once the capped ranks have left, admitted.
other   4 ranks of job "other" (no limits) run 4 MiB all_reduces meanwhile, checked.
Prints "<mode> ok" on success.
"""
import os
import sys

import numpy as np

import collserve as dist
from collserve.store import Store


def store():
    return Store(address=os.environ["COLLSERVE_COORDINATOR"], timeout=60)


def refused(fn, *words):
    try:
        fn()
    except dist.DistError as e:
        assert e.code == 8, f"code {e.code}: {e}"  # RESOURCE_EXHAUSTED
        for w in words:
            assert w in str(e), f"{w!r} not in {e}"
        return str(e)
    raise AssertionError(f"not refused ({words})")


def main():
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    if mode == "capped":
        dist.init_process_group()
        small = np.full(256, float(rank + 1), dtype=np.float32)
        dist.all_reduce(small)
        assert (small == 3.0).all(), small
        big = np.ones(1 << 20, dtype=np.float32)
        print("refused:", refused(lambda: dist.all_reduce(big), "max_segment_bytes 3000000", '"capped"'), flush=True)
        store().set(f"capped/{rank}", "attached")
        store().get("third/refused")  # stay attached until the third session was refused
        dist.all_reduce(small)  # the session still works after the refusal
        dist.destroy_process_group()
        store().set(f"capped/{rank}/left", "1")
    elif mode == "third":
        store().wait(["capped/0", "capped/1"])
        print("refused:", refused(lambda: dist.init_process_group(group_name="extra", rank=0, world_size=1),
                                  "max_sessions 2", '"capped"'), flush=True)
        store().set("third/refused", "1")
        store().wait(["capped/0/left", "capped/1/left"])
        # The two sessions ended (the sidecar stops counting a session before the client's
        # destroy returns): the quota has room again.
        dist.init_process_group(group_name="extra", rank=0, world_size=1)
        t = np.ones(4, dtype=np.float32)
        dist.all_reduce(t)
        dist.destroy_process_group()
    else:
        dist.init_process_group()
        for i in range(3):
            t = np.full(1 << 20, float(rank + i), dtype=np.float32)
            dist.all_reduce(t)
            assert (t == 6.0 + 4 * i).all(), (i, t[:4])
        dist.destroy_process_group()
    print(f"{mode} ok", flush=True)


if __name__ == "__main__":
    main()
