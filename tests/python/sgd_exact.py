"""Exact gradient averaging: 4 ranks vs one process (test_launch.py::test_gradient_averaging_is_exact).

    collserve launch --nproc_per_node 4 sgd_exact.py ranks OUT_DIR   # each rank: OUT_DIR/rank<R>.npz
    python sgd_exact.py reference OUT_DIR                          # OUT_DIR/reference.npz

Both train examples/digits_sgd.py's Net in float64 (no dropout) from the same seed for
STEPS SGD steps. Rank r's batch at step s is items [s*B, (s+1)*B) of DataPartitioner
partition r; the reference trains on the concatenation of the 4 ranks' batches, so that
averaging the ranks' gradients (each the mean over B) must give its gradient (the mean
over 4*B), up to floating-point summation order.
"""
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import digits_sgd  # noqa: E402

WORLD, STEPS, BATCH, SEED = 4, 10, 16, 7


def setup():
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = digits_sgd.Net(dropout=0.0).double()
    train, _ = digits_sgd.digits(dtype=torch.float64)
    partitioner = digits_sgd.DataPartitioner(train, [1.0 / WORLD] * WORLD)
    parts = [partitioner.use(r) for r in range(WORLD)]
    return model, optim.SGD(model.parameters(), lr=0.1, momentum=0.5), parts


def batch(part, step):
    items = [part[i] for i in range(step * BATCH, (step + 1) * BATCH)]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def sgd_step(model, optimizer, data, target, average):
    optimizer.zero_grad()
    F.nll_loss(model(data), target).backward()
    if average:
        digits_sgd.average_gradients(model)
    optimizer.step()


def save(model, path):
    np.savez(path, **{name: p.detach().numpy() for name, p in model.named_parameters()})


def main(mode, out_dir):
    model, optimizer, parts = setup()
    if mode == "ranks":
        dist = digits_sgd.dist
        dist.init_process_group("gloo")
        assert dist.get_world_size() == WORLD
        rank = dist.get_rank()
        for step in range(STEPS):
            sgd_step(model, optimizer, *batch(parts[rank], step), average=True)
        save(model, os.path.join(out_dir, f"rank{rank}.npz"))
        dist.destroy_process_group()
    else:
        for step in range(STEPS):
            batches = [batch(parts[r], step) for r in range(WORLD)]
            sgd_step(model, optimizer, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]),
                     average=False)
        save(model, os.path.join(out_dir, "reference.npz"))
        # Control: rank 0's batches alone (no averaging) must end elsewhere, or the
        # comparison above could not fail.
        model, optimizer, parts = setup()
        for step in range(STEPS):
            sgd_step(model, optimizer, *batch(parts[0], step), average=False)
        save(model, os.path.join(out_dir, "alone.npz"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
