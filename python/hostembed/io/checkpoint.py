"""Checkpoints of a whole training state that survive being interrupted.

The file is a plain torch.save archive ({"model": state_dict, "optimizer":
state_dict or list of them, "extra": ...}), so `torch.load(path, mmap=True)`
reads it without hostembed. torch.save writes each CPU storage straight from
its memory, so host tables and their Adam state go to disk without a copy.

What survives which fault
-------------------------
Saving: the checkpoint is written to `<path>.tmp-<pid>-<thread>` in the same
directory, fsync'ed, renamed over `path`, and the directory is fsync'ed. A
full disk (ENOSPC), a file size limit (EFBIG), a failed fsync or rename, an
exception or a kill (SIGKILL, power loss) at any point before the rename
leaves the previous checkpoint at `path` bit for bit; save() raises OSError
for the I/O failures (torch reports them as a bare "unexpected pos"
RuntimeError) and removes the temporary file; a killed process leaves it
behind (delete `<path>.tmp-*` at leisure: nothing reads them). A partial
file is never taken for a checkpoint: the archive's directory is written
last, so hostembed.load (and torch.load) of a truncated file raise
ValueError. A failed fsync of the directory after the rename raises OSError:
`path` then holds the new checkpoint, whole, which a power loss might still
revert to the previous one (never to a mix).

Loading is check-then-copy, not staged: staging would hold a second copy of
every table and its two moments (80 GB more for a 40 GB table with Adam).
1. Check, from metadata only, before anything changes: the zip records' sizes,
   before torch.load reads any (it allocates what a record claims), the file's
   structure, every model entry as torch's load_state_dict would (keys, types,
   layout, shapes, that the dtype converts), every optimizer state dict (group
   count and sizes, parameter ids, hyperparameters as the constructors check
   them (0 <= beta < 1, eps, lr >= 0, flags), steps (an int >= 0 or a 0-d
   tensor holding one), moments (floating, shaped like their parameter)), a
   dry run of torch's load_state_dict for torch optimizers, and that the file
   still holds every byte the tensors map. Anything wrong raises RuntimeError
   (does not fit the model: keys, shapes, group sizes) or ValueError /
   TypeError (malformed values), naming the entry, and changes nothing.
2. Stage what costs no second copy: the SparseAdam moments of an optimizer
   that has none yet (a fresh one, as when resuming) are read into new
   buffers; a read error or MemoryError here changes nothing either.
3. Copy in place: the host tables' rows, then the moments an optimizer
   already holds, then torch's load_state_dict for the dense parameters and
   buffers, then the optimizers' state and hyperparameters. Host rows are
   read from the file with pread (not through the mapping), so a read error
   (EIO, a file truncated after step 1) raises instead of killing the
   process with SIGBUS. A failure in this step (a read error, an interrupt,
   a module's own load hook raising) leaves the model and optimizers
   partially loaded; load() then raises RuntimeError saying which parts
   were overwritten ("partially loaded ... load a checkpoint again"), and
   the caller must reload a good checkpoint before training or saving.
What cannot be caught at all: a page fault of the mapped file on a dense
tensor (a file truncated, or a disk failing, after step 1) is a SIGBUS that
kills the process; the checkpoint on disk is untouched by loading.
"""
import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import nn

from .._core.table import table_of
from . import validate as _validate
from .files import LOADABLE, FileRows, check_torch_archive
from .stream import copy_rows, progress_bar, read_rows

FORMAT = "hostembed.checkpoint"
VERSION = 1

# The method of an optimizer whose state hostembed.load stages itself rather
# than through load_state_dict (SparseAdam: its moments are read straight
# into host buffers, never held twice): (state_dict, where) -> a plan with
# stage(), in_place_bytes(), copy_in_place() and install(), whose `fill` the
# load sets. Asked for by name: the optimizers sit above this layer.
LOAD_PLAN = "_checkpoint_load_plan"

# Host rows are read in pieces of this size, so the progress bar moves.
_READ_PIECE_BYTES = 256 << 20


