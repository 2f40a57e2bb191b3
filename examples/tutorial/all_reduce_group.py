#!/usr/bin/env python
"""The tutorial's all-reduce example on a group
(section 3.1 of the PyTorch tutorial "Writing Distributed Applications with PyTorch",
https://pytorch.org/tutorials/intermediate/dist_tuto.html), unchanged apart from
the import and init lines.

    collserve launch --nproc_per_node 2 examples/tutorial/all_reduce_group.py
"""
import torch
import collserve as dist  # was: import torch.distributed as dist


def run(rank, size):
    """ Simple collective communication. """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print('Rank ', rank, ' has data ', tensor[0])


if __name__ == "__main__":
    dist.init_process_group("gloo")  # was: mp.Process(target=init_process, ...) per rank
    run(dist.get_rank(), dist.get_world_size())
