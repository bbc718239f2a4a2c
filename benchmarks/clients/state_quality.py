"""Does compact optimizer state hold model quality?

Trains three small synthetic models, each with a learnable signal (labels
from a hidden model), and DistMult on three real knowledge graphs, with
hostembed.SparseAdam over the tables in several forms of state, and
compares each form's held-out metric (AUC; filtered MRR for the graphs)
with float32 state's:

  cf      collaborative filtering (benchmarks/compare.py's RecModel and data:
          user and item tables, Zipf ids, labels from a hidden rank-8 model)
  dlrm    DLRM-style: six EmbeddingBag(mode="sum") tables of different sizes,
          bags of 3 Zipf ids, dense features through a bottom MLP, pairwise
          dot interaction, top MLP
  deepfm  benchmarks/clients/ctr_adam.py's CTRModel and data (fields sharing a factor
          table and a first-order table, FM term + MLP)
  kg_umls, kg_nations, kg_kinships
          DistMult (score = sum(e_h * w_r * e_t)) on UMLS (135 entities, 46
          relations, 5,216 training triples), Nations (14, 55, 1,592) and
          Kinships (104, 25, 8,544), read from the files that ship inside the
          PyKEEN package (pip install pykeen==1.11.1 torch==2.13.0; skipped
          with a message where it is missing; nothing is downloaded).
          PyKEEN's default DistMult recipe: dimension 50, entities kept at
          unit L2 norm after every step (its entity constrainer), an L2
          regulariser on the relations (weight 0.1, norm / dim), one
          negative a triple (head or tail replaced by another entity, drawn
          once per pool sample), margin ranking loss (margin 1), batches of
          256, table lr 3e-3. Metric: the test split's filtered MRR, head
          and tail prediction both, a tie ranked in the middle of its group,
          the filter every triple of train, valid and test

A form is (table dtype, state dtype, row-wise second moment, state rounding):

  fp32                     float32 table and state: the reference
  bf16_state(_sr)          bfloat16 moments, rounded to nearest (stochastically)
  f16_state                float16 moments
  int8(_sr)                int8 moments, rounded to nearest (stochastically)
  rowwise                  float32 exp_avg, one second moment a row
  int8_rowwise             int8 exp_avg, one second moment a row
  bf16_table               a bfloat16 table, float32 moments (what the table's
                           dtype alone costs)
  bf16_table_int8          int8 moments on a bfloat16 table (4.06 bytes a
                           parameter at D=128)
  bf16_table_int8_rowwise  int8 exp_avg and a row-wise second moment on a
                           bfloat16 table: the most compact (3.06)
  bnb_adam8bit             the field's 8-bit Adam: torch nn.Embedding tables,
                           bitsandbytes' Adam8bit over the whole model. Dense
                           Adam, not lazy (every row moves every step), so it
                           is judged against
  torch_adam               the same with float32 torch.optim.Adam (no verdict:
                           its dAUC is dense against lazy Adam). These two run
                           where bitsandbytes imports

The dense layers are trained by torch.optim.Adam in every hostembed form.
For one seed every form starts from the same weights (bfloat16 tables
round them) and sees the same batches; the seed sets both. The hidden model
and the held-out set are the same for every seed.

For each (model, form, seed): the mean training loss over each window of
--log-every steps, the held-out metric at the end, and whether the loss became
non-finite (diverged). A form "holds" where
    |mean metric(form) - mean metric(ref)| <= max(ref max - ref min, 2e-3)
over the seeds, and no run of it diverged; ref is fp32 (torch_adam for
bnb_adam8bit where it ran). The rule is two-sided: a form that learns faster
fails it as a slower one does. The row-wise forms change the algorithm (one
step size a row), not only the precision, so a difference is expected there.
On the graphs it is large: with the entities projected back to unit norm
every step, a step proportional to the gradient within a row (row-wise)
lets the coordinates with the largest gradients take the norm from the
others, and each entity and relation ends up on a few coordinates
(--kg-diagnostics prints it).

    PYTHONPATH=python python benchmarks/clients/state_quality.py              # ~9 min on 2 vCPUs
    PYTHONPATH=python python benchmarks/clients/state_quality.py --quick      # < 1 min smoke test
    PYTHONPATH=python python benchmarks/clients/state_quality.py --models dlrm --forms fp32,int8 --seeds 5
    PYTHONPATH=python python benchmarks/clients/state_quality.py --models kg_umls,kg_nations,kg_kinships \
        --forms fp32,bf16_state,int8,rowwise,bf16_table_int8_rowwise --kg-diagnostics --threads 1   # ~2 min
    (the graphs' steps are tiny: on busy cores, --threads 1 runs them ~10x faster)
"""
import argparse
import datetime
import importlib.util
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import REPO_ROOT, RESULTS_DIR, ZipfIds, log, machine_info, require_hostembed, usable_cpus  # noqa: E402
from _common import write_json, write_plots  # noqa: E402

