"""Compact optimizer state of host tables: moments in float16, bfloat16 or
8 bits, chosen once per optimizer (``state_dtype=``), updated in place by
the core (csrc/quantize.h has the 8-bit formats), and seen in
``state_dict()`` as they are kept.

A state tensor of a [N, D] table is one of:
  float32 [N, D]                torch's (the default)
  float16 or bfloat16 [N, D]
  int8 [N, D]  + float32 [N, B] ``<key>_scale``: value = sign(c) (c s)^2, c the
                                code, s its block's scale (a signed state:
                                exp_avg)
  uint8 [N, D] + float32 [N, B] ``<key>_scale``: value = (c s)^4 (a state never
                                below 0: exp_avg_sq, Adagrad's sum)
  float32 [N]                   one value a row (SparseAdam's row-wise
                                second moment)
with B = ceil(D / 256): a scale per block of 256 columns of a row.

Any form loads into any other (``convert``): 8-bit codes are dequantized,
then the values are cast or quantized to the optimizer's form, a chunk of
rows at a time; a row-wise moment spreads over its row's columns, and a
per-element one becomes a row-wise one as its row's mean.
"""
import warnings

import torch

from ..io.validate import describe

Q8_BLOCK = 256  # csrc/quantize.h: HE_Q8_BLOCK
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
ROUNDINGS = ("nearest", "stochastic")
CODE_DTYPES = (torch.int8, torch.uint8)
_CHUNK_ROWS = 1 << 16


def scale_key(key):
    return f"{key}_scale"


def blocks(dim):
    return (dim + Q8_BLOCK - 1) // Q8_BLOCK


def _warn_if_wider_than_float(table):
    """8-bit codes carry a float32 scale per row and 256 columns: on rows
    this narrow (a width-1 table, as DeepFM's first-order weights) they take
    more bytes than the float state they replace. Said, not silently
    changed: the form stays the one asked for."""
    eight_bit = table.dim + 4 * blocks(table.dim)
    plain = table.dim * table.state_dtype.itemsize
    if eight_bit >= plain:
        warnings.warn(f"hostembed: 8-bit state of a [{table.num_rows}, {table.dim}] table takes {eight_bit} bytes a "
                      f"row and state tensor (codes and a float32 scale) against {plain} as "
                      f"{str(table.state_dtype).replace('torch.', '')}: "
                      "for tables this narrow use state_dtype=torch.bfloat16 (or float32) in an optimizer of their "
                      "own", UserWarning, stacklevel=4)


