"""A randomized conformance program: one rank of it, under "gloo" or "collserve".

    conformance.py BACKEND SEED CASES OUT

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment. Every rank draws
the same CASES cases from SEED (random.Random keyed by "SEED:case"), so the ranks of one run
and the runs of both backends issue the same calls in the same order. A case is one
collective or point-to-point call the c10d backend supports, with a random kind, dtype,
shape (empty and 0-d ones too), reduce op, root, group (the world or one of four subgroups),
memory layout (contiguous, transposed, stepped slice, for the element-wise ops) and form
(blocking, async_op=True waited for after the next cases were issued, or coalesced).

Every rank's input of a case is a function of (SEED, case, rank) alone, so each rank computes
the reference result of every case from the other ranks' inputs without asking them, and
checks its outputs against it. Integer-valued inputs (every dtype) must match exactly;
random normal inputs (float32 and float64 only) are compared within rtol 1e-5 / atol 1e-6
where the op sums or multiplies them (SUM, AVG, PREMUL_SUM, PRODUCT), since each rounding
depends on the order in which a backend combines the ranks' values (Gloo's ring and
collserve's tree differ, and the reference adds in float64), and exactly otherwise (MIN, MAX
and every op that moves values without arithmetic).

Gloo does not take some cases (bfloat16 and bool; AVG and PREMUL_SUM; non-contiguous
tensors; uneven all_gather; empty tensors, on which torch 1.13's Gloo dies of SIGFPE;
on torch 1.13 reduce_scatter and all_to_all lists; on torch 2.x reduce_scatter_tensor with
an op other than SUM, which 2.x's Gloo sums whatever the op): those run
under "collserve" only (`gloo_takes` says which) and are checked against the reference.
A call Gloo refuses anyway is recorded as refused, and the comparison counts it.

OUT receives, per rank, a torch.save'd list of records
    (case, kind, description, status, outputs, exact)
where status is "ok", "refused: <error>" or "mismatch: <what differs>", and outputs the
output tensors (cloned). tests/python/test_conformance.py compares the two backends' records
case by case. Exit 0 when every case ran (mismatches are data, not failures); prints
"rank R: conformance ok".
"""
import datetime
import functools
import hashlib
import math
import os
import random
import sys

import torch
import torch.distributed as dist

import collserve.torch  # noqa: F401  registers the "collserve" backend

TORCH2 = int(torch.__version__.split(".")[0]) >= 2
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8,
          torch.uint8, torch.bool]
