"""How much faster is training if nn.Embedding becomes hostembed.Embedding, and what does it cost in memory?

The workload is collaborative filtering with user and item tables too big
for the GPU (the PyTorch forum thread behind this project: CPU embeddings +
Adam at 5 s/iteration, CPU + SparseAdam at 15 it/s, GPU + SparseAdam at 90
it/s). The model scores an interaction as <u, i> / sqrt(D) + MLP([u, i]) and
trains on binary cross-entropy. The dense part runs on the output device
(the GPU if there is one, else the CPU) and is trained by torch.optim.Adam
in every case. The contenders differ only in the tables:

  1. torch nn.Embedding on the CPU + torch.optim.Adam (dense); fewer steps,
     and skipped where its dense gradients and Adam state would not fit in RAM
  2. torch nn.Embedding(sparse=True) on the CPU + torch.optim.SparseAdam
  3. torch nn.Embedding(sparse=True) on the GPU + torch.optim.SparseAdam,
     where there is a GPU and the tables and their state fit in its memory
  4. hostembed.Embedding + hostembed.SparseAdam
  5. the same with SparseAdam(fused=True): the tables' update runs in
     backward, with no weight.grad
  6. torch nn.Embedding on the CPU + torch.optim.Adam(fused=True) (dense):
     torch's fastest dense Adam
  7. hostembed.Embedding + torch.optim.Adam: the plain swap with the dense
     optimizer kept; hostembed steps the tables over every row without a
     dense gradient, with torch's results
  8. hostembed.Embedding(cache_rows=...) + SparseAdam(fused=True), with GPU
     outputs: a row cache in GPU memory of --cache-fraction of each
     table's rows, the rest in host memory

Every contender starts from the same weights and trains on the same
batches. Contenders 2-5 and 8 (SparseAdam) must follow the same loss curve to
float rounding, and so must 1, 6 and 7 (dense Adam, fewer steps), or the
script fails without reporting timings.

The plots carry the run's date and machine in their titles, and the JSON
holds everything they are drawn from: --plot-from JSON draws them again
from a run's JSON (no training), so a plot shown beside a table is that
run's.

Usage (after `pip install .`, or an in-place build with PYTHONPATH=python):
    python benchmarks/compare.py [--size default|large|tiny] [--users N --dim D ...]
    python benchmarks/compare.py --plot-from RUN.json --out benchmarks/figures
"""
import argparse
import functools
import gc
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from _common import (DENSE_ADAM_WARMUP, GIB, RESULTS_DIR, OtherLoad, PeakRss, ZipfIds, fail, fmt_gib, fmt_ms, log,
                     machine_info, mem_available_bytes, progress, require_hostembed, summarize_ms, synchronize,
                     usable_cpus, write_json, write_plots)

hostembed = require_hostembed()

# Every size parameter of a preset is also a command-line option that overrides it.
PRESETS = {
    # Seconds: for trying the script out, not for judging anything.
    "tiny": dict(users=200_000, items=50_000, dim=32, hidden=32, batch=4_096, steps=30, warmup=2, adam_steps=2),
    # A 2-core, 24 GB laptop-sized machine, under 3 minutes in all: 1.2 GiB of
    # tables, 7.7 GB for dense Adam.
    "default": dict(users=4_000_000, items=1_000_000, dim=64, hidden=64, batch=16_384, steps=200, warmup=5,
                    adam_steps=3),
    # A GPU box: 64M rows x 128 = 30.5 GiB of tables, 91.6 GiB with SparseAdam
    # state (more than an 80 GB GPU holds) and ~183 GiB for dense Adam.
    "large": dict(users=40_000_000, items=24_000_000, dim=128, hidden=256, batch=65_536, steps=100, warmup=5,
                  adam_steps=2),
}

LABEL_RANK = 8  # rank of the hidden model the labels come from

# Memory each contender needs per table element (fp32), to skip what cannot fit.
SPARSE_ADAM_BYTES = 12  # weight, exp_avg, exp_avg_sq (hostembed's moments are lazy, but
                        # with huge pages most of them become resident anyway)
DENSE_ADAM_BYTES = 24   # + the dense gradient and the two table-sized temporaries of
                        # torch's single-tensor Adam (sqrt, then the division): cpu_step.py
                        # measured 6.1 GiB at peak for a 1 GiB table
HOST_HEADROOM = GIB     # the rest of the process: batches, MLP, scratch buffers
GPU_HEADROOM = GIB      # activations, the sparse gradient, allocator slack

