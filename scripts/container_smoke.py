#!/usr/bin/env python3
"""Deployment smoke test of collserve in real containers, with Debian's podman (issue 40).

What it checks, in order (each step prints its commands and what it checked; the run ends
with a table of steps, results and seconds, and the sizes of the images):

 1. preconditions: root; podman, runc (or crun), uidmap, slirp4netns, fuse-overlayfs,
    netavark, aardvark-dns, iptables, mmdebstrap and python3-yaml, installed with apt-get
    where missing; podman without systemd gets --cgroup-manager=cgroupfs
    --events-backend=file on its command line (nothing under /etc is edited).
 2. the chart rendered as tests/deploy/chart_test.sh renders it (`helm template collserve
    helm/collserve -n collserve --kube-version 1.29.0 -f helm/collserve/ci/auth-values.yaml`:
    the admin token and the job tokens come from Secrets), and helm/examples/pytorchjob.yaml;
    the coordinator's StatefulSet, the sidecar's DaemonSet and the PyTorchJob's Master and
    Worker pods are translated into `podman run` options: args and env (with the kubelet's
    $(VAR) expansion, status.podIP/hostIP), volumeMounts (emptyDir and the
    volumeClaimTemplate as host directories, emptyDir medium Memory as a tmpfs, hostPath
    /run/collserve as one host directory shared by the sidecar and the trainers at the
    chart's path, Secrets as directories laid out as the kubelet writes them: ..data links,
    defaultMode, fsGroup), securityContext (runAsUser/runAsGroup, fsGroup, runAsNonRoot,
    readOnlyRootFilesystem, allowPrivilegeEscalation, capabilities), the grace period, and
    the Services' DNS names (--add-host on one podman network, one static IP per pod);
    the training operator's env (PYTHONUNBUFFERED, MASTER_ADDR/PORT, WORLD_SIZE, RANK) is
    added to the trainers as the operator appends it.
 3. the offline base image localhost/collserve/debian:12 (deploy/docker/build_base_image.sh)
    when it is missing;
 4. the coordinator, sidecar and trainer images built from deploy/docker (the chart's and
    the example's image names, --build-arg DEBIAN_IMAGE=localhost/collserve/debian:12
    BUILD_JOBS=2, the .dockerignore files via --ignorefile), each build timed;
 5. the coordinator started, its startup probe polled until it passes (bounded), the token
    Secrets read ("job credentials loaded"); then the sidecar, its readiness probe polled;
    then every probe of both (grpc probes run as `collservectl health` inside the pod's
    container against the pod IP and port) and the documented `collservectl
    --coordinator=... --sidecar=unix:/run/collserve/sidecar.sock health`; the socket's mode;
 6. both metrics ports hit with odd requests (HEAD /metrics, GET /, garbage, an oversized
    header, a cut request, a TLS ClientHello): both daemons must still run, serve /metrics
    and pass their probes afterwards;
 7. the main job: the PyTorchJob's two ranks (examples/digits_sgd.py --backend=collserve,
    world size 2, through the sidecar's socket): exit 0, every epoch line, a test accuracy
    of at least --min-accuracy;
 8. the same two ranks with more epochs; once both printed an epoch, the chart's preStop
    drain runs in the sidecar container (it must report the attached sessions and time out
    with exit 1 after drain.timeoutSeconds, as docs/operations.md "Draining a sidecar"
    says; meanwhile readiness NOT_SERVING, liveness SERVING, `collservectl health` with the
    job's token lists the host as draining, and the ranks keep training),
    then `podman stop` (SIGTERM, the rest of terminationGracePeriodSeconds) stops the
    sidecar: it must exit 0, and both ranks must exit non-zero within
    COLLSERVE_OP_TIMEOUT_S + 30 s with UNAVAILABLE and the error docs/operations.md ("Where
    the errors a rank sees come from") gives for a sidecar that went away, "session with
    the sidecar ended" (by default the code's other text for the same event, "sidecar H is
    shutting down", which a collective in flight gets, passes with a note; --strict-error
    fails it); the coordinator must still be healthy.
Everything it created (containers, the network, temporary directories) is removed at the
end, also on failure or Ctrl-C, unless --keep; the images stay unless --rmi.

Run it from anywhere, as root, on a Debian 12 machine that reaches its Debian mirror (not a
registry: the base image is built offline):

    sudo python3 scripts/container_smoke.py               # everything (three image builds)
    sudo python3 scripts/container_smoke.py --skip-build  # reuse the images built before
    python3 scripts/container_smoke.py --dry-run          # render, translate, print the commands

helm: --helm PATH, default the one tests/deploy/chart_test.sh installs
(build*/tests/deploy/npm-cache/node_modules/.bin/helm; `ctest -R deploy_chart` once), else
`helm` on PATH.

Not part of CI (too slow: three image builds, and the CI machines run no container engine);
run by hand for issue 40's closing note, with its output and the image sizes it prints.

Where the machine lacks CAP_SYS_RESOURCE (some VMs and sandboxes), the containers and builds
get the machine's hard nofile/nproc limits (--ulimit): podman's defaults are above them and
the runtime could not set them. What it does not reproduce: NetworkPolicy (podman enforces
none), resource requests, the kubelet's probe timing (a probe runs when the script checks,
and counts as failed after failureThreshold failures periodSeconds apart), cluster DNS (the
Service names are /etc/hosts entries), and the DaemonSet restarting the stopped sidecar.
Exit status: 0 every check passed, 1 a check failed (named on the way and in the table),
2 usage.
"""
import argparse
import contextlib
import datetime
import glob
import http.client
import ipaddress
import json
import os
import re
import resource
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART = os.path.join(ROOT, "helm", "collserve")
VALUES = os.path.join(CHART, "ci", "auth-values.yaml")
PYTORCHJOB = os.path.join(ROOT, "helm", "examples", "pytorchjob.yaml")
TRAINING_JOB = os.path.join(ROOT, "helm", "examples", "training-job.yaml")
DOCKER_DIR = os.path.join(ROOT, "deploy", "docker")
# The release and namespace tests/deploy/chart_test.sh renders, and helm/examples' README uses.
RELEASE = "collserve"
NAMESPACE = "collserve"
KUBE_VERSION = "1.29.0"  # chart_test.sh's
BASE_IMAGE = "localhost/collserve/debian:12"  # build_base_image.sh's default tag, as podman names it
LABEL = "io.collserve.smoke"  # on every container and the network this script creates
PREFIX = "collserve-smoke"    # their names
NODE_NAME = "smoke-node"
CTL = "/usr/local/bin/collservectl"  # in both daemon images (the chart's preStop names it so)

# What a rank gets when its sidecar goes away: docs/operations.md, "Where the errors a rank sees
# come from": `UNAVAILABLE ... session with the sidecar ended` (client/session_process_group.cc,
# ReadLoop: "session with the sidecar ended: <the stream's status>").
DOCUMENTED_ERROR = "session with the sidecar ended"
# Other texts the code gives for the same event (not in that table): a collective in flight
# when the sidecar stops fails with the group's failure (engine/group.cc, Group::Stop), and the
# client's ReadLoop has two more endings.
OTHER_SIDECAR_GONE = [
    (re.compile(r"sidecar \S+ is shutting down"), "engine/group.cc Group::Stop, a collective in flight"),
    (re.compile(r"session with the sidecar was cancelled"), "client/session_process_group.cc ReadLoop, stream CANCELLED"),
    (re.compile(r"the sidecar ended the session"), "client/session_process_group.cc ReadLoop, stream ended OK"),
]
# examples/digits_sgd.py's lines.
EPOCH_RE = re.compile(r"Rank\s+(\d+)\s*,\s*epoch\s+(\d+)\s*:\s*(\S+)")
ACCURACY_RE = re.compile(r"Rank\s+(\d+)\s*,\s*test accuracy:\s*([\d.]+)%")

# Images: (what, Dockerfile, target, the name the chart / the example uses without its tag).
IMAGES = [
    ("coordinator", "coordinator.Dockerfile", None, "collserve/coordinator"),
    ("sidecar", "sidecar.Dockerfile", None, "collserve/sidecar"),
    ("trainer", "sidecar.Dockerfile", "trainer", "collserve/trainer"),
]
# tool -> Debian package (step 1).
PACKAGES = [
    ("podman", "podman"),
    ("newuidmap", "uidmap"),
    ("slirp4netns", "slirp4netns"),
    ("fuse-overlayfs", "fuse-overlayfs"),
    ("/usr/lib/podman/netavark", "netavark"),
    ("/usr/lib/podman/aardvark-dns", "aardvark-dns"),
    ("iptables", "iptables"),
    ("mmdebstrap", "mmdebstrap"),
]


class Failed(Exception):
    """A failed check; the message says which."""


class Abort(Exception):
    """A step failed that later steps need."""


def log(text=""):
    print(text, flush=True)


def tail(text, n=40):
    lines = (text or "").rstrip("\n").splitlines()
    return "\n".join(("    " + l) for l in lines[-n:])


