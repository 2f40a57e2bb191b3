#!/usr/bin/env python
"""The tutorial's non-blocking point-to-point example
(section 2.2 of the PyTorch tutorial "Writing Distributed Applications with PyTorch",
https://pytorch.org/tutorials/intermediate/dist_tuto.html), unchanged apart from
the import and init lines.

    collserve launch --nproc_per_node 2 examples/tutorial/p2p_nonblocking.py
"""
import torch
import collserve as dist  # was: import torch.distributed as dist


def run(rank, size):
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print('Rank 0 started sending')
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print('Rank 1 started receiving')
    req.wait()
    print('Rank ', rank, ' has data ', tensor[0])


if __name__ == "__main__":
    dist.init_process_group("gloo")  # was: mp.Process(target=init_process, ...) per rank
    run(dist.get_rank(), dist.get_world_size())
