"""A recommendation model trained on several processes with torchrun: two
big tables (users, items) spread over the ranks by
hostembed.distributed.ShardedEmbedding, or kept as one copy for all the
ranks of this host by SharedEmbedding (--shared), and a dense part that
DistributedDataParallel averages. Synthetic Zipf-skewed interactions, each
rank its own batch; a checkpoint per rank at the end.

    torchrun --standalone --nproc_per_node 2 examples/train_sharded.py [--shared] [--steps 200]

CPU and gloo here; the tables stay in host memory.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hostembed
import hostembed.distributed as hd


class RecModel(nn.Module):
    def __init__(self, users, items, dim, table):
        super().__init__()
        self.users, self.items = table(users, dim), table(items, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, user_ids, item_ids):
        u, i = self.users(user_ids), self.items(item_ids)
        return (u * i).sum(-1) / u.shape[-1] ** 0.5 + self.mlp(torch.cat([u, i], -1)).squeeze(-1)


def zipf_ids(rows, count, generator):
    ranks = torch.arange(1, rows + 1, dtype=torch.float64).pow(-1.1)
    return torch.multinomial(ranks, count, replacement=True, generator=generator)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=1_000_000)
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096, help="interactions a step, per rank")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--shared", action="store_true", help="one copy of each table for this host's ranks")
    p.add_argument("--checkpoint-dir", default=None, help="where each rank saves its checkpoint (default: none)")
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun sets the rank, world size and rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same dense weights on every rank
    table = hd.SharedEmbedding if args.shared else hd.ShardedEmbedding
    model = RecModel(args.users, args.items, args.dim, table)
    hd.exclude_from_ddp(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    tables = hostembed.SparseAdam([*model.users.parameters(), *model.items.parameters()], lr=1e-2)
    dense = torch.optim.Adam(model.mlp.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own interactions
    for step in range(args.steps):
        users, items = zipf_ids(args.users, args.batch, gen), zipf_ids(args.items, args.batch, gen)
        labels = ((users + items) % 3 == 0).float()  # a pattern the tables can learn
        loss = F.binary_cross_entropy_with_logits(ddp(users, items), labels)
        loss.backward()
        tables.step()
        dense.step()
        tables.zero_grad()
        dense.zero_grad()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f} (rank 0's batch)", flush=True)

    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        hostembed.save(os.path.join(args.checkpoint_dir, f"rank{rank}.pt"), model, tables)
    dist.barrier()  # every rank done with the group before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
