"""Checks run before a load changes anything (hostembed.load, Embedding and
SparseAdam load_state_dict).

They read metadata only (types, shapes, dtypes, hyperparameters, step
counts), never the rows, so they cost microseconds even for a 40 GB table.
Each raises (or returns) a message that names the entry, what was expected
and what was found:

* TypeError: an entry of the wrong type (a step that is a str, a moment that
  is not a tensor or not a floating tensor, betas that are not a pair);
* ValueError: the right type with a value out of range (beta >= 1, lr < 0,
  a negative step) or a malformed layout (missing keys, parameter ids that
  no group lists);
* DoesNotFit (a ValueError): a well-formed state that does not fit this
  model or optimizer (group count or sizes, a shape): hostembed.load reports
  those as RuntimeError, like its other "does not fit" errors.
"""
import math
import numbers
import sys
import warnings
from collections.abc import Mapping

import torch

# One past the largest step count the core takes: it adds 1 and passes an int64.
MAX_STEP = (1 << 63) - 2


class DoesNotFit(ValueError):
    """A well-formed state for another model or optimizer."""


def describe(value):
    """A short account of a value for messages: its type and, for small
    values, the value itself."""
    if isinstance(value, torch.Tensor):
        layout = "" if value.layout == torch.strided else f" {value.layout}"
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"a {list(value.shape)} {value.dtype}{layout} tensor{where}"
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


# ---- hyperparameters


def real_value(value, name, where, *, tensor_ok=True):
    """value as a float for range checks: a real number (not a bool) or, as
    torch's constructors allow for lr and betas, a 1-element real tensor."""
    if isinstance(value, torch.Tensor) and tensor_ok:
        if value.numel() != 1:
            raise ValueError(f"{where}: '{name}' is a tensor of {value.numel()} elements; a tensor {name} must have "
                             "exactly one")
        if value.is_complex() or value.dtype == torch.bool or value.layout != torch.strided or value.is_meta:
            raise TypeError(f"{where}: '{name}' must be a real number, found {describe(value)}")
        return float(value.detach().cpu().reshape(()))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: '{name}' must be a real number, found {describe(value)}")
    if isinstance(value, numbers.Integral) and not -(1 << 63) <= value < (1 << 63):
        # torch turns a Python int into an int64 scalar: Adam(weight_decay=2**64) is
        # accepted by its constructor, then its step raises OverflowError.
        raise ValueError(f"{where}: '{name}' is the int {value}, which does not fit in 64 bits")
    return float(value)


def flag(group, name, where, *, none_ok=False):
    if name not in group:
        return
    value = group[name]
    if isinstance(value, bool) or (none_ok and value is None):
        return
    raise TypeError(f"{where}: '{name}' must be {'True, False or None' if none_ok else 'True or False'}, "
                    f"found {describe(value)}")


def _betas(group, where):
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{where}: 'betas' must be a pair (beta1, beta2), found {describe(betas)}")
    for index, beta in enumerate(betas):
        value = real_value(beta, f"betas[{index}]", where)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{where}: Invalid beta parameter at index {index}: expected 0 <= betas[{index}] < 1, "
                             f"found {value!r}")


def require_keys(group, keys, where):
    missing = [key for key in keys if key not in group]
    if missing:
        raise ValueError(f"{where}: the param group has no {', '.join(repr(k) for k in missing)} "
                         f"(it has {sorted(map(str, group))})")


def check_sparse_adam_group(group, where):
    """The checks of SparseAdam's constructor (torch's), applied to a loaded
    param group: 0 <= beta < 1, eps > 0, and lr >= 0 (the constructor asks
    lr > 0, but a scheduler may drive lr to 0, e.g. cosine annealing to
    eta_min=0, and that checkpoint must load); maximize a bool."""
    require_keys(group, ("lr", "betas", "eps"), where)
    lr = real_value(group["lr"], "lr", where)
    if not lr >= 0.0:
        raise ValueError(f"{where}: Invalid learning rate: expected lr >= 0, found {lr!r}")
    eps = real_value(group["eps"], "eps", where, tensor_ok=False)
    if not eps > 0.0:
        raise ValueError(f"{where}: Invalid epsilon value: expected eps > 0, found {eps!r}")
    _betas(group, where)
    flag(group, "maximize", where)
    check_plain_values(group, where, skip=("params", "lr", "betas", "eps", "maximize"))


