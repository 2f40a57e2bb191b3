"""One rank of tests/python/test_security.py's per-job quota test (Python SDK; RANK,
WORLD_SIZE, COLLSERVE_SIDECAR, COLLSERVE_JOB, COLLSERVE_TOKEN and COLLSERVE_COORDINATOR set).

    quota_worker.py capped | third | bounded | other

capped  2 ranks of job "capped" (max_sessions 2, max_segment_bytes 3,000,000): a 1 KiB
        all_reduce runs; a 4 MiB one is refused (RESOURCE_EXHAUSTED naming max_segment_bytes)
        while the ranks' small segments stay; they stay attached until "third" was refused.
third   a third session of job "capped" (group "extra"): refused naming max_sessions, then,
        once the capped ranks have left, admitted.
bounded 2 ranks of job "bounded" (max_inflight_collectives 4): rank 0 issues 6 async
        all_reduces while rank 1 waits, so its 5th and 6th are refused, and then an isend,
        refused at once (RESOURCE_EXHAUSTED naming max_inflight_collectives and its sequence
        number, #6: a group's requests count from 0): the sidecar has
        read all 7 by then. Rank 1 then issues its 6. Each all_reduce succeeds on both ranks
        with the right sum or fails on both, the 5th and 6th fail; once both ranks waited for
        all, the quota is free again and a blocking all_reduce runs.
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
    elif mode == "bounded":
        dist.init_process_group()
        if rank == 1:
            store().wait(["bounded/probed"])
        tensors = [np.full(256, float(rank + i), dtype=np.float32) for i in range(6)]
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        if rank == 0:
            probe = dist.isend(np.ones(4, dtype=np.float32), dst=1)
            print("refused:", refused(probe.wait, "max_inflight_collectives 4", '"bounded"', "request #6"),
                  flush=True)
            store().set("bounded/probed", "1")
        outcome = []
        for i, (w, t) in enumerate(zip(works, tensors)):
            try:
                w.wait()
                assert (t == 1.0 + 2 * i).all(), (i, t[:4])
                outcome.append("ok")
            except dist.DistError as e:
                if rank == 0 and i >= 4:
                    assert e.code == 8 and "max_inflight_collectives 4" in str(e), (i, e)
                outcome.append("failed")
        print("outcome:", " ".join(outcome), flush=True)
        assert outcome[4:] == ["failed", "failed"], outcome
        store().set(f"bounded/outcome/{rank}", " ".join(outcome))
        other = store().get(f"bounded/outcome/{1 - rank}").decode()
        assert other == " ".join(outcome), (outcome, other)  # both ranks agree on every op
        t = np.full(256, float(rank + 1), dtype=np.float32)
        dist.all_reduce(t)  # every request of both ranks completed: the quota is free again
        assert (t == 3.0).all(), t[:4]
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
