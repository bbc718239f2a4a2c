"""ShardedEmbeddingBag: torch.nn.EmbeddingBag's bags over a table whose rows
are spread over the ranks of a process group, as ShardedEmbedding spreads
them."""
import torch
import torch.nn.functional as F

from ..nn.lookup import bag_input
from ..nn.lookup.bag_cpu import padding_row
from .agreement import check_pretrained
from .sharded_embedding import _RowSharded

WHO = "hostembed.distributed.ShardedEmbeddingBag"


class ShardedEmbeddingBag(_RowSharded):
    r"""An :class:`torch.nn.EmbeddingBag` whose table is too big for one
    process: its rows are spread over the ranks as
    :class:`ShardedEmbedding` spreads them (rank r holds rows
    ``[r * N // W, (r + 1) * N // W)`` in ``self.shard``, a
    :class:`hostembed.Embedding`, and its optimizer updates only those).

    ``forward(input, offsets=None, per_sample_weights=None)`` takes each
    rank's own bags in any form ``nn.EmbeddingBag`` takes (2-D ids, or 1-D
    ids with offsets, ``include_last_offset``, per-sample weights in
    ``"sum"`` mode, ``padding_idx`` left out of each bag) and returns the
    pooled bags on ``device`` (the CPU by default). The rank's distinct
    ids are looked up through their owners (ShardedEmbedding's
    all-to-alls), then pooled here by
    torch's ``embedding_bag``; backward sends each distinct row's gradient
    to its owner, where the shard sums what every rank sent (the gradient
    of the sum of the ranks' losses). Every rank must call forward and
    backward the same number of times, like any collective.

    Arguments as :class:`torch.nn.EmbeddingBag` (``num_embeddings``,
    ``embedding_dim``, ``mode``, ``padding_idx``, ``include_last_offset``,
    ``sparse``, ``dtype``; ``max_norm`` and ``scale_grad_by_freq`` are not
    taken), ``process_group`` (default: the world) and
    ``share_within_host`` and ``device`` (as :class:`ShardedEmbedding`'s). Any hostembed
    optimizer trains the shard, ``fused=True`` too; keep the module out of
    ``DistributedDataParallel`` with :func:`exclude_from_ddp`. An id
    outside the table on any rank raises ``IndexError`` on every rank, and
    ranks that build different tables raise ``ValueError``.
    """

    _who = WHO

    def __init__(self, num_embeddings, embedding_dim, mode="mean", padding_idx=None, include_last_offset=False, *,
                 process_group=None, sparse=True, dtype=None, share_within_host=False, device=None, _weight=None,
                 _host=None, storage=None, ram_budget=None, cache_rows=None):
        bag_input.check_options(mode, False)
        super().__init__(num_embeddings, embedding_dim, padding_idx, process_group, sparse, dtype, _weight,
                         flags=(mode, bool(include_last_offset)), share_within_host=share_within_host, device=device,
                         _host=_host, storage=storage, ram_budget=ram_budget, cache_rows=cache_rows)
        self.mode, self.include_last_offset = mode, bool(include_last_offset)

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, mode="mean", padding_idx=None, include_last_offset=False, *,
                        process_group=None, sparse=True, share_within_host=False, device=None, _host=None,
                        storage=None, ram_budget=None, cache_rows=None):
        """A table holding `embeddings` (the whole [N, D] table, the same on
        every rank), each rank keeping its own rows."""
        check_pretrained(WHO, embeddings)
        module = cls(*embeddings.shape, mode, padding_idx, include_last_offset, process_group=process_group,
                     sparse=sparse, dtype=embeddings.dtype, share_within_host=share_within_host, device=device,
                     _weight=embeddings, _host=_host, storage=storage, ram_budget=ram_budget, cache_rows=cache_rows)
        module._shard_weight().requires_grad_(not freeze)
        return module

    def forward(self, input, offsets=None, per_sample_weights=None):
        ids, offsets, per_sample_weights, include_last_offset = bag_input.flatten(
            input, offsets, per_sample_weights, self.mode, self.include_last_offset, self._shard_weight().dtype)
        ids, offsets = ids.cpu(), offsets.cpu()
        rows, _, unique, inverse = self._distinct_rows(ids.reshape(-1))
        padding = -1 if self.padding_idx is None else self.padding_idx
        return self._to_output(F.embedding_bag(
            inverse, rows, offsets.to(torch.int64), mode=self.mode,
            per_sample_weights=None if per_sample_weights is None else per_sample_weights.cpu(),
            include_last_offset=include_last_offset, padding_idx=padding_row(unique, padding)))

    def extra_repr(self):
        return f"{super().extra_repr()}, mode={self.mode!r}"
