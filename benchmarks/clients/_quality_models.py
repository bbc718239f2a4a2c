"""The models state_quality.py trains, each with its data: a fixed pool of
training samples and a held-out set, and a model built from a table
factory (table(rows, dim, bag=False) -> the module a form trains). Three
synthetic models with a learnable signal (cf, dlrm, deepfm) and DistMult
on three knowledge graphs that ship inside the PyKEEN package (see
state_quality.py's docstring for each)."""
import importlib.util
import math
import os
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from _common import ZipfIds
from _compare import workload as compare  # compare.py's RecModel, make_batches, seeded_mlp
import ctr_adam  # CTRModel, make_data

TEST_SAMPLES = 50_000


# --- the three models: a fixed data pool each, and a model built from a table factory --------------

class CF:
    """compare.py's collaborative-filtering model and data, sized down."""
    name, steps, batch, table_lr, dense_lr = "cf", 400, 4096, 1e-2, 1e-3
    users, items, dim, hidden, alpha = 50_000, 20_000, 32, 32, 1.1

    def pool(self, n_train):
        (u, i, y), = compare.make_batches(SimpleNamespace(seed=0, users=self.users, items=self.items, alpha=self.alpha,
                                                          batch=n_train + TEST_SAMPLES), 1)
        return (u[:n_train], i[:n_train]), y[:n_train], (u[n_train:], i[n_train:]), y[n_train:]

    def model(self, table, seed):
        mlp = compare.seeded_mlp(SimpleNamespace(seed=seed, dim=self.dim, hidden=self.hidden), "cpu")
        return compare.RecModel(table(self.users, self.dim), table(self.items, self.dim), mlp, "cpu", "cpu")


class DLRM(nn.Module):
    """Bottom MLP over dense features, EmbeddingBag tables, pairwise dots, top MLP."""
    ROWS, DIM, BAG, DENSE, HIDDEN_RANK = (20_000, 10_000, 5_000, 2_000, 1_000, 500), 16, 3, 8, 4

    def __init__(self, table):
        super().__init__()
        self.tables = nn.ModuleList(table(rows, self.DIM, bag=True) for rows in self.ROWS)
        self.bottom = nn.Sequential(nn.Linear(self.DENSE, 32), nn.ReLU(), nn.Linear(32, self.DIM), nn.ReLU())
        n = len(self.ROWS) + 1
        self.pairs = torch.triu_indices(n, n, offset=1)
        self.top = nn.Sequential(nn.Linear(self.DIM + n * (n - 1) // 2, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense, ids):  # ids: [B, tables, BAG]
        x = self.bottom(dense)
        v = torch.stack([x] + [t(ids[:, k]) for k, t in enumerate(self.tables)], 1)  # [B, n, D]
        dots = torch.bmm(v, v.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], 1)).squeeze(1)


class DLRMTask:
    name, steps, batch, table_lr, dense_lr = "dlrm", 400, 2048, 1e-2, 3e-3
    rows, dim, bag, dense, alpha, init_std = DLRM.ROWS, DLRM.DIM, DLRM.BAG, DLRM.DENSE, 1.05, 0.1

    def pool(self, n_train):
        """Zipf ids per table; the label is Bernoulli(sigmoid) of a hidden
        DLRM-like score: pairwise dots of rank-4 hidden vectors (bag sums and
        a projection of the dense features), standardised and sharpened."""
        rng, n = np.random.default_rng(0), n_train + TEST_SAMPLES
        normal = lambda *shape: torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
        ids = torch.stack([ZipfIds(rows, self.alpha, rng).draw(n * self.bag).view(n, self.bag)
                           for rows in self.rows], 1)
        dense = normal(n, self.dense)
        hidden = [normal(rows, DLRM.HIDDEN_RANK) for rows in self.rows]
        h = torch.stack([dense @ normal(self.dense, DLRM.HIDDEN_RANK) / math.sqrt(self.dense)] +
                        [w[ids[:, k]].sum(1) / math.sqrt(self.bag) for k, w in enumerate(hidden)], 1)
        score = (h.sum(1).pow(2) - h.pow(2).sum(1)).sum(1) / 2  # sum of the pairwise dots
        score = 3 * (score - score.mean()) / score.std()
        y = torch.bernoulli(torch.sigmoid(score), generator=torch.Generator().manual_seed(0))
        return (dense[:n_train], ids[:n_train]), y[:n_train], (dense[n_train:], ids[n_train:]), y[n_train:]

    def model(self, table, seed):
        torch.manual_seed(seed)
        model = DLRM(table)
        for t in model.tables:
            nn.init.normal_(t.weight, std=self.init_std)
        return model


