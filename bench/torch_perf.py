#!/usr/bin/env python3
"""torch.distributed's side of the comparison: the sizes, columns and timing method of
collserve-perf (bench/collserve_perf.cc; nccl-tests' columns and bus factors) for a
torch.distributed backend, one process per rank under a launcher (env://):

    collserve launch --nproc_per_node 4 bench/torch_perf.py --backend gloo -b 8 -e 64M -f 4 -o all_reduce

--backend gloo is torch's own Gloo; --backend collserve is collserve's c10d backend. Each
rank issues -n ops back to back (async_op=True) after -w warm-up ones (also back to
back) and waits for them all; time is each rank's mean per op, averaged over ranks. torch 1.13's Gloo has no
reduce_scatter: -o reduce_scatter times its all_reduce-based equivalent (all_reduce of
the whole input, then this rank's block copied out), and the header says so; nor
_allgather_base: all_gather is the list form into views of one output tensor. all_to_all
is all_to_all_single, send_recv is an isend/irecv ring. With --backend collserve,
`-m arena` allocates the tensors with collserve.torch.empty (the sidecar's shared-memory
arena: no copy between the process and the sidecar); the default `-m heap` uses torch.zeros.
Only the out-of-place or in-place column that torch's call has is filled, as collserve-perf.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0,
           "all_to_all": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}
IN_PLACE = {"all_reduce", "broadcast", "reduce"}
DTYPES = {"float": torch.float32, "double": torch.float64, "int32": torch.int32, "int64": torch.int64}


def parse_bytes(text):
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def value(rank, n):
    return ((torch.arange(n, dtype=torch.int64) % 13) + 1) * (rank + 1)


class Bench:
    def __init__(self, op, dtype, root):
        self.op, self.dtype, self.root = op, dtype, root
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.sends = []

    def count(self, nbytes):
        c = nbytes // torch.tensor([], dtype=self.dtype).element_size()
        return c - c % self.n if self.op in ("all_gather", "reduce_scatter", "all_to_all") else c

    def issue(self, inp, out, count):
        op, n, block = self.op, self.n, count // self.n
        if op == "all_reduce":
            return dist.all_reduce(inp, async_op=True)
        if op == "broadcast":
            return dist.broadcast(inp, self.root, async_op=True)
        if op == "reduce":
            return dist.reduce(inp, self.root, async_op=True)
        if op == "all_gather":  # the list form into views of one tensor (1.13's Gloo has no _allgather_base)
            return dist.all_gather(list(out[:n * block].chunk(n)) if block else [out[:0]] * n, inp[:block],
                                   async_op=True)
        if op == "reduce_scatter":  # all_reduce-based: 1.13's Gloo has no reduce_scatter
            work = dist.all_reduce(inp, async_op=True)
            fut = work.get_future().then(lambda f: out[:block].copy_(f.value()[0][self.rank * block:][:block]))
            return fut
        if op == "all_to_all":
            return dist.all_to_all_single(out, inp, async_op=True)
        if op == "send_recv":
            self.sends.append(dist.isend(inp, (self.rank + 1) % n))
            return dist.irecv(out, (self.rank + n - 1) % n)
        raise SystemExit(f"unknown op {op}")

    def wait(self, work):
        work.wait()
        for s in self.sends:
            s.wait()
        self.sends.clear()

    def check(self, inp, out, count):
        n, rank, block = self.n, self.rank, count // self.n
        inp.copy_(value(rank, count))
        self.wait(self.issue(inp, out, count))
        pattern = value(0, count).to(torch.float64)
        total = n * (n + 1) / 2
        op = self.op
        if op == "all_reduce":
            got, want = inp, pattern * total
        elif op == "broadcast":
            got, want = inp, pattern * (self.root + 1)
        elif op == "reduce":
            got, want = (inp, pattern * total) if rank == self.root else (inp[:0], inp[:0])
        elif op == "all_gather":
            got, want = out, torch.cat([value(r, block) for r in range(n)])
        elif op == "reduce_scatter":
            got, want = out[:block], pattern[rank * block:][:block] * total
        elif op == "all_to_all":
            got, want = out, torch.cat([value(r, count)[rank * block:][:block] for r in range(n)])
        else:
            got, want = out, value((rank + n - 1) % n, count)
        return int((got.to(torch.float64) != want.to(torch.float64)).sum())

    def time(self, inp, out, count, warmup, iters, blocking=False):
        """Mean us per op; blocking: each op waited for before the next (-z 1)."""
        def run(ops):
            # Warm-up ops issued as the timed ones (and as nccl-tests does).
            if blocking:
                for _ in range(ops):
                    self.wait(self.issue(inp, out, count))
                return
            for w in [self.issue(inp, out, count) for _ in range(ops)]:
                self.wait(w)
        run(warmup)
        dist.barrier()
        start = time.perf_counter()
        run(iters)
        return (time.perf_counter() - start) / iters * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "collserve"])
    p.add_argument("-b", default="8")
    p.add_argument("-e", default="32M")
    p.add_argument("-f", type=int, default=2)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    p.add_argument("-o", default="all_reduce", choices=sorted(FACTORS))
    p.add_argument("-d", default="float", choices=sorted(DTYPES))
    p.add_argument("-r", type=int, default=0)
    p.add_argument("-c", type=int, default=1)
    p.add_argument("-z", type=int, default=0, help="1: wait for each op before the next (latency), as nccl-tests' -z")
    p.add_argument("-m", default="heap", choices=["heap", "arena"],
                   help="tensor memory: torch.zeros, or collserve.torch.empty (--backend collserve)")
    a = p.parse_args()
    if a.m == "arena" and a.backend != "collserve":
        p.error("-m arena needs --backend collserve")
    if a.backend == "collserve":
        import collserve.torch  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group(a.backend)
    dtype = DTYPES[a.d]
    rank, n = dist.get_rank(), dist.get_world_size()
    root = a.r if a.o in ("broadcast", "reduce") else -1
    bench = Bench(a.o, dtype, max(root, 0))

    def mean(v):
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item() / n
    if rank == 0:
        note = " (reduce_scatter = all_reduce + copy of this rank's block)" if a.o == "reduce_scatter" else ""
        print(f"# torch_perf: torch {torch.__version__} {a.backend}, {a.o}{note}, {a.d}, {n} ranks, "
              f"-n {a.n} -w {a.w} -c {a.c} -z {a.z} -m {a.m}")
        print(f"#{'out-of-place':>62}{'in-place':>32}")
        print("#%11s %12s %8s %6s %6s %8s %7s %7s %6s %8s %7s %7s %6s" % (
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
            "#wrong"))
    busbws, wrong_total = [], 0
    nbytes, last = parse_bytes(a.b), parse_bytes(a.e)
    while nbytes <= last:
        count = bench.count(nbytes)
        if count == 0:  # 1.13's Gloo dies of SIGFPE on an empty all_gather: skip empty sizes
            nbytes = max(nbytes * a.f, 1)
            continue
        size = count * torch.tensor([], dtype=dtype).element_size()
        if a.m == "arena":
            inp, out = collserve.torch.empty(count, dtype=dtype), collserve.torch.empty(count, dtype=dtype)
        else:
            inp, out = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)
        cols = ""
        for in_place in (False, True):
            if in_place != (a.o in IN_PLACE):
                cols += " %8s %7s %7s %6s" % ("N/A", "N/A", "N/A", "N/A")
                continue
            wrong = int(mean(bench.check(inp, out, count)) * n) if a.c else 0
            wrong_total += wrong
            us = mean(bench.time(inp, out, count, a.w, a.n, blocking=a.z != 0))
            algbw = size / (us * 1e3)
            busbw = algbw * FACTORS[a.o](n)
            busbws.append(busbw)
            cols += " %8.1f %7.3f %7.3f %6s" % (us, algbw, busbw, wrong if a.c else "N/A")
        if rank == 0:
            redop = "sum" if a.o in ("all_reduce", "reduce", "reduce_scatter") else "none"
            print(" %11d %12d %8s %6s %6d%s" % (size, count, a.d, redop, root, cols), flush=True)
        if nbytes == 0:
            break
        nbytes *= a.f
    if rank == 0:
        print(f"# Out of bounds values : {wrong_total} {'FAILED' if wrong_total else 'OK'}")
        print(f"# Avg bus bandwidth    : {sum(busbws) / max(len(busbws), 1):g}\n#")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if wrong_total else 0)


if __name__ == "__main__":
    main()
