"""A test shim for a torch 2.x built without libuv (Debian 13's torch 2.6), put on
PYTHONPATH by test_torch_backend.py's torchrun test only when that torch is the one under
test (collserve.launch.torch_without_libuv).

Such a torch's TCPStore refuses to start ("use_libuv was requested but PyTorch was build
without libuv support") unless given use_libuv=False, and torchrun never passes it: its c10d
and static rendezvous backends and the agent-store env:// path construct TCPStore without
the argument, so torchrun cannot run on that build at all, with or without collserve
(upstream wheels have libuv and never hit this). This makes use_libuv default to False, what
USE_LIBUV=0 selects on the paths that read it; nothing else changes. It shadows Debian's own
sitecustomize (apport hooks), which the tests do not need.
"""
import sys

import torch.distributed as _dist

# sys.modules: torch.distributed's attribute "rendezvous" is a function of that module.
_rendezvous = sys.modules["torch.distributed.rendezvous"]


class TCPStore(_dist.TCPStore):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("use_libuv", False)
        super().__init__(*args, **kwargs)


# Modules imported with torch.distributed hold the original class; later imports
# (torch.distributed.elastic) take this one.
_dist.TCPStore = TCPStore
_rendezvous.TCPStore = TCPStore