# Contenders 2-5 compute the same function of the same inputs; they differ
# only by float32 rounding: the order in which duplicate ids' gradient rows
# are summed, and torch's vectorised CPU sqrt, 1 ulp off for ~20% of inputs
# (hostembed's is correctly rounded). The MLP uses SiLU, not ReLU, so that
# such differences stay at rounding level: with ReLU, a pre-activation within
# rounding of 0 flips a unit and changes one sample's gradient by ~15%, and
# the trajectories drift apart (measured on a 400k-user version of this
# workload: a 1e-3 weight difference by step 100). With SiLU we measured,
# over 200 steps, at most 2e-7 relative difference in the loss and 5e-7 in
# any trained weight (|w| ~ 1). The tolerances leave a margin of 20x (weights,
# absolute) to 500x (loss) for other CPUs, GPUs and kernels. Yet a skipped
# update of one table, or a learning rate 1% off, moves the loss past them
# within 30 steps of --size tiny, and a gradient that drops one row per step
# leaves trained weights past them (all three tried).
LOSS_RTOL = 1e-4                        # on every step's loss
WEIGHT_RTOL, WEIGHT_ATOL = 1e-4, 1e-5   # on the trained rows after the last step


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, but not the None of options a preset fills in."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def preset_help(what, key):
    return f"{what} (preset: " + ", ".join(f"{name} {sizes[key]:,}" for name, sizes in PRESETS.items()) + ")"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--size", choices=sorted(PRESETS), default="default",
                   help="preset for the size options below; each option given overrides it")
    p.add_argument("--users", type=int, help=preset_help("rows of the user table", "users"))
    p.add_argument("--items", type=int, help=preset_help("rows of the item table", "items"))
    p.add_argument("--dim", type=int, help=preset_help("embedding dim D", "dim"))
    p.add_argument("--hidden", type=int, help=preset_help("hidden units of the MLP", "hidden"))
    p.add_argument("--batch", type=int, help=preset_help("interactions per batch", "batch"))
    p.add_argument("--steps", type=int, help=preset_help("timed steps (sparse contenders)", "steps"))
    p.add_argument("--warmup", type=int, help=preset_help(
        "untimed steps first (>= 1: the first allocates the optimizer state)", "warmup"))
    p.add_argument("--adam-steps", type=int, help=preset_help(
        f"timed steps of dense Adam, after {DENSE_ADAM_WARMUP} untimed; 0 skips it", "adam_steps"))
    p.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent of users and items")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of every optimizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch and hostembed threads")
    p.add_argument("--cache-fraction", type=float, default=0.2,
                   help="contender 8: rows of each table its GPU row cache holds, as a fraction")
    p.add_argument("--device", default="auto", help="output device: auto (cuda if available, else cpu), cpu, cuda[:N]")
    p.add_argument("--out", default=RESULTS_DIR, help="directory for the JSON and the plots")
    p.add_argument("--plot-from", metavar="JSON",
                   help="no run: draw the plots of the run this JSON of compare.py holds into --out")
    args = p.parse_args(argv)
    if args.plot_from is not None:
        return args
    for key, value in PRESETS[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.users, args.items, args.dim, args.hidden, args.batch, args.steps, args.warmup, args.threads) < 1:
        p.error("--users, --items, --dim, --hidden, --batch, --steps, --warmup and --threads must be >= 1")
    if args.adam_steps < 0:
        p.error("--adam-steps must be >= 0")
    if not 0 < args.cache_fraction <= 1:
        p.error("--cache-fraction must be in (0, 1]")
    try:
        args.device = output_device(args.device)
    except (RuntimeError, ValueError) as exc:
        p.error(f"--device: {exc}")
    return args


def output_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} asked for, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: only cpu and cuda are supported")
    return device


# --- workload ----------------------------------------------------------------------

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


# --- contenders -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Contender:
    number: int
    key: str
    label: str
    make_table: Callable      # (rows, cfg, out_device) -> embedding module
    table_optimizer: Callable  # torch.optim class over the tables
    on_gpu: bool = False      # tables on out_device (which must be a GPU)
    dense: bool = False       # dense Adam: fewer steps
    host_bytes: int = SPARSE_ADAM_BYTES  # host memory per table element, to skip what cannot fit

    def table_device(self, out_device):
        return out_device if self.on_gpu else torch.device("cpu")

    def steps(self, cfg):
        """(warm-up steps, timed steps)."""
        return (DENSE_ADAM_WARMUP, cfg.adam_steps) if self.dense else (cfg.warmup, cfg.steps)


def _torch_table(rows, cfg, out_device):
    return nn.Embedding(rows, cfg.dim)


def _torch_sparse_table(rows, cfg, out_device):
    return nn.Embedding(rows, cfg.dim, sparse=True)


def _torch_gpu_table(rows, cfg, out_device):
    # Drawn on the CPU and then moved: the CUDA generator would draw other
    # weights, and every contender must start from the same ones.
    return nn.Embedding(rows, cfg.dim, sparse=True).to(out_device)


def _hostembed_table(rows, cfg, out_device):
    return hostembed.Embedding(rows, cfg.dim, device=out_device)