class Run:
    """The steps and their checks; the summary table at the end."""

    def __init__(self):
        self.rows = []  # (title, result, seconds, detail)
        self._failures = None
        self.secrets = set()  # values never printed

    def redact(self, text):
        for s in self.secrets:
            text = text.replace(s, "<redacted>")
        return text

    @contextlib.contextmanager
    def step(self, title, fatal=True):
        log(f"\n=== {title}")
        start = time.monotonic()
        self._failures = []
        try:
            yield
        except Failed as e:
            self._failures.append(str(e))
            log(f"  FAIL: {self.redact(str(e))}")
        except (Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # a bug of this script, or an unexpected answer
            self._failures.append(f"{type(e).__name__}: {e}")
            log(self.redact(traceback.format_exc()))
        seconds = time.monotonic() - start
        failures, self._failures = self._failures, None
        self.rows.append((title, "FAIL" if failures else "PASS", seconds, "; ".join(failures)))
        log(f"--- {title}: {'FAIL' if failures else 'PASS'} ({seconds:.1f} s)")
        if failures and fatal:
            raise Abort(title)

    def check(self, ok, what, detail=""):
        """Records one check of the current step; a failed one fails the step (it goes on)."""
        if ok:
            log(f"  ok: {what}")
        else:
            msg = what + (f": {detail}" if detail else "")
            log(f"  FAIL: {self.redact(msg)}")
            self._failures.append(msg)
        return ok

    def skip(self, title, why):
        log(f"\n=== {title}: skipped ({why})")
        self.rows.append((title, "SKIP", 0.0, why))

    @property
    def failed(self):
        return any(r[1] == "FAIL" for r in self.rows)


RUN = Run()


def show(argv):
    return RUN.redact(shlex.join(str(a) for a in argv))


def sh(argv, timeout=60, check=True, quiet=False, cwd=None, env=None):
    """Runs argv (stdout and stderr together); Failed on a non-zero exit (check) or timeout."""
    if not quiet:
        log(f"$ {show(argv)}")
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                           timeout=timeout, cwd=cwd, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
        raise Failed(f"timed out after {timeout} s: {show(argv)}\n{tail(out)}")
    except FileNotFoundError:
        raise Failed(f"not found: {argv[0]}")
    if check and p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {show(argv)}\n{tail(RUN.redact(p.stdout))}")
    return p


class Attached:
    """A command whose output is read as it comes (a training container, a drain): lines kept,
    and echoed with a prefix."""

    def __init__(self, label, argv, echo=True):
        self.label = label
        self.lines = []
        self._lock = threading.Lock()
        log(f"$ {show(argv)} &")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", bufsize=1)
        self.ended = None
        self._thread = threading.Thread(target=self._read, args=(echo,), daemon=True)
        self._thread.start()

    def _read(self, echo):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._lock:
                self.lines.append(line)
            if echo:
                log(f"  [{self.label}] {RUN.redact(line)}")

    def text(self):
        with self._lock:
            return "\n".join(self.lines)

    def running(self):
        return self.proc.poll() is None

    def wait(self, timeout):
        """The exit code, or None if still running after `timeout` seconds."""
        try:
            rc = self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None
        self._thread.join(timeout=10)
        if self.ended is None:
            self.ended = time.monotonic()
        return rc


def poll(fn, bound_s, interval_s=1.0):
    """Calls fn() -> (ok, output) until ok or bound_s passed; returns (ok, output, seconds)."""
    start = time.monotonic()
    ok, out = fn()
    while not ok and time.monotonic() - start < bound_s:
        time.sleep(interval_s)
        ok, out = fn()
    return ok, out, time.monotonic() - start


def duration_s(text):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not m:
        raise Failed(f"cannot read the duration {text!r}")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


# ---------------------------------------------------------------- podman

class Podman:
    def __init__(self, args):
        self.global_opts = []
        if not os.path.isdir("/run/systemd/system"):  # no systemd: no systemd cgroups, no journald
            self.global_opts += ["--cgroup-manager=cgroupfs", "--events-backend=file"]
        self.runtime = args.runtime
        if self.runtime is None:
            self.runtime = "runc" if shutil.which("runc") or not shutil.which("crun") else "crun"
        self.global_opts += [f"--runtime={self.runtime}"] + list(args.podman_opt)
        # Rootful podman raises a container's RLIMIT_NOFILE to 1048576 (and sets nproc 32768);
        # without CAP_SYS_RESOURCE (some VMs and sandboxes) the runtime cannot raise a hard
        # limit above the machine's ("error setting rlimit type 7: operation not permitted"),
        # so the containers and the builds then get the machine's hard limits.
        # Both are then given: with nofile alone podman sets a higher nproc, refused the same way.
        self.ulimits = []
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if not has_capability(24) and nofile != resource.RLIM_INFINITY and nofile < 1048576:  # CAP_SYS_RESOURCE
            nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
            nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
            self.ulimits = [f"--ulimit=nofile={nofile}:{nofile}", f"--ulimit=nproc={nproc}:{nproc}"]

    def cmd(self, *argv):
        return ["podman", *self.global_opts, *argv]

    def exists(self, image):
        return sh(self.cmd("image", "exists", image), check=False, quiet=True).returncode == 0

    def state(self, name):
        """(status, exit code) of a container; ("missing", None) when there is none."""
        p = sh(self.cmd("inspect", "--type", "container", "--format", "{{.State.Status}} {{.State.ExitCode}}", name),
               check=False, quiet=True)
        if p.returncode != 0:
            return "missing", None
        status, code = p.stdout.split()[:2]
        return status, int(code)

    def logs(self, name):
        return sh(self.cmd("logs", name), check=False, quiet=True, timeout=30).stdout


def have_yaml():
    """Whether `import yaml` works; Debian's python3-yaml is also found from another python3."""
    import importlib
    for attempt in range(2):
        try:
            importlib.import_module("yaml")
            return True
        except ImportError:
            if attempt == 0 and "/usr/lib/python3/dist-packages" not in sys.path:
                sys.path.append("/usr/lib/python3/dist-packages")
            importlib.invalidate_caches()
    return False


def has_capability(bit):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << bit))
    except OSError:
        pass
    return True


def local_image(ref):
    """The chart names images without a registry (collserve/sidecar:0.1.0); podman stores a
    locally built one as localhost/<name>."""
    first = ref.split("/", 1)[0]
    if "/" in ref and ("." in first or ":" in first or first == "localhost"):
        return ref
    return "localhost/" + ref


# ---------------------------------------------------------------- the chart, translated

def k8s_expand(text, env):
    """The kubelet's $(VAR) expansion of command, args and env values ($$ is a literal $)."""
    def sub(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, str(text))


class Node:
    """The one "node": its directories (hostPath), the pods' volumes, its address."""

    def __init__(self, work, host_ip, dry):
        self.work = work
        self.host_ip = host_ip
        self.dry = dry
        self.hostpaths = {}  # node path -> host directory

    def mkdir(self, path, mode, uid=0, gid=0):
        if not self.dry:
            os.makedirs(path, exist_ok=True)
            os.chown(path, uid, gid)
            os.chmod(path, mode)
        return path

    def hostpath(self, path, kind):
        host = os.path.join(self.work, "node", path.strip("/").replace("/", "_") or "root")
        if path not in self.hostpaths:
            if kind == "Directory":
                raise Failed(f"hostPath {path} (type Directory) does not exist on the node: nothing made it "
                             "(the sidecar's DaemonSet has it with DirectoryOrCreate)")
            if kind not in ("DirectoryOrCreate", "", None):
                raise Failed(f"hostPath type {kind} is not translated")
            self.mkdir(host, 0o755)  # DirectoryOrCreate: 0755 root
            self.hostpaths[path] = host
        return self.hostpaths[path]

    def secret_volume(self, directory, data, mode, gid):
        """A Secret volume as the kubelet writes it (atomic writer): the files in a timestamped
        directory, ..data linking to it, one link per key; files with defaultMode, group fsGroup."""
        if self.dry:
            return directory
        self.mkdir(directory, 0o1777 | (0o2000 if gid else 0), 0, gid or 0)
        stamp = "..%s" % datetime.datetime.utcnow().strftime("%Y_%m_%d_%H_%M_%S.%f")
        self.mkdir(os.path.join(directory, stamp), 0o755 | (0o2000 if gid else 0), 0, gid or 0)
        for key, value in sorted(data.items()):
            path = os.path.join(directory, stamp, key)
            with open(path, "w") as f:
                f.write(value)
            os.chown(path, 0, gid or 0)
            os.chmod(path, mode)
        os.symlink(stamp, os.path.join(directory, "..data"))
        for key in data:
            os.symlink(os.path.join("..data", key), os.path.join(directory, key))
        return directory


class Spec:
    """One pod's container as `podman run` options."""

    def __init__(self, name, pod_name, ip, image):
        self.name = name          # the podman container
        self.pod_name = pod_name  # its hostname, as the pod's name
        self.ip = ip
        self.image = image
        self.env = {}             # in the pod's order
        self.secret_env = set()   # names whose value came from a Secret (passed in an env file)
        self.entrypoint = None
        self.args = []
        self.mounts = []          # (host, path, read-only)
        self.tmpfs = []           # (path, options)
        self.user = None
        self.groups = []
        self.run_as_non_root = False
        self.read_only = False
        self.no_new_privileges = False
        self.cap_drop = []
        self.cap_add = []
        self.privileged = False
        self.seccomp = None
        self.grace_s = 30
        self.ports = {}           # name -> containerPort
        self.probes = {}          # startup/readiness/liveness -> the probe
        self.pre_stop = None      # the preStop exec command
        self.notes = []           # what is not translated

    def run_argv(self, podman, network, hosts, run_id, env_file, detach):
        a = ["run"] + (["-d"] if detach else []) + [
            "--name", self.name, "--hostname", self.pod_name, "--network", network, "--ip", self.ip,
            "--pull=never", "--log-driver=k8s-file", "--label", f"{LABEL}={run_id}"] + podman.ulimits
        for host, ip in hosts:
            a += ["--add-host", f"{host}:{ip}"]
        if self.user is not None:
            a += ["--user", self.user]
        for g in self.groups:
            a += ["--group-add", str(g)]
        if self.read_only:
            # Kubernetes' readOnlyRootFilesystem: no writable /run, /tmp, /var/tmp either.
            a += ["--read-only", "--read-only-tmpfs=false"]
        if self.no_new_privileges:
            a += ["--security-opt", "no-new-privileges"]
        if self.seccomp:
            a += ["--security-opt", f"seccomp={self.seccomp}"]
        if self.privileged:
            a += ["--privileged"]
        for c in self.cap_drop:
            a += ["--cap-drop", c]
        for c in self.cap_add:
            a += ["--cap-add", c]
        a += ["--stop-timeout", str(self.grace_s)]
        for k, v in self.env.items():
            if k not in self.secret_env:
                a += ["--env", f"{k}={v}"]
        if self.secret_env:
            a += ["--env-file", env_file]
        for host, path, ro in self.mounts:
            a += ["--mount", f"type=bind,source={host},destination={path}" + (",ro=true" if ro else "")]
        for path, options in self.tmpfs:
            a += ["--tmpfs", f"{path}:{options}"]
        if self.entrypoint is not None:
            # With an entrypoint given, podman does not append the image's CMD: Kubernetes'
            # `command` without `args` likewise drops it.
            a += ["--entrypoint", json.dumps(self.entrypoint)]
        a += [self.image] + self.args
        return podman.cmd(*a)

    def write_env_file(self, path, dry):
        if self.secret_env and not dry:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                for k in self.env:
                    if k in self.secret_env:
                        f.write(f"{k}={self.env[k]}\n")