class DeepFM:
    """ctr_adam.py's CTRModel and data, sized down."""
    name, steps, batch, table_lr, dense_lr = "deepfm", 400, 2048, 1e-2, 1e-3
    rows, dim, fields, hidden, init_std = 100_000, 8, 10, 64, 0.01

    def pool(self, n_train):
        truth = torch.randn(self.rows, generator=torch.Generator().manual_seed(7)) * 0.5
        ids, y = ctr_adam.make_data(self.rows, self.fields, n_train + TEST_SAMPLES, 1, truth)
        return (ids[:n_train],), y[:n_train], (ids[n_train:],), y[n_train:]

    def model(self, table, seed):
        torch.manual_seed(seed)
        model = ctr_adam.CTRModel(table, self.rows, self.dim, self.fields, hidden=self.hidden)
        for t in (model.factors, model.linear):  # small, as DeepFM initialises them: N(0, 1) logits would be ~10
            nn.init.normal_(t.weight, std=self.init_std)
        return model


def pykeen_datasets():
    """The folder of the data sets that ship inside the PyKEEN package (found, not imported), or None."""
    spec = importlib.util.find_spec("pykeen")
    return os.path.join(os.path.dirname(spec.origin), "datasets") if spec is not None and spec.origin else None


class DistMult(nn.Module):
    """score(h, r, t) = sum(e_h * w_r * e_t); symmetric in h and t."""

    def __init__(self, table, entities, relations, dim):
        super().__init__()
        self.entities, self.relations = table(entities, dim), table(relations, dim)

    def forward(self, h, r, t):
        return (self.entities(h) * self.relations(r) * self.entities(t)).sum(-1)


