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

    The arguments are :class:`torch.nn.EmbeddingBag`'s (``max_norm`` and
    ``scale_grad_by_freq`` are not taken) and :class:`ShardedEmbedding`'s.
    Any hostembed
    optimizer trains the shard, ``fused=True`` too; keep the module out of
    ``DistributedDataParallel`` with :func:`exclude_from_ddp`. An id
    outside the table on any rank raises ``IndexError`` on every rank, and
    ranks that build different tables raise ``ValueError``.

    Args:
        num_embeddings (int): the whole table's number of rows, as
            :class:`ShardedEmbedding`'s.
        embedding_dim (int): the size of each embedding vector.
        mode (str, optional): ``"sum"``, ``"mean"`` or ``"max"``: how each
            bag is reduced, as :class:`hostembed.EmbeddingBag`'s (ValueError
            for any other). Default: ``"mean"``
        padding_idx (int, optional): a row of the whole table left out of
            each bag (and of a mean's count) and of the gradient, as
            :class:`hostembed.EmbeddingBag`'s. Default: None
        include_last_offset (bool, optional): if True, ``offsets`` has one
            more element than there are bags, the last one the size of
            ``input`` (the CSR format). Default: ``False``
        process_group (torch.distributed.ProcessGroup, optional):
            keyword-only: the ranks the rows are spread over, as
            :class:`ShardedEmbedding`'s. Default: None (the world)
        sparse (bool, optional): keyword-only: whether the shard's gradient
            is row-sparse, as :class:`ShardedEmbedding`'s. Default: ``True``
        dtype (torch.dtype, optional): keyword-only: the table's dtype, as
            :class:`hostembed.Embedding`'s. Default: None (torch's default
            dtype)
        share_within_host (bool, optional): keyword-only: the rows spread
            over the hosts, each host's one shared copy, as
            :class:`ShardedEmbedding`'s. Default: ``False``
        device (torch.device or str, optional): keyword-only: where the
            pooled outputs land; the rows stay in host memory.
            Default: None (the CPU)
        storage (str or os.PathLike, optional): keyword-only: each rank's
            shard kept on disk, as :class:`ShardedEmbedding`'s.
            Default: None
        ram_budget (int or str, optional): keyword-only, with ``storage``:
            the RAM of each shard's row cache, as
            :class:`ShardedEmbedding`'s. Default: None
        cache_rows (int, optional): keyword-only: each shard's row cache,
            as :class:`ShardedEmbedding`'s. Default: None
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
        """This rank's bags, pooled from rows the ranks that hold them send
        (a collective: every rank calls it, the same number of times).

        Args:
            input (Tensor): this rank's ids (torch.int64 or torch.int32) in
                bags, in any form :meth:`hostembed.EmbeddingBag.forward`
                takes: 2-D ``(B, N)``, 1-D ``(n,)`` with ``offsets``, or
                nested. An id outside ``[0, num_embeddings)`` on any rank
                raises IndexError on every rank.
            offsets (Tensor, optional): with a 1-D ``input``, where each bag
                starts: ``(B,)``, or ``(B + 1,)`` with
                ``include_last_offset``. Default: None
            per_sample_weights (Tensor, optional): a weight for each id, of
                ``input``'s shape; ``mode="sum"`` only. Default: None

        Returns:
            Tensor: shape ``(B, embedding_dim)``, one pooled row per bag, on
            ``output_device``.
        """
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
