"""GPU check (tests/gpu/run.sh, one rank under `python -m collserve launch`): a collective whose
GPU work does not finish within the op timeout is a clear error, not a hang. The rank queues an
all_reduce behind a ~6 s GPU sleep on its stream with a 2 s op timeout: the sidecar answers it
(the work is queued), and the next collective, issued 2.5 s later, finds the first still
unfinished on the GPU and fails with DEADLINE_EXCEEDED naming it; the group is then failed and
later calls fail at once. Prints "timeout_cuda: OK"."""
import sys
import time

import torch

import collserve.distributed_c10d as dist


def main():
    dist.init_process_group(timeout=2.0)
    dev = torch.device("cuda", 0)
    x = torch.ones(1024, device=dev)
    torch.cuda._sleep(12_000_000_000)  # ~6 s of GPU time at ~2 GHz
    dist.all_reduce(x)                  # queued behind the sleep: answered at once
    time.sleep(2.5)
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        raise AssertionError("the second all_reduce succeeded while the first was stuck on the GPU")
    except Exception as e:  # noqa: BLE001 (the SDK's error hierarchy)
        took = time.monotonic() - start
        assert "has not finished" in str(e) and took < 10, (type(e).__name__, str(e), took)
        print(f"timeout_cuda: first error after {took:.2f} s: {type(e).__name__}: {e}")
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        raise AssertionError("a failed group accepted another collective")
    except Exception as e:  # noqa: BLE001
        assert time.monotonic() - start < 5, "a failed group's call did not fail fast"
    print("timeout_cuda: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
