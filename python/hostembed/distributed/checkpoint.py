"""Checkpoints of models with ShardedEmbedding(Bag) tables, loaded into another
number of ranks: each rank takes the rows of its new range from the files
the old ranks wrote (hostembed.save, one file a rank), memory-mapped, so a
rank reads only its rows."""
import torch

from ..io.stream import copy_rows
from ..io.checkpoint import load as load_checkpoint
from .sharded_embedding import WHO, _RowSharded


def load_resharded(paths, model, optimizer=None):
    """Restores into `model` (and `optimizer`, one optimizer) the
    checkpoints that `len(paths)` ranks wrote with
    ``hostembed.save(path, model, optimizer)``, given in rank order, whatever
    the number of ranks now: each ShardedEmbedding or ShardedEmbeddingBag
    takes the rows of its range (and their optimizer state) from the files
    that hold them; everything else comes from the first file. With as many
    files as ranks, it is ``hostembed.load(paths[rank], model, optimizer)``.

    Across the single-process boundary, both ways: one file written by a
    single process whose model has a plain table (``hostembed.Embedding``
    or ``EmbeddingBag``, or torch's) where this model has a sharded one
    (``emb.weight`` for ``emb.shard.weight``) loads into the ranks; and the
    files of a sharded model load into a single process's model (no
    torch.distributed needed) whose table at the same place is a plain
    one, which gets every row. The models must otherwise be the same (the
    optimizer's parameters in the same order).

    The optimizer must be one hostembed or torch optimizer (not a list).
    Raises ValueError when the files do not hold a sharded table's rows as
    `len(paths)` ranks would have, before anything changes."""
    paths = [str(p) for p in paths]
    sharded = [(name, m) for name, m in model.named_modules() if isinstance(m, _RowSharded)]
    shared = [name for name, m in sharded if m._whole_group is not None]
    if shared:
        raise ValueError(f"{WHO}: load_resharded does not take tables made with share_within_host=True "
                         f"({', '.join(repr(n) for n in shared)}): their ranks share one copy of a host's rows")
    if sharded and len(paths) == sharded[0][1].world_size:
        return load_checkpoint(paths[sharded[0][1].rank], model, optimizer)
    files = [torch.load(p, map_location="cpu", mmap=True, weights_only=False) for p in paths]
    slots = _slots(model, sharded, files[0]["model"], len(paths))
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
        state[target] = _rows(start, end, old, [f["model"][source] for f in files])
        if optimizer is not None:
            i = index[param]
            saved = [f["optimizer"]["state"].get(i, {}) for f in files]
            opt_state["state"][i] = {name_: (_rows(start, end, old, [s[name_] for s in saved])
                                             if _per_row(value, old[1] - old[0]) else value)
                                     for name_, value in saved[0].items()}
    model.load_state_dict(state)
    if optimizer is not None:
        optimizer.load_state_dict(opt_state)
    return files[0].get("extra")


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


def _rows(start, end, old, parts):
    """Rows [start, end) of the table whose rows [old[k], old[k + 1]) are
    parts[k], read from only the parts that hold them."""
    out = torch.empty((end - start, *parts[0].shape[1:]), dtype=parts[0].dtype)
    for k, part in enumerate(parts):
        lo, hi = max(start, old[k]), min(end, old[k + 1])
        if lo < hi:
            dst, src = out[lo - start:hi - start], part[lo - old[k]:hi - old[k]]
            if dst.dim() == 2:  # copy_rows releases a mapped file's pages as it goes
                copy_rows(dst, src)
            else:  # a value per row: small
                dst.copy_(src)
    return out


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
