"""benchmarks/gpu/cache_step.py's check before timing, apart from the
protocols it runs on: a table with a row cache of each timed size must
train to the bits of the same table without one (every step's output,
then the weight and every optimizer state entry), or the run ends before
anything is timed. cache_step.check_bits draws the protocol's stream and
says how to build its table; this trains and compares."""
import gc

import torch

from _common import fail, log


def training_state(module, opt):
    """{name: value} of everything training leaves behind: the weight and
    each optimizer state entry (tensors and numbers alike), as host memory
    holds them once the cache has written back: state_dict() and reading
    the weight flush it, as a user's checkpoint would."""
    # The weight first: a difference is reported in the first entry that
    # has one, and a wrong state that never reached the weight then says so.
    state = {"weight": module.weight.detach().clone()}
    for index, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            state[f"state[{index}].{key}"] = value.detach().clone() if torch.is_tensor(value) else value
    return state


def first_difference(name, mine, theirs):
    """None if `mine` is `theirs` bit for bit, else what differs, in words."""
    if not torch.is_tensor(theirs):
        return None if mine == theirs else f"{name} is {mine!r}, not {theirs!r}"
    if not torch.is_tensor(mine) or mine.dtype != theirs.dtype or mine.shape != theirs.shape:
        return f"{name} is {getattr(mine, 'dtype', type(mine))} {tuple(getattr(mine, 'shape', ()))}, not " \
               f"{theirs.dtype} {tuple(theirs.shape)}"
    # Bits, not values: NaN == NaN here, and -0.0 != 0.0.
    if mine.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[mine.element_size()]
        differ = mine.view(ints) != theirs.view(ints)
    else:
        differ = mine != theirs
    if not bool(differ.any()):
        return None
    rows = differ.reshape(differ.shape[0] if differ.dim() else 1, -1).any(1).nonzero().view(-1)
    gap = float((mine.double() - theirs.double())[differ].abs().max())
    return f"{name} differs in {rows.numel()} row(s), first row {int(rows[0])} (max |difference| {gap:.3g})"


def train_checked(module, opt, w, grad_out, plan_ahead):
    """The timed steps' sequence over the whole draw (forward, backward,
    the next batch planned, step), with a gradient that depends on the
    rows the forward served (the output plus grad_out): a wrong row then
    changes the update, not only the output. Returns each step's output
    and the cache's counts of the batches trained (None without a cache)."""
    order = w.warmup + w.timed + [w.after]
    inputs = (lambda i: w.batches[i].view(-1, w.bag_size)) if w.bag_size else (lambda i: w.batches[i])
    plan_ahead = plan_ahead and module._table.cache is not None and not w.bag_size
    outputs, last = [], len(order) - 2
    if plan_ahead:
        module.prefetch(inputs(order[0]))
    for k in range(last + 1):
        out = module(inputs(order[k]))
        outputs.append(out.detach().clone())
        out.backward(out.detach() + grad_out)
        if k == last:
            # Before the batch no step trains is planned: its hits are
            # never served.
            stats = module.cache_stats
        if plan_ahead:
            module.prefetch(inputs(order[k + 1]))
        opt.step()
        opt.zero_grad()
    return outputs, stats


def trains_to_uncached_bits(w, build, sizes, base, label, seed, plan_ahead, device):
    """A fast wrong answer is not a result: on the draw `w`, a table from
    build() (a module and its optimizer) with a row cache of each of
    `sizes`, (fraction, cache rows) pairs of the draw's `base` rows, must
    train to the bits of the same table without one: every step's output,
    the weight and every optimizer state tensor, from the same random
    table (an all-zero one would hide a wrong row until its first update).
    A difference ends the run, naming `label` and the size. Returns the
    cache's counts a fraction."""
    out_rows = len(w.batches[0]) // w.bag_size if w.bag_size else len(w.batches[0])
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out_rows, w.dim, generator=gen).to(device)
    start = torch.randn(w.rows, w.dim, generator=gen)

    def train(cache_rows):
        module, opt = build()
        with torch.no_grad():
            module.weight.copy_(start)
        module.cache_rows = cache_rows
        outputs, stats = train_checked(module, opt, w, grad_out, plan_ahead)
        result = outputs, training_state(module, opt), stats
        del module, opt
        gc.collect()
        return result

    want_outputs, want, _ = train(None)
    counts = {}
    for fraction, cache_rows in sizes:
        where = f"{label}, cache {fraction:g} ({cache_rows:,} of the check's {base:,} rows)"
        outputs, got, stats = train(cache_rows)
        for k, (mine, theirs) in enumerate(zip(outputs, want_outputs)):
            wrong = first_difference(f"step {k}'s lookup output", mine, theirs)
            if wrong:
                fail(f"{where}: {wrong} from the uncached table's")
        if got.keys() != want.keys():
            fail(f"{where}: the optimizer holds {sorted(got)}, the uncached one {sorted(want)}")
        for name in want:
            wrong = first_difference(name, got[name], want[name])
            if wrong:
                fail(f"{where}: {wrong} from the uncached table's")
        if not stats["hits"]:
            # Every row fetched or bypassed: a wrong slot or a stale record
            # would never have been served, and the check would prove nothing.
            fail(f"{where}: no cached row was found again in a later step; the check's draw does not test the cache")
        counts[fraction] = stats
        log(f"{where}: trains to the uncached bits (outputs, weight, {len(want) - 1} optimizer state entries; "
            f"{stats['hits']:,} hits, {stats['evictions']:,} evictions, {stats['bypassed']:,} bypassed)")
    return counts
