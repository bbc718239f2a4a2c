"""Checkpoints of models with ShardedEmbedding(Bag) and SharedEmbedding
tables, loaded into another number of ranks or hosts: each rank takes the
rows of its new range from the files the old ranks wrote (hostembed.save,
one file a rank), memory-mapped, so a rank reads only its rows."""
import torch
import torch.distributed as dist

from ..io.stream import copy_rows
from ..io.checkpoint import load as load_checkpoint
from .shared_embedding import SharedEmbedding
from .sharded_embedding import WHO, _RowSharded


def load_resharded(paths, model, optimizer=None):
    """Restores into `model` (and `optimizer`, one optimizer) the
    checkpoints that `len(paths)` ranks wrote with
    ``hostembed.save(path, model, optimizer)``, given in rank order, whatever
    the number of ranks (or hosts) now: each ShardedEmbedding or
    ShardedEmbeddingBag takes the rows of its range (and their optimizer
    state) from the files that hold them; each SharedEmbedding (alone, or a
    host's rows under ``share_within_host=True``) has each rank write the
    rows it updates into the shared copy and take their optimizer state;
    everything else comes from the first file. Sharded tables alone, with
    as many files as ranks: ``hostembed.load(paths[rank], model,
    optimizer)``.

    Across the single-process boundary, both ways: one file written by a
    single process whose model has a plain table (``hostembed.Embedding``
    or ``EmbeddingBag``, or torch's) where this model has a sharded or
    shared one (``emb.weight`` for ``emb.shard.weight``, ``emb.table.weight``
    or ``emb.shard.table.weight``) loads into the ranks; and the files of
    such a model load into a single process's model (no torch.distributed
    needed) whose table at the same place is a plain one, which gets every
    row.
    The models must otherwise be the same (the optimizer's parameters in
    the same order).

    The optimizer must be one hostembed or torch optimizer (not a list).
    Raises ValueError when the files do not hold a table's rows as
    `len(paths)` ranks would have, before anything changes.

    Args:
        paths (sequence of str or os.PathLike): the checkpoint files the old
            ranks wrote, one a rank, in rank order (every rank gives them
            all).
        model (torch.nn.Module): this rank's model, built as the saved one
            with its distributed tables for the ranks (or the single
            process) there are now.
        optimizer (torch.optim.Optimizer, optional): one optimizer over the
            model's parameters, in the same order as the saved one's.
            Default: None (the model only)

    Returns:
        The first file's ``extra`` (None if it has none).
    """
    paths = [str(p) for p in paths]
    shared = [(name, m) for name, m in model.named_modules() if isinstance(m, SharedEmbedding)]
    # Those with share_within_host are their SharedEmbedding shards' to load.
    sharded = [(name, m) for name, m in model.named_modules() if isinstance(m, _RowSharded) and m._whole_group is None]
    if not shared and sharded and len(paths) == sharded[0][1].world_size:
        return load_checkpoint(paths[sharded[0][1].rank], model, optimizer)
    files = [torch.load(p, map_location="cpu", mmap=True, weights_only=False) for p in paths]
    plain_from_shared = not shared and not sharded and any(_shared_keys(files[0]["model"]))
    # The sharded tables' slots; or, for a plain model, the sharded tables
    # of the files (those of shared tables: _plain_from_shared).
    slots = _slots(model, sharded, files[0]["model"], len(paths)) if sharded or not (shared or plain_from_shared) \
        else []
    state = dict(files[0]["model"])
    opt_state = None if optimizer is None else _empty_like_saved(files[0].get("optimizer"), paths[0])
    index = _param_indices(optimizer) if optimizer is not None else {}
    for source, target, rows, dim, (start, end), param in slots:
        old = [rows * r // len(paths) for r in range(len(paths) + 1)]
        for k, f in enumerate(files):
            part = f["model"].get(source)
            if part is None or tuple(part.shape) != (old[k + 1] - old[k], dim):
                raise ValueError(f"{WHO}: {paths[k]} does not hold rows [{old[k]}, {old[k + 1]}) of {source!r} "
                                 f"(got {None if part is None else list(part.shape)}): give the {len(paths)} "
                                 "ranks' checkpoints in rank order")
        state.pop(source, None)
        held = [(old[k], old[k + 1], f["model"][source], old[k]) for k, f in enumerate(files)]
        state[target] = _rows(start, end, held)
        if optimizer is not None:
            i = index[param]
            saved = [f["optimizer"]["state"].get(i, {}) for f in files]
            opt_state["state"][i] = {
                name_: (_rows(start, end, [(lo, hi, s[name_], first) for (lo, hi, _, first), s in zip(held, saved)])
                        if _per_row(value, old[1] - old[0]) else value)
                for name_, value in saved[0].items()}
    if plain_from_shared:  # the files of shared tables into a single process's plain ones
        _plain_from_shared(model, files, paths, state, opt_state, index)
    modules = dict(model.named_modules())
    writes = [_shared_slot(name, module, files, paths, state, opt_state, index, _plain_key(name, modules))
              for name, module in shared]
    for write in writes:  # every file checked above: now the shared rows
        write()
    model.load_state_dict(state)
    if optimizer is not None:
        optimizer.load_state_dict(opt_state)
    for _, module in shared:  # every rank's rows written before any rank reads them
        dist.barrier(group=module.process_group)
    return files[0].get("extra")


def _shared_slot(name, module, files, paths, state, opt_state, index, plain_key):
    """A SharedEmbedding's part of load_resharded: checks that the files
    hold the rows this rank updates and their optimizer state (from each
    file's layout entry, or a single process's plain table at plain_key),
    puts the state into opt_state and the live table into `state` (which
    load_state_dict then skips), and returns what writes this rank's rows
    into the shared copy."""
    prefix = f"{name}." if name else ""
    key, layout_key = f"{prefix}table.weight", f"{prefix}_extra_state"
    mine = module.get_extra_state()
    first, _ = mine["table_rows"]
    start, end = mine["state_rows"]
    owned, source = _owned_rows(files, paths, key, module.embedding_dim, plain_key)
    _check_covered(start, end, owned, key)
    state.pop(source, None)
    weight = module.table.weight
    state[key], state[layout_key] = weight, mine
    if opt_state is not None:
        i = index[weight]
        saved = [f["optimizer"]["state"].get(i, {}) for f in files]
        entry = {}
        for name_, value in saved[0].items():
            if not _per_row(value, owned[0][2].shape[0]):
                entry[name_] = value
                continue
            # The state is the whole table's shape; this rank's rows filled.
            out = torch.zeros((module.num_embeddings, *value.shape[1:]), dtype=value.dtype)
            _fill_rows(out[start - first:end - first], start, end,
                       [(s0, s1, s[name_], t0) for (s0, s1, _, t0), s in zip(owned, saved)])
            entry[name_] = out
        opt_state["state"][i] = entry

    def write():
        with torch.no_grad():
            _fill_rows(weight.detach()[start - first:end - first], start, end, owned)
    return write


def _owned_rows(files, paths, key, dim, plain_key=None):
    """([(first row, end, the file's rows, the row its row 0 is)] a file,
    the key read): each row of a shared table `key` from the file of the
    rank that updated it, as its layout entry says (a file holds every row
    of its table, but another rank's may have been caught mid-update when
    it was saved); or, from one file of a single process, every row of its
    plain table at plain_key."""
    layout_key = key[:-len("table.weight")] + "_extra_state"
    if len(files) == 1 and layout_key not in files[0]["model"] and plain_key in files[0]["model"]:
        rows = files[0]["model"][plain_key]
        return [(0, rows.shape[0], rows, 0)], plain_key
    owned = []
    for path, f in zip(paths, files):
        layout, rows = f["model"].get(layout_key), f["model"].get(key)
        if not isinstance(layout, dict) or rows is None:
            raise ValueError(f"{WHO}: {path} holds no shared table {key!r} with its layout ({layout_key!r})"
                             + ("" if plain_key is None else f", nor a single process's {plain_key!r}"))
        (t0, t1), (s0, s1) = layout["table_rows"], layout["state_rows"]
        if tuple(rows.shape) != (t1 - t0, dim) or not t0 <= s0 <= s1 <= t1:
            raise ValueError(f"{WHO}: {path} says {key!r} holds rows [{t0}, {t1}), those of [{s0}, {s1}) its "
                             f"rank's, but it is {list(rows.shape)}")
        owned.append((s0, s1, rows, t0))
    return owned, key


def _plain_key(name, modules):
    """Where a single process's model keeps the plain table that the
    SharedEmbedding `name` holds (all of it or, under a ShardedEmbedding
    with share_within_host, its host's rows): `emb.weight` for `emb`'s
    and for `emb.shard`'s."""
    parent, _, last = name.rpartition(".")
    if last == "shard" and isinstance(modules.get(parent), _RowSharded):
        name = parent
    return f"{name}.weight" if name else "weight"


def _shared_keys(saved):
    """The keys of the shared tables in a state dict (each with its layout)."""
    return [k for k in saved if k.endswith("table.weight")
            and isinstance(saved.get(k[:-len("table.weight")] + "_extra_state"), dict)]


def _plain_from_shared(model, files, paths, state, opt_state, index):
    """The files of a model with shared tables into a single process's
    model whose tables at the same places are plain ones: each gets every
    row, each from the file of the rank that updated it."""
    params = dict(model.named_parameters())
    for key in _shared_keys(files[0]["model"]):
        prefix = key[:-len("table.weight")]
        plain = prefix[:-len("shard.")] if prefix.endswith("shard.") else prefix
        param = params.get(f"{plain}weight")
        if param is None or param.dim() != 2:
            raise ValueError(f"{WHO}: the files hold the shared table {key!r}, this model no plain table at "
                             f"{plain + 'weight'!r} to load it into")
        rows = param.shape[0]
        owned, _ = _owned_rows(files, paths, key, param.shape[1])
        _check_covered(0, rows, owned, key)
        state.pop(key)
        state.pop(f"{prefix}_extra_state")
        state[f"{plain}weight"] = _rows(0, rows, owned)
        if opt_state is not None:
            i = index[param]
            saved = [f["optimizer"]["state"].get(i, {}) for f in files]
            opt_state["state"][i] = {
                name_: (_rows(0, rows, [(s0, s1, s[name_], t0) for (s0, s1, _, t0), s in zip(owned, saved)])
                        if _per_row(value, owned[0][2].shape[0]) else value)
                for name_, value in saved[0].items()}


def _check_covered(start, end, held, key):
    at = start
    for lo, hi, *_ in sorted(held, key=lambda h: h[0]):
        if lo <= at < hi:
            at = hi
    if at < end:
        raise ValueError(f"{WHO}: no checkpoint holds row {at} of {key!r} as the rank that updated it saved it "
                         f"(this rank's rows are [{start}, {end})): give every rank's checkpoint, in rank order")


def _slots(model, sharded, saved, files):
    """(key in the files, key in the model, the table's rows and dim, the
    rows this process takes, its parameter) of each table to put together
    from the files: the model's sharded tables, from their shards (or, from
    one file, a single process's whole table at the same place); without
    any, the files' shards into the model's plain tables."""
    if sharded:
        slots = []
        for name, table in sharded:
            prefix = f"{name}." if name else ""
            source = f"{prefix}shard.weight"
            if source not in saved and files == 1 and f"{prefix}weight" in saved:
                source = f"{prefix}weight"  # a single process's plain table
            slots.append((source, f"{prefix}shard.weight", table.num_embeddings, table.embedding_dim,
                          table.row_range, table._shard_weight()))
        return slots
    slots = []
    for key in saved:
        if not key.endswith("shard.weight"):
            continue
        prefix = key[:-len("shard.weight")]
        param = dict(model.named_parameters()).get(f"{prefix}weight")
        if param is None or param.dim() != 2:
            continue
        slots.append((key, f"{prefix}weight", param.shape[0], param.shape[1], (0, param.shape[0]), param))
    if not slots:
        raise ValueError(f"{WHO}: load_resharded needs a model with ShardedEmbedding or ShardedEmbeddingBag tables, "
                         "or files of sharded tables for a model with plain tables at the same places")
    return slots


def _rows(start, end, held):
    """Rows [start, end) of a table put together from `held`: (first row,
    end, tensor, the row its row 0 is) of each source (see _fill_rows)."""
    parts = [h[2] for h in held]
    out = torch.empty((end - start, *parts[0].shape[1:]), dtype=parts[0].dtype)
    _fill_rows(out, start, end, held)
    return out


def _fill_rows(out, start, end, held):
    """out[r - start] = row r for r in [start, end), each from the first of
    `held` (first row, end, tensor, the row its row 0 is) that holds it,
    read from only the parts that hold them."""
    at = start
    for lo, hi, part, first in sorted(held, key=lambda h: h[0]):
        if not lo <= at < hi:
            continue
        lo, hi = at, min(end, hi)
        if lo < hi:
            dst, src = out[lo - start:hi - start], part[lo - first:hi - first]
            if dst.dim() == 2:  # copy_rows releases a mapped file's pages as it goes
                copy_rows(dst, src)
            else:  # a value per row: small
                dst.copy_(src)
            at = hi


def _per_row(value, rows):
    """A state tensor with a row (or a value) per table row; scalars such
    as `step` are the same on every rank."""
    return torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == rows


def _param_indices(optimizer):
    """Each parameter's index in the optimizer's state dict."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {p: i for i, p in enumerate(params)}


def _empty_like_saved(saved, path):
    if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
        raise ValueError(f"{WHO}: {path} holds no single optimizer's state dict to load")
    return {"state": dict(saved["state"]), "param_groups": saved["param_groups"]}