def translate(pod, container, *, name, pod_name, ip, node, secret_data, extra_env=(), claims=()):
    """Kubernetes pod spec + container -> Spec. Raises Failed on what it cannot translate."""
    spec = Spec(name, pod_name, ip, local_image(container["image"]))
    psc = pod.get("securityContext") or {}
    csc = container.get("securityContext") or {}

    def sc(key):
        return csc.get(key, psc.get(key))

    # Env, in order, with the kubelet's expansion of earlier variables.
    fields = {"status.podIP": ip, "status.hostIP": node.host_ip, "metadata.name": pod_name,
              "metadata.namespace": NAMESPACE, "spec.nodeName": NODE_NAME}
    for e in container.get("env") or []:
        if "value" in e:
            spec.env[e["name"]] = k8s_expand(e["value"], spec.env)
            continue
        ref = e.get("valueFrom") or {}
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            if path not in fields:
                raise Failed(f"{name}: env {e['name']}: fieldRef {path} is not translated")
            spec.env[e["name"]] = fields[path]
        elif "secretKeyRef" in ref:
            s = ref["secretKeyRef"]
            try:
                spec.env[e["name"]] = secret_data[s["name"]][s["key"]]
            except KeyError:
                raise Failed(f"{name}: env {e['name']}: no Secret {s['name']} key {s['key']}")
            spec.secret_env.add(e["name"])
        else:
            raise Failed(f"{name}: env {e['name']}: {sorted(ref)} is not translated")
    for k, v in extra_env:
        spec.env[k] = v
    if container.get("envFrom"):
        raise Failed(f"{name}: envFrom is not translated")

    command = [k8s_expand(c, spec.env) for c in container.get("command") or []]
    spec.args = [k8s_expand(a, spec.env) for a in container.get("args") or []]
    if command:
        spec.entrypoint = command

    # Users: the pod's, overridden by the container's.
    uid, gid = sc("runAsUser"), sc("runAsGroup")
    if uid is not None:
        spec.user = f"{uid}:{gid}" if gid is not None else str(uid)
    elif gid is not None:
        raise Failed(f"{name}: runAsGroup without runAsUser is not translated")
    fs_group = psc.get("fsGroup")
    spec.groups = ([fs_group] if fs_group is not None else []) + list(psc.get("supplementalGroups") or [])
    spec.run_as_non_root = bool(sc("runAsNonRoot"))
    spec.read_only = bool(csc.get("readOnlyRootFilesystem"))
    spec.no_new_privileges = csc.get("allowPrivilegeEscalation") is False
    spec.privileged = bool(csc.get("privileged"))
    caps = csc.get("capabilities") or {}
    spec.cap_drop = list(caps.get("drop") or [])
    spec.cap_add = list(caps.get("add") or [])
    seccomp = (sc("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        spec.seccomp = "unconfined"
    elif seccomp != "RuntimeDefault":
        raise Failed(f"{name}: seccompProfile {seccomp} is not translated")
    for key in ("hostNetwork", "hostIPC", "hostPID"):
        if pod.get(key):
            raise Failed(f"{name}: {key} is not translated")
    spec.grace_s = int(pod.get("terminationGracePeriodSeconds", 30))

    # Volumes.
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    pod_dir = os.path.join(node.work, "pods", name)
    for m in container.get("volumeMounts") or []:
        if m.get("subPath") or m.get("subPathExpr"):
            raise Failed(f"{name}: volumeMount {m['name']}: subPath is not translated")
        ro = bool(m.get("readOnly"))
        v = volumes.get(m["name"])
        if v is None and m["name"] in claims:  # a StatefulSet's volumeClaimTemplate: a fresh volume
            host = node.mkdir(os.path.join(pod_dir, "pvc-" + m["name"]),
                              0o2775 if fs_group is not None else 0o755, 0, fs_group or 0)
            spec.mounts.append((host, m["mountPath"], ro))
        elif v is None:
            raise Failed(f"{name}: volumeMount {m['name']} has no volume")
        elif "emptyDir" in v:
            ed = v["emptyDir"] or {}
            if ed.get("medium") == "Memory":
                options = "rw,mode=0777"
                if ed.get("sizeLimit"):
                    options += f",size={quantity_bytes(ed['sizeLimit'])}"
                spec.tmpfs.append((m["mountPath"], options))
            else:
                host = node.mkdir(os.path.join(pod_dir, "emptydir-" + m["name"]),
                                  0o2777 if fs_group is not None else 0o777, 0, fs_group or 0)
                spec.mounts.append((host, m["mountPath"], ro))
        elif "hostPath" in v:
            spec.mounts.append((node.hostpath(v["hostPath"]["path"], v["hostPath"].get("type")), m["mountPath"], ro))
        elif "secret" in v:
            s = v["secret"]
            if s.get("items"):
                raise Failed(f"{name}: secret volume {m['name']}: items are not translated")
            if s["secretName"] not in secret_data:
                raise Failed(f"{name}: no Secret {s['secretName']}")
            host = node.secret_volume(os.path.join(pod_dir, "secret-" + m["name"]), secret_data[s["secretName"]],
                                      int(s.get("defaultMode", 0o644)), fs_group)
            spec.mounts.append((host, m["mountPath"], True))  # Secret volumes are read-only
        else:
            raise Failed(f"{name}: volume {m['name']} ({sorted(v)}) is not translated")

    spec.ports = {p.get("name", str(p["containerPort"])): int(p["containerPort"]) for p in container.get("ports") or []}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if container.get(kind):
            spec.probes[kind] = container[kind]
    pre = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
    if pre:
        spec.pre_stop = [k8s_expand(c, spec.env) for c in pre["command"]]
    if container.get("resources"):
        spec.notes.append(f"resources {container['resources']} not applied")
    return spec


def quantity_bytes(q):
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|k|M|G)?", str(q))
    if not m:
        raise Failed(f"cannot read the quantity {q!r}")
    return int(m.group(1)) * {None: 1, "Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3, "k": 1000, "M": 1000 ** 2,
                              "G": 1000 ** 3}[m.group(2)]


def service_hosts(name, namespace=NAMESPACE):
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]


# ---------------------------------------------------------------- probes

class Probes:
    """A probe of the chart, run once from where the kubelet would reach it."""

    def __init__(self, podman, coordinator_address):
        self.podman = podman
        self.coordinator_address = coordinator_address  # the sidecar's --coordinator

    def describe(self, spec, kind):
        return self._argv_or_desc(spec, kind)[1]

    def _argv_or_desc(self, spec, kind):
        probe = spec.probes[kind]
        timeout = int(probe.get("timeoutSeconds", 1))
        if "grpc" in probe:
            port = int(probe["grpc"]["port"])
            service = probe["grpc"].get("service", "")
            # grpc.health.v1 Check(service) on podIP:port, as the kubelet makes it: collservectl
            # health inside the pod's container (both images have it; it checks "" and "liveness",
            # and for a coordinator also Store, Registry and Auth).
            if spec.name.endswith("-sidecar"):
                argv = [CTL, f"--coordinator={self.coordinator_address}", f"--sidecar={spec.ip}:{port}",
                        f"--timeout={max(timeout, 1)}s", "health"]
            else:
                argv = [CTL, f"--coordinator={spec.ip}:{port}", f"--timeout={max(timeout, 1)}s", "health"]
            desc = f"{kind} grpc.health.v1 service={service!r} on {spec.ip}:{port}"
            return self.podman.cmd("exec", spec.name, *argv), f"{desc} -> podman exec {spec.name} {shlex.join(argv)}"
        if "exec" in probe:
            argv = probe["exec"]["command"]
            return (self.podman.cmd("exec", spec.name, *argv),
                    f"{kind} exec -> podman exec {spec.name} {shlex.join(argv)}")
        if "tcpSocket" in probe:
            port = self._port(spec, probe["tcpSocket"]["port"])
            return ("tcp", spec.ip, port, timeout), f"{kind} tcpSocket {spec.ip}:{port} (from the host)"
        if "httpGet" in probe:
            h = probe["httpGet"]
            port = self._port(spec, h["port"])
            return ("http", spec.ip, port, h.get("path", "/"), timeout), \
                f"{kind} httpGet http://{spec.ip}:{port}{h.get('path', '/')} (from the host)"
        raise Failed(f"{spec.name}: {kind} {sorted(probe)} is not translated")

    @staticmethod
    def _port(spec, port):
        return spec.ports[port] if isinstance(port, str) and not port.isdigit() else int(port)

    def run(self, spec, kind, quiet=True):
        """(passed, output)."""
        argv, desc = self._argv_or_desc(spec, kind)
        if argv[0] == "tcp":
            try:
                with socket.create_connection((argv[1], argv[2]), timeout=max(argv[3], 1)):
                    return True, "connected"
            except OSError as e:
                return False, str(e)
        if argv[0] == "http":
            try:
                c = http.client.HTTPConnection(argv[1], argv[2], timeout=max(argv[4], 1))
                c.request("GET", argv[3])
                r = c.getresponse()
                return 200 <= r.status < 400, f"HTTP {r.status}"
            except OSError as e:
                return False, str(e)
        p = sh(argv, check=False, quiet=quiet, timeout=int(spec.probes[kind].get("timeoutSeconds", 1)) + 30)
        return p.returncode == 0, p.stdout

    def run_as_kubelet(self, spec, kind):
        """Passes unless failureThreshold attempts, periodSeconds apart, all fail (the kubelet's
        verdict: one slow answer on a busy machine is not a failed probe)."""
        probe = spec.probes[kind]
        attempts = int(probe.get("failureThreshold", 3))
        for attempt in range(attempts):
            ok, out = self.run(spec, kind, quiet=attempt > 0)
            if ok:
                return True, out + (f"\n(passed at attempt {attempt + 1})" if attempt else "")
            if attempt + 1 < attempts:
                time.sleep(int(probe.get("periodSeconds", 10)))
        return False, out + f"\n(failed {attempts} times, {probe.get('periodSeconds', 10)} s apart)"


