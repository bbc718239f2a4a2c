"""What the ranks of a group agree on before building a distributed table:
that torch.distributed is up, that every rank asks for the same table, and
which rows each rank holds or updates."""
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..nn.host_module import padding_index


class Agreed(NamedTuple):
    group: object
    rank: int
    world: int
    padding_idx: object  # int or None
    dtype: torch.dtype
    bounds: list  # rank r's rows: [bounds[r], bounds[r + 1])
    extras: list  # each rank's `extra`, in rank order


def agree(who, num_embeddings, embedding_dim, padding_idx, dtype, process_group, weight, *, flags=(),
          extra=None):
    """The group's agreement on a [num_embeddings, embedding_dim] table
    (`flags`: more options that must match; `extra`: a fact each rank
    shares, such as its host). ValueError on every rank if the ranks ask
    for different tables, or if `weight` (the values, or None) is not of
    the table's shape."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who} needs torch.distributed initialised first (torch.distributed.init_process_group)")
    group = process_group if process_group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    padding_idx = padding_index(padding_idx, num_embeddings)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    spec = (int(num_embeddings), int(embedding_dim), padding_idx, str(dtype), *flags)
    seen = [None] * world
    dist.all_gather_object(seen, (spec, extra), group=group)
    if any(s != seen[0][0] for s, _ in seen):
        described = "; ".join(f"rank {r}: (num_embeddings, embedding_dim, padding_idx, dtype, ...) = {s}"
                              for r, (s, _) in enumerate(seen))
        raise ValueError(f"{who}: every rank must build the same table, got {described}")
    if weight is not None and tuple(weight.shape) != (num_embeddings, embedding_dim):
        raise ValueError(f"{who}: the table's values must be [{num_embeddings}, {embedding_dim}], got "
                         f"{list(weight.shape)}")
    bounds = [int(num_embeddings) * r // world for r in range(world + 1)]
    return Agreed(group, rank, world, padding_idx, dtype, bounds, [e for _, e in seen])


def check_pretrained(who, embeddings):
    if embeddings.dim() != 2:
        raise ValueError(f"{who}: embeddings must be 2-D, got {embeddings.dim()}-D")
