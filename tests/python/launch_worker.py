"""A rank program for the launcher tests (test_launch.py). Modes (argv[1]):
  env        prints the rendezvous variables the launcher set
  token      how the job token reached the rank: whether COLLSERVE_TOKEN is set, the
             token file, its mode and its directory's mode; then `allreduce` (the token works)
  fail       rank 1 exits with code 3 at once; the others wait in a barrier
  record     rank 1 raises ValueError under torch's @record (which writes TORCHELASTIC_ERROR_FILE);
             the others exit 0
  sigterm    prints "ready", then on SIGTERM prints "got SIGTERM" and exits 7
  allreduce  all_reduce of the rank over the world; prints the sum
  late       rank 1 sleeps 7 s before init_process_group; then `allreduce`
  fail_once  rank 1 exits with code 3 in the first attempt (TORCHELASTIC_RESTART_COUNT 0);
             in later ones every rank does `allreduce` and prints the attempt
  intruder   rank 0 sets the job's key "secret" through the SDK, then reads it with a raw
             TCPStore GET on MASTER_PORT as itself and as uid 65534 (setpriv), printing
             "owner: ..." and "nobody: ..." (tcpstore_get.py's "got VALUE" or "closed")
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np

import collserve as dist


def main(mode):
    if mode == "env":
        names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "COLLSERVE_SIDECAR", "COLLSERVE_JOB", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "COLLSERVE_INIT_TIMEOUT_S", "COLLSERVE_RUN_ID"]
        print(" ".join(f"{n}={os.environ.get(n, '')}" for n in names))
        print("to stderr", file=sys.stderr)
    elif mode == "token":
        path = os.environ.get("COLLSERVE_TOKEN_FILE", "")
        modes = (f"{os.stat(path).st_mode & 0o777:o} {os.stat(os.path.dirname(path)).st_mode & 0o777:o}"
                 if path else "- -")
        print(f"COLLSERVE_TOKEN {'set' if 'COLLSERVE_TOKEN' in os.environ else 'unset'} file {path} modes {modes}")
        main("allreduce")
    elif mode == "fail":
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            sys.exit(3)
        try:
            dist.barrier()
        except dist.DistError as e:
            print(f"barrier failed: {type(e).__name__}")
            sys.exit(4)
    elif mode == "sigterm":
        def handler(signum, frame):
            print("got SIGTERM", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, handler)
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)  # idle until the signal the mode is about
        sys.exit(1)
    elif mode == "late":
        if os.environ["RANK"] == "1":
            time.sleep(7)  # the slow rank the mode is about
        main("allreduce")
    elif mode == "fail_once":
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        dist.init_process_group("gloo")
        if attempt == "0" and dist.get_rank() == 1:
            sys.exit(3)
        if attempt == "0":
            try:
                dist.barrier()
            except dist.DistError:
                sys.exit(4)
        t = np.array([dist.get_rank()], dtype=np.int64)
        dist.all_reduce(t)
        print(f"attempt {attempt} of {os.environ['TORCHELASTIC_MAX_RESTARTS']}: world {dist.get_world_size()} "
              f"sum {t[0]}")
    elif mode == "intruder":
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            from collserve.store import Store
            Store(address=os.environ["COLLSERVE_COORDINATOR"]).set("secret", "v1")
            with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcpstore_get.py")) as f:
                client = f.read()
            for who, prefix in (("owner", []),
                                ("nobody", ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"])):
                p = subprocess.run([*prefix, "/usr/bin/python3", "-c", client, os.environ["MASTER_PORT"], "secret"],
                                   capture_output=True, text=True, timeout=60)
                print(f"{who}: {p.stdout.strip() or p.stderr.strip()}")
        dist.barrier()
    elif mode == "record":
        # torch's @record writes the exception that ends a rank to TORCHELASTIC_ERROR_FILE.
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def train():
            if os.environ["RANK"] == "1":
                raise ValueError("rank 1 gives up")
        train()
    elif mode == "allreduce":
        dist.init_process_group("gloo")
        t = np.array([dist.get_rank()], dtype=np.int64)
        dist.all_reduce(t)
        print(f"world {dist.get_world_size()} sum {t[0]}")
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
