"""Rank processes for the Python suites without paying torch's import in each one.

`popen(args, **kwargs)` starts `python SCRIPT ARGS...` as subprocess.Popen would, and returns
an object with Popen's methods the tests use (pid, returncode, poll, wait, communicate, kill,
terminate, send_signal, stdout, stderr, args). Where it can, the process is forked from a
server that has imported torch once (the "fork server" of multiprocessing's forkserver start
method and of Android's zygote): a torch rank then costs a fork instead of its 1.2-3 CPU
seconds of `import torch` (3 under the ASan runtime), which were most of the CPU of the torch
suites (docs/ci.md, "Rank processes").

What the forked process gets is what a fresh `python SCRIPT` gets: its own pid (the server's
child, so `ps` shows the server as its parent, not the test), session (start_new_session),
working directory, environment (os.environ replaced by the one asked for), file descriptors 0,
1 and 2 (the pipes, /dev/null or files asked for), sys.argv, sys.path[0] (the script's
folder), `__main__` (runpy), and an ordinary interpreter exit: atexit handlers, buffered
output flushed, exit status from SystemExit or 1 for an uncaught exception, or a signal's.
Its torch modules were imported before it existed, so `popen` forks only when nothing that
an import reads differs from the server's environment (LD_*, PYTHON*, OMP_*, TORCH_*, the
sanitizers' options, ...: IMPORT_ENV below), and only for `sys.executable SCRIPT.py`; any
other command, or COLLSERVE_TEST_FORKSERVER=0, runs through subprocess.Popen unchanged.

Protocol (one socketpair per test process, requests under a lock): the client sends a JSON
request with its three descriptors (SCM_RIGHTS); the server forks, opens a pidfd for the child
before it can be reaped, and answers {"pid"} with the pidfd, so signals sent later reach that
child or nobody; when a child ends the server reaps it and sends {"exited", "status"}. The
server ends when its socket closes (its test process ended). Thread safety: popen and the
returned objects may be used from several threads (one lock guards the socket).
"""
import array
import atexit
import io
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

# Preloaded by the server: what the torch workers import first, and what costs the time.
PRELOAD = ("torch", "torch.distributed", "torch.nn")
# Environment variables that a preloaded import (or the interpreter's start) reads: a
# process asked for with another value of one of these is started fresh instead.
IMPORT_ENV = ("LD_", "PYTHON", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOMP_", "TORCH_", "PYTORCH_", "CUDA",
              "NCCL_", "ASAN_", "LSAN_", "UBSAN_", "TSAN_", "MSAN_", "MALLOC_", "GLIBC_", "LANG", "LC_")
_MAX_MESSAGE = 1 << 20  # bytes of one JSON message (an environment fits many times over)


