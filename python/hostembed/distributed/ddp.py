"""Keeping hostembed's distributed tables out of DistributedDataParallel."""
import torch
from torch import nn

from .shared_embedding import SharedEmbedding
from .sharded_embedding import _RowSharded


def exclude_from_ddp(model: nn.Module) -> None:
    """Keeps every ShardedEmbedding, ShardedEmbeddingBag and SharedEmbedding in `model` out of
    DistributedDataParallel's gradient all-reduce, which would average
    gradients these tables already sum over the ranks (and a sharded
    table's ranks hold different rows): call it before wrapping `model` in
    DDP.

    Args:
        model (torch.nn.Module): the model about to be wrapped; every
            parameter and buffer of its distributed tables is left out of
            DDP's synchronisation (its other parameters stay in).
    """
    names = [f"{prefix}.{name}" if prefix else name
             for prefix, module in model.named_modules() if isinstance(module, (_RowSharded, SharedEmbedding))
             for name, _ in [*module.named_parameters(), *module.named_buffers()]]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