def _hostembed_cached_table(rows, cfg, out_device):
    return hostembed.Embedding(rows, cfg.dim, device=out_device, cache_rows=max(1, int(cfg.cache_fraction * rows)))


TORCH_ADAM = Contender(1, "torch_adam", "torch nn.Embedding (CPU) + torch.optim.Adam (dense)",
                       _torch_table, torch.optim.Adam, dense=True, host_bytes=DENSE_ADAM_BYTES)
TORCH_SPARSE = Contender(2, "torch_sparse_cpu", "torch nn.Embedding(sparse=True) (CPU) + torch.optim.SparseAdam",
                         _torch_sparse_table, torch.optim.SparseAdam)
TORCH_GPU = Contender(3, "torch_sparse_gpu", "torch nn.Embedding(sparse=True) (GPU) + torch.optim.SparseAdam",
                      _torch_gpu_table, torch.optim.SparseAdam, on_gpu=True)
HOSTEMBED = Contender(4, "hostembed", "hostembed.Embedding + hostembed.SparseAdam",
                      _hostembed_table, hostembed.SparseAdam)
HOSTEMBED_FUSED = Contender(5, "hostembed_fused", "hostembed.Embedding + hostembed.SparseAdam(fused=True)",
                            _hostembed_table, functools.partial(hostembed.SparseAdam, fused=True))
TORCH_ADAM_FUSED = Contender(6, "torch_adam_fused", "torch nn.Embedding (CPU) + torch.optim.Adam(fused=True) (dense)",
                             _torch_table, functools.partial(torch.optim.Adam, fused=True), dense=True,
                             host_bytes=DENSE_ADAM_BYTES)
SWAP_ADAM = Contender(7, "hostembed_adam", "hostembed.Embedding + torch.optim.Adam (dense, plain swap)",
                      _hostembed_table, torch.optim.Adam, dense=True)
HOSTEMBED_CACHED = Contender(8, "hostembed_cached",
                             "hostembed.Embedding(cache_rows) + SparseAdam(fused=True), GPU cache",
                             _hostembed_cached_table, functools.partial(hostembed.SparseAdam, fused=True))
CONTENDERS = (TORCH_ADAM, TORCH_SPARSE, TORCH_GPU, HOSTEMBED, HOSTEMBED_FUSED, TORCH_ADAM_FUSED, SWAP_ADAM,
              HOSTEMBED_CACHED)
AGREEING = (TORCH_SPARSE, TORCH_GPU, HOSTEMBED, HOSTEMBED_FUSED, HOSTEMBED_CACHED)  # must follow the same loss curve
DENSE = (TORCH_ADAM, TORCH_ADAM_FUSED, SWAP_ADAM)                # and these the same one of dense Adam


def build(contender, cfg, out_device):
    """The model and its optimizers; tables drawn after the same seed by every contender."""
    torch.manual_seed(cfg.seed)
    users, items = (contender.make_table(rows, cfg, out_device)
                    for rows in progress((cfg.users, cfg.items), f"{contender.key}: table init"))
    model = RecModel(users, items, seeded_mlp(cfg, out_device), contender.table_device(out_device), out_device)
    optimizers = [contender.table_optimizer(model.tables(), lr=cfg.lr),
                  torch.optim.Adam(model.mlp.parameters(), lr=cfg.lr)]
    return model, optimizers


def _host_shortfall(need, what):
    available = mem_available_bytes()
    if available is None or need + HOST_HEADROOM <= available:
        return None
    return f"does not fit in host RAM: {what} need ~{need / GIB:.1f} GiB, {available / GIB:.1f} GiB available"


def skip_reason(contender, cfg, out_device) -> Optional[str]:
    """Why the contender cannot run here, judged just before it would (None: it runs)."""
    elements = (cfg.users + cfg.items) * cfg.dim
    if contender.dense and cfg.adam_steps == 0:
        return "--adam-steps 0"
    if contender is HOSTEMBED_CACHED and out_device.type != "cuda":
        return "a row cache in GPU memory needs GPU outputs"
    if contender.dense:
        gradients = " and dense gradients" if contender.host_bytes > SPARSE_ADAM_BYTES else ""
        return _host_shortfall(contender.host_bytes * elements,
                               f"the tables with Adam state{gradients} ({contender.host_bytes} bytes/element)")
    if not contender.on_gpu:
        return _host_shortfall(SPARSE_ADAM_BYTES * elements,
                               f"the tables with SparseAdam state ({SPARSE_ADAM_BYTES} bytes/element)")
    if out_device.type != "cuda":
        return "no GPU" if not torch.cuda.is_available() else "outputs are on the CPU (--device cpu)"
    need = SPARSE_ADAM_BYTES * elements
    free, total = torch.cuda.mem_get_info(out_device)
    if need + GPU_HEADROOM > free:
        return (f"does not fit in GPU memory: the tables with SparseAdam state need ~{need / GIB:.1f} GiB, "
                f"{free / GIB:.1f} of {total / GIB:.1f} GiB free")
    # Each table is drawn on the CPU before it moves to the GPU.
    return _host_shortfall(4 * max(cfg.users, cfg.items) * cfg.dim, "the largest table, drawn on the CPU,")