class StateForm:
    """How one optimizer keeps the state of its host tables: ``dtype`` (one
    of STATE_DTYPES; torch.int8 means 8-bit codes, int8 or uint8 by the
    state's sign) and ``rounding`` (how updated values are stored: to
    nearest, or stochastically, unbiased)."""

    def __init__(self, dtype=torch.float32, rounding="nearest", where="optimizer"):
        if dtype is None:
            dtype = torch.float32
        if isinstance(dtype, str) and dtype in ("int8", "bfloat16", "float16", "float32"):
            dtype = getattr(torch, dtype)
        if dtype not in STATE_DTYPES:
            raise ValueError(f"{where}: state_dtype must be one of torch.float32, torch.bfloat16, torch.float16 or "
                             f"torch.int8 (\"int8\"), got {dtype!r}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"{where}: state_rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if dtype == torch.float16:
            warnings.warn(f"{where}: float16 state underflows squared gradients under about 2.4e-4 (Adam's "
                          "exp_avg_sq takes a thousandth of them: gradients under 8e-3) to 0, and the step then "
                          "divides by eps; training diverged with it on every model "
                          "benchmarks/clients/state_quality.py trains. Use torch.bfloat16 (float32's range) or "
                          "torch.int8", UserWarning, stacklevel=3)
        self.dtype, self.rounding = dtype, rounding

    @property
    def compact(self):
        return self.dtype != torch.float32

    @property
    def stochastic(self):
        return self.rounding == "stochastic"

    def stored_dtype(self, table, nonnegative):
        """The dtype of a state tensor of `table` in this form."""
        if self.dtype == torch.int8:
            return torch.uint8 if nonnegative else torch.int8
        return table.state_dtype if self.dtype == torch.float32 else self.dtype

    def new(self, table, key, nonnegative):
        """{key: zeroed state of `table`, [scale_key(key): its scales]}."""
        dtype = self.stored_dtype(table, nonnegative)
        if dtype in CODE_DTYPES:
            _warn_if_wider_than_float(table)
        state = {key: table.zeros(dtype=dtype)}
        if dtype in CODE_DTYPES:
            state[scale_key(key)] = table.zeros(dtype=torch.float32, width=blocks(table.dim))
        return state

    def core_item(self, table, state, key):
        """What the core's update takes for state `key` of `state` (an
        optimizer's per-parameter state): the tensor, or for a compact one
        (tensor, its scales or None, stochastic)."""
        value = state[key]
        if not self.compact or value.dim() == 1:
            return value
        return (value, state.get(scale_key(key)), self.stochastic)

    def convert(self, table, key, nonnegative, per_row, source, source_scale):
        """New state of `table` in this form (as ``new``), filled from a
        state saved in any form (``source`` and, for 8-bit codes, its
        ``source_scale``), a chunk of rows at a time."""
        if per_row:
            state = {key: table.zeros(per_row=True)}
        else:
            state = self.new(table, key, nonnegative)
        dest, dest_scale = state[key], state.get(scale_key(key))
        for start in range(0, table.num_rows, _CHUNK_ROWS):
            end = min(start + _CHUNK_ROWS, table.num_rows)
            rows = _rows_as_float(source, source_scale, start, end)
            if dest.dtype == torch.float64 and source.dtype == torch.float64:
                rows = source[start:end].reshape(end - start, -1)  # not through float32
            if per_row:
                dest[start:end] = rows.mean(dim=1) if rows.shape[1] != 1 else rows[:, 0]
                continue
            rows = rows.expand(end - start, table.dim)
            if dest_scale is None:
                dest[start:end] = rows
            else:
                codes, scale = quantize(rows, dest.dtype == torch.uint8)
                dest[start:end], dest_scale[start:end] = codes, scale
        return state


def _rows_as_float(value, scale, start, end):
    """Rows [start, end) of a saved state as float32 [rows, D] (or [rows, 1]
    for a row-wise one)."""
    rows = value[start:end]
    if rows.dim() == 1:
        return rows.to(torch.float32).unsqueeze(1)
    if rows.dtype in CODE_DTYPES:
        return dequantize(rows, scale[start:end])
    return rows.to(torch.float32)


def dequantize(codes, scale):
    """float32 values of 8-bit codes [N, D] and their scales [N, B]."""
    dim = codes.shape[1]
    per_column = scale.to(torch.float32).repeat_interleave(Q8_BLOCK, dim=1)[:, :dim]
    r = codes.to(torch.float32) * per_column
    return (r * r) * (r * r) if codes.dtype == torch.uint8 else r * r.abs()


def _sqrt(values):
    # Correctly rounded, as the core's sqrtf (torch's float32 sqrt is not
    # always): a float64 square root rounded to float32 is.
    return values.double().sqrt().float()


def _root(values, nonnegative):
    return _sqrt(_sqrt(values)) if nonnegative else _sqrt(values.abs()).copysign(values)


def quantize(values, nonnegative):
    """(codes, scales) of float32 values [N, D], rounded to nearest, as the
    core quantizes a block (csrc/quantize.h): uint8 codes of the fourth root
    for a state that is never negative (a positive value at least code 1),
    else int8 codes of the signed square root."""
    n, dim = values.shape
    nb = blocks(dim)
    padded = torch.zeros(n, nb * Q8_BLOCK, dtype=torch.float32)
    padded[:, :dim] = values
    padded = padded.view(n, nb, Q8_BLOCK)
    top = 255.0 if nonnegative else 127.0
    roots = _root(padded, nonnegative)
    peak = roots.abs().amax(dim=2)
    finite = torch.isfinite(roots).all(dim=2)
    # Tensor by tensor, in float32 as the core divides: torch divides by a
    # Python number as a multiplication by its reciprocal, another rounding.
    tops = torch.full_like(peak, top)
    scale = torch.where(finite, peak / tops, torch.full_like(peak, float("nan")))
    inv = torch.where(finite & (peak > 0), tops / peak, torch.zeros_like(peak))
    codes = torch.round(roots * inv.unsqueeze(2)).clamp(-top, top).nan_to_num(0.0)
    if nonnegative:
        codes = torch.where((padded > 0) & (codes < 1) & finite.unsqueeze(2), torch.ones_like(codes), codes)
    codes = codes.view(n, nb * Q8_BLOCK)[:, :dim]
    return codes.to(torch.uint8 if nonnegative else torch.int8), scale


def check_saved(value, scale, key, param, where, per_row_ok):
    """A saved state tensor in any form (TypeError or ValueError naming
    it): float [N, D] (or [N] where a row-wise one may load), or 8-bit
    codes [N, D] with float32 scales [N, ceil(D / 256)]."""
    num_rows, dim = param.shape
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_meta:
        raise TypeError(f"{where}: '{key}' must be a dense tensor, found {describe(value)}")
    shapes = [(num_rows, dim)] + ([(num_rows,)] if per_row_ok else [])
    if value.dtype in CODE_DTYPES:
        if tuple(value.shape) != (num_rows, dim):
            raise ValueError(f"{where}: state '{key}' has shape {list(value.shape)}, expected {[num_rows, dim]}")
        want = (num_rows, blocks(dim))
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(f"{where}: 8-bit state '{key}' needs '{scale_key(key)}', a float32 tensor of shape "
                             f"{list(want)} (a scale per {Q8_BLOCK} columns of a row), found {describe(scale)}")
        return
    if not value.is_floating_point():
        raise TypeError(f"{where}: '{key}' must be a floating-point tensor or 8-bit codes (int8, uint8), found "
                        f"{describe(value)}")
    if tuple(value.shape) not in shapes:
        raise ValueError(f"{where}: state '{key}' has shape {list(value.shape)}, expected "
                         f"{' or '.join(str(list(s)) for s in shapes)}")
    if scale is not None:
        raise ValueError(f"{where}: '{scale_key(key)}' belongs to 8-bit codes, but '{key}' is {value.dtype}")


def state_bytes(state):
    """Bytes of host memory the tensors of one parameter's state take."""
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


class StateBytes(dict):
    """{parameter: bytes of its state}, keyed as ``optimizer.state`` is, so
    that ``opt.state_bytes()[model.emb.weight]`` finds a table's bytes.
    Printed, a dict keyed by parameters would print every table whole; this
    prints each as ``optimizer.state_dict()`` numbers it (its index in the
    param groups), its name where the optimizer was given named parameters,
    its shape and dtype."""

    def __init__(self, items=(), labels=None):
        super().__init__(items)
        self._labels = {} if labels is None else labels

    def copy(self):
        return StateBytes(self, dict(self._labels))

    def __repr__(self):
        shown = []
        for param, size in self.items():
            if isinstance(param, torch.Tensor):
                dtype = str(param.dtype).removeprefix("torch.")
                label = f"{self._labels.get(param, 'param')} {list(param.shape)} {dtype}"
            else:  # a key a caller added
                label = repr(param)
            shown.append(f"{label}: {size} bytes")
        return "{" + ", ".join(shown) + "}"
