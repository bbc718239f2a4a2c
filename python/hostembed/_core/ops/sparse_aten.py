"""Kernels torch lacks for sparse COO tensors, registered into aten for the
SparseCPU and SparseCUDA keys, so that torch's own gradient utilities take
a row-sparse weight.grad (hostembed's tables, nn.Embedding(sparse=True)):
``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and
``clip_grad_value_``, as Hugging Face's Trainer calls them. A plain swap of
nn.Embedding brings a sparse gradient into scripts that never had one;
these keep them working unchanged.

Each works on the coalesced values: a sparse gradient may hold a row more
than once (several lookups, several backward() calls), and its norm and
its clamp are those of the summed rows, as of the dense gradient.

An op that torch already serves for a key is left to torch, whether its
kernel is registered for that key or reaches it through an alias key
(CompositeImplicitAutograd, CompositeExplicitAutograd, ...): a later torch
that adds such a kernel must not be overridden. Only torch's private
dispatcher can say which kernel a key would run; where this torch lacks
that function, nothing is registered and a warning says what won't work.
"""
import warnings

import torch

_KEYS = ("SparseCPU", "SparseCUDA")
_lib = torch.library.Library("aten", "IMPL")


def _coalesced_in_place(t):
    """t with each row once (summed), in place: copy_ between sparse
    tensors replaces indices and values."""
    if not t.is_coalesced():
        t.copy_(t.coalesce())
    return t


def _vector_norm(t, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dim is not None and (not isinstance(dim, (list, tuple)) or len(dim) != 0):
        raise NotImplementedError(f"linalg.vector_norm of a sparse tensor: over all its elements only (dim=None), "
                                  f"got dim={dim!r}")
    ord = float(ord)
    if not (ord > 0 or ord == 0):
        raise NotImplementedError(f"linalg.vector_norm of a sparse tensor: ord > 0, 0 or inf, got {ord!r}")
    values = t.coalesce()._values()
    if dtype is not None:
        values = values.to(dtype)
    # The implicit zeros add nothing to these norms.
    out = torch.linalg.vector_norm(values, ord) if values.numel() else \
        torch.zeros((), dtype=dtype or t.dtype, device=t.device)
    return out.reshape([1] * t.dim()) if keepdim else out


def _clamp_values_(name):
    def clamp_(t, bound):
        _coalesced_in_place(t)
        getattr(t._values(), name)(bound)
        return t
    return clamp_


def _clamp_(t, min=None, max=None):
    _coalesced_in_place(t)
    t._values().clamp_(min, max)
    return t


# clamp's implicit zeros stay zeros only when 0 is inside the bounds;
# clip_grad_value_ clamps to [-c, c], c >= 0.
def _zero_inside(low, high):
    return (low is None or float(low) <= 0) and (high is None or float(high) >= 0)


def _checked(kernel, bounds):
    def run(t, *args, **kwargs):
        if not _zero_inside(*bounds(*args, **kwargs)):
            raise NotImplementedError("clamping a sparse tensor to bounds that exclude 0 would make every implicit "
                                      "zero nonzero: take .to_dense() first")
        return kernel(t, *args, **kwargs)
    return run


_KERNELS = {
    "linalg_vector_norm": _vector_norm,
    "clamp_min_": _checked(_clamp_values_("clamp_min_"), lambda b: (b, None)),
    "clamp_max_": _checked(_clamp_values_("clamp_max_"), lambda b: (None, b)),
    "clamp_": _checked(_clamp_, lambda min=None, max=None: (min, max)),
}


# torch's private question "would a call with this key run some kernel",
# the dispatch table's computed entry: a kernel for the exact key, one
# reached through an alias key, or a backend fallback.
_SERVED = "_dispatch_has_computed_kernel_for_dispatch_key"

_WONT_WORK = ("torch.nn.utils.clip_grad_norm_, get_total_norm and clip_grad_value_ (linalg.vector_norm, clamp_) "
              "on row-sparse gradients (hostembed tables, nn.Embedding(sparse=True)) fail as in plain torch; "
              "hostembed.clip_grad_norm_ still clips them")


def _register(kernels=_KERNELS, keys=_KEYS, lib=_lib):
    """Registers each kernel into lib for each key no kernel serves yet;
    returns the (name, key) pairs registered. All are checked before any
    is registered, so that a check that fails registers nothing."""
    served = getattr(torch._C, _SERVED, None)
    todo = []
    try:
        if served is None:
            raise AttributeError(f"torch._C.{_SERVED} is missing")
        for name, kernel in kernels.items():
            for key in keys:
                if not served(f"{lib.ns}::{name}", key):
                    todo.append((name, kernel, key))
    except (AttributeError, TypeError, RuntimeError) as exc:
        # A private function moved or changed: guessing could override a
        # kernel torch has, and import must not fail over an extra.
        warnings.warn(f"hostembed: registered no sparse kernels into {lib.ns} (torch {torch.__version__}: could not "
                      f"ask which kernels it has: {exc}); {_WONT_WORK}", RuntimeWarning, stacklevel=2)
        return []
    for name, kernel, key in todo:
        lib.impl(name, kernel, key)
    return [(name, key) for name, _, key in todo]


_register()
