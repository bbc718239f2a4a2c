"""ShardedEmbedding: one table's rows spread over the ranks of a
torch.distributed process group, each rank holding its contiguous range in
a hostembed.Embedding of its own (its shard)."""
import torch
import torch.distributed as dist
from torch import nn

from .._core.ids import prepare_ids
from .._core.ops import cpu as cpu_ops
from ..nn.embedding import Embedding
from .agreement import agree, check_pretrained
from .exchange import ExchangeRows, ExpandRows, exchange, split_by_owner

WHO = "hostembed.distributed.ShardedEmbedding"


class _RowSharded(nn.Module):
    """What ShardedEmbedding and ShardedEmbeddingBag share: the shard of
    this rank's rows, and the lookup of a batch's distinct ids through the
    ranks that own them."""

    _who = WHO

    def __init__(self, num_embeddings, embedding_dim, padding_idx, process_group, sparse, dtype, _weight,
                 flags=()):
        super().__init__()
        agreed = agree(self._who, num_embeddings, embedding_dim, padding_idx, dtype, process_group, _weight,
                       flags=(bool(sparse), *flags))
        group, rank, world, padding_idx, dtype, bounds = agreed[:6]
        self.num_embeddings, self.embedding_dim, self.padding_idx = int(num_embeddings), int(embedding_dim), padding_idx
        self.process_group, self.rank, self.world_size = group, rank, world
        self._bounds = torch.tensor(bounds, dtype=torch.int64)
        start, end = bounds[rank], bounds[rank + 1]
        self.row_range = (start, end)
        local_padding = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None
        self.shard = Embedding(end - start, embedding_dim, local_padding, sparse=sparse, dtype=dtype,
                               _weight=None if _weight is None else _weight[start:end])

    def _distinct_rows(self, flat):
        """(rows, dedup, unique, inverse) of this rank's flat ids: the rows
        of its distinct ids (ascending, `unique`) from their owners,
        differentiable (backward sends their gradient rows back to the
        owners' shards), the core's sort of the ids, and each id's index in
        unique. An id outside the table on any rank raises IndexError on
        every rank before any id travels."""
        bad = ((flat < 0) | (flat >= self.num_embeddings)).nonzero()
        first_bad = [int(flat[bad[0, 0]]), int(bad[0, 0])] if bad.numel() else [0, -1]
        if bad.numel():  # sends nothing: every rank raises after the counts' exchange
            dedup, unique, inverse = None, flat.new_empty(0, dtype=torch.int64), None
        else:
            # The core's threaded sort, kept for backward's sums (ExpandRows).
            dedup, unique, inverse = cpu_ops.dedup_ids(flat, self.num_embeddings)
        send = split_by_owner(unique, self._bounds)
        recv = self._counts_and_range_check(first_bad, send)
        group, start = self.process_group, self.row_range[0]
        wanted = exchange(unique, send, recv, group) - start
        rows = ExchangeRows.apply(self.shard(wanted), recv, send, group)
        return rows, dedup, unique, inverse

    def _counts_and_range_check(self, first_bad, send):
        """How many ids each rank sends here, from one all-to-all that also
        tells every rank the first id outside the table on each rank
        (first_bad: [id, position], position -1 for none): then every rank
        raises, before any id travels."""
        out = torch.tensor([[count, *first_bad] for count in send], dtype=torch.int64)
        got = torch.empty_like(out)
        dist.all_to_all_single(got, out, group=self.process_group)
        for r, (_, bad_id, position) in enumerate(got.tolist()):
            if position >= 0:
                raise IndexError(f"{self._who}: id {bad_id} at position {position} of rank {r}'s ids is out of "
                                 f"range for a table of {self.num_embeddings} rows (raised on every rank; nothing "
                                 "was looked up)")
        return got[:, 0].tolist()

    def extra_repr(self):
        start, end = self.row_range
        return (f"{self.num_embeddings}, {self.embedding_dim}, rank {self.rank} of {self.world_size} holds rows "
                f"[{start}, {end})")


class ShardedEmbedding(_RowSharded):
    r"""An embedding table too big for one process: rank r of the process
    group holds rows ``[r * N // W, (r + 1) * N // W)`` of the ``N``-row
    table (``W`` ranks) in a :class:`hostembed.Embedding` of its own,
    ``self.shard``, and its optimizer updates only those rows.

    ``forward(ids)`` takes each rank's own ids and returns ``table[ids]``
    on the CPU, as ``nn.Embedding`` would. Each rank's distinct ids go to
    the ranks that own them (one all-to-all), the owners look them up in
    their shards, and the rows come back (another); backward sends each
    row's gradient to its owner, where the shard's backward sums what every
    rank sent, so a shard's gradient is that of the sum of the ranks'
    losses (as with TorchRec's row-wise sharding; DDP would average dense
    gradients instead). Every rank must call forward and backward the same
    number of times, in the same order, like any collective.

    Train the shard with any hostembed optimizer (``fused=True`` too) over
    ``module.parameters()``; keep the table out of
    ``DistributedDataParallel`` with :func:`exclude_from_ddp`. An id outside
    the table on any rank raises ``IndexError`` on every rank, naming the
    id and the rank, before anything is looked up. Every rank must build
    the same table (``ValueError`` otherwise, on every rank).

    Arguments as :class:`hostembed.Embedding` (``num_embeddings``,
    ``embedding_dim``, ``padding_idx``, ``sparse``, ``dtype``), and
    ``process_group`` (default: the world). A new table's shards are drawn
    N(0, 1) rank by rank; :meth:`from_pretrained` shards given values.
    """

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, *, process_group=None, sparse=True,
                 dtype=None, _weight=None):
        super().__init__(num_embeddings, embedding_dim, padding_idx, process_group, sparse, dtype, _weight)

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None, *, process_group=None, sparse=True):
        """A table holding `embeddings` (the whole [N, D] table, the same on
        every rank), each rank keeping its own rows."""
        check_pretrained(WHO, embeddings)
        module = cls(*embeddings.shape, padding_idx, process_group=process_group, sparse=sparse,
                     dtype=embeddings.dtype, _weight=embeddings)
        module.shard.weight.requires_grad_(not freeze)
        return module

    def forward(self, input):
        ids = prepare_ids(input, WHO)
        flat = ids.reshape(-1)
        rows, dedup, _, inverse = self._distinct_rows(flat)
        out = ExpandRows.apply(rows, flat, dedup, inverse, self.num_embeddings)
        return out.view(*ids.shape, self.embedding_dim)
