#!/usr/bin/env python
"""The tutorial's ring all-reduce built from isend/recv
(section 4.5 of the PyTorch tutorial "Writing Distributed Applications with PyTorch",
https://pytorch.org/tutorials/intermediate/dist_tuto.html), unchanged apart from
the import and init lines; run() calls it on each rank's tensor and checks the sum.

    collserve launch --nproc_per_node 4 examples/tutorial/ring_all_reduce.py
"""
import torch
import collserve as dist  # was: import torch.distributed as dist


def allreduce(send, recv):
   rank = dist.get_rank()
   size = dist.get_world_size()
   send_buff = send.clone()
   recv_buff = send.clone()
   accum = send.clone()

   left = ((rank - 1) + size) % size
   right = (rank + 1) % size

   for i in range(size - 1):
       if i % 2 == 0:
           # Send send_buff
           send_req = dist.isend(send_buff, right)
           dist.recv(recv_buff, left)
           accum[:] += recv_buff[:]
       else:
           # Send recv_buff
           send_req = dist.isend(recv_buff, right)
           dist.recv(send_buff, left)
           accum[:] += send_buff[:]
       send_req.wait()
   recv[:] = accum[:]


def run(rank, size):
    send = torch.arange(4, dtype=torch.float32) + 10 * rank
    recv = torch.zeros(4)
    allreduce(send, recv)
    expected = sum(torch.arange(4, dtype=torch.float32) + 10 * r for r in range(size))
    print('Rank ', rank, ' has data ', recv.tolist(), 'correct' if torch.equal(recv, expected) else 'WRONG')


if __name__ == "__main__":
    dist.init_process_group("gloo")  # was: mp.Process(target=init_process, ...) per rank
    run(dist.get_rank(), dist.get_world_size())