# --- running --------------------------------------------------------------------------------

def train_step(model, optimizers, batch):
    """One training step; returns (seconds, loss tensor)."""
    users, items, labels = batch
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    logits = model(users, items)
    loss = F.binary_cross_entropy_with_logits(logits, labels.to(model.out_device))
    loss.backward()
    for opt in optimizers:
        opt.step()
    synchronize(model.out_device)  # GPU work is queued: wait for it before reading the clock
    return time.perf_counter() - t0, loss


def run_steps(model, optimizers, batches, desc):
    seconds, losses = [], []
    for batch in progress(batches, desc):
        s, loss = train_step(model, optimizers, batch)
        seconds.append(s)
        losses.append(loss.item())  # after the clock: on a GPU it waits for the copy
    return seconds, losses


def initial_digest(model, desc, chunk_bytes=64 << 20):
    """SHA-256 of the tables' and the MLP's bytes: every contender must start
    from exactly the same weights, and a digest checks every element without
    keeping a second copy of the tables (~1.8 GB/s here, once per contender)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for table in model.tables():
            rows_per_chunk = max(1, chunk_bytes // (4 * table.shape[1]))
            for start in progress(range(0, table.shape[0], rows_per_chunk), desc):
                digest.update(table[start:start + rows_per_chunk].detach().cpu().contiguous().numpy())
        for p in model.mlp.parameters():
            digest.update(p.detach().cpu().contiguous().numpy())
    return digest.hexdigest()


def probe(model, rows):
    """A CPU copy of the weights the checks compare: the rows of the first
    batch (trained from step 1) of both tables, and the whole MLP."""
    with torch.no_grad():
        parts = [table[ids.to(table.device)] for table, ids in zip(model.tables(), rows)]
        parts += list(model.mlp.parameters())
        return torch.cat([p.detach().reshape(-1).cpu() for p in parts])


def release_memory():
    gc.collect()
    hostembed.empty_cache()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gpu_peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def train(contender, cfg, out_device, batches, peak, probe_rows):
    """Builds, warms up and times one contender. Returns (result, initial digest, final probe)."""
    n_warm, n_timed = contender.steps(cfg)
    log(f"{contender.number}. {contender.label}: {n_warm} warm-up + {n_timed} timed steps")
    gpu_peak_reset(out_device)
    peak.start()
    t0 = time.perf_counter()
    model, optimizers = build(contender, cfg, out_device)
    build_s = time.perf_counter() - t0
    rss_build = peak.window()
    initial = initial_digest(model, f"{contender.key}: initial weights digest")

    # Over warm-up and timed steps: CPU accounting ticks at 10 ms, too coarse for a few steps.
    peak.start()
    other_load = OtherLoad()
    warm_s, warm_losses = run_steps(model, optimizers, batches[:n_warm], f"{contender.key}: warm-up")
    timed_s, timed_losses = run_steps(model, optimizers, batches[n_warm:n_warm + n_timed], f"{contender.key}: timed")
    result = summarize_ms(timed_s)
    result.update(
        label=contender.label, number=contender.number, table_device=str(model.table_device),
        steps_per_s=1e3 / result["median_ms"], warmup_steps=n_warm, timed_steps=n_timed,
        build_s=build_s, first_step_ms=warm_s[0] * 1e3,
        peak_rss_bytes_build=rss_build, peak_rss_bytes_train=peak.window(), peak_gpu_bytes=gpu_peak(out_device),
        final_loss=(warm_losses + timed_losses)[-1], losses=warm_losses + timed_losses,
        step_ms=[s * 1e3 for s in timed_s], cpu_fraction_used_by_others=other_load.fraction(),
    )
    final = probe(model, probe_rows)
    return result, initial, final


def run_contender(contender, cfg, out_device, batches, peak, probe_rows):
    """train() unless the contender cannot run here; frees it before the next one."""
    reason = skip_reason(contender, cfg, out_device)
    if reason is None:
        try:
            return train(contender, cfg, out_device, batches, peak, probe_rows)
        except torch.OutOfMemoryError as exc:
            # The estimate in skip_reason() said it fits; the allocator disagreed.
            reason = f"ran out of memory: {str(exc).splitlines()[0]}"
        finally:
            release_memory()
    log(f"{contender.number}. {contender.label}: skipped: {reason}")
    return {"label": contender.label, "number": contender.number, "skipped": reason}, None, None


def dense_floor(cfg, out_device, batches):
    """ms/step of the same step with no embedding work at all: the floor for
    any table implementation, and the share of the step a faster table cannot win."""
    log("dense part alone (fixed embedding outputs, no tables)")
    torch.manual_seed(cfg.seed + 2)
    model = RecModel(FixedRows(cfg.batch, cfg.dim, out_device), FixedRows(cfg.batch, cfg.dim, out_device),
                     seeded_mlp(cfg, out_device), out_device, out_device)
    optimizers = [torch.optim.Adam(model.mlp.parameters(), lr=cfg.lr)]
    other_load = OtherLoad()
    run_steps(model, optimizers, batches[:cfg.warmup], "dense part: warm-up")
    seconds, _ = run_steps(model, optimizers, batches[cfg.warmup:cfg.warmup + cfg.steps], "dense part: timed")
    del model, optimizers
    release_memory()
    floor = summarize_ms(seconds)
    floor["cpu_fraction_used_by_others"] = other_load.fraction()
    return floor


# --- checks ---------------------------------------------------------------------------------

def check_same_start(contender, initial, reference):
    if reference is not None and initial != reference[1]:
        fail(f"{contender.label} and {reference[0]}, built after the same torch.manual_seed, start from "
             "different weights, so their comparison would mean nothing")


def check_agreement(results, finals, group):
    """Fails loudly unless the contenders of `group` that ran follow the same
    loss curve and end with the same trained weights (to the tolerances above)."""
    ran = [c for c in group if "losses" in results[c.key]]
    if len(ran) < 2:
        numbers = ", ".join(str(c.number) for c in group)
        return {"checked": False, "reason": f"fewer than two of contenders {numbers} ran"}
    ref = ran[0]
    ref_losses = np.array(results[ref.key]["losses"])
    summary = {"checked": True, "reference": ref.key, "loss_rtol": LOSS_RTOL,
               "weight_rtol": WEIGHT_RTOL, "weight_atol": WEIGHT_ATOL, "steps": len(ref_losses), "contenders": {}}
    for c in ran[1:]:
        losses = np.array(results[c.key]["losses"])
        rel = np.abs(losses - ref_losses) / np.abs(ref_losses)
        bad = np.flatnonzero(~(rel <= LOSS_RTOL))  # ~(<=) also catches NaN
        if bad.size:
            k = bad[0]
            fail(f"{c.label} and {ref.label} trained from the same weights on the same batches but their "
                 f"losses differ beyond rtol {LOSS_RTOL:g}: at step {k + 1} {losses[k]:.9g} vs {ref_losses[k]:.9g} "
                 f"(relative difference {rel[k]:.3g}); {bad.size} of {rel.size} steps differ, up to "
                 f"{np.nanmax(rel):.3g}. One of them computes a different update.")
        try:
            torch.testing.assert_close(finals[c.key], finals[ref.key], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
        except AssertionError as err:
            fail(f"after {rel.size} steps, the trained weights of {c.label} differ from {ref.label}'s "
                 f"(rows of the first batch, then the MLP, flattened):\n{err}")
        summary["contenders"][c.key] = {
            "loss_max_rel_diff": float(rel.max()),
            "weight_max_abs_diff": (finals[c.key] - finals[ref.key]).abs().max().item(),
            "weights_bitwise_equal": torch.equal(finals[c.key], finals[ref.key]),
        }
    return summary


# --- report ---------------------------------------------------------------------------------

def add_speedups(results):
    base = results[TORCH_SPARSE.key].get("median_ms")
    for r in results.values():
        if "median_ms" in r:
            r["speedup_vs_torch_sparse_cpu"] = base / r["median_ms"] if base else None


NOISY_LOAD = 0.05  # others' share of the CPUs above which a run's timings are called noisy


def _load(fraction):
    return "an unknown share" if fraction is None else f"{fraction:.0%}"


def timing_notes(results, floor):
    """Notes on figures that do not mean what they seem to: a contender
    below the dense part alone (a floor no table can beat: measurement
    noise) and the fused contender slower than the unfused one. Each names
    the other processes' share of the CPUs while the figures were taken."""
    notes = []
    floor_ms = floor.get("median_ms") if floor else None
    for c in CONTENDERS:
        r = results.get(c.key, {})
        if floor_ms is None or "median_ms" not in r or r["median_ms"] >= floor_ms:
            continue
        notes.append(
            f"Note: {c.number}. took {fmt_ms(r['median_ms'])} ms a step, {fmt_ms(floor_ms - r['median_ms'])} ms "
            f"less than the dense part alone ({fmt_ms(floor_ms)} ms), which does all of its work but the tables': "
            f"measurement noise, not a gain. Other processes used {_load(r.get('cpu_fraction_used_by_others'))} "
            f"of the CPUs while it ran and {_load(floor.get('cpu_fraction_used_by_others'))} while the floor ran; "
            "its step time beyond the floor is not a figure to quote.")
    plain, fused = results.get(HOSTEMBED.key, {}), results.get(HOSTEMBED_FUSED.key, {})
    if "median_ms" in plain and "median_ms" in fused and fused["median_ms"] > plain["median_ms"]:
        loads = [r.get("cpu_fraction_used_by_others") for r in (plain, fused)]
        note = (f"Note: {HOSTEMBED_FUSED.number}. (fused) took {fmt_ms(fused['median_ms'])} ms a step against "
                f"{fmt_ms(plain['median_ms'])} for {HOSTEMBED.number}. (unfused), "
                f"{fused['median_ms'] / plain['median_ms']:.2f}x its time. Other processes used {_load(loads[0])} "
                f"of the CPUs during {HOSTEMBED.number}. and {_load(loads[1])} during {HOSTEMBED_FUSED.number}.; ")
        if all(x is not None and x <= NOISY_LOAD for x in loads):
            note += ("that is little, so the difference is this machine's, not noise: fusing does not pay here "
                     "for this workload.")
        else:
            note += ("the contenders run one after another, so other load can account for the difference: "
                     "rerun on an idle machine (or time both in interleaved rounds, as cpu_step.py does) before "
                     "concluding that fusing does not pay here.")
        notes.append(note)
    return notes