def check_torch_group(optimizer, group, where):
    """What torch's own constructors check, for the optimizers hostembed
    models commonly pair with a host table (Adam, AdamW, SGD); any other
    optimizer gets the checks every torch optimizer shares (lr >= 0)."""
    # Required: what the class's __setstate__ does not default (an older
    # torch's checkpoint lacks the flags added since).
    if isinstance(optimizer, torch.optim.Adam):  # AdamW too
        require_keys(group, ("lr", "betas", "eps", "weight_decay"), where)
        _betas(group, where)
        eps = real_value(group["eps"], "eps", where, tensor_ok=False)
        if not eps >= 0.0:
            raise ValueError(f"{where}: Invalid epsilon value: expected eps >= 0, found {eps!r}")
        for name in ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay"):
            flag(group, name, where)
        for name in ("foreach", "fused"):
            flag(group, name, where, none_ok=True)
    elif isinstance(optimizer, torch.optim.SGD):
        require_keys(group, ("lr", "momentum", "dampening", "weight_decay"), where)
        momentum = real_value(group["momentum"], "momentum", where, tensor_ok=False)
        if not momentum >= 0.0:
            raise ValueError(f"{where}: Invalid momentum value: expected momentum >= 0, found {momentum!r}")
        real_value(group["dampening"], "dampening", where, tensor_ok=False)
        for name in ("nesterov", "maximize", "differentiable"):
            flag(group, name, where)
        for name in ("foreach", "fused"):
            flag(group, name, where, none_ok=True)
    elif "lr" not in group:
        return
    lr = real_value(group["lr"], "lr", where)
    if not lr >= 0.0:
        raise ValueError(f"{where}: Invalid learning rate: expected lr >= 0, found {lr!r}")
    if "weight_decay" in group:
        decay = real_value(group["weight_decay"], "weight_decay", where, tensor_ok=False)
        if not decay >= 0.0:
            raise ValueError(f"{where}: Invalid weight_decay value: expected weight_decay >= 0, found {decay!r}")


_PLAIN = (bool, numbers.Number, str, type(None), torch.Tensor, torch.dtype)


def check_plain_values(mapping, where, skip=()):
    """Other entries of a param group (a scheduler's 'initial_lr', torch's
    'param_names', ...): kept as they are, but only plain data (numbers,
    strings, None, tensors, dtypes and short lists or tuples of them)."""
    for key, value in mapping.items():
        if key in skip:
            continue
        items = value if isinstance(value, (list, tuple)) else (value,)
        if not all(isinstance(item, _PLAIN) for item in items):
            raise TypeError(f"{where}: '{key}' must be plain data (numbers, strings, None, tensors, or a list of "
                            f"them), found {describe(value)}")


# ---- per-parameter state

# State that torch's optimizers keep per element of their parameter, so
# shaped like it. Other state need not be: LBFGS keeps flat vectors of all
# its parameters ('d', 'prev_flat_grad') under the first one.
PER_ELEMENT = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "sum", "square_avg", "acc_delta",
                         "momentum_buffer", "grad_avg", "prev", "step_size", "ax"})


def check_step(value, where, name="step"):
    """A step count: an int >= 0 or a 0-d real tensor holding one (torch's
    Adam keeps a float32 0-d tensor); the value as an int."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.layout != torch.strided or value.is_meta or value.is_complex() \
                or value.dtype == torch.bool:
            raise TypeError(f"{where}: '{name}' must be an int >= 0 or a 0-d tensor holding one, found "
                            f"{describe(value)}")
        number = value.detach().cpu().item()
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: '{name}' must be an int >= 0 or a 0-d tensor holding one, found "
                        f"{describe(value)}")
    else:
        number = int(value)
    if isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
        raise ValueError(f"{where}: '{name}' must be a whole number of steps, found {number!r}")
    number = int(number)
    if not 0 <= number <= MAX_STEP:
        raise ValueError(f"{where}: '{name}' must be between 0 and {MAX_STEP}, found {number}")
    return number


def check_moment(value, param, name, where):
    """An optimizer moment (exp_avg, exp_avg_sq, ...): a dense floating
    tensor (complex for a complex parameter) shaped like its parameter."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: '{name}' must be a tensor shaped like the parameter {list(param.shape)}, found "
                        f"{describe(value)}")
    if value.layout != torch.strided or value.is_meta:
        raise TypeError(f"{where}: '{name}' must be a dense tensor with data, found {describe(value)}")
    floating = value.is_floating_point() or (param.is_complex() and value.is_complex())
    if not floating:
        raise TypeError(f"{where}: '{name}' must be a floating-point tensor, found {describe(value)}")
    if tuple(value.shape) != tuple(param.shape):
        raise DoesNotFit(f"{where}: state '{name}' has shape {list(value.shape)}, expected {list(param.shape)} like "
                         "the parameter")


