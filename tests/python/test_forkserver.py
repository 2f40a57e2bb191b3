"""forkserver.popen, the suites' way to start torch rank programs (docs/ci.md, "Rank
processes"): a forked rank must look like a fresh `python SCRIPT` to what it runs."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import forkserver

CHILD = textwrap.dedent("""\
    import atexit, json, os, sys, tempfile, time
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("FORKSERVER_X"),
                      "tmp": tempfile.gettempdir(), "leader": os.getsid(0) == os.getpid(),
                      "path0": sys.path[0], "main": __name__, "ppid": os.getppid()}))
    print("to stderr", file=sys.stderr)
    mode = sys.argv[1]
    if mode == "raise":
        raise RuntimeError("boom")
    if mode == "sleep":  # a process that stays up until the test signals it (not an ordering pause)
        print("sleeping", flush=True)
        time.sleep(60)
    sys.exit(int(mode))
    """)


@pytest.fixture
def child(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def report(text):
    import json
    return json.loads(text.splitlines()[0])


def test_a_forked_rank_gets_what_a_fresh_process_gets(child, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = dict(os.environ, FORKSERVER_X="1", TMPDIR=str(tmp_path))
    p = forkserver.popen([sys.executable, child, "3"], env=env, cwd=str(cwd), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert isinstance(p, forkserver.ForkedProcess)
    out, err = p.communicate(timeout=60)
    got = report(out)
    assert p.returncode == 3
    assert got["argv"] == [child, "3"] and got["cwd"] == str(cwd) and got["x"] == "1"
    assert got["tmp"] == str(tmp_path) and got["leader"] and got["main"] == "__main__"
    assert got["path0"] == os.path.dirname(child) and got["ppid"] != os.getpid()
    assert out.rstrip().endswith("atexit ran") and err == "to stderr\n"


def test_an_exception_exits_1_with_its_traceback_and_stderr_can_join_stdout(child):
    p = forkserver.popen([sys.executable, child, "raise"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and err is None
    assert b"RuntimeError: boom" in out and b"to stderr" in out and b"atexit ran" in out


def test_timeouts_signals_and_poll_behave_as_popens(child):
    p = forkserver.popen([sys.executable, child, "sleep"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() != ""  # the report line
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    p.kill()  # after the end: nothing happens, as with Popen
    assert p.poll() == -signal.SIGTERM


def test_many_ranks_at_once_each_get_their_own_exit_code(child):
    procs = [forkserver.popen([sys.executable, child, str(i)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i in range(8)]
    assert [p.wait(timeout=60) for p in procs] == list(range(8))


def test_what_an_import_reads_or_another_command_starts_a_fresh_process(child, monkeypatch):
    for args, env in (([sys.executable, child, "0"], dict(os.environ, OMP_NUM_THREADS="1")),
                      ([sys.executable, child, "0"], dict(os.environ, LD_PRELOAD="")),
                      ([sys.executable, "-c", "pass"], None)):
        p = forkserver.popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert isinstance(p, subprocess.Popen), args
        assert p.wait(timeout=60) == 0
    monkeypatch.setenv("COLLSERVE_TEST_FORKSERVER", "0")
    p = forkserver.popen([sys.executable, child, "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert isinstance(p, subprocess.Popen) and p.wait(timeout=60) == 0
