"""compare.py's workload: the batches of user and item ids with their
labels, and the collaborative-filtering model they train (also used by
benchmarks/clients/state_quality.py)."""
import math

import numpy as np
import torch
from torch import nn

from _common import ZipfIds, progress

LABEL_RANK = 8  # rank of the hidden model the labels come from


def make_batches(cfg, count):
    """`count` batches (user ids, item ids, labels), on the CPU as a data loader gives them.

    Users and items are Zipf-distributed over their tables. Labels come from
    a hidden random rank-LABEL_RANK model, 1 where <p_user, q_item> > 0: a
    deterministic, balanced target the model can learn, so the loss goes down.
    """
    rng = np.random.default_rng(cfg.seed)
    users, items = ZipfIds(cfg.users, cfg.alpha, rng), ZipfIds(cfg.items, cfg.alpha, rng)
    hidden_users = rng.standard_normal((cfg.users, LABEL_RANK), dtype=np.float32)
    hidden_items = rng.standard_normal((cfg.items, LABEL_RANK), dtype=np.float32)
    batches = []
    for _ in progress(range(count), "generating batches"):
        u, i = users.draw(cfg.batch), items.draw(cfg.batch)
        score = np.einsum("br,br->b", hidden_users[u.numpy()], hidden_items[i.numpy()])
        batches.append((u, i, torch.from_numpy((score > 0).astype(np.float32))))
    return batches


def workload_stats(batches):
    return {
        "unique_users_per_batch_mean": float(np.mean([torch.unique(u).numel() for u, _, _ in batches])),
        "unique_items_per_batch_mean": float(np.mean([torch.unique(i).numel() for _, i, _ in batches])),
        "positive_fraction": float(torch.cat([y for _, _, y in batches]).mean()),
    }


# --- model -------------------------------------------------------------------------------

class RecModel(nn.Module):
    """logit(user, item) = <u, i> / sqrt(D) + MLP([u, i]).

    The tables live on table_device (ids are moved there, as a training
    loop with CPU data loading would); their outputs are used on out_device,
    where the MLP is. The 1/sqrt(D) keeps the initial logits ~N(0, 1) with
    nn.Embedding's N(0, 1) initialisation.
    """

    def __init__(self, users, items, mlp, table_device, out_device):
        super().__init__()
        self.users, self.items, self.mlp = users, items, mlp
        self.table_device, self.out_device = torch.device(table_device), torch.device(out_device)
        self.scale = 1.0 / math.sqrt(mlp[0].in_features // 2)

    def forward(self, user_ids, item_ids):
        # .to() is a no-op where the tensor is already there (hostembed's outputs land on out_device).
        u = self.users(user_ids.to(self.table_device)).to(self.out_device)
        i = self.items(item_ids.to(self.table_device)).to(self.out_device)
        return (u * i).sum(-1) * self.scale + self.mlp(torch.cat([u, i], dim=-1)).squeeze(-1)

    def tables(self):
        return [self.users.weight, self.items.weight]


class FixedRows(nn.Module):
    """Stands in for a table: the same [batch, D] rows for any ids, no table,
    no optimizer. Used to time the dense part of the step alone."""

    def __init__(self, batch, dim, device):
        super().__init__()
        # A parameter, so backward still computes the gradient w.r.t. the rows,
        # which every embedding needs; model.zero_grad() drops it.
        self.weight = nn.Parameter(torch.randn(batch, dim, device=device))

    def forward(self, ids):
        return self.weight


def seeded_mlp(cfg, device):
    # Its own seed, drawn on the CPU: the same MLP whatever the tables drew before.
    torch.manual_seed(cfg.seed + 1)
    return nn.Sequential(nn.Linear(2 * cfg.dim, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, 1)).to(device)
