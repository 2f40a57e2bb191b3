#!/usr/bin/env python
"""Distributed synchronous SGD on the scikit-learn digits dataset, through collserve.

The program of the PyTorch tutorial "Writing Distributed Applications with PyTorch"
(https://pytorch.org/tutorials/intermediate/dist_tuto.html,
section 4: Partition/DataPartitioner, a small network, average_gradients with all_reduce)
with two changes: the data is scikit-learn's digits (1797 real 8x8 handwritten digits that
ship with Debian's python3-sklearn, no download) instead of MNIST, and the network is sized
for 8x8 images. Rank r trains on partition r; after every backward pass the gradients are
averaged with all_reduce, so every rank takes the same SGD step. At the end the ranks
evaluate disjoint shards of the held-out test set and all_reduce the counts.

    collserve launch --nproc_per_node 4 examples/digits_sgd.py          # scripts/main_job.sh
    collserve launch --nproc_per_node 4 examples/digits_sgd.py --backend collserve   # torch.distributed
"""
import argparse
from math import ceil
from random import Random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import collserve as dist  # was: import torch.distributed as dist


""" Dataset partitioning helper """
class Partition(object):
    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner(object):
    def __init__(self, data, sizes=[0.7, 0.2, 0.1], seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


def digits(dtype=torch.float32, test_fraction=0.2, seed=0):
    """(train, test): lists of (1x8x8 image tensor scaled to [0, 1], label) from
    sklearn.datasets.load_digits, split by a fixed shuffle."""
    from sklearn.datasets import load_digits
    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=dtype).unsqueeze(1)
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = list(range(len(labels)))
    Random(seed).shuffle(order)
    n_test = int(test_fraction * len(order))
    test = [(images[i], labels[i]) for i in order[:n_test]]
    train = [(images[i], labels[i]) for i in order[n_test:]]
    return train, test


def partition_dataset(dataset, global_batch=64):
    """This rank's partition of `dataset` and its batch size (global_batch / world_size)."""
    size = dist.get_world_size()
    bsz = global_batch // size
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes)
    partition = partition.use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition, batch_size=bsz, shuffle=True)
    return train_set, bsz


class Net(nn.Module):
    """Two 3x3 convolutions with 2x2 pooling (8x8 -> 4x4 -> 2x2), then two linear layers."""

    def __init__(self, dropout=0.25):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(128, 64)
        self.fc2 = nn.Linear(64, 10)
        self.dropout = dropout

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 128)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def average_gradients(model):
    """ Gradient averaging. """
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def evaluate(model, test):
    """Test accuracy over every rank's shard of `test` (counts summed with all_reduce)."""
    model.eval()
    shard = test[dist.get_rank()::dist.get_world_size()]
    counts = torch.zeros(2, dtype=torch.int64)
    with torch.no_grad():
        if shard:
            images = torch.stack([x for x, _ in shard])
            labels = torch.stack([y for _, y in shard])
            counts[0] = int((model(images).argmax(dim=1) == labels).sum())
            counts[1] = len(shard)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    model.train()
    return counts[0].item() / counts[1].item()


def run(rank, size, epochs, lr):
    """ Distributed Synchronous SGD Example """
    torch.manual_seed(1234)
    train, test = digits()
    train_set, bsz = partition_dataset(train)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.5)

    num_batches = ceil(len(train_set.dataset) / float(bsz))
    for epoch in range(epochs):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print('Rank ', dist.get_rank(), ', epoch ', epoch, ': ', epoch_loss / num_batches)
    accuracy = evaluate(model, test)
    print(f'Rank  {rank} , test accuracy: {100 * accuracy:.2f}% on {len(test)} held-out digits')
    return accuracy


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--backend", default="sdk", choices=["sdk", "collserve", "gloo"],
                   help="sdk (default): the collserve Python SDK; collserve or gloo: torch.distributed itself "
                   "with that backend (collserve's c10d backend, or torch's own Gloo)")
    p.add_argument("--min_accuracy", type=float, default=0.0, help="exit 1 if the test accuracy is lower (0-1)")
    args = p.parse_args()
    torch.set_num_threads(1)  # several ranks share this host's cores
    global dist
    if args.backend != "sdk":  # the same program on torch.distributed
        import importlib
        if args.backend == "collserve":
            importlib.import_module("collserve.torch")  # registers the backend
        dist = importlib.import_module("torch.distributed")
    dist.init_process_group(args.backend if args.backend != "sdk" else "gloo")  # env:// from collserve launch
    accuracy = run(dist.get_rank(), dist.get_world_size(), args.epochs, args.lr)
    dist.destroy_process_group()
    if accuracy < args.min_accuracy:
        raise SystemExit(f"test accuracy {accuracy:.4f} is below --min_accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()