def _send(sock, message, fds=()):
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def _recv(sock, max_fds=0):
    """One message (a SOCK_SEQPACKET record) and the descriptors sent with it; None at EOF."""
    fds = array.array("i")
    data, ancillary, flags, _ = sock.recvmsg(_MAX_MESSAGE, socket.CMSG_LEN(max(max_fds, 3) * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        if data:
            raise ValueError(f"forkserver: a message over the {_MAX_MESSAGE}-byte or 3-descriptor limit")
        return None, []
    return json.loads(data), list(fds)


# ---------------------------------------------------------------------------- the server


def _serve(sock):
    """Forks a child per request until the socket closes. Returns the child's request in the
    child (the caller runs its script), None in the server when it is done."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children = {}  # pid -> pidfd (kept open until the exit is reported)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                continue
            request, fds = _recv(sock, 3)
            if request is None:  # the test process is gone
                return None
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sel.close()
                sock.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                for fd in children.values():
                    os.close(fd)
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                for fd in fds:
                    if fd > 2:
                        os.close(fd)
                return request
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            children[pid] = pidfd
            _send(sock, {"pid": pid}, [pidfd])
        while children:  # reap what ended, and say so
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                os.close(children.pop(pid))
            _send(sock, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def _run_child(request):
    """In the forked child: becomes `python SCRIPT ARGS...` as asked, and runs it as __main__
    (returning normally, raising SystemExit or an exception: the interpreter's exit follows)."""
    if request.get("new_session"):
        os.setsid()
    if request.get("cwd"):
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import tempfile
    tempfile.tempdir = None  # TMPDIR as the child's environment has it
    script = request["argv"][1]
    sys.argv = request["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    runpy.run_path(script, run_name="__main__")


def _main():
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    request = _serve(sock)
    if request is not None:
        _run_child(request)


# ---------------------------------------------------------------------------- the client


class _Server:
    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.exits = {}  # pid -> exit code, for children whose waiter has not asked yet

    def spawn(self, request, fds):
        with self.lock:
            _send(self.sock, request, fds)
            while True:
                message, got = _recv(self.sock, 1)
                if message is None:
                    raise RuntimeError("forkserver: the server ended (exit %s)" % self.proc.poll())
                if "pid" in message:
                    return message["pid"], got[0]
                self.exits[message["exited"]] = message["status"]

    def exit_code(self, pid):
        """The exit code of a child that has ended (its pidfd was readable): the server
        reports it once it has reaped the child, at most moments later."""
        with self.lock:
            while pid not in self.exits:
                message, fds = _recv(self.sock)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    raise RuntimeError("forkserver: the server ended (exit %s)" % self.proc.poll())
                if "exited" in message:
                    self.exits[message["exited"]] = message["status"]
            return self.exits.pop(pid)


_server = None
_server_lock = threading.Lock()


@atexit.register
def _stop_server():
    """Ends the server with the test process and waits for it, so that its children's CPU
    time counts in the test process's (wait4 rusage: CI's CPU column)."""
    if _server is not None:
        _server.sock.close()
        try:
            _server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _server.proc.kill()


def _get_server():
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        return _server


class ForkedProcess:
    """The part of subprocess.Popen the suites use, for a process the server forked."""

    def __init__(self, args, env, stdin, stdout, stderr, text, cwd, start_new_session):
        self.args = list(args)
        self.returncode = None
        self.stdout = self.stderr = None
        self._text = text
        self._chunks = {}
        opened, pipes = [], {}

        def target(spec, default_fd, name):
            if spec is None:
                return default_fd
            if spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
                return fd
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                pipes[name] = r
                opened.append(w)
                return w
            return spec if isinstance(spec, int) else spec.fileno()

        if stdin == subprocess.PIPE:
            raise ValueError("forkserver: stdin=PIPE is not supported (popen() starts such a process fresh)")
        fd_in = target(stdin, 0, "stdin")
        fd_out = target(stdout, 1, "stdout")
        fd_err = fd_out if stderr == subprocess.STDOUT else target(stderr, 2, "stderr")
        server = _get_server()
        request = {"argv": self.args, "env": dict(os.environ if env is None else env), "cwd": cwd,
                   "new_session": bool(start_new_session)}
        try:
            self.pid, self._pidfd = server.spawn(request, [fd_in, fd_out, fd_err])
        finally:
            for fd in opened:
                os.close(fd)
        self._server = server
        for name, fd in pipes.items():
            f = io.open(fd, "r" if text else "rb", **({"encoding": "utf-8", "errors": "replace"} if text else {}))
            setattr(self, name, f)
            self._chunks[name] = []

    def _ended(self, timeout):
        """Whether the process has ended, waiting up to `timeout` seconds (None: forever)."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._pidfd, selectors.EVENT_READ)
            return bool(sel.select(timeout))

    def _reap(self):
        self.returncode = self._server.exit_code(self.pid)
        os.close(self._pidfd)

    def poll(self):
        if self.returncode is None and self._ended(0):
            self._reap()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if not self._ended(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._reap()
        return self.returncode

    def communicate(self, input=None, timeout=None):
        if input is not None:
            raise ValueError("forkserver: communicate(input) is not supported")
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {name: getattr(self, name) for name in ("stdout", "stderr") if getattr(self, name)}
        open_streams = {name: f for name, f in streams.items() if not f.closed}
        if open_streams:
            with selectors.DefaultSelector() as sel:
                for name, f in open_streams.items():
                    sel.register(f.fileno(), selectors.EVENT_READ, name)
                while sel.get_map():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise subprocess.TimeoutExpired(self.args, timeout)
                    for key, _ in sel.select(left):
                        data = os.read(key.fd, 65536)
                        if data:
                            self._chunks[key.data].append(data)
                        else:
                            sel.unregister(key.fd)
                            streams[key.data].close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

        def joined(name):
            if name not in streams:
                return None
            data = b"".join(self._chunks[name])
            return data.decode("utf-8", "replace") if self._text else data
        return joined("stdout"), joined("stderr")

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdout, self.stderr):
            if f:
                f.close()
        self.wait()


def _forkable(args, env, kwargs):
    if os.environ.get("COLLSERVE_TEST_FORKSERVER", "1") == "0" or set(kwargs) - {"stdin", "stdout", "stderr", "text", "cwd", "start_new_session"}:
        return False
    if len(args) < 2 or args[0] != sys.executable or not str(args[1]).endswith(".py"):
        return False
    if kwargs.get("stdin") == subprocess.PIPE:
        return False
    server_env = _server.env if _server is not None else os.environ
    wanted = os.environ if env is None else env
    changed = {k for k in set(server_env) | set(wanted) if server_env.get(k) != wanted.get(k)}
    return not any(k.startswith(IMPORT_ENV) for k in changed)


def popen(args, env=None, **kwargs):
    """subprocess.Popen(args, env=env, **kwargs), forked from the torch-preloaded server when
    `args` is [sys.executable, SCRIPT.py, ...] and nothing an import reads differs (see the
    module's docstring). kwargs: stdin, stdout, stderr, text, cwd, start_new_session."""
    args = [str(a) for a in args]
    if not _forkable(args, env, kwargs):
        return subprocess.Popen(args, env=env, **kwargs)
    return ForkedProcess(args, env, kwargs.get("stdin"), kwargs.get("stdout"), kwargs.get("stderr"),
                         kwargs.get("text", False), kwargs.get("cwd"), kwargs.get("start_new_session", False))


if __name__ == "__main__":
    _main()
