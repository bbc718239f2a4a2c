"""EmbeddingBag's input: the forms torch.nn.EmbeddingBag takes, checked and
brought to one (flat ids, offsets, per-sample weights) before any row is
read or renormed, so a refused input changes nothing."""
import torch
from torch import Tensor

from ..._core.ids import check_ids
from ..._core.ops.common import custom_op

MODES = ("sum", "mean", "max")
WHO = "hostembed.EmbeddingBag"


def check_options(mode, scale_grad_by_freq):
    """torch's own checks of the options, with its exception types and words."""
    if mode not in MODES:
        raise ValueError("mode has to be one of sum, mean or max")
    if mode == "max" and scale_grad_by_freq:
        raise ValueError("max mode does not support scaling the gradient by the frequency")


_FIXED_OFFSETS = {}


def _fixed_offsets(bags, length, dtype, device):
    """The offsets of `bags` bags of `length` ids each (a 2-D input), made
    once per shape: a model calls with the same batch shape every step.
    Nothing writes offsets, so one tensor serves every call; never one from
    a trace (torch.compile: its tensors are the graph's)."""
    if torch.compiler.is_compiling():
        return _offsets_of_fixed_bags(bags, length, dtype, device)
    # An inference tensor cannot be saved for a backward outside
    # inference mode (torch's own pooling saves the offsets): one per mode.
    key = (bags, length, dtype, device, torch.is_inference_mode_enabled())
    offsets = _FIXED_OFFSETS.get(key)
    if offsets is None:
        offsets = _offsets_of_fixed_bags(bags, length, dtype, device)
        if len(_FIXED_OFFSETS) >= 64:  # a few shapes at a time in practice
            _FIXED_OFFSETS.clear()
        _FIXED_OFFSETS[key] = offsets
    return offsets


def _offsets_of_fixed_bags(bags, length, dtype, device):
    # torch.arange refuses step 0 (bags of length 0): every bag starts at 0.
    return (torch.arange(0, bags * length, max(length, 1), dtype=dtype, device=device)
            if length else torch.zeros(bags, dtype=dtype, device=device))


def flatten(input, offsets, per_sample_weights, mode, include_last_offset, weights_dtype=torch.float32,
            core_checks_offsets=False):
    """(ids [n], offsets [bags or bags + 1], per_sample_weights [n] or None,
    include_last_offset) from any input form torch's EmbeddingBag takes
    (mode already checked by check_options). core_checks_offsets: 1-D
    offsets are left as given, for the core's pooling to check (which then
    calls check_offsets for torch's error); ids past the last offset stay.
    Raises as torch does (ValueError, NotImplementedError, RuntimeError),
    and also where torch reads out of bounds or says nothing useful
    (offsets that decrease, ids that are not int32/int64)."""
    check_ids(input, WHO, "input")
    if per_sample_weights is not None and input.size() != per_sample_weights.size():
        raise ValueError(
            f"embedding_bag: If per_sample_weights ({per_sample_weights.shape}) is not None, "
            f"then it must have the same shape as the input ({input.shape})"
        )
    if input.dim() == 2 and input.is_nested:
        include_last_offset = True
        offsets = input.offsets()
        input = input.values().reshape(-1)
        if per_sample_weights is not None:
            if not per_sample_weights.is_nested:
                raise ValueError("If input is nested, then per_sample_weights must be nested if specified")
            per_sample_weights = per_sample_weights.values().reshape(-1)
    elif input.dim() == 2:
        if offsets is not None:
            raise ValueError(
                "if input is 2D, then offsets has to be None, as input is treated is a mini-batch of fixed "
                f"length sequences. However, found offsets of type {type(offsets)}"
            )
        offsets = _fixed_offsets(*input.shape, input.dtype, input.device)
        include_last_offset = False
        input = input.reshape(-1)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("offsets has to be a 1D Tensor but got None")
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
            raise ValueError("offsets has to be a 1D Tensor")
    else:
        raise ValueError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}")
    if per_sample_weights is not None and mode != "sum":
        raise NotImplementedError(
            "embedding_bag: per_sample_weights was not None. per_sample_weights is only supported for "
            f"mode='sum' (got mode='{mode}'). Please open a feature request on GitHub."
        )
    check_ids(offsets, WHO, "offsets")
    if core_checks_offsets:  # eager, then
        in_bags = input.numel()
    elif torch.compiler.is_compiling():
        # Checked inside an op: a traced graph cannot read the offsets.
        offsets = checked_offsets.op(offsets, input.numel(), include_last_offset)
        in_bags = input.numel()
    else:
        in_bags = _check_offsets(offsets, input.numel(), include_last_offset)
    if in_bags < input.numel():
        # The ids after the last offset belong to no bag. (torch documents
        # the last offset as the input's length; past it, its CPU kernel
        # pools them into the last bag in some modes and not in others.)
        input = input[:in_bags]
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights[:in_bags]
    if per_sample_weights is not None and per_sample_weights.dtype != weights_dtype:
        # torch's embedding_bag takes one dtype for both, in these words.
        raise RuntimeError(f"{WHO}: expected per_sample_weights to have the same type as the weight "
                           f"({weights_dtype}), got {per_sample_weights.dtype}")
    return input, offsets, per_sample_weights, include_last_offset


def check_offsets(batches):
    """Raises torch's error for the first batch (_core/ops/bags.BagBatch)
    whose offsets torch would refuse; returns if none."""
    for batch in batches:
        _check_offsets(batch.offsets, batch.ids.numel(), batch.include_last_offset)


def _check_offsets(offsets, count, include_last_offset):
    """Each bag is a range of the ids: offsets start at 0, never decrease and
    end within the ids. Returns how many ids are in bags: count, or with
    include_last_offset the last offset. One host read of a bool for
    offsets on a GPU (two for a last offset short of count)."""
    if offsets.numel() == 0:
        if include_last_offset:
            raise RuntimeError("include_last_offset: number of offset should be at least 1")
        return count
    first, last = offsets[0], offsets[-1]
    decreasing = offsets[1:] < offsets[:-1]
    unusual = (first != 0) | (last > count) | decreasing.any()
    if include_last_offset:
        unusual |= last < count
    if not bool(unusual):
        return count
    if int(first) != 0:
        raise RuntimeError("offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start "
                           f"from position 0. However, got {int(first)}")
    if decreasing.any():
        at = int(decreasing.nonzero()[0]) + 1
        raise RuntimeError(f"{WHO}: offsets must not decrease (each bag is a range of the input), but "
                           f"offsets[{at}] = {int(offsets[at])} < offsets[{at - 1}] = {int(offsets[at - 1])}")
    if int(last) > count:
        raise RuntimeError(f"offsets[-1] can not be greater than input's length {count} but got offsets[-1] of "
                           f"{int(last)}")
    return int(last)


@custom_op("hostembed::checked_offsets")
def checked_offsets(offsets: Tensor, count: int, include_last_offset: bool) -> Tensor:
    """A copy of the offsets once _check_offsets passes them, for traced
    code. There the last offset must be the input's length, as torch
    documents: eagerly, ids past it belong to no bag (flatten drops them),
    and a compiled graph cannot drop a data-dependent number of ids."""
    in_bags = _check_offsets(offsets, count, include_last_offset)
    if in_bags < count:
        raise RuntimeError(f"{WHO}: under torch.compile, include_last_offset needs offsets[-1] equal to the input's "
                           f"length (torch's contract), got offsets[-1] = {in_bags} and the input's length {count}")
    return offsets.clone()


@checked_offsets.op.register_fake
def _(offsets, count, include_last_offset):
    return torch.empty_like(offsets)
