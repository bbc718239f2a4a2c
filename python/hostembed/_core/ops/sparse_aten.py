"""Kernels torch lacks for sparse COO tensors, registered into aten for the
SparseCPU and SparseCUDA keys, so that torch's own gradient utilities take
a row-sparse weight.grad (hostembed's tables, nn.Embedding(sparse=True)):
``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and
``clip_grad_value_``, as Hugging Face's Trainer calls them. A plain swap of
nn.Embedding brings a sparse gradient into scripts that never had one;
these keep them working unchanged.

Each works on the coalesced values: a sparse gradient may hold a row more
than once (several lookups, several backward() calls), and its norm and
its clamp are those of the summed rows, as of the dense gradient. A key
torch already serves is left to torch.
"""
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


def _register():
    for name, kernel in _KERNELS.items():
        for key in _KEYS:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
                _lib.impl(name, kernel, key)


_register()