hostembed = require_hostembed()
from _compare import workload as compare  # noqa: E402  (compare.py's RecModel, make_batches, seeded_mlp)
import ctr_adam  # noqa: E402  (CTRModel, make_data, auc)

F32, BF16, I8 = torch.float32, torch.bfloat16, torch.int8
# name: (table dtype, state_dtype, rowwise_exp_avg_sq, state_rounding)
FORMS = {
    "fp32": (F32, F32, False, "nearest"),
    "bf16_state": (F32, BF16, False, "nearest"),
    "bf16_state_sr": (F32, BF16, False, "stochastic"),
    "f16_state": (F32, torch.float16, False, "nearest"),
    "int8": (F32, I8, False, "nearest"),
    "int8_sr": (F32, I8, False, "stochastic"),
    "rowwise": (F32, F32, True, "nearest"),
    "int8_rowwise": (F32, I8, True, "nearest"),
    "bf16_table": (BF16, F32, False, "nearest"),
    "bf16_table_int8": (BF16, I8, False, "nearest"),
    "bf16_table_int8_rowwise": (BF16, I8, True, "nearest"),
}
DENSE_FORMS = ("bnb_adam8bit", "torch_adam")  # torch tables, one dense optimizer over the model
REFERENCE = "fp32"
MIN_TOLERANCE = 2e-3
TEST_SAMPLES = 50_000


def reference_of(form, forms):
    """The form a form is judged against; None for fp32."""
    if form == REFERENCE:
        return None
    return "torch_adam" if form == "bnb_adam8bit" and "torch_adam" in forms else REFERENCE


def bitsandbytes():
    """The bitsandbytes module, or None with the reason."""
    try:
        import bitsandbytes as bnb
        return bnb, None
    except Exception as exc:  # not installed, or no backend for this machine
        return None, f"{type(exc).__name__}: {exc}"


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


# --- forms ------------------------------------------------------------------------------------------

def table_factory(form):
    """table(rows, dim, bag=False) -> the module the form trains."""
    if form in DENSE_FORMS:
        return lambda rows, dim, bag=False: nn.EmbeddingBag(rows, dim, mode="sum") if bag else nn.Embedding(rows, dim)
    dtype = FORMS[form][0]

    def table(rows, dim, bag=False):
        module = (hostembed.EmbeddingBag(rows, dim, mode="sum", dtype=dtype) if bag
                  else hostembed.Embedding(rows, dim, dtype=dtype))
        if dtype != F32:  # a bfloat16 table gives bfloat16 rows: the float32 model gets them as float32
            module.register_forward_hook(lambda mod, inputs, out: out.float())
        return module
    return table


def state_options(form):
    """SparseAdam's keyword arguments for the form; those at their default
    are left out, so that fp32 is plain SparseAdam."""
    _, state_dtype, rowwise, rounding = FORMS[form]
    options = {"state_dtype": state_dtype, "rowwise_exp_avg_sq": rowwise, "state_rounding": rounding}
    defaults = {"state_dtype": F32, "rowwise_exp_avg_sq": False, "state_rounding": "nearest"}
    return {k: v for k, v in options.items() if v != defaults[k]}


def split_params(model):
    tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    ids = {id(p) for p in tables}
    return tables, [p for p in model.parameters() if id(p) not in ids]


