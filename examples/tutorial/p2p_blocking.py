#!/usr/bin/env python
"""The tutorial's blocking point-to-point example
(section 2.1 of the PyTorch tutorial "Writing Distributed Applications with PyTorch",
https://pytorch.org/tutorials/intermediate/dist_tuto.html), unchanged apart from
the import and init lines.

    collserve launch --nproc_per_node 2 examples/tutorial/p2p_blocking.py
"""
import torch
import collserve as dist  # was: import torch.distributed as dist


def run(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print('Rank ', rank, ' has data ', tensor[0])


if __name__ == "__main__":
    dist.init_process_group("gloo")  # was: mp.Process(target=init_process, ...) per rank
    run(dist.get_rank(), dist.get_world_size())
