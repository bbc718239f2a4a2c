"""Checking and preparing the ids a lookup is asked for."""
import torch

ID_DTYPES = (torch.int64, torch.int32)


class IdDtypeError(TypeError, RuntimeError):
    """Ids of a dtype other than int64/int32.

    A TypeError, and a RuntimeError too because that is what torch raises
    for the same mistake, so code written for nn.Embedding still catches it.
    """


def prepare_ids(ids, who="hostembed.Embedding") -> torch.Tensor:
    """The ids as a contiguous CPU int64/int32 tensor, or a clear error."""
    check_ids(ids, who)
    # Each .to()/.contiguous() costs ~1 us even when it returns ids itself.
    return ids if ids.is_cpu and ids.is_contiguous() else ids.to("cpu").contiguous()


def check_ids(ids, who="hostembed.Embedding", name="ids") -> None:
    """A clear error unless ids is an int64/int32 tensor (on any device)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in ID_DTYPES:
        raise IdDtypeError(f"{who}: {name} must have dtype torch.int64 or torch.int32, got {ids.dtype}")