def save(path, model, optimizer=None, *, extra=None):
    """Writes model.state_dict(), the optimizer state (one optimizer or a
    list/tuple of them) and `extra` (plain values and tensors, e.g. the epoch
    or a data-loader position) to `path`.

    The file appears whole or not at all: it is written under a temporary
    name in the same directory, fsync'ed, then renamed over `path`, and the
    directory is fsync'ed. A crash, kill or I/O error (a full disk, a failed
    fsync or rename) before the rename leaves the previous checkpoint at
    `path` untouched (and, after a kill, a stray `<path>.tmp-*` file). I/O
    failures raise OSError. See the module's docstring for every case.

    Args:
        path (str or os.PathLike): the file to write, in an existing
            directory.
        model (torch.nn.Module): the model whose ``state_dict()`` is saved
            (host tables straight from their memory, row caches written
            back first).
        optimizer (torch.optim.Optimizer or list or tuple, optional): one
            optimizer, or a list or tuple of them, whose ``state_dict()`` is
            saved; :func:`load` takes them in the same form. Default: None
        extra (object, optional): keyword-only: plain values and tensors
            (what ``torch.load(weights_only=True)`` reads back) saved
            beside them, which :func:`load` returns. Default: None
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
    stage = "writing"
    try:
        try:
            _save_without_crc(checkpoint, temporary)
        except RuntimeError as exc:
            if not _is_write_failure(exc):
                raise
            raise _SaveError(f"hostembed.save: writing '{temporary}' failed ({exc}: torch's report of a failed "
                             f"write, e.g. a full disk or the file size limit; {_free_space(directory)}); the "
                             f"previous checkpoint at '{path}' is untouched") from exc
        stage = "the fsync of"
        _fsync(temporary, os.O_RDONLY)
        stage = "the rename of"
        os.replace(temporary, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, OSError) and not isinstance(exc, _SaveError):
            raise _os_error(exc, f"hostembed.save: {stage} '{temporary}' failed ({exc.strerror or exc}); the "
                                 f"previous checkpoint at '{path}' is untouched") from exc
        raise
    try:
        _fsync(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise _os_error(exc, f"hostembed.save: '{path}' holds the new checkpoint, whole, but the fsync of its "
                             f"directory failed ({exc.strerror or exc}): a power loss may still bring back the "
                             "previous one") from exc


class _SaveError(OSError):
    """An I/O failure of save() that torch reported as a RuntimeError."""


def _os_error(exc, message):
    # OSError(errno, ...) is the errno's subclass (FileNotFoundError, ...).
    return OSError(exc.errno, message) if exc.errno is not None else OSError(message)


def _is_write_failure(exc):
    text = str(exc)
    return "unexpected pos" in text or "file write failed" in text or "PytorchStreamWriter" in text


def _free_space(directory):
    try:
        stat = os.statvfs(directory)
    except OSError:
        return "free space unknown"
    return f"{stat.f_bavail * stat.f_frsize} bytes free there"


def _save_without_crc(obj, path):
    # torch.save checksums every record by default, single-threaded, which
    # halves the write rate of a table-sized checkpoint (see
    # benchmarks/cpu/load_save.py). The checksum is not needed for integrity
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

    Host tables are read from the file with pread, in row chunks straight
    into the table, so loading a 40 GB table needs the table's memory, not
    twice it. Everything is checked before anything changes (keys, shapes,
    dtypes, optimizer layout, hyperparameters, step counts): a checkpoint
    that does not fit raises RuntimeError naming both shapes (or the keys),
    a malformed one ValueError or TypeError naming the entry, and the model
    and optimizer are as they were. Only a failure while rows are being
    copied (a read error, an interrupt) leaves them partially loaded, and
    the RuntimeError says so. The module's docstring lists every case.

    Args:
        path (str or os.PathLike): a checkpoint written by :func:`save`
            (FileNotFoundError if there is no such file).
        model (torch.nn.Module): the model to restore in place, built as
            the one saved.
        optimizer (torch.optim.Optimizer or list or tuple, optional): the
            optimizer, or the list or tuple of them, given as it was to
            :func:`save`. Default: None (the model only)
        strict (bool, optional): keyword-only: as torch's
            ``load_state_dict(strict=...)``: whether the model's keys must
            match the checkpoint's exactly. Default: ``True``

    Returns:
        The checkpoint's ``extra`` (None if it has none).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"hostembed.load: no such file: '{path}'")
    # The file is opened once and read through this descriptor: a checkpoint
    # renamed over `path` meanwhile (a trainer saving while this loads) is
    # never mixed with this one.
    fd = os.open(path, os.O_RDONLY)
    try:
        return _Load(path, fd, model, optimizer, strict).run()
    finally:
        os.close(fd)


class _Load:
    def __init__(self, path, fd, model, optimizer, strict):
        self.path, self.fd, self.model, self.optimizer, self.strict = path, fd, model, optimizer, strict
        proc = f"/proc/self/fd/{fd}"
        self.source = proc if os.path.exists(proc) else path
        self.stat = os.fstat(fd)

    def run(self):
        checkpoint = self._read()
        self._check_top(checkpoint)
        mappings = _FileMappings(self.stat)
        model_part = _check_model(self.path, checkpoint["model"], self.model, self.strict)
        pairs = _optimizer_pairs(self.path, checkpoint, self.optimizer)
        plans = [self._check_optimizer(index, opt, state) for index, (opt, state) in enumerate(pairs)]
        self._check_covered(mappings, checkpoint["model"], [state for _, state in pairs])
        fill = _Filler(self.source, self.path, mappings).fill
        for plan in plans:
            if plan is not None:
                plan.fill = fill
        self._stage(plans)
        self._commit(checkpoint["model"], model_part, pairs, plans, fill)
        return checkpoint.get("extra")

    def _read(self):
        cannot = (f"hostembed.load: cannot read '{self.path}' as a checkpoint (a truncated or partly written file "
                  "reads like this)")
        # torch.load allocates the size a record claims before reading it
        # (4 GiB for a forged 1 KB file): the records are checked first
        with open(self.fd, "rb", closefd=False) as f:
            check_torch_archive(self.path, f, self.stat.st_size, cannot)
        try:
            return torch.load(self.source, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # a damaged archive raises RuntimeError, UnpicklingError, ...
            raise ValueError(f"{cannot}: {exc}") from exc

    def _check_top(self, checkpoint):
        path = self.path
        if not isinstance(checkpoint, Mapping) or "model" not in checkpoint:
            found = sorted(map(str, checkpoint)) if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
            raise ValueError(f"hostembed.load: '{path}' is not a checkpoint written by hostembed.save "
                             f"(expected a mapping with a 'model' entry, found {found})")
        if "format" in checkpoint and checkpoint["format"] != FORMAT:
            raise ValueError(f"hostembed.load: '{path}' has format {_validate.describe(checkpoint['format'])}, "
                             f"expected {FORMAT!r}")
        if "version" in checkpoint:
            version = checkpoint["version"]
            if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
                raise ValueError(f"hostembed.load: '{path}' has version {_validate.describe(version)}, this "
                                 f"hostembed reads versions 1 to {VERSION}")

    def _check_optimizer(self, index, opt, state):
        """The optimizer's full check; the plan of an optimizer that stages
        its own load (a SparseAdam), None for the others (whose
        load_state_dict was dry-run)."""
        where = f"hostembed.load: '{self.path}': optimizer [{index}] ({type(opt).__name__})"
        try:
            _check_optimizer_fits(self.path, state, opt, where)
            load_plan = getattr(opt, LOAD_PLAN, None)
            if load_plan is not None:
                return load_plan(state, where)
            _validate.check_torch_optimizer(opt, state, where)
            return None
        except _validate.DoesNotFit as exc:
            raise RuntimeError(f"{exc}; nothing was loaded") from None
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc}; nothing was loaded") from None

    def _check_covered(self, mappings, model_state, optimizer_states):
        """Every tensor the file maps is within the file as it is now."""
        for key, tensor in _tensors(model_state, "model"):
            mappings.check_covered(tensor, key, self.path)
        for index, state in enumerate(optimizer_states):
            for key, tensor in _tensors(state.get("state", {}), f"optimizer [{index}] state"):
                mappings.check_covered(tensor, key, self.path)

    def _stage(self, plans):
        try:
            for plan in plans:
                if plan is not None:
                    plan.stage()
        except MemoryError as exc:
            raise MemoryError(f"hostembed.load: no memory for the optimizer state of '{self.path}' ({exc}); "
                              "nothing was loaded") from exc
        except Exception as exc:
            raise RuntimeError(f"hostembed.load: reading the optimizer state of '{self.path}' failed "
                               f"({type(exc).__name__}: {exc}); nothing was loaded") from exc

    def _commit(self, saved_model, model_part, pairs, plans, fill):
        host, substituted = model_part
        done = []
        try:
            for key, param, table in host:
                table.check_process()
                table.wait_for_gpu_use()  # no kernel may still read the rows about to change
                table.rows_changed(None)
                done.append(f"the rows of '{key}'")
                # A table several processes share: each loads the rows it
                # updates, which its own file holds as it left them (another
                # process's rows there may have been caught mid-update).
                start, end = table.update_rows or (0, table.num_rows)
                fill(table.tensor[start:end], saved_model[key][start:end], f"loading {key}")
            for index, plan in enumerate(plans):
                if plan is not None and plan.in_place_bytes():
                    done.append(f"the moments of optimizer [{index}]")
                    plan.copy_in_place()
            done.append("the dense parameters and buffers")
            self.model.load_state_dict(substituted, strict=self.strict)
            for index, ((opt, state), plan) in enumerate(zip(pairs, plans)):
                done.append(f"optimizer [{index}]")
                if plan is not None:
                    plan.install()
                else:
                    opt.load_state_dict(state)
        except Exception as exc:
            raise RuntimeError(
                f"hostembed.load: loading '{self.path}' failed part way ({type(exc).__name__}: {exc}); the model "
                f"and optimizers are partially loaded: {', '.join(done)} {'was' if len(done) == 1 else 'were'} "
                "being overwritten (the last only in part), the rest is as it was. Load a checkpoint again "
                "before training or saving"
            ) from exc
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: let them through, with a word
            if done and hasattr(exc, "add_note"):
                exc.add_note(f"hostembed.load was interrupted while overwriting {done[-1]}: the model and "
                             "optimizers are partially loaded; load a checkpoint again before training or saving")
            raise


def _tensors(value, name):
    """(name, tensor) for every tensor in nested mappings and lists."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{name}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{name}[{index}]")


