"""Recovering a torch DDP job from a lost rank: in place (collserve.torch.reconfigure: the
survivors go on, a restarted rank joins later) against the usual path (the launcher restarts
every rank, which resume from the last checkpoint), paired trials in one run.

    PYTHONPATH=build/python /usr/bin/python3 bench/recovery.py [--trials 5] [--steps 600]

Each trial runs examples/ddp_elastic.py as 4 ranks under `collserve launch` on this host; the
rank of launch rank 2 kills itself with SIGKILL at the start of step 100 (--die_step).
  in place: --survive_failures --max_restarts 1 (the restarted rank joins at a later step)
  restart:  --max_restarts 3, checkpoints every --checkpoint_every steps (rank 0, torch.save)
For each trial it prints the pause (from the kill until every survivor, or every restarted
rank, has completed a step after its recovery), the steps redone (completed before the kill and computed again),
the step the restarted rank joined at (in place), the final accuracy, and whether every step
is consistent (summarize() below: each step's parameter checksum the same on every rank and
every time it was computed, each rank's steps in order with none skipped or applied twice
outside a restart or recovery, steps 0..N-1 all completed).
Medians at the end. The step time is paced to --step_time (default 10 ms) so that the
restarted rank (a new Python with torch to import) can join before the job ends.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_elastic.py")


def events(text):
    """The EVENT records of a launcher's output, each with "launch_rank" (the [rankN] prefix)."""
    out = []
    for line in text.splitlines():
        if "EVENT " not in line or not line.startswith("[rank"):
            continue
        record = json.loads(line.split("EVENT ", 1)[1])
        record["launch_rank"] = int(line[len("[rank"):line.index("]")])
        out.append(record)
    return out


def summarize(text, steps):
    """What one run of ddp_elastic.py did: the kill, the pause after it, the steps redone,
    the joins, and `problems` (empty when every step is consistent)."""
    ev = events(text)
    problems = []
    kills = [e for e in ev if e["kind"] == "kill"]
    done = [e for e in ev if e["kind"] == "step"]
    # Each step's checksums, per world the step ran in: DDP keeps the replicas equal, and a
    # step computed again (after a restart from a checkpoint) must give what it gave before.
    by_step = {}
    for e in done:
        by_step.setdefault((e["step"], e["world"]), set()).add(e["checksum"])
    for (step, world), sums in sorted(by_step.items()):
        if len(sums) != 1:
            problems.append(f"step {step} (world {world}): checksums differ: {sorted(sums)}")
    # Each rank's steps go 0, 1, 2, ... with nothing skipped or applied twice, except that a
    # (re)start, recovery or admission goes on from the step it names.
    boundaries = ("joined", "resumed", "recovered", "admitted")
    expected = {}
    for e in sorted(ev, key=lambda e: e["time"]):
        if e["kind"] in boundaries:
            expected[e["launch_rank"]] = e["step"]
        elif e["kind"] == "step":
            want = expected.get(e["launch_rank"], 0)
            if e["step"] != want:
                problems.append(f"launch rank {e['launch_rank']} completed step {e['step']} after step {want - 1}")
            expected[e["launch_rank"]] = e["step"] + 1
    missing = sorted(set(range(steps)) - {e["step"] for e in done})
    if missing:
        problems.append(f"steps never completed: {missing[:10]}")
    result = {"problems": problems, "kill_step": None, "pause_s": None, "redone": None, "joined_step": None}
    if kills:
        kill = kills[0]
        result["kill_step"] = kill["step"]
        # Each surviving or restarted rank's recovery ("recovered" in place, "resumed" after a
        # restart), and the first step it completed after it. The pause ends when every one
        # of them has completed that step.
        recovery = {}
        for e in ev:
            if e["kind"] in ("recovered", "resumed") and e["time"] > kill["time"]:
                recovery.setdefault(e["launch_rank"], e["time"])
        firsts = {}
        for e in done:
            if e["launch_rank"] in recovery and e["time"] > recovery[e["launch_rank"]]:
                firsts.setdefault(e["launch_rank"], e)
        # Steps completed before any recovery (a rank may log a step just after the kill).
        before = [e["step"] for e in done if e["time"] < min(recovery.values(), default=float("inf"))]
        if firsts:
            result["pause_s"] = max(e["time"] for e in firsts.values()) - kill["time"]
            result["redone"] = (max(before) if before else -1) + 1 - min(e["step"] for e in firsts.values())
    joins = [e for e in ev if e["kind"] == "joined"]
    if joins:
        result["joined_step"] = joins[0]["step"]
    return result


def run(mode, steps, step_time, checkpoint_every, timeout_s):
    args = [sys.executable, "-m", "collserve", "launch", "--nproc_per_node", "4"]
    with tempfile.TemporaryDirectory(prefix="collserve-recovery-") as ckpt:
        if mode == "inplace":
            args += ["--survive_failures", "--max_restarts", "1", EXAMPLE]
        else:
            args += ["--max_restarts", "3", EXAMPLE, "--recovery", "restart", "--checkpoint_dir", ckpt,
                     "--checkpoint_every", str(checkpoint_every)]
        args += ["--die_rank", "2", "--die_step", "100", "--steps", str(steps), "--step_time", str(step_time)]
        t0 = time.monotonic()
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        wall = time.monotonic() - t0
    result = summarize(proc.stdout, steps)
    result.update(mode=mode, rc=proc.returncode, wall_s=wall,
                  accuracy=[float(line.rsplit("accuracy ", 1)[1].split("%")[0])
                            for line in proc.stdout.splitlines() if "test accuracy" in line])
    if proc.returncode != 0:
        result["problems"].append(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--step_time", type=float, default=0.01)
    p.add_argument("--checkpoint_every", type=int, default=30)
    p.add_argument("--timeout_s", type=float, default=600)
    a = p.parse_args()
    results = {"inplace": [], "restart": []}
    print(f"{'trial':>5} {'mode':>8} {'pause s':>8} {'redone':>6} {'joined at':>9} {'accuracy %':>11} "
          f"{'wall s':>7}  problems")
    for trial in range(a.trials):
        for mode in ("inplace", "restart"):  # paired: one of each per trial
            r = run(mode, a.steps, a.step_time, a.checkpoint_every, a.timeout_s)
            results[mode].append(r)
            pause = f"{r['pause_s']:.3f}" if r["pause_s"] is not None else "-"
            print(f"{trial:>5} {mode:>8} {pause:>8} {str(r['redone']):>6} {str(r['joined_step'] or '-'):>9} "
                  f"{min(r['accuracy'], default=0):>11.2f} {r['wall_s']:>7.1f}  {'; '.join(r['problems']) or 'none'}",
                  flush=True)
    for mode, rs in results.items():
        pauses = [r["pause_s"] for r in rs if r["pause_s"] is not None]
        redone = [r["redone"] for r in rs if r["redone"] is not None]
        print(f"median {mode}: pause {statistics.median(pauses):.3f} s (min {min(pauses):.3f}, max {max(pauses):.3f}), "
              f"redone {statistics.median(redone)} steps, {sum(1 for r in rs if not r['problems'])}/{len(rs)} trials "
              "consistent")
    return 0 if all(not r["problems"] for rs in results.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