def check_state_values(state, param, where):
    """Per-parameter state of an optimizer hostembed does not know: a step
    count if there is one, tensors with dimensions shaped like the
    parameter, and no strings or containers of junk (torch's
    load_state_dict would turn a str into the repr of a generator)."""
    for key, value in state.items():
        if key == "step":
            check_step(value, where)
            continue
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                if item.layout != torch.strided or item.is_meta:
                    raise TypeError(f"{where}: '{key}' must be a dense tensor with data, found {describe(item)}")
                if key in PER_ELEMENT and item is value and tuple(item.shape) != tuple(param.shape):
                    raise DoesNotFit(f"{where}: state '{key}' has shape {list(item.shape)}, expected "
                                     f"{list(param.shape)} like the parameter")
            elif isinstance(item, bool) or item is None:
                continue
            elif not isinstance(item, numbers.Real):
                raise TypeError(f"{where}: '{key}' must be a tensor or a number, found {describe(item)}")


ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def check_adam_state(state, param, group, where):
    """torch.optim.Adam / AdamW: an empty state, or step + both moments
    (+ max_exp_avg_sq with amsgrad); Adam.step() would raise KeyError
    half-way through its parameters otherwise."""
    if not state:
        return
    needed = ("step",) + ADAM_MOMENTS + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    missing = [key for key in needed if key not in state]
    if missing:
        raise ValueError(f"{where}: the state has no {', '.join(repr(k) for k in missing)} (it has "
                         f"{sorted(map(str, state))}); expected all of {list(needed)} or none")
    check_step(state["step"], where)
    for key in needed[1:]:
        check_moment(state[key], param, key, where)
    check_state_values(state, param, where)


# ---- the layout of an optimizer state dict


def optimizer_layout(optimizer, saved, where):
    """Checks the shape of an optimizer state dict against `optimizer` and
    returns [(group index, saved group, [(saved id, param), ...])].

    TypeError/ValueError for a malformed dict, DoesNotFit for one that is
    well formed but belongs to another optimizer (group count and sizes:
    torch's checks, with the numbers)."""
    if not isinstance(saved, Mapping):
        raise TypeError(f"{where}: expected an optimizer state dict (a mapping with 'state' and 'param_groups'), "
                        f"found {describe(saved)}")
    missing = [key for key in ("state", "param_groups") if key not in saved]
    if missing:
        raise ValueError(f"{where}: the optimizer state dict has no {', '.join(repr(k) for k in missing)} "
                         f"(it has {sorted(map(str, saved))})")
    state, groups = saved["state"], saved["param_groups"]
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: 'state' must be a mapping from parameter ids to their state, found "
                        f"{describe(state)}")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise TypeError(f"{where}: 'param_groups' must be a list of mappings, found {describe(groups)}")
    seen = set()
    for index, group in enumerate(groups):
        ids = group.get("params")
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in ids):
            raise TypeError(f"{where}: param_groups[{index}]['params'] must be a list of int parameter ids, found "
                            f"{describe(ids)}")
        repeated = sorted(seen.intersection(ids)) or sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"{where}: parameter id(s) {repeated} appear more than once in 'param_groups'")
        seen.update(ids)
    own = optimizer.param_groups
    if len(groups) != len(own):
        raise DoesNotFit(f"{where}: the state dict has {len(groups)} parameter group(s), the optimizer has "
                         f"{len(own)}")
    sizes, saved_sizes = [len(g["params"]) for g in own], [len(g["params"]) for g in groups]
    if sizes != saved_sizes:
        raise DoesNotFit(f"{where}: the state dict has parameter groups of sizes {saved_sizes}, the optimizer has "
                         f"{sizes}")
    strays = [key for key in state if key not in seen]
    if strays:
        raise ValueError(f"{where}: 'state' holds parameter id(s) {sorted(map(repr, strays))[:5]} that no param "
                         "group lists")
    for key, value in state.items():
        if not isinstance(value, Mapping):
            raise TypeError(f"{where}: the state of parameter {key} must be a mapping, found {describe(value)}")
    return [(index, group, list(zip(group["params"], own_group["params"])))
            for index, (group, own_group) in enumerate(zip(groups, own))]