class KGTask:
    """DistMult on one of PyKEEN's bundled graphs, by PyKEEN's default
    DistMult recipe (see the module docstring). The pool is the training
    triples repeated for the epochs, each copy with its own negative; the
    seed sets the initial weights and the order."""
    batch, table_lr, dense_lr, dim, margin, reg_weight = 256, 3e-3, 0.0, 50, 1.0, 0.1
    metric = "filtered MRR"

    def __init__(self, dataset, epochs):
        self.name, self.dataset, self.epochs = f"kg_{dataset}", dataset, epochs
        root = pykeen_datasets()
        self.folder = os.path.join(root, dataset) if root else None
        self.unavailable = None if self.folder and os.path.isfile(os.path.join(self.folder, "train.txt")) else (
            f"PyKEEN is not installed; its package ships the {dataset} files: "
            "pip install pykeen==1.11.1 torch==2.13.0 (torch pinned to the local build)")
        self._splits, self.steps = None, 0
        if not self.unavailable:
            with open(os.path.join(self.folder, "train.txt")) as f:
                self.steps = math.ceil(epochs * sum(1 for line in f if line.strip()) / self.batch)

    def splits(self):
        """{split: LongTensor [n, 3] of (head, relation, tail) ids}; ids by sorted name over all splits."""
        if self._splits is None:
            rows = {}
            for split in ("train", "valid", "test"):
                with open(os.path.join(self.folder, split + ".txt")) as f:
                    rows[split] = [line.rstrip("\n").split("\t") for line in f if line.strip()]
            entities = sorted({x for r in rows.values() for h, _, t in r for x in (h, t)})
            relations = sorted({rel for r in rows.values() for _, rel, _ in r})
            e, rel_id = {x: i for i, x in enumerate(entities)}, {x: i for i, x in enumerate(relations)}
            self.num_entities, self.num_relations = len(entities), len(relations)
            self._splits = {k: torch.tensor([[e[h], rel_id[r], e[t]] for h, r, t in v]) for k, v in rows.items()}
        return self._splits

    def pool(self, n_train):
        splits = self.splits()
        train, test = splits["train"], splits["test"]
        gen = torch.Generator().manual_seed(0)
        x = train.repeat(math.ceil(n_train / train.shape[0]), 1)[:n_train]
        h, r, t = x.unbind(1)
        # PyKEEN's basic negative sampler: the head or the tail (even odds) replaced by another entity
        side = torch.rand(n_train, generator=gen) < 0.5
        other = torch.randint(self.num_entities - 1, (n_train,), generator=gen)
        other = other + (other >= torch.where(side, h, t)).long()
        neg_h, neg_t = torch.where(side, other, h), torch.where(side, t, other)
        # the filter: for each test triple, the other true answers of its tail and of its head query
        known = torch.cat(list(splits.values()))
        tails, heads = {}, {}
        for a, b, c in known.tolist():
            tails.setdefault((a, b), []).append(c)
            heads.setdefault((b, c), []).append(a)
        n = test.shape[0]
        self._filters = (torch.zeros(n, self.num_entities, dtype=torch.bool),
                        torch.zeros(n, self.num_entities, dtype=torch.bool))
        for i, (a, b, c) in enumerate(test.tolist()):
            self._filters[0][i, tails[(a, b)]] = True
            self._filters[0][i, c] = False
            self._filters[1][i, heads[(b, c)]] = True
            self._filters[1][i, a] = False
        return (h, r, t, neg_h, neg_t), torch.zeros(n_train), tuple(test.unbind(1)), torch.zeros(n)

    def model(self, table, seed):
        self.splits()
        torch.manual_seed(seed)
        model = DistMult(table, self.num_entities, self.num_relations, self.dim)
        bound = math.sqrt(6 / self.dim)  # PyKEEN's xavier_uniform_ (then its unit-norm constrainer)
        with torch.no_grad():
            model.entities.weight.copy_(F.normalize(torch.empty(self.num_entities, self.dim).uniform_(-bound, bound)))
            # xavier_normal_norm_: a normal draw at unit norm
            model.relations.weight.copy_(F.normalize(torch.randn(self.num_relations, self.dim)))
        return model

    def loss(self, model, x, y):
        h, r, t, neg_h, neg_t = x
        w = model.relations(r)
        pos = (model.entities(h) * w * model.entities(t)).sum(1)
        neg = (model.entities(neg_h) * w * model.entities(neg_t)).sum(1)
        return F.relu(neg - pos + self.margin).mean() + self.reg_weight * (w.norm(dim=1) / self.dim).mean()

    @torch.no_grad()
    def after_step(self, model):
        """PyKEEN's entity constrainer: every entity row back to unit L2 norm."""
        w = model.entities.weight
        w.copy_(F.normalize(w.float(), dim=1).to(w.dtype))

    @torch.no_grad()
    def evaluate(self, model, x, y):
        h, r, t = x
        everyone = model.entities(torch.arange(self.num_entities)).double()
        w = model.relations(r).double()
        reciprocal = []
        for query, answer, known in ((h, t, self._filters[0]), (t, h, self._filters[1])):  # tail, head prediction
            # the same sum in the same order for every candidate (a matmul's columns may round differently),
            # so that equal rows tie exactly
            q = model.entities(query).double() * w
            scores = torch.cat([(q[i:i + 256, None, :] * everyone).sum(-1) for i in range(0, q.shape[0], 256)])
            if not torch.isfinite(scores).all():
                return float("nan")
            true = scores.gather(1, answer[:, None])
            scores = scores.masked_fill(known, -math.inf)
            higher, ties = (scores > true).sum(1), (scores == true).sum(1)  # ties count the answer itself
            reciprocal.append(1.0 / (1 + higher + (ties - 1) / 2).double())
        return torch.cat(reciprocal).mean().item()

    def diagnostics(self, model, opt):
        """How many of the coordinates each entity and relation row uses (the
        participation ratio of its squared weights), and, from a per-element
        exp_avg_sq, how far its elements are from their row's mean: what a
        row-wise second moment replaces them with."""
        out = {}
        for name, table in (("entities", model.entities), ("relations", model.relations)):
            sq = table.weight.detach().float().pow(2)
            out[f"{name}_coords_used"] = float(((sq.sum(1) ** 2) / sq.pow(2).sum(1)).mean())
            state = opt.state.get(table.weight, {}) if opt is not None else {}
            v = state.get("exp_avg_sq")
            if v is not None and v.dim() == 2 and v.dtype == torch.float32:
                v = v[v.sum(1) > 0]
                ratio = (v / v.mean(1, keepdim=True)).flatten()
                q = torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95])).tolist()
                out[f"{name}_v_over_row_mean_q05_q50_q95"] = q
                out[f"{name}_v_row_max_over_min_median"] = float((v.max(1).values / v.min(1).values).median())
        return out


KG_TASKS = (KGTask("umls", 100), KGTask("nations", 100), KGTask("kinships", 40))
TASKS = {t.name: t for t in (CF(), DLRMTask(), DeepFM()) + KG_TASKS}