def run_date(report, json_path=None):
    """The run's date: the one its JSON records, else a YYYY-MM-DD in the
    JSON's path (runs kept before the JSON held a date), else None."""
    if report.get("date"):
        return report["date"]
    found = re.findall(r"\d{4}-\d{2}-\d{2}", json_path or "")
    return found[-1] if found else None


def run_label(report, date):
    """The run's date and machine, for the plots' titles."""
    m = report.get("machine", {})
    cpus = f"{m.get('usable_cpus', '?')} CPUs ({m.get('cpu_model', 'unknown CPU')})"
    gpu = m.get("gpu")
    where = f"{gpu['name']} + {cpus}" if gpu else cpus
    return (f"{date or 'date not recorded'}, {where}, torch {m.get('torch', '?')}, "
            f"outputs on {m.get('output_device', '?')}")


def print_report(cfg, report, json_path, plots, plots_note):
    results, wl = report["contenders"], report["workload"]
    out = report["machine"]["output_device"]
    print("## Collaborative-filtering training step: torch nn.Embedding vs hostembed.Embedding\n")
    print(f"users {cfg.users:,} x {cfg.dim}, items {cfg.items:,} x {cfg.dim} "
          f"({fmt_gib(4 * (cfg.users + cfg.items) * cfg.dim)} of fp32 tables); batch {cfg.batch:,} interactions, "
          f"Zipf({cfg.alpha}) ids (mean {wl['unique_users_per_batch_mean']:,.0f} unique users, "
          f"{wl['unique_items_per_batch_mean']:,.0f} unique items); MLP {2 * cfg.dim}-{cfg.hidden}-1 on {out}; "
          f"lr {cfg.lr:g}; {cfg.threads} threads; size preset '{cfg.size}'\n")
    print("| contender | ms/step | steps/s | speedup vs 2. | peak RSS | peak GPU mem | final loss (step) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in CONTENDERS:
        r = results[c.key]
        if "skipped" in r:
            print(f"| {c.number}. {c.label} | skipped: {r['skipped']} | | | | | |")
            continue
        speedup = r.get("speedup_vs_torch_sparse_cpu")
        print(f"| {c.number}. {c.label} | {fmt_ms(r['median_ms'])} | {r['steps_per_s']:.2f} "
              f"| {'n/a' if speedup is None else f'{speedup:.2f}x'} | {fmt_gib(r['peak_rss_bytes_train'])} "
              f"| {fmt_gib(r['peak_gpu_bytes'])} | {r['final_loss']:.4f} ({len(r['losses'])}) |")

    print(f"\nms/step: median of the timed steps, after {cfg.warmup} untimed (dense Adam: {cfg.adam_steps} timed "
          f"after {DENSE_ADAM_WARMUP}); a step is forward, BCE loss, backward and both optimizers. Peak RSS: the "
          "process's peak while the contender trained. Final loss: on the last training batch, after that many "
          "steps; the curves are in the JSON and the plot.")
    floor = report["dense_floor"]["median_ms"]
    beyond = ", ".join(f"{c.number}. {fmt_ms(results[c.key]['median_ms'] - floor)}"
                       for c in CONTENDERS if "median_ms" in results[c.key]) or "no contender ran"
    print(f"\nDense part alone (MLP, loss and Adam on fixed embedding outputs): {fmt_ms(floor)} ms/step, a floor "
          f"no table can beat. Step time beyond it, ms: {beyond}.")
    for note in report.get("notes", ()):
        print(note)
    for agree in (report["agreement"], report["dense_agreement"]):
        if not agree["checked"]:
            print(f"Agreement: not checked ({agree['reason']}).")
            continue
        ref = results[agree["reference"]]
        for key, a in agree["contenders"].items():
            print(f"Agreement: {results[key]['number']}. matches {ref['number']}.'s loss at all {agree['steps']} "
                  f"steps (max relative difference {a['loss_max_rel_diff']:.2g}, tolerance {LOSS_RTOL:g}); "
                  f"trained weights max abs difference {a['weight_max_abs_diff']:.2g}.")
    print("1., 6. and 7. use dense Adam, a different optimizer from 2.-5.'s SparseAdam: they are compared with "
          "each other.")
    others = report["other_load"]["cpu_fraction_used_by_others"]
    if others is not None and others > NOISY_LOAD:
        print(f"Other processes used {others:.0%} of the CPUs during the run: timings are noisy, rerun on an idle machine.")
    print(f"\nWall time {report['wall_s']:.0f} s. JSON: {json_path}")
    print(f"Plots: {', '.join(plots)}" if plots else plots_note)


def plot_ms_per_step(cfg, results, floor_ms, run):
    # .get: the JSON of an older run (--plot-from) may not know every contender.
    ran = [c for c in CONTENDERS if "median_ms" in results.get(c.key, {})]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(ran)))
        ms = [results[c.key]["median_ms"] for c in ran]
        fraction = getattr(cfg, "cache_fraction", None)  # absent from the JSON of runs before contender 8
        cached = "" if fraction is None else f" ({fraction:.0%} of the rows)"
        ax.barh([f"{c.number}. {c.label}" + (cached if c is HOSTEMBED_CACHED else "") for c in ran], ms,
                color="tab:blue")
        for y, v in enumerate(ms):
            ax.text(v, y, f" {fmt_ms(v)} ms", va="center")
        ax.axvline(floor_ms, color="gray", linestyle="--", label=f"dense part alone ({fmt_ms(floor_ms)} ms)")
        ax.set_xscale("log")
        ax.set_xlim(right=max(ms) * 4)
        ax.invert_yaxis()
        ax.set_xlabel("ms per training step (median, log scale)")
        ax.set_title(f"{run}\nusers {cfg.users:,} + items {cfg.items:,} rows x {cfg.dim}, batch {cfg.batch:,}",
                     fontsize=10)
        ax.legend(loc="lower right")
        skipped = [f"{c.number}. skipped: {results[c.key]['skipped']}" for c in CONTENDERS
                   if "skipped" in results.get(c.key, {})]
        if skipped:
            fig.text(0.01, -0.02, "\n".join(skipped), fontsize=8, va="top")
        return fig
    return draw


