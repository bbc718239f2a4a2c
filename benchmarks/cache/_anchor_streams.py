"""The id streams of the published cache benchmarks, read from their code,
and of hostembed's own reference stream; each returns a Workload.

dynamicemb (NVIDIA recsys-examples, corelib/dynamicemb/benchmark/
benchmark_batched_dynamicemb_tables.py, the caching suite): 10 tables of
26,843,545 rows, D=128 float32, 104,857 ids a table a step (sequence
lookups, no pooling), each table's ids drawn on their own from a continuous
power law on [1, rows) with alpha 1.05 (inverse CDF, truncated to an
integer; id 1 the hottest, no hashing); 100 batches drawn once; one pass
over them untimed, then the timed pass over the same 100 with the cache
kept; Adam (lr 0.1); the cache a fraction ("cfr") of the distinct rows each
table's 100 batches touch; mean ms of forward + backward (the update fused
in backward). Here each table's ids are renumbered to the rows its 100
batches touch, in a random order (hot rows scattered as a hash would), and
the 10 tables folded into one table of their touched rows, with one cache
of cfr x those rows: every lookup and the cache's working set stay the
same, and the table fits host memory (19.6M rows at full size, not 268M).
One cache over the folded tables instead of one a table: the tables' ids
are drawn alike, so each gets about its share.

fbgemm (pytorch/FBGEMM, fbgemm_gpu/bench/tbe/
split_table_batched_embeddings_benchmark.py, the `cache` command): 32
tables of 100,000 rows, D=128 float32, batches of 512 bags of 20 ids a
table, pooled by sum; 2 x 100 batches, the first 100 warm-up, the last 100
timed; each id a draw of Zipf(alpha) over 1, 2, ... (alpha 1.15, the value
its help recommends for training; its default, 1.0, means uniform ids),
minus one, modulo the rows; each bag keeps the first 20 distinct of 60
draws, sorted; one random injective map of the ranks into the rows, shared
by every table; then 10% of each table's positions copied from the previous
batch (reuse 0.1); exact row-wise Adagrad fused in backward; one LRU cache
of 0.2 x all rows. Here the tables are folded into one table (table t's
rows at t x 100,000), bags of a fixed 20 as one EmbeddingBag; a bag with
fewer than 20 distinct of its 60 draws is drawn again (FBGEMM falls back
to uniform ids for the whole batch; at alpha 1.15 neither happens in
practice). Its warm-up steps train (FBGEMM's are forward-only).

fresh / replayed: hostembed's reference stream (benchmarks/gpu/cache_step.py
before the protocols): one table of 60M rows, D=128, 1,048,570 ids a step,
bounded Zipf(1.05) over ranks scattered by a random permutation; "fresh"
draws a new batch every step (what training does), "replayed" cycles 10
batches.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from _common import ZipfIds


@dataclass
class Workload:
    protocol: str
    rows: int               # rows of the (folded) table
    dim: int
    batches: list           # id tensors on the device, one a distinct batch
    warmup: list            # indices into batches: untimed steps
    timed: list             # indices into batches: the timed steps
    after: int = 0          # index of the batch that would come next (planned ahead by the last timed step)
    bag_size: int = 0       # 0: Embedding (one row an id); > 0: EmbeddingBag of fixed-size sum bags
    optimizer: str = "adam"
    lr: float = 1e-3
    notes: dict = field(default_factory=dict)
    # Rows, most probable first, where the generator's law says (FBGEMM's:
    # its rank -> row map, tables folded); None where it does not.
    hottest: object = None


def _scaled(n, scale):
    return max(1, int(round(n * scale)))


def powerlaw_ids(rows, alpha, n, generator, device):
    """n ids from the continuous power law on [1, rows) by inverse CDF,
    truncated to integers in [1, rows - 1] (dynamicemb's draw)."""
    u = torch.rand(n, dtype=torch.float64, generator=generator, device=device)
    e = 1.0 - alpha
    y = ((float(rows) ** e - 1.0) * u + 1.0) ** (1.0 / e)
    return y.clamp_(max=rows - 1).long()


def dynamicemb(scale=1.0, batches=100, tables=10, alpha=1.05, seed=0, device="cpu"):
    rows, per_table = _scaled(26_843_545, scale), _scaled(104_857, scale)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    folded, offset = [], 0
    for _ in range(tables):
        ids = powerlaw_ids(rows, alpha, batches * per_table, gen, device)
        touched, inverse = torch.unique(ids, return_inverse=True)
        scatter = torch.randperm(touched.numel(), generator=gen, device=device)
        folded.append((scatter[inverse] + offset).view(batches, per_table))
        offset += touched.numel()
        del ids, inverse, scatter
    stream = [torch.cat([t[i] for t in folded]) for i in range(batches)]
    del folded
    unique = float(np.mean([torch.unique(b).numel() for b in stream]))
    return Workload("dynamicemb", offset, 128, stream, warmup=list(range(batches)), timed=list(range(batches)),
                    after=0, optimizer="adam", lr=0.1,
                    notes={"tables": tables, "rows_per_table": rows, "ids_per_table": per_table, "alpha": alpha,
                           "touched_rows": offset, "unique_per_step": unique})


def zipf_unbounded(alpha, shape, generator, device):
    """Zipf(alpha) draws over 1, 2, ... as float64 (rejection sampling,
    Devroye's method; values past 2^53 are inexact, which their use modulo
    the rows does not notice)."""
    am1 = alpha - 1.0
    b = 2.0 ** am1
    n = int(np.prod(shape))
    out = torch.empty(n, dtype=torch.float64, device=device)
    filled = 0
    while filled < n:
        want = int((n - filled) * 1.3) + 64
        u = 1.0 - torch.rand(want, dtype=torch.float64, generator=generator, device=device)
        v = torch.rand(want, dtype=torch.float64, generator=generator, device=device)
        x = torch.floor(u ** (-1.0 / am1))
        t = (1.0 + 1.0 / x) ** am1
        ok = (v * x * (t - 1.0) / (b - 1.0) <= t / b) & torch.isfinite(x)
        x = x[ok][: n - filled]
        out[filled:filled + x.numel()] = x
        filled += x.numel()
    return out.view(shape)


def _distinct_bags(rows, alpha, bags, bag_size, generator, device):
    """[bags, bag_size] ranks in [0, rows): each bag the first bag_size
    distinct of 3 x bag_size Zipf draws (minus one, modulo rows), sorted."""
    out = torch.empty(bags, bag_size, dtype=torch.long, device=device)
    todo = torch.arange(bags, device=device)
    while todo.numel():
        draws = torch.fmod(zipf_unbounded(alpha, (todo.numel(), 3 * bag_size), generator, device) - 1.0,
                           float(rows)).long()
        ordered, where = torch.sort(draws, dim=1, stable=True)
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        is_first = torch.zeros_like(first).scatter_(1, where, first)
        keep = is_first & (is_first.cumsum(1) <= bag_size)
        enough = keep.sum(1) == bag_size
        picked = draws[enough][keep[enough]].view(-1, bag_size)
        out[todo[enough]] = picked.sort(dim=1).values
        todo = todo[~enough]
    return out


def fbgemm(scale=1.0, iters=100, tables=32, alpha=1.15, reuse=0.1, bag_size=20, seed=0, device="cpu"):
    rows, batch = _scaled(100_000, scale), _scaled(512, scale)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    rank_to_row = torch.randperm(rows, generator=gen, device=device)
    per_table = batch * bag_size
    copied = int(per_table * reuse)
    offsets = (torch.arange(tables, device=device) * rows).repeat_interleave(per_table)
    stream, previous = [], None
    for _ in range(2 * iters):
        ids = rank_to_row[_distinct_bags(rows, alpha, tables * batch, bag_size, gen, device)].view(tables, per_table)
        if previous is not None:
            for t in range(tables):
                pos = torch.randperm(per_table, generator=gen, device=device)[:copied]
                ids[t, pos] = previous[t, pos]
        previous = ids
        stream.append(ids.reshape(-1) + offsets)
    unique = float(np.mean([torch.unique(b).numel() for b in stream[iters:]]))
    return Workload("fbgemm", tables * rows, 128, stream, warmup=list(range(iters)),
                    timed=list(range(iters, 2 * iters)), after=0, bag_size=bag_size,
                    optimizer="rowwise_adagrad", lr=0.01,
                    notes={"tables": tables, "rows_per_table": rows, "bags_per_table": batch, "bag_size": bag_size,
                           "alpha": alpha, "reuse": reuse, "unique_per_step": unique},
                    # A rank's mass, summed over the tables, falls with it.
                    hottest=(rank_to_row.cpu()[:, None] + torch.arange(tables)[None, :] * rows).reshape(-1))


def reference(protocol, scale=1.0, warmup=10, steps=20, stream=10, alpha=1.05, seed=0, device="cpu"):
    """hostembed's reference stream, fresh or replayed (the draws of
    benchmarks/gpu/cache_step.py before the protocols, for comparison with its
    earlier figures)."""
    rows, batch = _scaled(60_000_000, scale), _scaled(1_048_570, scale)
    draw = ZipfIds(rows, alpha, np.random.default_rng(seed))
    count = warmup + steps + 1  # the last for the last timed step to plan ahead
    distinct = stream if protocol == "replayed" else count
    batches = [draw.draw(batch).to(device) for _ in range(distinct)]
    order = [i % distinct for i in range(count)]
    unique = float(np.mean([torch.unique(batches[i]).numel() for i in order[warmup:-1]]))
    return Workload(protocol, rows, 128, batches, warmup=order[:warmup], timed=order[warmup:-1], after=order[-1],
                    optimizer="adam",
                    notes={"alpha": alpha, "ids_per_step": batch, "distinct_batches": distinct,
                           "unique_per_step": unique})
