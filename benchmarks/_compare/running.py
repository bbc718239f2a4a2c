"""compare.py's runs: each contender trained and timed on the same batches,
the dense part alone (the floor), and the checks that the contenders that
must agree do, before any timing is reported."""
import gc
import hashlib
import time

import numpy as np
import torch
import torch.nn.functional as F

from _common import OtherLoad, fail, log, progress, require_hostembed, summarize_ms, synchronize

from .contenders import AGREEING, DENSE, TORCH_SPARSE, build, skip_reason
from .workload import FixedRows, RecModel, seeded_mlp

hostembed = require_hostembed()

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


def add_speedups(results):
    base = results[TORCH_SPARSE.key].get("median_ms")
    for r in results.values():
        if "median_ms" in r:
            r["speedup_vs_torch_sparse_cpu"] = base / r["median_ms"] if base else None


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