class _FileMappings:
    """Where this process maps the checkpoint file (torch.load(mmap=True)
    maps it once, privately): to find a tensor's bytes in the file."""

    def __init__(self, stat):
        self.size = stat.st_size
        self.regions = []  # (start, end, file offset)
        identity = (stat.st_dev, stat.st_ino)
        seen = {}
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) < 6 or not fields[5].startswith("/"):
                        continue
                    name = fields[5].rstrip("\n")
                    if name not in seen:
                        try:
                            st = os.stat(name)
                            seen[name] = (st.st_dev, st.st_ino) == identity
                        except OSError:  # "(deleted)", gone
                            seen[name] = False
                    if seen[name]:
                        start, end = (int(x, 16) for x in fields[0].split("-"))
                        self.regions.append((start, end, int(fields[2], 16)))
        except OSError:
            pass

    def offset(self, address):
        for start, end, file_offset in self.regions:
            if start <= address < end:
                return address - start + file_offset
        return None

    def check_covered(self, tensor, key, path):
        if tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        offset = self.offset(storage.data_ptr())
        if offset is not None and offset + storage.nbytes() > self.size:
            raise ValueError(f"hostembed.load: '{path}' is truncated: {key} needs bytes up to "
                             f"{offset + storage.nbytes()}, the file has {self.size}; nothing was loaded")

    def rows(self, source, tensor):
        """A FileRows for a contiguous 2-D tensor mapped from the file, else None."""
        if tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.dim() != 2 \
                or not tensor.is_contiguous() or tensor.dtype not in LOADABLE or tensor.numel() == 0:
            return None
        offset = self.offset(tensor.data_ptr())
        if offset is None:
            return None
        return FileRows(source, offset, tuple(tensor.shape), tensor.dtype)