GLOO_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.int8, torch.uint8}
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
R = dist.ReduceOp
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
GLOO_OPS = {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"}
# Subgroups every rank creates in this order (torch's new_group is collective); ranks are
# global ranks, out of range ones dropped for smaller worlds.
SUBGROUPS = [[0, 1], [1, 2, 3], [0, 2, 3], [3, 1]]
KINDS = ["all_reduce", "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast", "all_gather",
         "all_gather_uneven", "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter",
         "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "send_recv",
         "isend_irecv", "barrier", "all_gather_object", "broadcast_object_list"]
TRACE = os.environ.get("COLLSERVE_CONFORMANCE_TRACE") == "1"  # print each case before it runs
ELEMENTWISE = {"all_reduce", "reduce", "broadcast"}


def seed_of(*parts):
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def make(seed, case, rank, salt, dtype, shape, style):
    """Rank `rank`'s input `salt` of a case: integer-valued in a small range (exact in every
    dtype and for every op over up to 4 ranks: products stay below 2^7), or random normal."""
    g = torch.Generator().manual_seed(seed_of(seed, case, rank, salt))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if style == "random" and dtype in (torch.float32, torch.float64):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    lo, hi = (0, 3) if dtype == torch.uint8 else (-3, 3)
    if dtype in (torch.int32, torch.int64):
        lo, hi = -50, 50
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def reduce_ref(xs, op, dtype, factor):
    if dtype == torch.bool:
        if op in ("SUM", "MAX", "BOR"):
            return functools.reduce(torch.logical_or, xs)
        if op in ("PRODUCT", "MIN", "BAND"):
            return functools.reduce(torch.logical_and, xs)
        return functools.reduce(torch.logical_xor, xs)
    if op in ("BAND", "BOR", "BXOR"):
        f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        return functools.reduce(f, xs)
    wide = torch.float64 if dtype in FLOATS else torch.int64
    ws = [x.to(wide) for x in xs]
    if op in ("SUM", "AVG"):
        acc = functools.reduce(torch.add, ws)
        if op == "AVG":
            acc = acc / len(xs) if dtype in FLOATS else torch.div(acc, len(xs), rounding_mode="trunc")
    elif op == "PREMUL_SUM":
        acc = functools.reduce(torch.add, [w * factor for w in ws])
    elif op == "PRODUCT":
        acc = functools.reduce(torch.mul, ws)
    elif op == "MIN":
        acc = functools.reduce(torch.minimum, ws)
    else:
        acc = functools.reduce(torch.maximum, ws)
    return acc.to(dtype)


def torch_op(op, factor):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(R, op)


def random_shape(rng, min_dim=0, rows=None):
    nd = rng.choice([0, 1, 1, 2, 2, 3]) if rows is None else rng.choice([1, 2, 2, 3])
    shape = [rng.choice([0, 1, 2, 3, 5, 7]) if rng.random() < 0.1 else rng.randint(1, 6) for _ in range(nd)]
    if rng.random() < 0.05 and nd >= 1:
        shape[0] = rng.randint(3000, 40000)  # past the SDK's small-message paths
    if rows is not None:
        shape[0] = rows
    return tuple(max(min_dim, s) for s in shape)


class Case:
    """The parameters of one case, drawn from the case's own rng (the same on every rank)."""

    def __init__(self, seed, index, world):
        rng = random.Random(f"{seed}:{index}")
        self.seed, self.index, self.world = seed, index, world
        self.kind = rng.choice(KINDS)
        subgroups = [[r for r in g if r < world] for g in SUBGROUPS]
        choice = rng.randrange(len(subgroups) + 2)  # the world twice as often as each subgroup
        self.group_index = None if choice >= len(subgroups) or len(subgroups[choice]) < 2 else choice
        self.members = list(range(world)) if self.group_index is None else sorted(subgroups[self.group_index])
        self.dtype = rng.choice(DTYPES)
        self.op = rng.choice(OPS)
        if self.op in ("BAND", "BOR", "BXOR") and self.dtype in FLOATS:
            self.op = rng.choice(["SUM", "MIN", "MAX", "PRODUCT"])
        if self.op == "PREMUL_SUM" and self.dtype not in FLOATS:
            self.op = "SUM"
        if self.op == "AVG" and self.dtype == torch.bool:
            self.op = "MAX"
        self.factor = rng.choice([0.5, 2.0, -1.0])
        self.style = "random" if rng.random() < 0.4 else "integers"
        self.shape = random_shape(rng)
        self.layout = rng.choice(["contiguous"] * 6 + ["transposed", "stepped"]) if self.kind in ELEMENTWISE else \
            "contiguous"
        self.root = rng.choice(self.members)
        self.async_op = rng.random() < 0.3 and not self.kind.endswith("_object") and not self.kind.endswith("_list")
        n = len(self.members)
        self.uneven = [random_shape(rng) for _ in range(n)]  # all_gather_uneven: one shape per member
        self.count = rng.randint(1, 3)  # tensors of a coalesced call
        self.shapes = [random_shape(rng) for _ in range(self.count)]
        # all_to_all_single: rows[i][j] rows go from member i to member j (0 = empty pieces).
        self.rows = [[rng.choice([0, 1, 2, 3, 4]) for _ in range(n)] for _ in range(n)]
        self.equal_splits = rng.random() < 0.3
        if self.equal_splits:
            k = rng.randint(0, 3)
            self.rows = [[k] * n for _ in range(n)]
        self.tail = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))
        pair = rng.sample(self.members, 2)
        self.src, self.dst = pair
        self.any_source = rng.random() < 0.3
        self.tag = rng.randint(0, 5)

    def exact(self):
        """Whether outputs must equal the reference bit for bit (see the module's docstring)."""
        return not (self.style == "random" and self.dtype in (torch.float32, torch.float64) and
                    self.op in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT") and
                    self.kind in ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
                                  "reduce_scatter_tensor"))

    def gloo_takes(self):
        """Whether torch's Gloo backend takes this case (those it does not run under collserve only)."""
        if self.dtype not in GLOO_DTYPES or self.layout != "contiguous" or self.kind == "all_gather_uneven":
            return False
        if self.kind in ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
            if self.op not in GLOO_OPS:
                return False
        if self.kind in ("reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_gather_into_tensor"):
            if self.kind == "reduce_scatter_tensor" and self.op != "SUM":
                # torch 2.x's Gloo reduce_scatter_tensor (reduce_scatter_tensor_coalesced) builds
                # AllreduceOptions with the op but calls allreduce without them: it always sums.
                return False
            return TORCH2  # torch 1.13's Gloo has none of these (what 2.x's refuses is counted)
        # torch 1.13's Gloo dies of SIGFPE on an empty all_gather; empty tensors run under
        # collserve only.
        return all(math.prod(s) > 0 for s in [self.shape] + self.shapes)

    def describe(self):
        what = [self.kind, str(self.dtype).replace("torch.", ""), f"group={self.members}"]
        if self.kind in ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
            what.append(self.op + (f"({self.factor})" if self.op == "PREMUL_SUM" else ""))
        if self.kind in ("reduce", "broadcast", "gather", "scatter", "broadcast_object_list"):
            what.append(f"root={self.root}")
        if self.kind in ("send_recv", "isend_irecv"):
            what.append(f"{self.src}->{self.dst} tag={self.tag}" + (" any source" if self.any_source else ""))
        what.append(f"shape={list(self.shape)}")
        if self.layout != "contiguous":
            what.append(self.layout)
        what.append(self.style)
        if self.async_op:
            what.append("async")
        return " ".join(what)

    def inp(self, rank, salt=0, shape=None):
        return make(self.seed, self.index, rank, salt, self.dtype, self.shape if shape is None else shape, self.style)


