"""Survive a lost rank without restarting (issue 17): 4 ranks train the digits example's
elastic variant; one kills itself with SIGKILL mid-epoch; the 3 survivors re-form the group
in place (collserve.reconfigure) and finish training to >= 90% test accuracy."""
import os
import re
import subprocess
import sys

import forkserver
from daemons import wait_for
from test_sdk import Cluster, outputs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
ELASTIC = os.path.join(ROOT, "examples", "digits_sgd_elastic.py")


def test_under_the_launcher_with_survive_failures():
    proc = subprocess.run([sys.executable, "-m", "collserve.launch", "--nproc_per_node", "4", "--survive_failures",
                           ELASTIC, "--epochs", "8", "--die_rank", "1", "--die_epoch", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "rank 1 was killed by signal 9; the other ranks went on without it" in proc.stderr, proc.stderr
    assert len(re.findall(r"is now rank \d of 3", proc.stdout)) == 3, proc.stdout


def test_the_launcher_restarts_the_lost_rank_and_the_job_goes_on_with_four():
    # The survivors re-form at once (about 0.1 s); the restarted rank needs seconds to start (a
    # Python with torch), more than the remaining epochs took in the Debian 13 stage on a loaded
    # machine, so the survivors wait for it at the start of the last epoch (--wait_for_world).
    # 8 epochs ended at 87% under ASan on a slow machine, 10 gave 93% there.
    proc = subprocess.run([sys.executable, "-m", "collserve.launch", "--nproc_per_node", "4", "--survive_failures",
                           "--max_restarts", "1", ELASTIC, "--epochs", "10", "--die_rank", "2", "--die_epoch", "2",
                           "--epoch_time", "0.5", "--wait_for_world", "4", "--wait_timeout", "150",
                           "--min_accuracy", "0.9"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "rank 2 failed (exit code -9); starting it again to join the running ranks (restart 1 of 1)" in proc.stderr
    assert re.search(r"\[rank2\]: joined the running job at epoch \d as rank \d of 4", proc.stdout), proc.stdout
    # Every rank ends in a group of 4 with >= 90% accuracy.
    accuracies = re.findall(r"of 4, test accuracy: ([0-9.]+)%", proc.stdout)
    assert len(accuracies) == 4 and all(float(a) >= 90.0 for a in accuracies), proc.stdout


def test_elastic_formation_with_min_world_size_and_a_late_rank():
    """WORLD_SIZE 4, COLLSERVE_MIN_WORLD_SIZE 2: three ranks form a group of 3 after the
    join window; a fourth that comes later is admitted at the next generation."""
    cluster = Cluster()
    worker = os.path.join(HERE, "elastic_worker.py")
    env = dict(COLLSERVE_MIN_WORLD_SIZE="2", COLLSERVE_JOIN_WINDOW_S="2", COLLSERVE_RUN_ID="formation")
    logs = [os.path.join(cluster.dir, f"rank{r}.out") for r in (0, 1, 3, 2)]
    procs = []

    def start(rank, log):
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, worker, "4", "any"], env=cluster.env(rank, 4, **env),
                                          text=True, stdout=out, stderr=subprocess.STDOUT))

    def text(log):
        with open(log, errors="replace") as f:
            return f.read()
    try:
        for rank, log in zip((0, 1, 3), logs):
            start(rank, log)
        # Past the window: the three formed a group of 3.
        wait_for(lambda: all(re.search(r"init: rank \d of 3", text(log)) for log in logs[:3]), 60,
                 what="a group of 3 formed by ranks 0, 1 and 3")
        start(2, logs[3])
        for p in procs:
            p.wait(timeout=120)
        results = [(p.returncode, text(log)) for p, log in zip(procs, logs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        cluster.stop()
    report = "\n".join(f"--- process {i} (exit {code})\n{text}" for i, (code, text) in enumerate(results))
    for i, (code, text) in enumerate(results):
        assert code == 0, report
        assert "ok: world 4" in text, report
    for code, text in results[:3]:
        assert "init: rank" in text and " of 3" in text and "admitted joiners:" in text, report
    assert "init: rank 3 of 4" in results[3][1], report


def test_three_survivors_reform_and_finish_training():
    cluster = Cluster()
    try:
        procs = [forkserver.popen([sys.executable, ELASTIC, "--epochs", "12", "--die_rank", "2", "--die_epoch", "3",
                                   "--min_accuracy", "0.9"], env=cluster.env(r, 4), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(4)]
        results = outputs(procs, limit=240)
    finally:
        cluster.stop()
    report = "\n".join(f"--- rank {r} (exit {code})\n{text}" for r, (code, text) in enumerate(results))
    assert results[2][0] == -9, report  # the one that died
    new_ranks, common = set(), set()
    for r in (0, 1, 3):
        code, text = results[r]
        assert code == 0, report
        m = re.search(r"reconfigured after Dist\w+ in epoch 3: rank \d of 4 is now rank (\d) of 3", text)
        assert m, report
        new_ranks.add(int(m.group(1)))
        # Every survivor is told the same common seq, at most its own last completed one.
        seqs = re.search(r"collectives 0\.\.(-?\d+) of the old group completed on every survivor, this rank "
                         r"completed 0\.\.(-?\d+)", text)
        assert seqs and 0 <= int(seqs.group(1)) <= int(seqs.group(2)), report
        common.add(int(seqs.group(1)))
        acc = re.search(r"of 3, test accuracy: ([0-9.]+)%", text)
        assert acc and float(acc.group(1)) >= 90.0, report
        assert "epoch 11:" in text, report
    assert new_ranks == {0, 1, 2}, report
    assert len(common) == 1, report


def _recovery_bench():
    """bench/recovery.py (its summarize() checks a run's steps)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("recovery", os.path.join(ROOT, "bench", "recovery.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ddp_survivors_recover_in_place_and_the_restarted_rank_joins_later():
    """Issue 42: DDP on backend "collserve", 4 ranks; launch rank 2 is killed (SIGKILL) at step
    100; the 3 survivors re-form in place (collserve.torch.reconfigure: no process restarts),
    redo step 100 and go on; the launcher starts rank 2 again, which joins at a later step;
    the job ends with 4 ranks and >= 90% accuracy, and no step is wrong (every step's
    parameters equal on every rank, each rank's steps in order, none skipped or repeated).
    The survivors wait for it at their last check (--wait_for_world): on a loaded machine the
    new process's start (torch's import) took longer than their remaining 700 steps."""
    steps = 800
    proc = subprocess.run([sys.executable, "-m", "collserve.launch", "--nproc_per_node", "4", "--survive_failures",
                           "--max_restarts", "1", os.path.join(ROOT, "examples", "ddp_elastic.py"), "--die_rank", "2",
                           "--die_step", "100", "--steps", str(steps), "--step_time", "0.01", "--join_window", "60",
                           "--min_accuracy", "0.9", "--wait_for_world", "4", "--wait_timeout", "150"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, report
    bench = _recovery_bench()
    summary = bench.summarize(proc.stdout, steps)
    assert summary["problems"] == [], (summary, report)
    assert summary["kill_step"] == 100 and summary["redone"] == 0, (summary, report)
    events = bench.events(proc.stdout)
    recovered = [e for e in events if e["kind"] == "recovered"]
    # The survivors, not restarted: the same processes went from world 4 to 3 at step 100.
    assert sorted(e["launch_rank"] for e in recovered) == [0, 1, 3], report
    assert all(e["step"] == 100 and e["world"] == 3 and e["old_world"] == 4 for e in recovered), report
    # The member list closed once the killed rank had left, not after the 60 s join window.
    assert all(e["reconfigure_s"] < 30 for e in recovered), report
    assert not [e for e in events if e["kind"] == "resumed"], report
    assert "restarting the 4 ranks" not in proc.stderr, report
    joined = [e for e in events if e["kind"] == "joined"]
    assert len(joined) == 1 and joined[0]["launch_rank"] == 2 and joined[0]["world"] == 4, report
    assert joined[0]["step"] > 100, report
    accuracies = re.findall(r"of 4: test accuracy ([0-9.]+)% after 800 steps", proc.stdout)
    assert len(accuracies) == 4 and all(float(a) >= 90.0 for a in accuracies), report


def test_a_restarted_rank_the_job_never_admitted_is_stopped_when_the_others_finish():
    """The survivors finish 20 steps after the kill, before the restarted rank (a new Python
    importing torch) can ask to join: the launcher stops it when they are done, instead of
    leaving it to wait for an admission until its init timeout, and the job succeeds."""
    proc = subprocess.run([sys.executable, "-m", "collserve.launch", "--nproc_per_node", "4", "--survive_failures",
                           "--max_restarts", "1", os.path.join(ROOT, "examples", "ddp_elastic.py"), "--die_rank", "2",
                           "--die_step", "100", "--steps", "120"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "rank 2, started again, had not been admitted when the other ranks finished; stopping it" in proc.stderr, \
        proc.stderr
    assert len(re.findall(r"of 3: test accuracy", proc.stdout)) == 3, proc.stdout
