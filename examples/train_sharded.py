"""A recommendation model trained on several processes with torchrun: two
big tables (users, items) spread over the ranks by
hostembed.distributed.ShardedEmbedding, or kept as one copy for all the
ranks of this host by SharedEmbedding (--shared), and a dense part that
DistributedDataParallel averages. Synthetic Zipf-skewed interactions, each
rank its own batch; a checkpoint per rank at the end, and --resume to go
on from the checkpoints of any number of ranks (load_resharded).

    torchrun --standalone --nproc_per_node 2 examples/train_sharded.py [--shared] [--fused] [--steps 200]
    torchrun --standalone --nproc_per_node 3 examples/train_sharded.py --resume --checkpoint-dir ckpt

The tables stay in host memory. With --device cpu (the default) everything
runs on the CPU over gloo; with --device cuda each rank's outputs and dense
part go to its GPU (LOCAL_RANK), DDP over NCCL, the tables' traffic over
gloo (one process group with both backends).
"""
import argparse
import functools
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
    p.add_argument("--fused", action="store_true", help="the tables updated in backward (fused=True)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where outputs and the dense part go")
    p.add_argument("--checkpoint-dir", default=None, help="where each rank saves its checkpoint (default: none)")
    p.add_argument("--resume", action="store_true",
                   help="first load the checkpoints in --checkpoint-dir, written by any number of ranks")
    args = p.parse_args()

    # torchrun sets the rank, world size and rendezvous.
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same dense weights on every rank
    table = functools.partial(hd.SharedEmbedding if args.shared else hd.ShardedEmbedding, device=device)
    model = RecModel(args.users, args.items, args.dim, table)
    model.mlp.to(device)
    hd.exclude_from_ddp(model)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    tables = hostembed.SparseAdam([*model.users.parameters(), *model.items.parameters()], lr=1e-2, fused=args.fused)
    dense = torch.optim.Adam(model.mlp.parameters(), lr=1e-3)
    if args.resume:
        # Each rank's file holds the dense part and the tables' optimizer
        # state; load_resharded takes each rank's rows from the files that
        # hold them, whatever the number of ranks that wrote them.
        names = sorted(f for f in os.listdir(args.checkpoint_dir) if f.startswith("rank") and f.endswith(".pt"))
        paths = [os.path.join(args.checkpoint_dir, f"rank{r}.pt") for r in range(len(names))]
        hd.load_resharded(paths, model, tables)
        if rank == 0:
            print(f"resumed from {len(paths)} ranks' checkpoints", flush=True)

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own interactions
    for step in range(args.steps):
        users, items = zipf_ids(args.users, args.batch, gen), zipf_ids(args.items, args.batch, gen)
        labels = ((users + items) % 3 == 0).float().to(device)  # a pattern the tables can learn
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