def plot_losses(cfg, results, agreement, run):
    ran = [c for c in CONTENDERS if "losses" in results.get(c.key, {})]
    agreeing = ", ".join(f"{c.number}." for c in AGREEING if c in ran)
    styles = {1: ("tab:red", "-", "o"), 2: ("tab:orange", "-", None), 3: ("tab:green", "--", None),
              4: ("tab:blue", ":", None), 5: ("tab:purple", "-.", None), 6: ("tab:brown", "-", "s"),
              7: ("tab:cyan", ":", "^"), 8: ("tab:olive", "--", "x")}

    def draw(plt):
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(2, 1))
        for c in ran:
            color, line, marker = styles[c.number]
            losses = results[c.key]["losses"]
            top.plot(range(1, len(losses) + 1), losses, color=color, linestyle=line, marker=marker,
                     label=f"{c.number}. {c.label}")
        top.set_ylabel("BCE loss (training batch)")
        top.legend(fontsize=8)
        top.set_title(f"{run}\nSame start, same batches: SparseAdam's {agreeing} must overlap", fontsize=10)
        if agreement["checked"]:
            ref = np.array(results[agreement["reference"]]["losses"])
            for key in agreement["contenders"]:
                c = next(c for c in CONTENDERS if c.key == key)
                rel = np.abs(np.array(results[key]["losses"]) - ref) / np.abs(ref)
                # Equal losses have no place on a log axis: draw them at the bottom.
                bottom.plot(range(1, rel.size + 1), np.maximum(rel, 1e-10), color=styles[c.number][0],
                            label=f"{c.number}. vs {results[agreement['reference']]['number']}.")
            bottom.axhline(LOSS_RTOL, color="gray", linestyle="--", label="tolerance")
            bottom.set_yscale("log")
            bottom.legend(fontsize=8)
        bottom.set_ylabel("relative loss difference\n(equal: drawn at 1e-10)")
        bottom.set_xlabel("step")
        return fig
    return draw


