#!/usr/bin/python3
"""The stages of scripts/test.sh (so of CI), run in lanes beside each other, and their table.

    build lane (nice 10): asan build (with the fuzz targets) -> release build -> tsan build
                          -> Debian 13 build (once its root is made)
    test lanes (nice 0):  release tests, asan tests, tsan tests, fuzzing, Debian 13 tests, two at
                          a time (COLLSERVE_CI_TEST_SLOTS), each once its tree is built
    root lane (nice 19):  the Debian 13 root (mmdebstrap, cached; from the start)

A stage's tests start once its tree is built. The build lane runs ahead at a lower CPU
priority, so the compiles of later trees take mostly what the tests leave idle (about a third
of both cores: tests wait on processes, sockets and timeouts) and the tests keep the cores
they ask for; two test steps at once use what one leaves idle when the trees are built
already (a warm compiler cache). Every step writes its output to build-ci/<step>.log, printed whole when the step
ends; the run goes on past a failed step (what depends on it is skipped) and exits non-zero if
any step failed. It ends with a table of each stage's build and test seconds, tests run,
compiler-cache hit rate, the CPU seconds each step used (its wait4 rusage), and the total (docs/ci.md).

Environment: COLLSERVE_SANITIZERS=0 skips the asan and tsan stages, COLLSERVE_DEBIAN13=0 the
Debian 13 stage, COLLSERVE_FUZZ_SECONDS (default 20) sets the fuzzing time per target,
COLLSERVE_CI_STEP_TIMEOUT_S (default 3600) bounds each step, COLLSERVE_CI_TEST_SLOTS (default
2) sets how many test steps run at once.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGS = os.path.join(ROOT, "build-ci")
STEP_TIMEOUT_S = int(os.environ.get("COLLSERVE_CI_STEP_TIMEOUT_S", "3600"))
FUZZ_SECONDS = os.environ.get("COLLSERVE_FUZZ_SECONDS", "20")
# Test steps run at once (each is a ctest -j2 or the Debian 13 stage's two pytest slots).
TEST_SLOTS = int(os.environ.get("COLLSERVE_CI_TEST_SLOTS", "2"))
START = time.monotonic()
print_lock = threading.Lock()


def elapsed():
    return time.monotonic() - START


def say(line):
    with print_lock:
        print(f"[ci {elapsed():6.0f}s] {line}", flush=True)


class Step:
    """One command of a stage: `kind` is "build" or "test"; it runs once every step in `after`
    has passed (it is skipped when one failed or was skipped)."""

    def __init__(self, name, stage, kind, command, after=(), tree=None):
        self.name, self.stage, self.kind, self.command, self.after, self.tree = name, stage, kind, command, after, tree
        self.done = threading.Event()
        self.rc = None  # None: not run (skipped)
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # user + system, of the step and what it waited for
        self.started = self.ended = None
        self.log = os.path.join(LOGS, f"{name}.log")

    def run(self, nice):
        for dep in self.after:
            dep.done.wait()
        if any(dep.rc != 0 for dep in self.after):
            say(f"{self.name}: skipped ({', '.join(d.name for d in self.after if d.rc != 0)} did not pass)")
            self.done.set()
            return
        say(f"{self.name}: started")
        self.started = elapsed()
        with open(self.log, "w") as out:
            proc = subprocess.Popen(["nice", "-n", str(nice), "bash", "-c", self.command], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=in_autogroup(nice))
            # wait4, not proc.wait: its rusage is the CPU time of the step and of every process
            # of it that was waited for (the compilers, the tests and the daemons they stop).
            killed = threading.Event()

            def kill():
                killed.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            timer = threading.Timer(STEP_TIMEOUT_S, kill)
            timer.start()
            _, status, usage = os.wait4(proc.pid, 0)
            timer.cancel()
            proc.returncode = self.rc = os.waitstatus_to_exitcode(status)
            self.cpu_seconds = usage.ru_utime + usage.ru_stime
            if killed.is_set():
                out.write(f"\nci: {self.name} killed after {STEP_TIMEOUT_S} s (COLLSERVE_CI_STEP_TIMEOUT_S)\n")
                self.rc = 124
        self.ended = elapsed()
        self.seconds = self.ended - self.started
        with print_lock:
            print(f"\n======== {self.name} ({self.stage} {self.kind}): {self.seconds:.0f} s, {self.cpu_seconds:.0f} CPU s, "
                  f"exit {self.rc}", flush=True)
            with open(self.log, errors="replace") as f:
                sys.stdout.write(f.read())
            print(f"======== end of {self.name}\n", flush=True)
        self.done.set()

    def output(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def in_autogroup(nice):
    """For Popen's preexec_fn, after its setsid(): gives the step's new session, which the
    kernel schedules as a group of its own when autogroup is on (Debian's default,
    /proc/sys/kernel/sched_autogroup_enabled), that group's nice. Without it a process's own
    nice weighs only against processes of its session, so a nice 10 compile would take half
    of both cores from the tests, each in their own session, instead of what they leave idle."""
    def set_nice():
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
        except OSError:
            pass  # no autogroup: `nice -n` alone applies
    return set_nice


def lane(steps, nice):
    for step in steps:
        step.run(nice)


def pool(steps, slots, nice):
    """Runs `steps` on `slots` threads, each taking the next step in order (which then waits
    for what it depends on)."""
    queue, lock = list(steps), threading.Lock()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                step = queue.pop(0)
            step.run(nice)
    threads = [threading.Thread(target=worker) for _ in range(slots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def tests_run(step):
    """What a test step ran, from its output: ctest's and pytest's summaries, fuzz targets."""
    out = step.output()
    ctest = sum(int(n) for n in re.findall(r"tests passed, \d+ tests failed out of (\d+)", out))
    skipped = len(re.findall(r"^\s*\d+ - .*\(Skipped\)$", out, re.M))
    parts = []
    if ctest:
        parts.append(f"{ctest} ctest" + (f" ({skipped} skipped)" if skipped else ""))
    pytest = sum(int(n) for n in re.findall(r"debian13: test_\w+\.py: (\d+) passed", out))
    pytest_failed = sum(int(n) for n in re.findall(r"debian13: test_\w+\.py: .*?(\d+) failed", out))
    if pytest or pytest_failed:
        parts.append(f"{pytest + pytest_failed} pytest" + (f" ({pytest_failed} failed)" if pytest_failed else ""))
    fuzz = re.search(r"fuzz: (\d+) targets, total", out)
    if fuzz:
        parts.append(f"{fuzz.group(1)} fuzz targets x {FUZZ_SECONDS} s")
    return ", ".join(parts) or "-"


def hit_rate(step):
    if step.tree is None:
        return "-"
    log = os.path.join(ROOT, step.tree, "ccache-stats.log")
    try:
        with open(log) as f:
            counters = f.read().split()
    except OSError:
        return "-"
    hits = sum(1 for c in counters if c in ("direct_cache_hit", "preprocessed_cache_hit"))
    misses = counters.count("cache_miss")
    if hits + misses == 0:
        return "no compiles"
    return f"{hits}/{hits + misses} ({100 * hits / (hits + misses):.0f}%)"


# Lines of a failed step's log that say what failed: ctest's failed and timed-out tests,
# gtest's failure messages, pytest's error lines, sanitizer reports and compiler errors.
FAILURE_LINE = re.compile(r"\*\*\*(Failed|Timeout|Exception)|: Failure$|^E   |^FAILED |^ERROR |error: |"
                          r"runtime error: |==ERROR: |WARNING: ThreadSanitizer|^SUMMARY: |\(exit [1-9]")
DIGEST_CONTEXT = 12  # lines after a gtest failure message (its Expected/Which is/streamed output)
DIGEST_LINES = 60   # per failed step


def failure_digest(step):
    """The lines of `step`'s log that say why it failed, each with the lines after it that
    explain it, at most DIGEST_LINES of at most 600 characters: printed after every step
    ran, next to the table, where a reader of the run's last lines finds them (the log in
    build-ci/ has the whole output)."""
    try:
        with open(step.log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    keep = set()
    for i, line in enumerate(lines):
        if FAILURE_LINE.search(line):
            after = DIGEST_CONTEXT if line.endswith(": Failure") else 0
            keep.update(range(i, min(i + after + 1, len(lines))))
    out = [lines[i][:600] for i in sorted(keep)]
    if len(out) > DIGEST_LINES:
        out = out[:DIGEST_LINES] + [f"... {len(out) - DIGEST_LINES} more lines in {os.path.relpath(step.log, ROOT)}"]
    return out


def main():
    os.makedirs(LOGS, exist_ok=True)
    sanitizers = os.environ.get("COLLSERVE_SANITIZERS", "1") != "0"
    debian13 = os.environ.get("COLLSERVE_DEBIAN13", "1") != "0" and os.geteuid() == 0
    if os.environ.get("COLLSERVE_DEBIAN13", "1") != "0" and not debian13:
        say("debian13: not run (needs root: mounts and chroot)")
    env = "source scripts/ccache_env.sh && "
    release_build = Step("release-build", "release", "build",
                         env + "ccache_stats_log build && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCOLLSERVE_BUILD_TESTS=ON -DCOLLSERVE_BUILD_BENCH=ON "
                         "&& cmake --build build -j2 && echo \"build: $(ccache_hit_rate build)\"", tree="build")
    ctest = "ctest --test-dir build --output-on-failure -j2 --timeout 300"
    if sanitizers:
        # The C++ integration and fault tests that the asan stage runs find there all they
        # would here (the same assertions, with memory and UB checks): this stage runs the
        # unit tests, the Python suites (the Release daemons and modules as users run them)
        # and the C++ tests asan leaves out (docs/ci.md "What a stage leaves to another").
        release_command = (f"{ctest} -LE '^(integration|fault)$'; unit=$?; "
                           f"{ctest} -L '^(integration|fault)$' -R \"^python_|$(bash scripts/sanitizers.sh --asan-unrun-regex)\"; "
                           "rest=$?; exit $((unit | rest))")
    else:
        release_command = ctest
    release_test = Step("release-test", "release", "test", release_command, after=[release_build])
    build_lane, test_lane, root_lane = [release_build], [release_test], []
    if sanitizers:
        asan_build = Step("asan-build", "asan", "build", "bash scripts/sanitizers.sh --build-only asan", tree="build-asan")
        tsan_build = Step("tsan-build", "tsan", "build", "bash scripts/sanitizers.sh --build-only tsan", tree="build-tsan")
        # The asan tests are the longest step: their tree is built first, so that they start
        # first and the run does not end with them alone on the cores.
        build_lane = [asan_build, release_build, tsan_build]
        test_lane = [Step("asan-test", "asan", "test", "bash scripts/sanitizers.sh --test-only asan", after=[asan_build]),
                     release_test,
                     Step("tsan-test", "tsan", "test", "bash scripts/sanitizers.sh --test-only tsan", after=[tsan_build]),
                     Step("fuzz", "asan", "test", f"bash scripts/fuzz.sh {FUZZ_SECONDS}", after=[asan_build])]
    if debian13:
        root = Step("debian13-root", "debian13", "build", "bash scripts/debian13.sh --root-only")
        d13_build = Step("debian13-build", "debian13", "build", "bash scripts/debian13.sh --build-only", after=[root],
                         tree="build-debian13")
        root_lane.append(root)
        build_lane.append(d13_build)
        test_lane.append(Step("debian13-test", "debian13", "test", "bash scripts/debian13.sh --test-only",
                              after=[d13_build]))
    # Priorities: the tests first, the compiles after them, the Debian 13 root (needed last)
    # after both: nice 10 leaves a compile about a tenth of a core a test wants, 19 about 1/70.
    lanes = [threading.Thread(target=lane, args=(build_lane, 10)),
             threading.Thread(target=pool, args=(test_lane, TEST_SLOTS, 0))]
    if root_lane:
        lanes.append(threading.Thread(target=lane, args=(root_lane, 19)))
    for t in lanes:
        t.start()
    for t in lanes:
        t.join()

    steps = root_lane + build_lane + test_lane
    stages = []
    for s in steps:
        if s.stage not in stages:
            stages.append(s.stage)
    rows = [("stage", "build s", "test s", "CPU s (build + test)", "tests run", "ccache hits", "result")]
    if os.environ.get("COLLSERVE_CI_DEPS_S"):
        rows.append(("deps", os.environ["COLLSERVE_CI_DEPS_S"], "-", "-", "-", "-", "ok"))  # scripts/install_deps.sh
    for stage in stages:
        mine = [s for s in steps if s.stage == stage]
        builds = [s for s in mine if s.kind == "build"]
        tests = [s for s in mine if s.kind == "test"]
        result = "ok" if all(s.rc == 0 for s in mine) else \
            "FAILED: " + ", ".join(f"{s.name} ({'skipped' if s.rc is None else f'exit {s.rc}'})"
                                   for s in mine if s.rc != 0)
        build_s = " + ".join(f"{s.seconds:.0f}" for s in builds) or "-"
        rows.append((stage, build_s, " + ".join(f"{s.seconds:.0f}" for s in tests) or "-",
                     f"{sum(s.cpu_seconds for s in builds):.0f} + {sum(s.cpu_seconds for s in tests):.0f}",
                     "; ".join(tests_run(s) for s in tests) or "-",
                     ", ".join(h for h in (hit_rate(s) for s in builds) if h != "-") or "-", result))
    for s in steps:
        if s.rc not in (None, 0):
            print(f"\n=== why {s.name} failed (lines of {os.path.relpath(s.log, ROOT)}, printed whole above)")
            for line in failure_digest(s):
                print("  " + line)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n=== CI stages (the build lane runs beside the test lane at nice 10, so the columns overlap"
          " in time; the Debian 13 build column is root + build)")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    failed = [s for s in steps if s.rc != 0]
    total = elapsed() + int(os.environ.get("COLLSERVE_CI_DEPS_S", "0"))
    cpu = sum(s.cpu_seconds for s in steps)
    print(f"total: {total:.0f} s ({total / 60:.1f} min) wall, deps included; {cpu:.0f} CPU s in the steps "
          f"({cpu / max(elapsed(), 1) / (os.cpu_count() or 1):.0%} of {os.cpu_count()} cores over the run); "
          + ("every step passed" if not failed else f"{len(failed)} steps failed or were skipped: "
             + ", ".join(s.name for s in failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