class _Filler:
    """Copies a checkpoint tensor into a host table: rows the file maps
    are read with pread (a read error raises; through the mapping it would
    be a SIGBUS), anything else is copied in row chunks."""

    def __init__(self, source, path, mappings):
        self.source, self.name, self.mappings = source, os.path.basename(path), mappings

    def fill(self, dst, src, desc):
        rows = self.mappings.rows(self.source, src)
        if rows is None:
            copy_rows(dst, src.detach(), desc=desc)
            return
        num_rows, dim = rows.shape
        row_bytes = dim * rows.dtype.itemsize
        step = max(1, _READ_PIECE_BYTES // row_bytes)
        with progress_bar(rows.nbytes, None, f"{desc} from {self.name}") as bar:
            for start in range(0, num_rows, step):
                stop = min(start + step, num_rows)
                piece = FileRows(rows.path, rows.offset + start * row_bytes, (stop - start, dim), rows.dtype)
                read_rows(piece, dst[start:stop], progress=False)
                bar.update((stop - start) * row_bytes)


def _check_model(path, saved, model, strict):
    """Checks the model's entries as torch's load_state_dict would, before
    anything is copied; returns the host tables to fill
    [(key, parameter, table)] and the state dict to hand to torch, whose
    host entries are the tables themselves (which it then skips)."""
    if not isinstance(saved, Mapping):
        raise TypeError(f"hostembed.load: '{path}': 'model' must be a state dict (a mapping), found "
                        f"{_validate.describe(saved)}; nothing was loaded")
    odd = [key for key in saved if not isinstance(key, str)]
    if odd:
        raise TypeError(f"hostembed.load: '{path}': the model's state dict has keys that are not strings: "
                        f"{odd[:5]!r}; nothing was loaded")
    try:
        _validate.check_metadata(saved, f"hostembed.load: '{path}': the model's state dict")
    except TypeError as exc:
        raise TypeError(f"{exc}; nothing was loaded") from None
    own = model.state_dict(keep_vars=True)
    extra_state = {f"{name}.{nn.modules.module._EXTRA_STATE_KEY_SUFFIX}".lstrip(".")
                   for name, module in model.named_modules(remove_duplicate=False)
                   if type(module).set_extra_state is not nn.Module.set_extra_state}
    problems = []
    if strict:
        missing = sorted(set(own) - set(saved))
        unexpected = sorted(set(saved) - set(own))
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
    # A module that can say whether its saved extra state fits it
    # (check_extra_state) says so now, before anything loads.
    for name, module in model.named_modules(remove_duplicate=False):
        key = f"{name}.{nn.modules.module._EXTRA_STATE_KEY_SUFFIX}".lstrip(".")
        if key in saved and hasattr(module, "check_extra_state"):
            problem = module.check_extra_state(saved[key])
            if problem is not None:
                problems.append(problem)
    tables = {}  # id(table) -> (key, parameter, table), the last key of a table named twice
    for key in sorted(set(own) & set(saved)):
        mine = own[key]
        if key in extra_state or not isinstance(mine, torch.Tensor):
            continue  # a module's extra state: its own set_extra_state checks it
        problem = _validate.tensor_problem(saved[key], mine, key)
        if problem is not None:
            problems.append(problem)
            continue
        table = table_of(mine)
        if table is not None and table.views(mine):
            tables[id(table)] = (key, mine, table)
    if problems:
        raise RuntimeError(f"hostembed.load: '{path}' does not fit the model, nothing was loaded: "
                           + "; ".join(problems))
    # torch's load is handed the tables themselves for their entries, which
    # it skips (copy_ of a tensor onto itself): the rows come from fill().
    substituted = OrderedDict(saved)
    metadata = getattr(saved, "_metadata", None)
    if metadata is not None:
        substituted._metadata = metadata
    for key in set(own) & set(saved):
        mine = own[key]
        if isinstance(mine, torch.Tensor) and id(table_of(mine)) in tables:
            substituted[key] = mine.detach()
    return list(tables.values()), substituted


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


def _check_optimizer_fits(path, saved, optimizer, where):
    """torch checks group sizes but not the shapes of per-parameter state,
    which would then fail mid-step; check both up front (RuntimeError, as
    for the model; malformed dicts raise TypeError/ValueError). Shapes of
    the per-element state only (exp_avg, momentum_buffer, ...): LBFGS keeps
    flat vectors of all its parameters under the first one."""
    layout = _validate.optimizer_layout(optimizer, saved, where)
    saved_state = saved["state"]
    for _, _, pairs in layout:
        for saved_id, p in pairs:
            for key, value in saved_state.get(saved_id, {}).items():
                # (a row-wise second moment, SparseAdam's, is one value a row)
                if key in _validate.PER_ELEMENT and isinstance(value, torch.Tensor) and value.dim() > 0 \
                        and value.shape != p.shape and not (key == "exp_avg_sq" and value.shape == p.shape[:1]):
                    raise RuntimeError(
                        f"hostembed.load: optimizer state '{key}' of parameter {saved_id} in '{path}' has shape "
                        f"{list(value.shape)}, the parameter has {list(p.shape)}; nothing was loaded"
                    )