def optimizers(form, model, task):
    tables, dense = split_params(model)
    groups = [{"params": tables, "lr": task.table_lr}] + ([{"params": dense, "lr": task.dense_lr}] if dense else [])
    if form == "bnb_adam8bit":
        return [bitsandbytes()[0].optim.Adam8bit(groups)]
    if form == "torch_adam":
        return [torch.optim.Adam(groups)]
    return ([torch.optim.Adam(dense, lr=task.dense_lr)] if dense else []) + [
        hostembed.SparseAdam(tables, lr=task.table_lr, **state_options(form))]


# --- one run ---------------------------------------------------------------------------------------

def seeded_data(pool, seed, steps, batch):
    """The training samples in the seed's order, and the held-out set (the same for every seed)."""
    x, y, test_x, test_y = pool
    order = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(seed))[:steps * batch]
    return tuple(t[order] for t in x), y[order], test_x, test_y


def initial_state(task, seed):
    """The seed's initial weights, drawn once with torch tables: every form loads them."""
    return {k: v.clone() for k, v in task.model(table_factory("torch_adam"), seed).state_dict().items()}


@torch.no_grad()
def held_out_auc(model, x, y, chunk=8192):
    scores = torch.cat([model(*(t[i:i + chunk] for t in x)) for i in range(0, y.numel(), chunk)])
    return ctr_adam.auc(scores.double(), y) if torch.isfinite(scores).all() else float("nan")


def metric_name(task):
    return getattr(task, "metric", "AUC")


def train(task, form, seed, data, initial, steps, log_every, diagnose=False):
    model = task.model(table_factory(form), seed)
    model.load_state_dict(initial)
    opts = optimizers(form, model, task)
    x, y, test_x, test_y = data
    curve, window, diverged, t0 = [], [], False, time.perf_counter()
    for k in range(steps):
        rows = slice(k * task.batch, (k + 1) * task.batch)
        batch_x = tuple(t[rows] for t in x)
        loss = (task.loss(model, batch_x, y[rows]) if hasattr(task, "loss")
                else F.binary_cross_entropy_with_logits(model(*batch_x), y[rows]))
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in opts:
            opt.step()
        if hasattr(task, "after_step"):
            task.after_step(model)
        window.append(loss.item())
        if not math.isfinite(window[-1]):
            diverged = True
            break
        if (k + 1) % log_every == 0 or k + 1 == steps:
            curve.append([k + 1, float(np.mean(window))])
            window = []
    evaluate = task.evaluate if hasattr(task, "evaluate") else held_out_auc
    result = {"seed": seed, "diverged": diverged, "curve": curve, "train_s": time.perf_counter() - t0,
              "final_loss": curve[-1][1] if curve and not diverged else float("nan"),
              "metric": float("nan") if diverged else evaluate(model, test_x, test_y)}
    if diagnose and hasattr(task, "diagnostics") and form in FORMS:
        result["diagnostics"] = task.diagnostics(model, opts[-1])
    return result


# --- summary, report, plot --------------------------------------------------------------------------

def summarize(runs, ref, ref_name=None):
    values = [r["metric"] for r in runs]
    s = {"metric_mean": float(np.mean(values)), "metric_min": float(np.min(values)),
         "metric_max": float(np.max(values)),
         "final_loss_mean": float(np.mean([r["final_loss"] for r in runs])),
         "diverged": any(r["diverged"] for r in runs), "runs": runs}
    if ref is not None:
        tolerance = max(ref["metric_max"] - ref["metric_min"], MIN_TOLERANCE)
        s["reference"], s["delta"] = ref_name, s["metric_mean"] - ref["metric_mean"]
        s["tolerance"] = tolerance
        s["holds"] = bool(abs(s["delta"]) <= tolerance and not s["diverged"])  # False where NaN
    return s


def verdict(form, s):
    if form in (REFERENCE, "torch_adam") or "holds" not in s:
        return {REFERENCE: "reference", "torch_adam": "dense reference"}.get(form, "no reference ran")
    return "diverged" if s["diverged"] else ("holds" if s["holds"] else "DOES NOT HOLD")