def run_contenders(cfg, out_device, batches, peak):
    """Runs every contender; returns (results by key, agreement summary)."""
    probe_rows = [torch.unique(ids) for ids in batches[0][:2]]
    results, finals, reference = {}, {}, None

    def run(c):
        nonlocal reference
        results[c.key], initial, finals[c.key] = run_contender(c, cfg, out_device, batches, peak, probe_rows)
        if initial is not None:
            check_same_start(c, initial, reference)
            reference = reference or (c.label, initial)

    # The sparse contenders first, checked against each other before the
    # slow dense Adam: a wrong answer fails fast.
    for c in AGREEING:
        run(c)
    agreement = check_agreement(results, finals, AGREEING)
    for c in DENSE:
        run(c)
    dense_agreement = check_agreement(results, finals, DENSE)
    add_speedups(results)
    return results, agreement, dense_agreement


# --- main --------------------------------------------------------------------------------

def draw_plots(cfg, report, out_dir, run):
    """The run's plots (ms per step, loss curves) from its report, titled
    with `run` (its date and machine); (paths written, note)."""
    results = report["contenders"]
    ran = any("median_ms" in r for r in results.values())
    stem = f"compare_{cfg.size}"
    plots, note = write_plots(out_dir, {
        f"{stem}_ms_per_step.png": plot_ms_per_step(cfg, results, report["dense_floor"]["median_ms"], run),
        f"{stem}_loss.png": plot_losses(cfg, results, report["agreement"], run),
    } if ran else {})
    return plots, note or ("" if ran else "plots skipped: no contender ran")