# ---------------------------------------------------------------- the smoke test

class Smoke:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.podman = Podman(args)
        self.run_id = f"{os.getpid()}-{int(time.time())}"
        self.network = PREFIX
        self.created = []   # containers, in start order
        self.network_created = False
        self.work = None
        self.helm_home = None
        self.image_tags = {}  # what -> local reference
        self.build_seconds = {}
        net = ipaddress.ip_network(args.subnet)
        self.gateway = str(net.network_address + 1)
        self.ip = lambda n: str(net.network_address + n)

    # ---- 1
    def preconditions(self):
        a = self.args
        if self.dry:
            log("dry run: no root needed, nothing is installed")
        else:
            RUN.check(os.geteuid() == 0, "running as root", "run it with sudo python3 scripts/container_smoke.py")
            if os.geteuid() != 0:
                raise Failed("not root")
        missing = []
        for tool, package in PACKAGES:
            found = os.path.exists(tool) if tool.startswith("/") else shutil.which(tool)
            if not found:
                missing.append(package)
        if not (shutil.which("runc") or shutil.which("crun")):
            missing.append("runc")
        elif a.runtime and not shutil.which(a.runtime) and not os.path.exists(a.runtime):
            missing.append(a.runtime)
        if not have_yaml():
            missing.append("python3-yaml")
        if missing and self.dry:
            log(f"would install: apt-get install -y --no-install-recommends {' '.join(missing)}")
            if "python3-yaml" in missing:
                raise Failed("the dry run needs python3-yaml: apt-get install python3-yaml")
        elif missing:
            if a.no_install:
                raise Failed(f"missing packages (--no-install): {' '.join(missing)}")
            install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            if sh(install, timeout=900, check=False, env=env).returncode != 0:
                sh(["apt-get", "update"], timeout=600, env=env)
                sh(install, timeout=900, env=env)
            RUN.check(True, f"installed {' '.join(missing)}")
        else:
            RUN.check(True, "packages present: podman, runc/crun, uidmap, slirp4netns, fuse-overlayfs, netavark, "
                            "aardvark-dns, iptables, mmdebstrap, python3-yaml")
        if "python3-yaml" in missing and not self.dry and not have_yaml():
            raise Failed("python3-yaml is installed but `import yaml` fails")
        self.helm = a.helm or default_helm()
        if not self.helm or not os.access(self.helm, os.X_OK):
            raise Failed("no helm: pass --helm PATH, or run `ctest --test-dir build -R deploy_chart` once "
                         "(it installs helm into build/tests/deploy/npm-cache)")
        version = sh([self.helm, "version", "--short"], timeout=30).stdout.strip()
        log(f"helm: {self.helm} ({version})")
        if not version.startswith("v3.6.2"):
            log(f"  note: tests/deploy/chart_test.sh pins helm v3.6.2, this is {version}")
        if shutil.which("podman"):
            info = sh(self.podman.cmd("info", "--format", "{{.Version.Version}} {{.Host.NetworkBackend}} "
                                      "{{.Host.CgroupManager}} cgroups-{{.Host.CgroupsVersion}} "
                                      "{{.Store.GraphDriverName}} {{.Host.OCIRuntime.Name}} {{.Store.GraphRoot}}"),
                      check=not self.dry, timeout=60)
            log(f"podman: {info.stdout.strip().splitlines()[-1] if info.stdout.strip() else '?'}")
            fields = info.stdout.split()
            if not self.dry and len(fields) >= 7:
                RUN.check(fields[-6] in ("netavark", "cni"), f"podman network backend {fields[-6]}")
                free = shutil.disk_usage(fields[-1] if os.path.isdir(fields[-1]) else "/").free
                log(f"  free space under {fields[-1]}: {free / 2 ** 30:.1f} GiB")
                if free < 15 * 2 ** 30:
                    log("  note: the three builds take several GiB (the build stages are cached)")
        elif self.dry:
            log("podman: not installed (dry run)")
        log(f"podman global options: {' '.join(self.podman.global_opts)}")
        if self.podman.ulimits:
            log(f"no CAP_SYS_RESOURCE here: containers and builds get {' '.join(self.podman.ulimits)} "
                "(the machine's hard limits; podman's defaults are above them)")

    # ---- 2
    def render(self):
        import yaml
        self.helm_home = tempfile.mkdtemp(prefix="collserve-smoke-helm-")
        env = dict(os.environ, HELM_CACHE_HOME=f"{self.helm_home}/cache", HELM_CONFIG_HOME=f"{self.helm_home}/config",
                   HELM_DATA_HOME=f"{self.helm_home}/data")
        p = sh([self.helm, "template", RELEASE, CHART, "-n", NAMESPACE, "--kube-version", KUBE_VERSION, "-f", VALUES],
               timeout=120, env=env)
        docs = [d for d in yaml.safe_load_all(p.stdout) if d]
        kinds = {}
        for d in docs:
            kinds.setdefault(d["kind"], []).append(d)
        log(f"rendered: {', '.join(f'{k} x{len(v)}' if len(v) > 1 else k for k, v in sorted(kinds.items()))}")

        def component(d):
            return ((d.get("spec", {}).get("template", {}).get("metadata", {}) or {}).get("labels", {}) or {}).get(
                "app.kubernetes.io/component")

        sts = [d for d in kinds.get("StatefulSet", []) if component(d) == "coordinator"]
        ds = [d for d in kinds.get("DaemonSet", []) if component(d) == "sidecar"]
        if len(sts) != 1 or len(ds) != 1:
            raise Failed("the rendering has no single coordinator StatefulSet and sidecar DaemonSet")
        self.sts, self.ds = sts[0], ds[0]
        self.services = kinds.get("Service", [])
        with open(PYTORCHJOB) as f:
            self.pytorchjob = yaml.safe_load(f)
        with open(TRAINING_JOB) as f:
            training_job = yaml.safe_load(f)
        RUN.check(self.sts["spec"].get("replicas", 1) == 1, "one coordinator replica")

        # Secrets: the keys the pods need (secretKeyRef of the examples, files the args name in
        # a mounted Secret), each a fresh random token.
        needed = {}
        for job in (self.pytorchjob, training_job):
            for pod in pod_templates(job):
                for c in pod["containers"]:
                    for e in c.get("env") or []:
                        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                        if ref:
                            needed.setdefault(ref["name"], set()).add(ref["key"])
        for workload in (self.sts, self.ds):
            pod = workload["spec"]["template"]["spec"]
            vols = {v["name"]: v for v in pod.get("volumes") or []}
            for c in pod["containers"]:
                for m in c.get("volumeMounts") or []:
                    v = vols.get(m["name"], {})
                    if "secret" not in v:
                        continue
                    keys = needed.setdefault(v["secret"]["secretName"], set())
                    for arg in c.get("args") or []:
                        value = arg.split("=", 1)[-1]
                        if value.startswith(m["mountPath"].rstrip("/") + "/"):
                            keys.add(value[len(m["mountPath"].rstrip("/")) + 1:])
        self.secret_data = {name: {k: secrets.token_hex(32) for k in sorted(keys)} for name, keys in needed.items()}
        for data in self.secret_data.values():
            RUN.secrets.update(data.values())
        for name, data in sorted(self.secret_data.items()):
            log(f"Secret {name}: keys {', '.join(data)} (random 32-byte hex tokens, made here)")

        # The pods, translated.
        self.work = "/tmp/collserve-smoke-WORKDIR" if self.dry else tempfile.mkdtemp(prefix="collserve-smoke-")
        if not self.dry:
            os.chmod(self.work, 0o700)
        self.node = Node(self.work, self.gateway, self.dry)
        release_services = {}
        coord_pod = f"{self.sts['metadata']['name']}-0"
        claims = [c["metadata"]["name"] for c in self.sts["spec"].get("volumeClaimTemplates") or []]
        sts_pod, ds_pod = self.sts["spec"]["template"]["spec"], self.ds["spec"]["template"]["spec"]
        self.coordinator = translate(sts_pod, sts_pod["containers"][0], name=f"{PREFIX}-coordinator",
                                     pod_name=coord_pod, ip=self.ip(10), node=self.node,
                                     secret_data=self.secret_data, claims=claims)
        self.sidecar = translate(ds_pod, ds_pod["containers"][0], name=f"{PREFIX}-sidecar",
                                 pod_name=f"{self.ds['metadata']['name']}-smoke", ip=self.ip(11), node=self.node,
                                 secret_data=self.secret_data)
        # The Services' names (cluster DNS here: /etc/hosts entries of every container).
        ip_of = {"coordinator": self.coordinator.ip, "sidecar": self.sidecar.ip}
        self.hosts = []
        for s in self.services:
            comp = (s["spec"].get("selector") or {}).get("app.kubernetes.io/component")
            if comp in ip_of:
                for h in service_hosts(s["metadata"]["name"]):
                    self.hosts.append((h, ip_of[comp]))
                release_services[s["metadata"]["name"]] = comp
        headless = self.sts["spec"].get("serviceName")
        if headless:
            for h in service_hosts(f"{coord_pod}.{headless}"):
                self.hosts.append((h, self.coordinator.ip))
        coordinator_flag = [a for a in self.sidecar.args if a.startswith("--coordinator=")]
        if not coordinator_flag:
            raise Failed("the sidecar has no --coordinator")
        self.coordinator_address = coordinator_flag[0].split("=", 1)[1]
        host = self.coordinator_address.rsplit(":", 1)[0]
        RUN.check(any(h == host and ip == self.coordinator.ip for h, ip in self.hosts),
                  f"the sidecar's --coordinator={self.coordinator_address} is a Service name of the coordinator")
        self.probes = Probes(self.podman, self.coordinator_address)
        RUN.check(self.sidecar.pre_stop is not None, "the sidecar has a preStop drain")
        for s in (self.coordinator, self.sidecar):
            log(f"{s.name}: pod {s.pod_name}, IP {s.ip}, image {s.image}, user {s.user or '(image default)'}, "
                f"groups {s.groups}, read-only root {s.read_only}, caps dropped {s.cap_drop}, grace {s.grace_s} s")
            for n in s.notes:
                log(f"  note: {n}")
        self.trainer_template()

    def trainer_template(self):
        """The PyTorchJob's Master and Worker pods; the operator's env and Services."""
        job = self.pytorchjob
        self.job_name = job["metadata"]["name"]
        specs = job["spec"]["pytorchReplicaSpecs"]
        self.replicas = []  # (type, index, rank, pod template)
        rank = 0
        for rtype in ("Master", "Worker"):
            if rtype not in specs:
                continue
            for index in range(int(specs[rtype].get("replicas", 1))):
                self.replicas.append((rtype.lower(), index, rank, specs[rtype]["template"]))
                rank += 1
        self.world_size = rank
        master = specs["Master"]["template"]["spec"]
        c = [c for c in master["containers"] if c["name"] == "pytorch"]
        if not c:
            raise Failed("the PyTorchJob's Master has no container named pytorch")
        ports = [p["containerPort"] for p in c[0].get("ports") or [] if p.get("name") == "pytorchjob-port"]
        if not ports:
            raise Failed("the PyTorchJob's Master has no pytorchjob-port")
        self.master_port = int(ports[0])
        RUN.check(self.world_size == 2, f"the PyTorchJob has {self.world_size} ranks (Master + Worker)")

    def trainers(self, tag, base_ip, epochs=None):
        """The PyTorchJob's pods as Specs (names and IPs distinct per run of the job)."""
        master_pod = f"{self.job_name}-master-0"
        specs = []
        ips = {}
        for rtype, index, rank, _ in self.replicas:
            ips[f"{self.job_name}-{rtype}-{index}"] = self.ip(base_ip + rank)
        hosts = list(self.hosts)
        for pod_name, ip in ips.items():  # the operator's Service per replica
            hosts += [(h, ip) for h in service_hosts(pod_name)]
        for rtype, index, rank, template in self.replicas:
            pod = template["spec"]
            container = [c for c in pod["containers"] if c["name"] == "pytorch"][0]
            if epochs is not None:
                container = dict(container)
                cmd = [x for x in container["command"] if not x.startswith("--epochs=")]
                container["command"] = cmd + [f"--epochs={epochs}"]
            pod_name = f"{self.job_name}-{rtype}-{index}"
            # The training operator appends these after the manifest's env (envvar.go, setPodEnv).
            extra = [("PYTHONUNBUFFERED", "0"), ("MASTER_PORT", str(self.master_port)), ("MASTER_ADDR", master_pod),
                     ("WORLD_SIZE", str(self.world_size)), ("RANK", str(rank))]
            s = translate(pod, container, name=f"{PREFIX}-{tag}{rtype}-{index}", pod_name=pod_name, ip=ips[pod_name],
                          node=self.node, secret_data=self.secret_data, extra_env=extra)
            s.rank = rank
            s.hosts = hosts
            specs.append(s)
        return specs

    # ---- 3
    def base_image(self):
        if (not self.dry or shutil.which("podman")) and self.podman.exists(BASE_IMAGE):
            RUN.check(True, f"{BASE_IMAGE} is there")
            return
        script = os.path.join(DOCKER_DIR, "build_base_image.sh")
        if self.args.podman_opt:  # the script's own `podman import` would not get them
            tar = os.path.join(self.work, "debian-12.tar")
            argv = ["bash", script, "--engine", "none", "--output", tar]
            imp = self.podman.cmd("import", "--change", 'CMD ["bash"]', tar, BASE_IMAGE)
        else:
            argv, imp = ["bash", script, "--engine", "podman"], None
        if self.dry:
            log(f"would run (when {BASE_IMAGE} is missing): {show(argv)}" + (f" && {show(imp)}" if imp else ""))
            return
        log(f"{BASE_IMAGE} is missing: building it offline from the Debian mirror")
        p = sh(argv, timeout=1800, cwd=ROOT)
        log(tail(p.stdout, 12))
        if imp:
            sh(imp, timeout=600)
            os.unlink(tar)
        RUN.check(self.podman.exists(BASE_IMAGE), f"{BASE_IMAGE} built")

    # ---- 4
    def build_argv(self, what, dockerfile, target, ref):
        a = ["build", "--pull=never", f"--network={self.args.build_network}",
             "-f", os.path.join(DOCKER_DIR, dockerfile),
             "--ignorefile", os.path.join(DOCKER_DIR, dockerfile + ".dockerignore"),
             "--build-arg", f"DEBIAN_IMAGE={BASE_IMAGE}", "--build-arg", f"BUILD_JOBS={self.args.build_jobs}",
             *self.podman.ulimits]
        if target:
            a += ["--target", target]
        if self.args.no_cache:
            a += ["--no-cache"]
        if self.revision:
            a += ["--label", f"org.opencontainers.image.revision={self.revision}"]
        return self.podman.cmd(*a, "-t", ref, ROOT)

    def image_refs(self):
        version = self.app_version()
        trainer = [c for c in self.pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
                   if c["name"] == "pytorch"][0]["image"]
        chart = {"coordinator": self.coordinator.image, "sidecar": self.sidecar.image, "trainer": local_image(trainer)}
        for what, _, _, name in IMAGES:
            self.image_tags[what] = local_image(f"{name}:{version}")
            RUN.check(chart[what] == self.image_tags[what],
                      f"the {what} image the {'PyTorchJob' if what == 'trainer' else 'chart'} runs is "
                      f"{chart[what]}", f"the build tags {self.image_tags[what]}")

    @staticmethod
    def app_version():
        with open(os.path.join(CHART, "Chart.yaml")) as f:
            m = re.search(r'^appVersion:\s*"?([^"\s]+)"?', f.read(), re.M)
        return m.group(1)

    def build(self):
        p = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain"],
                               capture_output=True, text=True).stdout.strip()
        self.revision = p.stdout.strip() if p.returncode == 0 and not dirty else None
        if p.returncode == 0 and dirty:
            log(f"note: the working tree has local changes (HEAD {p.stdout.strip()[:12]}): the images hold them, "
                "so they get no revision label")
        for what, dockerfile, target, _ in IMAGES:
            argv = self.build_argv(what, dockerfile, target, self.image_tags[what])
            if self.dry:
                log(f"would run: {show(argv)}")
                continue
            if self.args.log_dir:
                os.makedirs(self.args.log_dir, exist_ok=True)
            logfile = os.path.join(self.args.log_dir or self.work, f"build-{what}.log")
            log(f"$ {show(argv)} > {logfile}")
            start = time.monotonic()
            with open(logfile, "w") as out:
                try:
                    rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                        timeout=self.args.build_timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = None
            self.build_seconds[what] = time.monotonic() - start
            with open(logfile, errors="replace") as f:
                text = f.read()
            if rc != 0:
                log(tail(text, 40))
                raise Failed(f"building the {what} image: " + (f"exit {rc}" if rc is not None else
                                                                f"over --build-timeout {self.args.build_timeout} s"))
            RUN.check(True, f"{self.image_tags[what]} built in {self.build_seconds[what]:.0f} s")

    def image_sizes(self):
        """(reference, id, bytes, podman image ls's size) of the images and the base image."""
        if self.dry or not shutil.which("podman"):
            return []
        listed = {}
        p = sh(self.podman.cmd("image", "ls", "--format", "{{.Repository}}:{{.Tag}}\t{{.Size}}"), check=False,
               quiet=True)
        for line in p.stdout.splitlines() if p.returncode == 0 else []:
            ref, _, size = line.partition("\t")
            listed[ref] = size
        rows = []
        for ref in list(self.image_tags.values()) + [BASE_IMAGE]:
            p = sh(self.podman.cmd("image", "inspect", "--format", "{{.Id}} {{.Size}}", ref), check=False, quiet=True)
            if p.returncode == 0 and p.stdout.split():
                image_id, size = p.stdout.split()[:2]
                rows.append((ref, image_id.split(":")[-1][:12], int(size), listed.get(ref, "?")))
        return rows

    # ---- network, daemons
    def cleanup_stale(self):
        p = sh(self.podman.cmd("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}"), check=False)
        stale = p.stdout.split() if p.returncode == 0 else []
        if stale:
            log(f"removing containers of an earlier run: {' '.join(stale)}")
            sh(self.podman.cmd("rm", "-f", "-t", "2", *stale), check=False, timeout=120)
        if sh(self.podman.cmd("network", "exists", self.network), check=False, quiet=True).returncode == 0:
            sh(self.podman.cmd("network", "rm", "-f", self.network), check=False, timeout=60)

    def create_network(self):
        argv = self.podman.cmd("network", "create", "--subnet", self.args.subnet, "--gateway", self.gateway,
                               "--disable-dns", "--label", f"{LABEL}={self.run_id}", self.network)
        if self.dry:
            log(f"would run: {show(argv)}")
            return
        self.cleanup_stale()
        sh(argv, timeout=60)
        self.network_created = True

    def start(self, spec, detach=True, hosts=None):
        env_file = os.path.join(self.work, f"{spec.name}.env")
        spec.write_env_file(env_file, self.dry)
        argv = spec.run_argv(self.podman, self.network, hosts if hosts is not None else self.hosts, self.run_id,
                             env_file, detach)
        if self.dry:
            log(f"would run: {show(argv)}")
            if spec.secret_env:
                log(f"  {env_file} (0600): " + ", ".join(f"{k}=<Secret>" for k in sorted(spec.secret_env)))
            return None
        if spec.run_as_non_root:
            user = spec.user or sh(self.podman.cmd("image", "inspect", "--format", "{{.Config.User}}", spec.image),
                                   quiet=True).stdout.strip()
            RUN.check(user.split(":")[0] not in ("", "0", "root"), f"{spec.name}: runAsNonRoot, runs as {user}")
        self.created.append(spec.name)
        if detach:
            sh(argv, timeout=120)
            return None
        return Attached(spec.pod_name, argv)

    def running(self, spec):
        status, code = self.podman.state(spec.name)
        return status == "running", f"{status} (exit code {code})"

    def dump_logs(self, *specs):
        for s in specs:
            text = self.podman.logs(s.name)
            log(f"  last lines of {s.name}'s log:\n{tail(RUN.redact(text), 30)}")

    def start_coordinator(self):
        c = self.coordinator
        self.start(c)
        if self.dry:
            log(f"would poll: {self.probes.describe(c, 'startupProbe')}")
            return
        probe = c.probes["startupProbe"]
        bound = min(self.args.timeout, int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3)))
        ok, out, secs = poll(lambda: self.probes.run(c, "startupProbe"), bound, 1.0)
        if not RUN.check(ok, f"coordinator startup probe passed after {secs:.1f} s",
                         f"not within {bound} s: {tail(out, 10)}"):
            self.dump_logs(c)
            raise Failed("the coordinator did not start")
        log(tail(out, 20))
        jobs = self.secret_data.get(self.job_tokens_secret(), {})
        loaded = re.compile(r"job credentials loaded: (\d+) job token file\(s\), an admin token")
        _, m, _ = poll(lambda: (lambda m: (m is not None, m))(loaded.search(self.podman.logs(c.name))), 15, 1.0)
        RUN.check(m is not None and int(m.group(1)) == len(jobs),
                  f"the coordinator read the Secrets: {m.group(0) if m else 'no job credentials loaded line'}",
                  f"expected {len(jobs)} job token file(s) and an admin token")

    def job_tokens_secret(self):
        pod = self.sts["spec"]["template"]["spec"]
        args = pod["containers"][0].get("args") or []
        jobs_dir = [a.split("=", 1)[1] for a in args if a.startswith("--job_tokens_dir=")]
        for m in pod["containers"][0].get("volumeMounts") or []:
            if jobs_dir and m["mountPath"].rstrip("/") == jobs_dir[0].rstrip("/"):
                for v in pod.get("volumes") or []:
                    if v["name"] == m["name"] and "secret" in v:
                        return v["secret"]["secretName"]
        return None

    def start_sidecar(self):
        s = self.sidecar
        self.start(s)
        if self.dry:
            log(f"would poll: {self.probes.describe(s, 'readinessProbe')}")
            return
        ok, out, secs = poll(lambda: self.probes.run(s, "readinessProbe"), self.args.timeout, 1.0)
        if not RUN.check(ok, f"sidecar readiness probe passed after {secs:.1f} s",
                         f"not within {self.args.timeout} s: {tail(out, 10)}"):
            self.dump_logs(s)
            raise Failed("the sidecar did not become ready")
        m = re.search(r"collserve-sidecar (\S+) serving on (\S+)", self.podman.logs(s.name))
        self.sidecar_host_id = m.group(1) if m else None
        RUN.check(m is not None, f"sidecar log: {m.group(0) if m else 'no serving line'}")

    def socket_path(self):
        args = dict(a[2:].split("=", 1) for a in self.sidecar.args if a.startswith("--") and "=" in a)
        sock = args.get("unix_socket", "")
        for host, path, _ in self.sidecar.mounts:
            if sock.startswith(path.rstrip("/") + "/"):
                return sock, os.path.join(host, sock[len(path.rstrip("/")) + 1:])
        raise Failed(f"the sidecar's socket {sock} is on none of its volumes")

    def check_probes(self, when):
        """Every probe of both daemons, once, and the documented health command."""
        for spec in (self.coordinator, self.sidecar):
            for kind in spec.probes:
                if self.dry:
                    log(f"would run: {self.probes.describe(spec, kind)}")
                    continue
                ok, out = self.probes.run_as_kubelet(spec, kind)
                RUN.check(ok, f"{when}: {spec.pod_name} {kind}", tail(out, 10))
        sock, host_sock = self.socket_path()
        argv = self.podman.cmd("exec", self.sidecar.name, CTL, f"--coordinator={self.coordinator_address}",
                               f"--sidecar=unix:{sock}", "health")
        if self.dry:
            log(f"would run: {show(argv)}   # exit 0: everything SERVING")
            return
        p = sh(argv, check=False, timeout=60)
        log(tail(p.stdout, 30))
        RUN.check(p.returncode == 0, f"{when}: collservectl health (coordinator and the sidecar's socket) exits 0",
                  f"exit {p.returncode}")

    def check_socket(self):
        sock, host_sock = self.socket_path()
        if self.dry:
            log(f"would check: {host_sock} (the node's {sock}) is a socket, root, 0755")
            return
        try:
            st = os.stat(host_sock)
        except OSError as e:
            RUN.check(False, f"the sidecar's socket {sock} is in the node's directory", str(e))
            return
        RUN.check(stat.S_ISSOCK(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o755,
                  f"{sock}: a socket, owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o} "
                  "(deploy/docker/README.md: root, 0755)")
        p = sh(self.podman.cmd("exec", self.sidecar.name, "ls", "-la", "/run/collserve-admin/sidecar"), check=False)
        log(tail(p.stdout, 5))
        RUN.check(p.returncode == 0 and "admin.sock" in p.stdout, "the admin socket is on the sidecar's emptyDir")

    # ---- metrics
    def odd_requests(self):
        targets = [(self.coordinator, "metrics"), (self.sidecar, "metrics")]
        for spec, port_name in targets:
            port = spec.ports[port_name]
            if self.dry:
                log(f"would send odd requests to http://{spec.ip}:{port}/ (HEAD /metrics, GET /, garbage, ...)")
                continue
            log(f"{spec.pod_name} metrics on {spec.ip}:{port}:")
            for what, result in odd_http(spec.ip, port):
                log(f"  {what}: {result}")
            ok, out = http_get(spec.ip, port, "/metrics")
            RUN.check(ok and "collserve_build_info" in out, f"{spec.pod_name}: GET /metrics after them: 200 with "
                      "collserve_build_info", out[:200])
        if self.dry:
            return
        for spec in (self.coordinator, self.sidecar):
            ok, state = self.running(spec)
            RUN.check(ok, f"{spec.name} still running after the odd requests: {state}")
        self.check_probes("after the odd requests")

    # ---- the main job
    def main_job(self):
        specs = self.trainers("", 20)
        epochs = epochs_of(specs[0])
        if self.dry:
            for s in specs:
                self.start(s, detach=False, hosts=s.hosts)
            log(f"would check: each exits 0 within {self.args.timeout} s, prints epochs 0..{epochs - 1} and a test "
                f"accuracy >= {100 * self.args.min_accuracy:.0f}%")
            return
        self.check_socket()
        runs = [self.start(s, detach=False, hosts=s.hosts) for s in specs]
        deadline = time.monotonic() + self.args.timeout
        codes = [r.wait(deadline - time.monotonic()) for r in runs]
        for s, r, rc in zip(specs, runs, codes):
            if rc is None:
                sh(self.podman.cmd("kill", s.name), check=False)
                r.wait(30)
            text = r.text()
            seen = sorted({int(m.group(2)) for m in EPOCH_RE.finditer(text) if int(m.group(1)) == s.rank})
            acc = [float(m.group(2)) for m in ACCURACY_RE.finditer(text) if int(m.group(1)) == s.rank]
            RUN.check(rc == 0, f"rank {s.rank} ({s.pod_name}) exit code {rc}",
                      "still running after --timeout" if rc is None else tail(text, 15))
            RUN.check(seen == list(range(epochs)), f"rank {s.rank}: {len(seen)} of {epochs} epoch lines")
            RUN.check(bool(acc) and acc[-1] >= 100 * self.args.min_accuracy,
                      f"rank {s.rank}: test accuracy {acc[-1] if acc else '(none)'}% "
                      f"(at least {100 * self.args.min_accuracy:.0f}%)")

    # ---- the sidecar stopped mid-job
    def fault(self):
        specs = self.trainers("fault-", 30, epochs=self.args.fault_epochs)
        sidecar = self.sidecar
        drain = self.podman.cmd("exec", sidecar.name, *sidecar.pre_stop)
        drain_flags = dict(a[2:].split("=", 1) for a in sidecar.pre_stop if a.startswith("--") and "=" in a)
        drain_s = duration_s(drain_flags.get("drain_timeout", "10m"))
        op_timeout = float(specs[0].env.get("COLLSERVE_OP_TIMEOUT_S", "300"))
        if self.dry:
            for s in specs:
                self.start(s, detach=False, hosts=s.hosts)
            log("would wait for an epoch line of each rank, then run the preStop drain:")
            log(f"would run: {show(drain)}   # exit 1 after {drain_s:.0f} s naming the attached sessions")
            health = self.health_json_argv(env_file=os.path.join(self.work, "job-token.env"),
                                           job=specs[0].env.get("COLLSERVE_JOB"))
            log(f"meanwhile: {show(health)}   # exit 1, readiness NOT_SERVING, liveness SERVING, the host draining")
            stop = self.podman.cmd("stop", "-t", f"<{sidecar.grace_s} - drain seconds>", sidecar.name)
            log(f"would run: {show(stop)}")
            log(f"would check: the sidecar exits 0; each rank exits non-zero within {op_timeout:.0f} + 30 s with "
                f"UNAVAILABLE and {DOCUMENTED_ERROR!r}")
            return
        runs = [self.start(s, detach=False, hosts=s.hosts) for s in specs]
        try:
            def epochs_seen():
                return [len([m for m in EPOCH_RE.finditer(r.text()) if int(m.group(1)) == s.rank])
                        for s, r in zip(specs, runs)]

            ok, _, secs = poll(lambda: (all(n > 0 for n in epochs_seen()) or not all(r.running() for r in runs), None),
                               self.args.timeout, 0.5)
            if not RUN.check(all(n > 0 for n in epochs_seen()) and all(r.running() for r in runs),
                             f"both ranks training (an epoch line each after {secs:.1f} s)",
                             f"epoch lines {epochs_seen()}, running {[r.running() for r in runs]}"):
                raise Failed("the ranks did not start training")
            before = epochs_seen()
            # Progress through the drain is read off the sidecar's own counter of completed
            # collectives: the ranks' stdout reaches podman in blocks (about 8 KiB at a time),
            # so their epoch lines cannot time it.
            collectives_before = sidecar_collectives(sidecar)

            # The preStop hook, as the kubelet runs it on pod deletion.
            drain_run = Attached("preStop drain", drain)
            t_drain = time.monotonic()

            # collservectl health with the job's token (as a rank has it), so that it also lists
            # the job's hosts: the draining one shows draining_since (docs/operations.md).
            token_env = os.path.join(self.work, "job-token.env")
            fd = os.open(token_env, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"COLLSERVE_TOKEN={specs[0].env.get('COLLSERVE_TOKEN', '')}\n")
            health = self.health_json_argv(env_file=token_env, job=specs[0].env.get("COLLSERVE_JOB"))
            log(f"while draining, polling: {show(health)}")
            seen = {}

            def not_ready():
                p = sh(health, check=False, quiet=True, timeout=60)
                j = json_line(p.stdout)
                if j is None:
                    return False, p.stdout
                sc = [x for x in j.get("sidecars", []) if x.get("address", "").startswith(sidecar.ip)]
                if sc and sc[0].get("readiness") == "NOT_SERVING" and sc[0].get("liveness") == "SERVING" \
                        and p.returncode == 1:
                    seen["not_ready"] = p.stdout
                if any(h.get("draining_since_unix_ms", 0) > 0 for h in j.get("hosts", [])):
                    seen["hosts"] = p.stdout
                return "not_ready" in seen and "hosts" in seen, p.stdout
            ok, out, secs = poll(not_ready, drain_s, 1.0)
            RUN.check("not_ready" in seen, "while draining: the sidecar's readiness NOT_SERVING, liveness SERVING, "
                      "collservectl health exits 1", tail(out, 5))
            RUN.check("hosts" in seen, "while draining: collservectl health lists the job's host as draining "
                      "(draining_since_unix_ms)", tail(out, 5))
            log(tail(RUN.redact(seen.get("hosts", out)), 5))
            rc = drain_run.wait(drain_s + 30)
            drain_secs = time.monotonic() - t_drain
            text = drain_run.text()
            m = re.search(r"(\d+) session\(s\) are still attached after", text)
            RUN.check(rc == 1, f"the preStop drain exited {rc} after {drain_secs:.1f} s (1: sessions still attached "
                               f"at --drain_timeout, docs/operations.md)")
            RUN.check(m is not None and int(m.group(1)) >= self.world_size and "ranks [0, 1]" in text,
                      "the drain named the attached sessions: " + (m.group(0) if m else "(no such line)"),
                      tail(text, 5))
            collectives_after = sidecar_collectives(sidecar)
            RUN.check(all(r.running() for r in runs) and collectives_after > collectives_before >= 0,
                      f"the ranks kept training through the drain (the sidecar's "
                      f"collserve_collectives_total{{code=\"OK\"}}: {collectives_before:.0f} -> "
                      f"{collectives_after:.0f}; epoch lines delivered so far {before} -> {epochs_seen()})")

            # Then SIGTERM with what is left of the grace period (at least 2 s, as the kubelet gives).
            grace = max(2, int(round(sidecar.grace_s - drain_secs)))
            t_stop = time.monotonic()
            sh(self.podman.cmd("stop", "-t", str(grace), sidecar.name), timeout=grace + 60)
            stop_secs = time.monotonic() - t_stop
            status, code = self.podman.state(sidecar.name)
            RUN.check(status == "exited" and code == 0, f"the sidecar stopped on SIGTERM in {stop_secs:.1f} s, "
                      f"exit code {code} (0: a clean stop; 137: killed at the end of the {grace} s grace)")
            bound = op_timeout + 30
            for s, r in zip(specs, runs):
                rc = r.wait(t_stop + bound - time.monotonic())
                secs = (r.ended or time.monotonic()) - t_stop
                text = r.text()
                RUN.check(rc is not None and rc != 0,
                          f"rank {s.rank} exited {rc} {secs:.1f} s after the stop (bound: op timeout "
                          f"{op_timeout:.0f} s + 30 s)", "still running" if rc is None else "")
                errors = [l for l in text.splitlines() if "UNAVAILABLE" in l]
                line = errors[-1].strip() if errors else "(no UNAVAILABLE line)"
                documented = any(DOCUMENTED_ERROR in l for l in errors)
                other = [why for rx, why in OTHER_SIDECAR_GONE if any(rx.search(l) for l in errors)]
                if self.args.strict_error:
                    RUN.check(documented, f"rank {s.rank}: UNAVAILABLE ... {DOCUMENTED_ERROR!r}: {line}")
                else:
                    RUN.check(documented or bool(other),
                              f"rank {s.rank}: the error of a sidecar that went away: {line}")
                    if not documented and other:
                        log(f"  note: rank {s.rank} got the text of {other[0]}, not docs/operations.md's "
                            f"{DOCUMENTED_ERROR!r} (--strict-error fails on that)")
        finally:
            for s, r in zip(specs, runs):
                if r.running():
                    sh(self.podman.cmd("kill", s.name), check=False)
                    r.wait(30)
        ok, state = self.running(self.coordinator)
        RUN.check(ok, f"the coordinator still runs: {state}")
        ok, out = self.probes.run_as_kubelet(self.coordinator, "readinessProbe")
        RUN.check(ok, "the coordinator's readiness probe passes after the sidecar stopped", tail(out, 10))

    def health_json_argv(self, env_file=None, job=None):
        port = self.sidecar.ports.get("grpc", 29500)
        return self.podman.cmd("exec", *(["--env-file", env_file] if env_file else []), self.sidecar.name, CTL,
                               "--json", *([f"--job={job}"] if job else []),
                               f"--coordinator={self.coordinator_address}", f"--sidecar={self.sidecar.ip}:{port}",
                               "health")

    # ---- cleanup
    def cleanup(self):
        if self.dry:
            if self.helm_home:
                shutil.rmtree(self.helm_home, ignore_errors=True)
            return
        log("\n=== cleanup")
        if self.args.log_dir and self.created:
            os.makedirs(self.args.log_dir, exist_ok=True)
            for name in self.created:
                with open(os.path.join(self.args.log_dir, f"{name}.log"), "w") as f:
                    f.write(RUN.redact(self.podman.logs(name)))
            log(f"container logs: {self.args.log_dir}")
        if self.args.keep:
            log(f"--keep: left the containers {' '.join(self.created) or '(none)'}, the network {self.network} and "
                f"{self.work}; remove them with:\n  podman rm -f $(podman ps -aq --filter label={LABEL})"
                f"\n  podman network rm {self.network}\n  rm -rf {self.work}")
        else:
            if self.created:
                sh(self.podman.cmd("rm", "-f", "-i", "-t", "5", *reversed(self.created)), check=False, timeout=180)
            if self.network_created:
                sh(self.podman.cmd("network", "rm", "-f", self.network), check=False, timeout=60)
            if self.work and os.path.isdir(self.work):
                shutil.rmtree(self.work, ignore_errors=True)
                log(f"removed {self.work}")
        if self.helm_home:
            shutil.rmtree(self.helm_home, ignore_errors=True)
        if self.args.rmi and self.image_tags:
            sh(self.podman.cmd("rmi", "-f", *self.image_tags.values()), check=False, timeout=300)


def pod_templates(obj):
    if obj.get("kind") == "PyTorchJob":
        return [r["template"]["spec"] for r in obj["spec"]["pytorchReplicaSpecs"].values()]
    return [obj["spec"]["template"]["spec"]]


def json_line(text):
    """The JSON object collservectl --json printed (its error, if any, is on the merged stderr)."""
    for line in reversed((text or "").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def epochs_of(spec):
    for a in (spec.entrypoint or []) + spec.args:
        if a.startswith("--epochs="):
            return int(a.split("=", 1)[1])
    return 20  # digits_sgd.py's default


def sidecar_collectives(sidecar):
    """The sidecar's collectives completed OK so far (the sum of collserve_collectives_total
    with code="OK" on its /metrics); -1 if the scrape fails."""
    ok, body = http_get(sidecar.ip, sidecar.ports["metrics"], "/metrics")
    if not ok:
        return -1
    total = 0.0
    for line in body.splitlines():
        if line.startswith("collserve_collectives_total{") and 'code="OK"' in line:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


def http_get(ip, port, path, method="GET"):
    try:
        c = http.client.HTTPConnection(ip, port, timeout=5)
        c.request(method, path)
        r = c.getresponse()
        body = r.read().decode(errors="replace")
        return r.status == 200, body if r.status == 200 else f"HTTP {r.status}"
    except OSError as e:
        return False, str(e)


def odd_http(ip, port):
    """Odd requests to a /metrics port; returns (what, what came back) — anything but a crash will do."""
    out = []
    for what, method, path in [("HEAD /metrics", "HEAD", "/metrics"), ("GET /", "GET", "/"),
                               ("GET /metrics?%ff%00", "GET", "/metrics?%ff%00"), ("POST /metrics", "POST", "/metrics"),
                               ("GET /../../etc/passwd", "GET", "/../../etc/passwd")]:
        try:
            c = http.client.HTTPConnection(ip, port, timeout=5)
            c.request(method, path)
            r = c.getresponse()
            r.read()
            out.append((what, f"HTTP {r.status}"))
        except OSError as e:
            out.append((what, f"{type(e).__name__}: {e}"))
    raw = [("garbage bytes", os.urandom(512) + b"\r\n\r\n"),
           ("a TLS ClientHello", bytes.fromhex("16030100a5010000a10303") + os.urandom(160)),
           ("a 64 KiB header", b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Long: " + b"A" * 65536 + b"\r\n\r\n"),
           ("a request cut short", b"GET /metr"),
           ("BREW /metrics HTTP/1.1", b"BREW /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
           ("HTTP/0.9 GET", b"GET /metrics\r\n")]
    for what, data in raw:
        try:
            with socket.create_connection((ip, port), timeout=5) as s:
                s.sendall(data)
                if what == "a request cut short":
                    out.append((what, "closed"))
                    continue
                s.shutdown(socket.SHUT_WR)
                answer = s.recv(200)
                first = answer.split(b"\r\n", 1)[0][:80].decode("ascii", "backslashreplace")
                out.append((what, first or "closed without an answer"))
        except OSError as e:
            out.append((what, f"{type(e).__name__}: {e}"))
    return out


def default_helm():
    """The helm tests/deploy/chart_test.sh installs (CACHE_DIR = <build>/tests/deploy/npm-cache), else PATH's."""
    for pattern in ("build", "build*"):
        for d in sorted(glob.glob(os.path.join(ROOT, pattern, "tests", "deploy", "npm-cache"))):
            helm = os.path.join(d, "node_modules", ".bin", "helm")
            if os.access(helm, os.X_OK):
                return helm
    return shutil.which("helm")


def summary(sizes, image_tags, build_seconds, dry):
    log("\n=== summary" + (" (dry run)" if dry else ""))
    w = max([len(r[0]) for r in RUN.rows] + [4])
    log(f"{'step':<{w}}  result  seconds")
    for title, result, secs, detail in RUN.rows:
        log(f"{title:<{w}}  {result:<6}  {secs:7.1f}" + (f"  {RUN.redact(detail)[:300]}" if detail and result != "PASS"
                                                            else ""))
    if sizes:
        log("\nimages:")
        log(f"  {'image':<40} {'id':<12}  {'podman image ls':>15}  {'bytes':>11}  build")
        for ref, image_id, size, listed in sizes:
            what = [k for k, v in image_tags.items() if v == ref and k in build_seconds]
            built = f"{build_seconds[what[0]]:.0f} s" if what else "-"
            log(f"  {ref:<40} {image_id:<12}  {listed:>15}  {size:>11}  {built}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run as root: sudo python3 scripts/container_smoke.py "
                                       "(see the module docstring).")
    p.add_argument("--skip-build", dest="skip_build", action="store_true",
                   help="reuse the images (they must exist); no base image or builds")
    p.add_argument("--no-cache", dest="no_cache", action="store_true",
                   help="build without podman's layer cache (for cold build times)")
    p.add_argument("--keep", action="store_true", help="leave the containers, the network and the work directory")
    p.add_argument("--rmi", action="store_true", help="remove the three images at the end")
    p.add_argument("--helm", help="the helm binary (default: chart_test.sh's build*/tests/deploy/npm-cache, else PATH)")
    p.add_argument("--timeout", type=int, default=600,
                   help="bound of each wait: a daemon becoming ready, the ranks' first epoch, the main job (s)")
    p.add_argument("--build-timeout", dest="build_timeout", type=int, default=7200,
                   help="bound of each image build (s)")
    p.add_argument("--build-jobs", dest="build_jobs", default="2", help="BUILD_JOBS of the builds")
    p.add_argument("--build-network", dest="build_network", default="host",
                   help="podman build --network (host: apt-get reaches the mirror as the machine does)")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="render and translate, print the commands, run nothing (no root, no podman needed)")
    p.add_argument("--subnet", default="10.89.40.0/24", help="the podman network's subnet (the pods' IPs)")
    p.add_argument("--runtime", help="OCI runtime (default: runc, else crun)")
    p.add_argument("--podman-opt", dest="podman_opt", action="append", default=[],
                   help="an extra global podman option, e.g. --storage-driver=vfs (repeatable)")
    p.add_argument("--fault-epochs", dest="fault_epochs", type=int, default=100000,
                   help="--epochs of the run whose sidecar is stopped (it must outlast the drain)")
    p.add_argument("--min-accuracy", dest="min_accuracy", type=float, default=0.9,
                   help="the main job's least test accuracy (0-1; scripts/main_job.sh's 0.9)")
    p.add_argument("--strict-error", dest="strict_error", action="store_true",
                   help=f"require docs/operations.md's {DOCUMENTED_ERROR!r} on every rank (default: also accept the "
                        "other texts the code gives for a sidecar that stopped)")
    p.add_argument("--log-dir", dest="log_dir", help="keep the build logs and containers' logs there")
    p.add_argument("--no-install", dest="no_install", action="store_true",
                   help="fail instead of apt-get installing missing packages")
    args = p.parse_args()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    smoke = Smoke(args)
    interrupted = False
    try:
        with RUN.step("1. preconditions"):
            smoke.preconditions()
        with RUN.step("2. render the chart and translate its pods"):
            smoke.render()
            smoke.image_refs()
        if args.skip_build:
            RUN.skip("3. base image", "--skip-build")
            with RUN.step("4. images (--skip-build: they must exist)"):
                for what, ref in smoke.image_tags.items():
                    if not args.dry_run:
                        RUN.check(smoke.podman.exists(ref), f"{ref} exists")
        else:
            with RUN.step("3. base image"):
                smoke.base_image()
            with RUN.step("4. build the images"):
                smoke.build()
        with RUN.step("5. network, coordinator and sidecar up, probes and health"):
            smoke.create_network()
            smoke.start_coordinator()
            smoke.start_sidecar()
            smoke.check_probes("at start")
        with RUN.step("6. odd requests to the metrics ports", fatal=False):
            smoke.odd_requests()
        with RUN.step("7. the main job: two ranks of the PyTorchJob"):
            smoke.main_job()
        with RUN.step("8. drain, then stop the sidecar mid-job"):
            smoke.fault()
    except Abort as e:
        log(f"\nstopped after the failed step: {e}")
    except KeyboardInterrupt as e:
        interrupted = True
        log(f"\ninterrupted ({e or 'Ctrl-C'}): cleaning up")
    finally:
        sizes = []
        try:
            sizes = smoke.image_sizes()
        except Exception:
            log(traceback.format_exc())
        try:
            smoke.cleanup()
        except Exception:
            log(traceback.format_exc())
        summary(sizes, smoke.image_tags, smoke.build_seconds, args.dry_run)
    if interrupted:
        return 130
    if RUN.failed:
        log("\nFAILED: " + "; ".join(RUN.redact(r[0]) for r in RUN.rows if r[1] == "FAIL"))
        return 1
    log("\nall checks passed" + (" (dry run: nothing was started)" if args.dry_run else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