def laid_out(t, layout):
    """`t`'s values in a tensor of the given memory layout (a view of a larger base)."""
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "stepped" and t.dim() >= 1:
        base = torch.zeros((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype)
        view = base[::2]
        view.copy_(t)
        return view
    return t.clone()


class Runner:
    def __init__(self, backend, seed, rank, world, groups):
        self.backend, self.seed, self.rank, self.world, self.groups = backend, seed, rank, world, groups
        self.records = []
        self.pending = []  # (case, works, check) of async cases not yet waited for

    def group(self, c):
        return None if c.group_index is None else self.groups[c.group_index]

    def record(self, c, status, outputs):
        self.records.append((c.index, c.kind, c.describe(), status, [o.clone() for o in outputs], c.exact()))

    def check(self, c, outputs, expected):
        if len(outputs) != len(expected):
            return f"mismatch: {len(outputs)} outputs, expected {len(expected)}"
        for i, (o, e) in enumerate(zip(outputs, expected)):
            if o.dtype != e.dtype or tuple(o.shape) != tuple(e.shape):
                return f"mismatch: output {i} is {o.dtype}{list(o.shape)}, expected {e.dtype}{list(e.shape)}"
            if c.exact():
                same = torch.equal(o, e)
            else:
                same = torch.allclose(o, e, rtol=1e-5, atol=1e-6)
            if not same:
                bad = (o != e).nonzero()
                return f"mismatch: output {i} differs from the reference at {bad[:3].tolist()}: {o} != {e}"
        return "ok"

    def finish(self, c, works, outputs_fn, expected_fn):
        def done():
            for w in works:
                if w is not None:
                    w.wait()
            outputs = outputs_fn()
            self.record(c, self.check(c, outputs, expected_fn()), outputs)
        if c.async_op and any(w is not None for w in works):
            self.pending.append(done)
            if len(self.pending) > 3:
                self.pending.pop(0)()
        else:
            self.flush()
            done()

    def flush(self):
        while self.pending:
            self.pending.pop(0)()

    def run(self, c):
        if self.rank not in c.members:
            return
        if TRACE:
            print(f"case {c.index}: {c.describe()}", flush=True)
        try:
            getattr(self, "case_" + c.kind)(c)
        except (RuntimeError, ValueError, TypeError) as e:
            self.flush()
            self.record(c, f"refused: {type(e).__name__}: {str(e).splitlines()[0][:300]}", [])

    # ---- element-wise ops ----
    def case_all_reduce(self, c):
        t = laid_out(c.inp(self.rank), c.layout)
        w = dist.all_reduce(t, op=torch_op(c.op, c.factor), group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: [t], lambda: [reduce_ref([c.inp(m) for m in c.members], c.op, c.dtype,
                                                             c.factor)])

    def case_all_reduce_coalesced(self, c):
        ts = [make(c.seed, c.index, self.rank, i, c.dtype, s, c.style) for i, s in enumerate(c.shapes)]
        w = dist.all_reduce_coalesced(ts, op=torch_op(c.op, c.factor), group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: ts, lambda: [
            reduce_ref([make(c.seed, c.index, m, i, c.dtype, s, c.style) for m in c.members], c.op, c.dtype, c.factor)
            for i, s in enumerate(c.shapes)])

    def case_reduce(self, c):
        t = laid_out(c.inp(self.rank), c.layout)
        w = dist.reduce(t, c.root, op=torch_op(c.op, c.factor), group=self.group(c), async_op=c.async_op)
        if self.rank == c.root:
            self.finish(c, [w], lambda: [t], lambda: [reduce_ref([c.inp(m) for m in c.members], c.op, c.dtype,
                                                                 c.factor)])
        else:  # what a non-root's tensor holds afterwards is unspecified
            self.finish(c, [w], lambda: [], lambda: [])

    def case_broadcast(self, c):
        t = laid_out(c.inp(self.rank), c.layout)
        w = dist.broadcast(t, c.root, group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: [t], lambda: [c.inp(c.root)])

    # ---- gathers ----
    def case_all_gather(self, c):
        outs = [torch.full(c.shape, 7, dtype=c.dtype) if c.dtype != torch.bool else torch.zeros(c.shape, dtype=torch.bool)
                for _ in c.members]
        w = dist.all_gather(outs, c.inp(self.rank), group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: outs, lambda: [c.inp(m) for m in c.members])

    def case_all_gather_uneven(self, c):
        mine = c.uneven[c.members.index(self.rank)]
        outs = [torch.zeros(s, dtype=c.dtype) for s in c.uneven]
        w = dist.all_gather(outs, c.inp(self.rank, shape=mine), group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: outs, lambda: [c.inp(m, shape=s) for m, s in zip(c.members, c.uneven)])

    def case_all_gather_into_tensor(self, c):
        n = len(c.members)
        shape = c.shape if len(c.shape) else (1,)
        out = torch.zeros((shape[0] * n,) + tuple(shape[1:]), dtype=c.dtype)
        w = dist.all_gather_into_tensor(out, c.inp(self.rank, shape=shape), group=self.group(c),
                                        async_op=c.async_op)
        self.finish(c, [w], lambda: [out], lambda: [torch.cat([c.inp(m, shape=shape) for m in c.members])])

    def case_all_gather_coalesced(self, c):
        ins = [make(c.seed, c.index, self.rank, i, c.dtype, s, c.style) for i, s in enumerate(c.shapes)]
        outs = [[torch.zeros(s, dtype=c.dtype) for s in c.shapes] for _ in c.members]  # [rank][input], as torch's
        w = dist.all_gather_coalesced(outs, ins, group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: [t for lst in outs for t in lst], lambda: [
            make(c.seed, c.index, m, i, c.dtype, s, c.style) for m in c.members for i, s in enumerate(c.shapes)])

    def case_gather(self, c):
        outs = [torch.zeros(c.shape, dtype=c.dtype) for _ in c.members] if self.rank == c.root else None
        w = dist.gather(c.inp(self.rank), outs, dst=c.root, group=self.group(c), async_op=c.async_op)
        if self.rank == c.root:
            self.finish(c, [w], lambda: outs, lambda: [c.inp(m) for m in c.members])
        else:
            self.finish(c, [w], lambda: [], lambda: [])

    def case_scatter(self, c):
        out = torch.zeros(c.shape, dtype=c.dtype)
        ins = [c.inp(c.root, salt=m) for m in c.members] if self.rank == c.root else None
        w = dist.scatter(out, ins, src=c.root, group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: [out], lambda: [c.inp(c.root, salt=self.rank)])

    # ---- reduce-scatters ----
    def case_reduce_scatter(self, c):
        out = torch.zeros(c.shape, dtype=c.dtype)
        ins = [c.inp(self.rank, salt=m) for m in c.members]
        w = dist.reduce_scatter(out, ins, op=torch_op(c.op, c.factor), group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: [out], lambda: [
            reduce_ref([c.inp(m, salt=self.rank) for m in c.members], c.op, c.dtype, c.factor)])

    def case_reduce_scatter_tensor(self, c):
        n = len(c.members)
        shape = c.shape if len(c.shape) else (1,)
        full = (shape[0] * n,) + tuple(shape[1:])
        out = torch.zeros(shape, dtype=c.dtype)
        w = dist.reduce_scatter_tensor(out, c.inp(self.rank, shape=full), op=torch_op(c.op, c.factor),
                                       group=self.group(c), async_op=c.async_op)
        me = c.members.index(self.rank)

        def expected():
            whole = reduce_ref([c.inp(m, shape=full) for m in c.members], c.op, c.dtype, c.factor)
            return [whole.narrow(0, me * shape[0], shape[0])]
        self.finish(c, [w], lambda: [out], expected)

    # ---- all_to_all ----
    def case_all_to_all_single(self, c):
        me = c.members.index(self.rank)
        n = len(c.members)
        tail = c.tail
        send = c.rows[me]
        recv = [c.rows[i][me] for i in range(n)]
        inp = make(c.seed, c.index, self.rank, 0, c.dtype, (sum(send),) + tail, c.style)
        out = torch.zeros((sum(recv),) + tail, dtype=c.dtype)
        splits = (None, None) if c.equal_splits else (recv, send)
        w = dist.all_to_all_single(out, inp, output_split_sizes=splits[0], input_split_sizes=splits[1],
                                   group=self.group(c), async_op=c.async_op)

        def expected():
            pieces = []
            for i, m in enumerate(c.members):
                theirs = make(c.seed, c.index, m, 0, c.dtype, (sum(c.rows[i]),) + tail, c.style)
                pieces.append(theirs.narrow(0, sum(c.rows[i][:me]), c.rows[i][me]))
            return [torch.cat(pieces)]
        self.finish(c, [w], lambda: [out], expected)

    def case_all_to_all(self, c):
        me = c.members.index(self.rank)
        n = len(c.members)
        shape_of = [[(c.rows[i][j],) + c.tail for j in range(n)] for i in range(n)]
        ins = [make(c.seed, c.index, self.rank, j, c.dtype, shape_of[me][j], c.style) for j in range(n)]
        outs = [torch.zeros(shape_of[i][me], dtype=c.dtype) for i in range(n)]
        w = dist.all_to_all(outs, ins, group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: outs, lambda: [
            make(c.seed, c.index, m, me, c.dtype, shape_of[i][me], c.style) for i, m in enumerate(c.members)])

    # ---- point-to-point (global ranks, as torch's) ----
    def case_send_recv(self, c):
        if self.rank == c.src:
            t = c.inp(self.rank)
            if c.async_op:
                self.finish(c, [dist.isend(t, c.dst, group=self.group(c), tag=c.tag)], lambda: [], lambda: [])
            else:
                dist.send(t, c.dst, group=self.group(c), tag=c.tag)
                self.finish(c, [], lambda: [], lambda: [])
        elif self.rank == c.dst:
            t = torch.zeros(c.shape, dtype=c.dtype)
            src = None if c.any_source else c.src
            if c.async_op and not c.any_source:
                self.finish(c, [dist.irecv(t, src, group=self.group(c), tag=c.tag)], lambda: [t],
                            lambda: [c.inp(c.src)])
            else:
                self.flush()
                sender = dist.recv(t, src, group=self.group(c), tag=c.tag)
                status = self.check(c, [t], [c.inp(c.src)])
                if status == "ok" and sender != c.src:
                    status = f"mismatch: recv returned sender {sender}, expected {c.src}"
                self.record(c, status, [t])

    def case_isend_irecv(self, c):
        # batch_isend_irecv: every member sends to the next and receives from the previous.
        n = len(c.members)
        me = c.members.index(self.rank)
        nxt, prv = c.members[(me + 1) % n], c.members[(me - 1) % n]
        out = torch.zeros(c.shape, dtype=c.dtype)
        ops = [dist.P2POp(dist.isend, c.inp(self.rank), nxt, group=self.group(c), tag=c.tag),
               dist.P2POp(dist.irecv, out, prv, group=self.group(c), tag=c.tag)]
        works = dist.batch_isend_irecv(ops)
        self.finish(c, works, lambda: [out], lambda: [c.inp(prv)])

    def case_barrier(self, c):
        w = dist.barrier(group=self.group(c), async_op=c.async_op)
        self.finish(c, [w], lambda: [], lambda: [])

    # ---- objects (pickled through broadcast and all_gather) ----
    def obj(self, c, rank):
        return {"case": c.index, "rank": rank, "values": c.inp(rank).flatten()[:5].tolist()}

    def case_all_gather_object(self, c):
        objs = [None] * len(c.members)
        dist.all_gather_object(objs, self.obj(c, self.rank), group=self.group(c))
        ok = objs == [self.obj(c, m) for m in c.members]
        self.flush()
        self.record(c, "ok" if ok else f"mismatch: {objs}", [])

    def case_broadcast_object_list(self, c):
        lst = [self.obj(c, self.rank), c.index]
        dist.broadcast_object_list(lst, src=c.root, group=self.group(c))
        ok = lst == [self.obj(c, c.root), c.index]
        self.flush()
        self.record(c, "ok" if ok else f"mismatch: {lst}", [])


def main():
    backend, seed, cases, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(os.environ.get("WORKER_TIMEOUT_S", "60")))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    groups = [dist.new_group([r for r in g if r < world]) for g in SUBGROUPS]
    runner = Runner(backend, seed, rank, world, groups)
    for i in range(cases):
        c = Case(seed, i, world)
        if backend == "gloo" and not c.gloo_takes():
            continue
        runner.run(c)
    runner.flush()
    dist.barrier()
    torch.save(runner.records, os.path.join(out, f"{backend}-{rank}.pt"))
    dist.destroy_process_group()
    print(f"rank {rank}: conformance ok", flush=True)


if __name__ == "__main__":
    main()
