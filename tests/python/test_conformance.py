"""The randomized conformance suite: the same seeded program (conformance.py) under torch's
"gloo" and under "collserve", every output compared with a reference computed from the
ranks' inputs and with Gloo's, case by case.

A bounded run here: COLLSERVE_CONFORMANCE_SEEDS (default "1-3"; a comma list or a range
"1-20") and COLLSERVE_CONFORMANCE_CASES (cases per seed, default 300). The long run of
docs/testing.md sets both higher. Run with -s to see the count of cases per collective.
"""
import collections
import os
import sys

import pytest

torch = pytest.importorskip("torch")
from test_torch_backend import WORKER, run_ranks  # noqa: E402

PROGRAM = os.path.join(os.path.dirname(WORKER), "conformance.py")
WORLD = int(os.environ.get("COLLSERVE_CONFORMANCE_WORLD", "4"))


def seeds():
    spec = os.environ.get("COLLSERVE_CONFORMANCE_SEEDS", "1-3")
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def run(backend, seed, cases, out):
    run_ranks(WORLD, [backend, str(seed), str(cases), str(out)], program=PROGRAM, tag="conformance",
              timeout=600)
    return [torch.load(os.path.join(out, f"{backend}-{r}.pt")) for r in range(WORLD)]


def same(a, b, exact):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def compare(seed, gloo, coll):
    """Returns (counts per kind, mismatches) for one seed's records of every rank."""
    counts = collections.defaultdict(collections.Counter)
    bad = []
    for rank in range(WORLD):
        by_case = {rec[0]: rec for rec in gloo[rank]}
        for case, kind, what, status, outputs, exact in coll[rank]:
            where = f"seed {seed} case {case} rank {rank} ({what})"
            if status != "ok":
                bad.append(f"{where}: collserve {status}")
                continue
            g = by_case.get(case)
            if g is None:
                counts[kind]["reference only"] += 1
            elif g[3].startswith("refused"):
                counts[kind]["gloo refused"] += 1
            elif g[3] != "ok":
                bad.append(f"{where}: gloo itself differs from the reference: {g[3]}")
            elif len(g[4]) != len(outputs) or not all(same(a, b, exact) for a, b in zip(g[4], outputs)):
                bad.append(f"{where}: collserve's outputs differ from gloo's")
            else:
                counts[kind]["equal to gloo"] += 1
        missing = set(by_case) - {rec[0] for rec in coll[rank]}
        bad.extend(f"seed {seed} case {c} rank {rank}: ran under gloo only" for c in sorted(missing))
    return counts, bad


def test_every_collective_matches_gloo_and_the_reference(tmp_path):
    cases = int(os.environ.get("COLLSERVE_CONFORMANCE_CASES", "300"))
    total = collections.defaultdict(collections.Counter)
    mismatches = []
    for seed in seeds():
        out = tmp_path / f"seed{seed}"
        out.mkdir()
        gloo = run("gloo", seed, cases, out)
        coll = run("collserve", seed, cases, out)
        counts, bad = compare(seed, gloo, coll)
        mismatches += bad
        for kind, c in counts.items():
            total[kind].update(c)
    width = max(len(k) for k in total)
    print(f"\nconformance: seeds {seeds()}, {cases} cases each, world {WORLD}, torch {torch.__version__}")
    print(f"  {'kind':<{width}}  rank-cases  equal to gloo  gloo refused  reference only")
    for kind in sorted(total):
        c = total[kind]
        print(f"  {kind:<{width}}  {sum(c.values()):>10}  {c['equal to gloo']:>13}  {c['gloo refused']:>12}  "
              f"{c['reference only']:>14}")
    print(f"  mismatches: {len(mismatches)}")
    assert not mismatches, "\n".join(mismatches[:40])
    assert set(total) >= {"all_reduce", "all_gather_coalesced", "all_to_all_single", "send_recv"}, total
