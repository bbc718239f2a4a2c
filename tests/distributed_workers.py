"""What each rank runs in tests/test_distributed.py: spawned processes on a
gloo group, each writing its result (or its exception) to OUTDIR/rank<r>.pt."""
import datetime
import os

import torch
import torch.distributed as dist

import hostembed
import hostembed.distributed as hd

ROWS, DIM, BATCH, STEPS = 600, 8, 64, 8
OPTIMIZERS = {
    "SGD": (hostembed.SGD, dict(lr=0.1)),
    "SparseAdam": (hostembed.SparseAdam, dict(lr=0.01)),
    "RowWiseAdagrad": (hostembed.RowWiseAdagrad, dict(lr=0.1)),
}


def initial_table():
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))


def batch(step, rank):
    """Rank `rank`'s ids and target at `step`: Zipf-skewed ids, so ranks
    share their hot rows."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    weights = torch.arange(1, ROWS + 1, dtype=torch.float64).pow(-1.1)
    ids = torch.multinomial(weights, BATCH, replacement=True, generator=gen).view(8, -1)
    return ids, torch.randn(*ids.shape, DIM, generator=gen)


def train(rank, world, optimizer, fused):
    emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False)
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(emb.parameters(), fused=fused, **hyper)
    for step in range(STEPS):
        ids, target = batch(step, rank)
        (emb(ids) - target).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    state = {key: torch.as_tensor(value).clone() for key, value in opt.state[emb.shard.weight].items()
             if torch.is_tensor(value) and value.dim() > 0}
    return {"range": emb.row_range, "weight": emb.shard.weight.detach().clone(), "state": state}


def out_of_range(rank, world):
    emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False)
    before = emb.shard.weight.detach().clone()
    ids = torch.tensor([3, ROWS + 5]) if rank == world - 1 else torch.tensor([1, 2])
    try:
        emb(ids)
    except IndexError as exc:
        message = str(exc)
    else:
        message = None
    # The group still works: a good batch after the refused one.
    good = emb(torch.tensor([rank, ROWS - 1 - rank]))
    return {"message": message, "unchanged": torch.equal(before, emb.shard.weight.detach()),
            "good": torch.equal(good, initial_table()[[rank, ROWS - 1 - rank]])}


def mismatched(rank, world):
    try:
        hd.ShardedEmbedding(ROWS, DIM + rank)
    except ValueError as exc:
        return {"message": str(exc)}
    return {"message": None}


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = hd.ShardedEmbedding.from_pretrained(initial_table(), freeze=False)
        self.dense = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.dense(self.emb(ids)).squeeze(-1)


def with_ddp(rank, world):
    """A sharded table and a dense layer under DDP: the dense gradient is
    averaged over the ranks, the table kept out of the all-reduce (DDP
    cannot reduce a sparse gradient whose rows differ by rank anyway)."""
    torch.manual_seed(0)
    model = _Model()
    hd.exclude_from_ddp(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ids, target = batch(0, rank)
    (ddp(ids) - target[..., 0]).pow(2).sum().backward()
    # This rank's own dense gradient, without DDP, for the test to average.
    alone = _Model()
    alone.load_state_dict(model.state_dict())
    (alone(ids) - target[..., 0]).pow(2).sum().backward()
    return {"dense_grad": model.dense.weight.grad.clone(), "own_dense_grad": alone.dense.weight.grad.clone(),
            "shard_has_grad": model.emb.shard.weight.grad is not None}


JOBS = {"train": train, "out_of_range": out_of_range, "mismatched": mismatched, "with_ddp": with_ddp}


def worker(rank, world, outdir, job, args):
    torch.set_num_threads(1)
    hostembed.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = JOBS[job](rank, world, *args)
    except Exception as exc:  # reported to the test, which fails with it
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