def print_table(name, task, results, seeds):
    print(f"\n## {name}: {task.steps} steps of {task.batch}, table lr {task.table_lr:g}, dense lr "
          f"{task.dense_lr:g}, {len(seeds)} seed(s)\n")
    metric = metric_name(task)
    print(f"| form | held-out {metric} mean | min..max | final train loss | vs | difference | tolerance "
          "| in ref spreads | verdict |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for form, s in results.items():
        vs, delta, tol, spreads = (s["reference"], f"{s['delta']:+.4f}", f"{s['tolerance']:.4f}",
                                   f"{s['delta'] / s['tolerance']:+.1f}") if "reference" in s else ("", "", "", "")
        print(f"| {form} | {s['metric_mean']:.4f} | {s['metric_min']:.4f}..{s['metric_max']:.4f} "
              f"| {s['final_loss_mean']:.4f} | {vs} | {delta} | {tol} | {spreads} | {verdict(form, s)} |")
    diagnosed = {form: [r["diagnostics"] for r in s["runs"] if "diagnostics" in r] for form, s in results.items()}
    if any(diagnosed.values()):
        print(f"\n{name}, mean over the seeds: coordinates each row uses (participation ratio of its squared"
              f" weights, of {task.dim}); per-element exp_avg_sq against its row's mean (where kept per element)\n")
        for form, runs in diagnosed.items():
            if runs:
                mean = {k: np.mean([r[k] for r in runs], axis=0) for k in runs[0]}
                print(f"  {form}: " + "; ".join(
                    f"{k} " + (" ".join(f"{x:.3g}" for x in v) if np.ndim(v) else f"{v:.3g}") for k, v in mean.items()))


def mean_curve(runs):
    steps = [c[0] for c in runs[0]["curve"]]
    n = min(len(r["curve"]) for r in runs)
    return steps[:n], np.mean([[c[1] for c in r["curve"][:n]] for r in runs], axis=0)


def plot(report):
    models = report["models"]

    def draw(plt):
        fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False,
                                 gridspec_kw={"height_ratios": (2, 1)}, sharex="col")
        for col, (name, results) in enumerate(models.items()):
            top, bottom = axes[0][col], axes[1][col]
            ref = mean_curve(results[REFERENCE]["runs"]) if REFERENCE in results else None
            kept = []  # the curves the axes are scaled to: a form far off fp32's would flatten the rest
            for form, s in results.items():
                steps, loss = mean_curve(s["runs"])
                off = ref is not None and not np.all(np.abs(loss[:len(ref[1])] - ref[1][:len(loss)]) < 0.1)
                style = (dict(color="black", linewidth=2.5) if form == REFERENCE else
                         dict(linewidth=1, linestyle="--" if form in DENSE_FORMS else "-"))
                label = f"{form} (off the chart)" if off else form
                top.plot(steps, loss, label=label, **style)
                if ref is not None:
                    n = min(len(loss), len(ref[1]))
                    bottom.plot(steps[:n], loss[:n] - ref[1][:n], label=label, **style)
                    if not off:
                        kept.append((loss, loss[:n] - ref[1][:n]))
            if kept:
                for axis, values in ((top, [k[0] for k in kept]), (bottom, [k[1] for k in kept])):
                    low, high = min(map(np.min, values)), max(map(np.max, values))
                    pad = 0.05 * (high - low or 1.0)
                    axis.set_ylim(low - pad, high + pad)
            top.set_title(name)
            bottom.set_xlabel("step")
        axes[0][0].set_ylabel(f"training loss (mean of {report['config']['log_every']} steps and the seeds)")
        axes[1][0].set_ylabel("minus fp32's")
        axes[0][0].legend(fontsize=7)
        return fig
    return draw


