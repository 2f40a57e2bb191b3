"""One rank of an unmodified torch.distributed job whose store is the coordinator's
TCPStore endpoint (test_tcpstore.py). argv: init_method ("tcp://host:port" or "env://").
Every rank is a store client (TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun)."""
import datetime
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=sys.argv[1], timeout=datetime.timedelta(seconds=30))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
dist.barrier()
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item()}")
dist.destroy_process_group()
