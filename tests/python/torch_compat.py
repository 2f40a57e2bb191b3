"""What the torch suites need on a torch built without libuv (Debian 13's 2.6; docs/torch.md):
such a torch's TCPStore refuses to start unless given use_libuv=False, and torch's
agent-store path (TORCHELASTIC_USE_AGENT_STORE, torchrun) never passes it."""
import os

from collserve.launch import torch_without_libuv

NO_LIBUV = torch_without_libuv()
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_nolibuv")


def store_kwargs():
    """Extra arguments for a TCPStore client made by a test."""
    return {"use_libuv": False} if NO_LIBUV else {}


def agent_store_env(env):
    """`env` (a dict, changed and returned) for processes that take torch's agent-store path:
    on a torch without libuv, tests/python/torch_nolibuv (see its docstring) on PYTHONPATH."""
    if NO_LIBUV:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SHIM, env.get("PYTHONPATH", "")) if p)
        env["USE_LIBUV"] = "0"
    return env