# --- main ------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(TASKS), help="comma-separated subset of " + ",".join(TASKS))
    p.add_argument("--forms", default=None, help="comma-separated subset of " + ",".join(list(FORMS) + list(
        DENSE_FORMS)) + " (default: all; the dense two where bitsandbytes imports)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, the same for every form")
    p.add_argument("--steps", type=int, default=None, help="training steps of every model (default: each its own, "
                   "400; the graphs' epochs, 100 (Kinships 40), in batches of 256)")
    p.add_argument("--kg-diagnostics", action="store_true", help="the graphs: print how many coordinates each "
                   "entity and relation row uses, and the spread of exp_avg_sq within rows")
    p.add_argument("--log-every", type=int, default=10, help="steps a logged loss averages")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 seed, 60 steps")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch and hostembed threads")
    p.add_argument("--out-json", default=os.path.join(RESULTS_DIR, "state_quality.json"))
    p.add_argument("--out-png", default=os.path.join(REPO_ROOT, "benchmarks", "figures", "state_quality.png"))
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 1, args.steps or 60
    args.models = [m for m in args.models.split(",") if m]
    bnb, args.bitsandbytes = bitsandbytes()
    if args.forms is None:  # the dense two only where bitsandbytes imports
        args.forms = ",".join(list(FORMS) + (list(DENSE_FORMS) if bnb else []))
    args.forms = [f for f in args.forms.split(",") if f]
    unknown = [m for m in args.models if m not in TASKS] + [f for f in args.forms if f not in FORMS and
                                                             f not in DENSE_FORMS]
    if unknown:
        p.error(f"unknown model or form: {', '.join(unknown)}")
    if min(args.seeds, args.log_every, args.threads, args.steps or 1) < 1:
        p.error("--seeds, --steps, --log-every and --threads must be >= 1")
    if "bnb_adam8bit" in args.forms and bnb is None:
        p.error(f"bnb_adam8bit: bitsandbytes does not import ({args.bitsandbytes})")
    args.bitsandbytes = bnb.__version__ if bnb else args.bitsandbytes
    return args


def task_config(task):
    return {"metric": metric_name(task), **{k: getattr(task, k) for k in dir(task) if not k.startswith("_") and
                                            isinstance(getattr(task, k), (int, float, str, tuple))}}


def run_model(task, args):
    steps = args.steps or task.steps
    task.steps = steps
    pool = task.pool(steps * task.batch)
    runs = {form: [] for form in args.forms}
    for seed in range(args.seeds):
        data, initial = seeded_data(pool, seed, steps, task.batch), initial_state(task, seed)
        for form in args.forms:
            r = train(task, form, seed, data, initial, steps, args.log_every, args.kg_diagnostics)
            log(f"{task.name} seed {seed} {form}: {metric_name(task)} {r['metric']:.4f}, loss {r['final_loss']:.4f}"
                f"{' DIVERGED' if r['diverged'] else ''} ({r['train_s']:.1f} s)")
            runs[form].append(r)
    results = {}
    for form in sorted(args.forms, key=lambda f: (f != REFERENCE, f != "torch_adam")):  # references first
        ref = reference_of(form, args.forms)
        results[form] = summarize(runs[form], results.get(ref), ref)
    return {form: results[form] for form in args.forms}


def main(argv=None):
    t0 = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hostembed.set_num_threads(args.threads)
    if "bnb_adam8bit" not in args.forms:
        log(f"bnb_adam8bit not run (bitsandbytes: {args.bitsandbytes})")
    for name in [m for m in args.models if getattr(TASKS[m], "unavailable", None)]:
        log(f"{name} skipped: {TASKS[name].unavailable}")
        args.models.remove(name)
    models = {name: run_model(TASKS[name], args) for name in args.models}
    report = {"benchmark": "state_quality", "date": datetime.datetime.now().astimezone().isoformat(),
              "machine": machine_info(threads=args.threads, bitsandbytes=args.bitsandbytes),
              "config": vars(args), "min_tolerance": MIN_TOLERANCE,
              "tasks": {name: task_config(TASKS[name]) for name in args.models},
              "models": models}
    for name in args.models:
        print_table(name, TASKS[name], models[name], range(args.seeds))
    paths, note = write_plots(os.path.dirname(os.path.abspath(args.out_png)),
                              {os.path.basename(args.out_png): plot(report)}) if models else ([], "no model ran")
    report["wall_s"] = time.perf_counter() - t0
    write_json(args.out_json, report)
    print(f"\nWall time {report['wall_s']:.0f} s. JSON: {args.out_json}. " + (f"Plot: {paths[0]}" if paths else note))


if __name__ == "__main__":
    main()