def check_torch_optimizer(optimizer, saved, where):
    """Everything checkable of a state dict for a torch optimizer (Adam,
    SGD, ...) before its load_state_dict runs, then a dry run of that
    load_state_dict on a throwaway copy of the optimizer: torch's own load
    replaces the state and then fails in __setstate__ (Adam's float(step)),
    leaving it half loaded; the dry run makes any such failure happen where
    it changes nothing. Costs what torch's load costs for the dense state (a
    deepcopy of the param groups, dtype casts of the moments)."""
    layout = optimizer_layout(optimizer, saved, where)
    state = saved["state"]
    adam = isinstance(optimizer, torch.optim.Adam)  # AdamW too
    for index, group, pairs in layout:
        group_where = f"{where}: param_groups[{index}]"
        check_torch_group(optimizer, group, group_where)
        for saved_id, param in pairs:
            if saved_id not in state:
                continue
            param_where = f"{where}: state of parameter {saved_id}"
            if adam:
                check_adam_state(state[saved_id], param, group, param_where)
            else:
                check_state_values(state[saved_id], param, param_where)
    dry_run_torch_load(optimizer, saved, where)


def dry_run_torch_load(optimizer, saved, where):
    probe = object.__new__(type(optimizer))
    probe.__dict__.update(optimizer.__dict__)
    # Hooks belong to the real load (they may have side effects): none here.
    probe.__dict__["_optimizer_load_state_dict_pre_hooks"] = {}
    probe.__dict__["_optimizer_load_state_dict_post_hooks"] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.optim.Optimizer.load_state_dict(probe, saved)
    except Exception as exc:  # noqa: BLE001 - reported in the documented types
        kind = TypeError if isinstance(exc, TypeError) else ValueError
        raise kind(f"{where}: {type(optimizer).__name__}.load_state_dict refuses this state dict: "
                   f"{type(exc).__name__}: {exc}") from exc


# ---- tensors a module's load_state_dict copies


_castable_cache = {}


def _castable(src, dst):
    key = (src, dst)
    if key not in _castable_cache:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # complex -> real warns, and copies
                torch.empty(1, dtype=dst).copy_(torch.empty(1, dtype=src))
            _castable_cache[key] = True
        except Exception:  # noqa: BLE001 - any refusal means "not castable"
            _castable_cache[key] = False
    return _castable_cache[key]


def tensor_problem(value, target, key):
    """Why torch's Module.load_state_dict would refuse to copy `value` into
    the parameter or buffer `target` (a message naming `key`), or None.
    Checked from metadata: the type, layout, shape (with torch's [1] -> 0-d
    allowance) and whether the dtype casts to the target's."""
    if not isinstance(value, torch.Tensor):
        return f"'{key}' must be a tensor, found {describe(value)}"
    if torch.nn.parameter.is_lazy(target) or target.is_meta:
        return None  # torch does not copy into these
    if value.layout != torch.strided:
        return f"'{key}' must be a dense (strided) tensor, found {describe(value)}"
    if value.is_meta:
        return f"'{key}' is a meta tensor (it holds no data)"
    shape = tuple(value.shape)
    if target.dim() == 0 and shape == (1,):
        shape = ()
    if shape != tuple(target.shape):
        return f"'{key}' has shape {list(value.shape)} in the checkpoint, {list(target.shape)} in the model"
    if not target.is_quantized and not _castable(value.dtype, target.dtype):
        return f"'{key}' is {describe(value)}, which does not convert to the model's {target.dtype}"
    return None


def check_metadata(state_dict, where):
    """The `_metadata` torch.save keeps beside a state dict (per-module
    versions that modules such as BatchNorm compare with ints)."""
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise TypeError(f"{where}: the state dict's _metadata must be a mapping, found {describe(metadata)}")
    for prefix, entry in metadata.items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where}: _metadata[{prefix!r}] must be a mapping, found {describe(entry)}")
        version = entry.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"{where}: _metadata[{prefix!r}]['version'] must be an int, found {describe(version)}")


# ---- Embedding._load_from_state_dict's helpers


def same_memory(a, b):
    """True when tensors a and b are the same elements of the same memory."""
    if a.layout != torch.strided or a.is_meta or b.is_meta or a.device != b.device:
        return False
    return a.numel() > 0 and b.numel() > 0 and a.data_ptr() == b.data_ptr() and a.stride() == b.stride() \
        and a.dtype == b.dtype and a.shape == b.shape


def shares_memory(a, b):
    """True when tensor a views any byte of b's storage."""
    if a.layout != torch.strided or a.is_meta or a.device != b.device or not a.numel() or not b.numel():
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def strict_of_running_load():
    """The `strict` argument of the torch.nn.Module.load_state_dict call this
    load runs under, or None when there is none (a custom loader calling
    _load_from_state_dict itself)."""
    code = torch.nn.Module.load_state_dict.__code__
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return None
