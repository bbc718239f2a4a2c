"""Checkpoints of a whole training state that survive being interrupted.

The file is a plain torch.save archive ({"model": state_dict, "optimizer":
state_dict or list of them, "extra": ...}), so `torch.load(path, mmap=True)`
reads it without hostembed. torch.save writes each CPU storage straight from
its memory, so host tables and their Adam state go to disk without a copy.
"""
import contextlib
import os
import threading
from collections.abc import Mapping

import torch

FORMAT = "hostembed.checkpoint"
VERSION = 1


def save(path, model, optimizer=None, *, extra=None):
    """Writes model.state_dict(), the optimizer state (one optimizer or a
    list/tuple of them) and `extra` (plain values and tensors, e.g. the epoch
    or a data-loader position) to `path`.

    The file appears whole or not at all: it is written under a temporary
    name in the same directory, fsync'ed, then renamed over `path`, and the
    directory is fsync'ed. A crash or kill before the rename leaves the
    previous checkpoint at `path` untouched (and at worst a stray
    `<path>.tmp-*` file).
    """
    path = os.fspath(path)
    checkpoint = {"format": FORMAT, "version": VERSION, "model": model.state_dict()}
    if optimizer is not None:
        if isinstance(optimizer, (list, tuple)):
            checkpoint["optimizer"] = [opt.state_dict() for opt in optimizer]
        else:
            checkpoint["optimizer"] = optimizer.state_dict()
    if extra is not None:
        checkpoint["extra"] = extra
    directory = os.path.dirname(os.path.abspath(path))
    temporary = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        _save_without_crc(checkpoint, temporary)
        _fsync(temporary, os.O_RDONLY)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync(directory, os.O_RDONLY | os.O_DIRECTORY)


def _save_without_crc(obj, path):
    # torch.save checksums every record by default, single-threaded, which
    # halves the write rate of a table-sized checkpoint (see
    # benchmarks/load_save.py). The checksum is not needed for integrity
    # here (the rename makes a checkpoint whole or absent) and torch.load
    # does not check it.
    get = getattr(torch.serialization, "get_crc32_options", None)
    if get is None:  # torch < 2.6 has no switch
        torch.save(obj, path)
        return
    previous = get()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, path)
    finally:
        torch.serialization.set_crc32_options(previous)


def _fsync(path, flags):
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path, model, optimizer=None, *, strict=True):
    """Restores a checkpoint written by save() into `model` (and
    `optimizer`, given as it was to save) in place; returns its `extra`.

    The file is memory-mapped and copied in row chunks whose pages are
    released as they go, so loading a 40 GB table needs the table's memory,
    not twice it. Shapes, keys and optimizer layout are checked against the
    model before anything is copied: a mismatch raises RuntimeError naming
    both shapes and leaves the model and optimizer as they were.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"hostembed.load: no such file: '{path}'")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # a damaged archive raises RuntimeError, UnpicklingError, ...
        raise ValueError(f"hostembed.load: cannot read '{path}' as a checkpoint: {exc}") from exc
    if not isinstance(checkpoint, Mapping) or "model" not in checkpoint:
        found = sorted(checkpoint) if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise ValueError(f"hostembed.load: '{path}' is not a checkpoint written by hostembed.save "
                         f"(expected a mapping with a 'model' entry, found {found})")
    _check_model(path, checkpoint["model"], model, strict)
    pairs = _optimizer_pairs(path, checkpoint, optimizer)
    for opt, state in pairs:
        _check_optimizer(path, state, opt)
    model.load_state_dict(checkpoint["model"], strict=strict)
    for opt, state in pairs:
        opt.load_state_dict(state)
    return checkpoint.get("extra")


def _check_model(path, saved, model, strict):
    own = model.state_dict()
    problems = []
    if strict:
        missing = sorted(set(own) - set(saved))
        unexpected = sorted(set(saved) - set(own))
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
    for key in sorted(set(own) & set(saved)):
        mine, theirs = own[key], saved[key]
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.shape != theirs.shape:
            problems.append(f"'{key}' has shape {list(theirs.shape)} in the checkpoint, "
                            f"{list(mine.shape)} in the model")
    if problems:
        raise RuntimeError(f"hostembed.load: '{path}' does not fit the model, nothing was loaded: "
                           + "; ".join(problems))


def _optimizer_pairs(path, checkpoint, optimizer):
    if optimizer is None:
        return []
    if "optimizer" not in checkpoint:
        raise ValueError(f"hostembed.load: '{path}' holds no optimizer state (saved without optimizer=)")
    saved = checkpoint["optimizer"]
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    states = list(saved) if isinstance(saved, list) else [saved]
    if isinstance(optimizer, (list, tuple)) != isinstance(saved, list) or len(optimizers) != len(states):
        raise ValueError(f"hostembed.load: '{path}' holds the state of {len(states)} optimizer(s), "
                         f"{len(optimizers)} given")
    return list(zip(optimizers, states))


def _check_optimizer(path, saved, optimizer):
    """torch checks group sizes but not the shapes of per-parameter state,
    which would then fail mid-step; check both up front."""
    groups, saved_groups = optimizer.param_groups, saved.get("param_groups", [])
    sizes = [len(g["params"]) for g in groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise RuntimeError(f"hostembed.load: '{path}' has optimizer parameter groups of sizes {saved_sizes}, "
                           f"the optimizer has {sizes}; nothing was loaded")
    saved_state = saved.get("state", {})
    for group, saved_group in zip(groups, saved_groups):
        for p, saved_id in zip(group["params"], saved_group["params"]):
            for key, value in saved_state.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise RuntimeError(
                        f"hostembed.load: optimizer state '{key}' of parameter {saved_id} in '{path}' has shape "
                        f"{list(value.shape)}, the parameter has {list(p.shape)}; nothing was loaded"
                    )