def plot_from(json_path, out_dir):
    """--plot-from: the plots of a run already made, from its JSON."""
    with open(json_path) as f:
        report = json.load(f)
    if report.get("benchmark") != "compare":
        sys.exit(f"{json_path} is not a JSON of compare.py (benchmark: {report.get('benchmark')!r})")
    cfg = argparse.Namespace(**report["config"])
    date = run_date(report, os.path.abspath(json_path))
    if not report.get("date"):
        log(f"{json_path} records no date; " + (f"the date in its path, {date}, titles the plots" if date else
                                                 "the plots say the date was not recorded"))
    plots, note = draw_plots(cfg, report, out_dir, run_label(report, date))
    for line in timing_notes(report["contenders"], report["dense_floor"]):
        print(line)
    print(f"Plots: {', '.join(plots)}" if plots else note)


def main(argv=None):
    wall_t0 = time.perf_counter()
    cfg = parse_args(argv)
    if cfg.plot_from is not None:
        return plot_from(cfg.plot_from, cfg.out)
    date = time.strftime("%Y-%m-%d")
    out_device = cfg.device
    if out_device.type == "cuda" and out_device.index is not None:
        torch.cuda.set_device(out_device)
    torch.set_num_threads(cfg.threads)
    hostembed.set_num_threads(cfg.threads)
    peak, other_load = PeakRss(), OtherLoad()

    count = max(cfg.warmup + cfg.steps, DENSE_ADAM_WARMUP + cfg.adam_steps)
    log(f"generating {count} batches of {cfg.batch:,} interactions")
    batches = make_batches(cfg, count)

    results, agreement, dense_agreement = run_contenders(cfg, out_device, batches, peak)
    floor = dense_floor(cfg, out_device, batches)

    report = {
        "benchmark": "compare",
        "date": date,
        "machine": machine_info(threads=cfg.threads, torch_threads=torch.get_num_threads(),
                                hostembed_threads=hostembed.get_num_threads(), output_device=str(out_device)),
        "config": {k: (str(v) if k == "device" else v) for k, v in vars(cfg).items()},
        "workload": workload_stats(batches[:cfg.warmup + cfg.steps]),
        "contenders": {c.key: results[c.key] for c in CONTENDERS},
        "dense_floor": floor,
        "agreement": agreement,
        "dense_agreement": dense_agreement,
        "other_load": {"loadavg_before": other_load.loadavg_before,
                       "cpu_fraction_used_by_others": other_load.fraction()},
    }
    peak.window()  # folds the last window into peak.overall
    report["peak_rss_bytes"] = peak.overall
    report["notes"] = timing_notes(results, floor)
    stem = f"compare_{cfg.size}"
    ran = any("median_ms" in r for r in results.values())
    plots, plots_note = draw_plots(cfg, report, cfg.out, run_label(report, report["date"]))
    report["plots"] = plots or plots_note
    report["wall_s"] = time.perf_counter() - wall_t0
    json_path = os.path.join(cfg.out, f"{stem}.json")
    write_json(json_path, report)
    print_report(cfg, report, json_path, plots, plots_note)
    if not ran:
        sys.exit("nothing was measured: every contender was skipped here (the table says why)")


if __name__ == "__main__":
    main()
