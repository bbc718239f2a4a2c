"""ShardedEmbedding: one table's rows spread over the ranks of a
torch.distributed process group, each rank holding its contiguous range in
a hostembed.Embedding of its own (its shard)."""
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

from .._core.ids import prepare_ids
from .._core.ops import cpu as cpu_ops
from ..nn.embedding import Embedding
from .agreement import agree, check_pretrained
from .exchange import (ExchangeRows, ExpandRows, comm_device, exchange, first_out_of_range, out_of_range_on_ranks,
                       split_by_owner)
from .shared_embedding import SharedEmbedding

WHO = "hostembed.distributed.ShardedEmbedding"


class _RowSharded(nn.Module):
    """What ShardedEmbedding and ShardedEmbeddingBag share: the shard of
    this rank's rows, and the lookup of a batch's distinct ids through the
    ranks that own them."""

    _who = WHO

    def __init__(self, num_embeddings, embedding_dim, padding_idx, process_group, sparse, dtype, _weight,
                 flags=(), share_within_host=False, device=None, _host=None, storage=None, ram_budget=None,
                 cache_rows=None):
        super().__init__()
        if share_within_host and (storage is not None or ram_budget is not None or cache_rows is not None):
            raise ValueError(f"{self._who}: share_within_host keeps a host's rows in one shared mapping; storage=, "
                             "ram_budget= and cache_rows= apply to shards of a rank's own")
        self._output_device = torch.device("cpu") if device is None else torch.device(device)
        if self._output_device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{self._who}(device={str(self._output_device)!r}): CUDA is not available")
        # _host: which host this rank is on, for tests that play several.
        host = (socket.gethostname() if _host is None else _host) if share_within_host else None
        agreed = agree(self._who, num_embeddings, embedding_dim, padding_idx, dtype, process_group, _weight,
                       flags=(bool(sparse), bool(share_within_host), storage is not None, *flags), extra=host)
        group, rank, world, padding_idx, dtype, bounds, hosts = agreed
        self.num_embeddings, self.embedding_dim, self.padding_idx = int(num_embeddings), int(embedding_dim), padding_idx
        self._whole_group = None
        if share_within_host:
            # Rows spread over the hosts; each host's rows one copy that its
            # ranks share; the lookups go to the rank of the same local index
            # on the owning host.
            self._whole_group = group
            host_group, group, rank, world = _host_groups(group, hosts, self._who)
            bounds = [int(num_embeddings) * h // world for h in range(world + 1)]
        self.process_group, self.rank, self.world_size = group, rank, world
        self._bounds = torch.tensor(bounds, dtype=torch.int64)
        start, end = bounds[rank], bounds[rank + 1]
        self.row_range = (start, end)
        local_padding = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None
        rows = None if _weight is None else _weight[start:end]
        if share_within_host:
            self.shard = SharedEmbedding(end - start, embedding_dim, local_padding, process_group=host_group,
                                         dtype=dtype, _weight=rows, _host=host)
            self.shard._first_row = start
        else:
            # On disk: a directory of the rank's own under `storage` (a
            # rank's shard is its rows; the same ranks open them again).
            shard_storage = None if storage is None else os.path.join(os.fspath(storage), f"rank{rank}-of-{world}")
            self.shard = Embedding(end - start, embedding_dim, local_padding, sparse=sparse, dtype=dtype, _weight=rows,
                                   storage=shard_storage, ram_budget=ram_budget, cache_rows=cache_rows)
            self.shard._table.sharded = True  # its gradient comes from every rank's lookups: no all-reduce

    def _shard_weight(self):
        return self.shard.table.weight if isinstance(self.shard, SharedEmbedding) else self.shard.weight

    @property
    def output_device(self) -> torch.device:
        """Where forward's outputs land (the rows stay in host memory)."""
        return self._output_device

    def _apply(self, fn, recurse=True):
        # .to()/.cuda()/.half() arrive here as fn over every tensor: a move
        # sends the outputs there (the shard, its lookups and the exchange
        # stay where the rows are); a cast converts the shard's rows.
        dtype = self._shard_weight().dtype
        probe = fn(torch.empty(0, device=self._output_device, dtype=dtype))
        if probe.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{self._who}: outputs on {probe.device} need CUDA, which is not available")
        if probe.is_floating_point() and probe.dtype != dtype:
            self.shard._apply(lambda t: fn(t).to("cpu"))
        self._output_device = probe.device
        return self

    def _to_output(self, out):
        device = self._output_device
        return out if device.type == "cpu" else out.to(device)

    def _distinct_rows(self, flat):
        """(rows, dedup, unique, inverse) of this rank's flat ids: the rows
        of its distinct ids (ascending, `unique`) from their owners,
        differentiable (backward sends their gradient rows back to the
        owners' shards), the core's sort of the ids, and each id's index in
        unique. An id outside the table on any rank raises IndexError on
        every rank before any id travels."""
        first_bad = first_out_of_range(flat, self.num_embeddings)
        bad = first_bad[1] >= 0
        if self._whole_group is not None:
            # The exchanges below reach only this rank's peers on the other
            # hosts: every rank of the group hears of a bad id first.
            self._range_check_everywhere(first_bad)
        if bad:  # sends nothing: every rank raises after the counts' exchange
            dedup, unique, inverse = None, flat.new_empty(0, dtype=torch.int64), None
        else:
            # The core's threaded sort, kept for backward's sums (ExpandRows).
            dedup, unique, inverse = cpu_ops.dedup_ids(flat, self.num_embeddings)
        if self.world_size == 1:  # every row is this rank's: nothing travels
            if bad:
                self._raise_out_of_range(*first_bad, 0)
            return self.shard(unique), dedup, unique, inverse
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
        device = comm_device(self.process_group)
        out = torch.tensor([[count, *first_bad] for count in send], dtype=torch.int64, device=device)
        got = torch.empty_like(out)
        dist.all_to_all_single(got, out, group=self.process_group)
        for r, (_, bad_id, position) in enumerate(got.tolist()):
            if position >= 0:  # (with share_within_host, _range_check_everywhere raised first)
                self._raise_out_of_range(bad_id, position, r)
        return got[:, 0].tolist()

    def _range_check_everywhere(self, first_bad):
        """IndexError on every rank of the whole group if any has an id
        outside the table (first_bad: [id, position], position -1 for
        none), from one all-gather."""
        for r, (bad_id, position) in enumerate(out_of_range_on_ranks(first_bad, self._whole_group)):
            if position >= 0:
                self._raise_out_of_range(bad_id, position, r)

    def _raise_out_of_range(self, bad_id, position, rank):
        raise IndexError(f"{self._who}: id {bad_id} at position {position} of rank {rank}'s ids is out of range for "
                         f"a table of {self.num_embeddings} rows (raised on every rank; nothing was looked up)")

    def extra_repr(self):
        start, end = self.row_range
        return (f"{self.num_embeddings}, {self.embedding_dim}, rank {self.rank} of {self.world_size} holds rows "
                f"[{start}, {end})")


def _host_groups(group, hosts, who):
    """(this rank's host group, its cross-host group, its host's index, the
    number of hosts) for a group whose ranks are on `hosts` (hosts[r]:
    rank r's): the ranks of each host, and for each local index the ranks
    of that index on every host. Every host must run as many ranks
    (ValueError). Every rank makes every group, in the same order, as
    torch.distributed.new_group needs."""
    names = list(dict.fromkeys(hosts))
    local = [[r for r, h in enumerate(hosts) if h == name] for name in names]
    if len({len(ranks) for ranks in local}) != 1:
        raise ValueError(f"{who}: share_within_host needs as many ranks on every host, got "
                         + ", ".join(f"{len(ranks)} on {name!r}" for name, ranks in zip(names, local)))
    glob = [dist.get_global_rank(group, r) if group is not dist.group.WORLD else r for r in range(len(hosts))]
    me = dist.get_rank(group)
    backend = dist.get_backend(group)  # the traffic goes as the given group's would
    host_groups = [dist.new_group([glob[r] for r in ranks], backend=backend) for ranks in local]
    cross_groups = [dist.new_group([glob[ranks[i]] for ranks in local], backend=backend)
                    for i in range(len(local[0]))]
    h = names.index(hosts[me])
    i = local[h].index(me)
    return host_groups[h], cross_groups[i], h, len(names)


class ShardedEmbedding(_RowSharded):
    r"""An embedding table too big for one process: rank r of the process
    group holds rows ``[r * N // W, (r + 1) * N // W)`` of the ``N``-row
    table (``W`` ranks) in a :class:`hostembed.Embedding` of its own,
    ``self.shard``, and its optimizer updates only those rows.

    ``forward(ids)`` takes each rank's own ids and returns ``table[ids]``
    on ``device`` (the CPU by default), as ``nn.Embedding`` would. Each
    rank's distinct ids go to
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
    the same table (``ValueError`` otherwise, on every rank), after
    ``torch.distributed.init_process_group`` (``RuntimeError`` before). A
    new table's shards are drawn N(0, 1) rank by rank;
    :meth:`from_pretrained` shards given values.

    Args:
        num_embeddings (int): the whole table's number of rows, ``N``, as
            :class:`hostembed.Embedding`'s (the same on every rank).
        embedding_dim (int): the size of each embedding vector, as
            :class:`hostembed.Embedding`'s.
        padding_idx (int, optional): a row of the whole table, as
            :class:`hostembed.Embedding`'s (negative counts from the end);
            the rank that holds it keeps it out of the gradient.
            Default: None
        process_group (torch.distributed.ProcessGroup, optional):
            keyword-only: the ranks the rows are spread over. The ranks'
            traffic goes through the group's backend: on the CPU with gloo
            (or a group made with ``backend="cpu:gloo,cuda:nccl"``), through
            each rank's current GPU with NCCL alone. Default: None (the
            world)
        sparse (bool, optional): keyword-only: whether the shard's gradient
            is row-sparse, as :class:`hostembed.Embedding`'s (a table
            shared within a host, ``share_within_host=True``, always has
            row-sparse gradients). Default: ``True``
        dtype (torch.dtype, optional): keyword-only: the table's dtype, as
            :class:`hostembed.Embedding`'s. Default: None (torch's default
            dtype)
        share_within_host (bool, optional): keyword-only. True spreads the
            rows over the hosts instead of the ranks: host h of H holds rows
            ``[h * N // H, (h + 1) * N // H)`` as one
            :class:`SharedEmbedding` that all its ranks map
            (``self.shard``), each rank updating its part of them (any
            optimizer, as for SharedEmbedding), so a host holds its rows
            once whatever its number of ranks. A rank's lookups go to the
            rank of the same local index on the owning host. Every host must
            run as many ranks (``ValueError`` otherwise); the ranks' host is
            their host name. Not with ``storage``, ``ram_budget`` or
            ``cache_rows`` (ValueError). Default: ``False``
        device (torch.device or str, optional): keyword-only: where the
            outputs land, as ``.to()`` moves them; the rows stay in host
            memory. A CUDA device needs CUDA (RuntimeError otherwise).
            Default: None (the CPU)
        storage (str or os.PathLike, optional): keyword-only: each rank's
            shard kept on disk as :class:`hostembed.Embedding`'s
            ``storage=``, in the directory ``rank{r}-of-{W}`` under
            ``storage`` (a local disk of each rank's host), with a row cache
            of ``ram_budget`` bytes or ``cache_rows`` rows; the same number
            of ranks opens the shards again. Default: None
        ram_budget (int or str, optional): keyword-only, with ``storage``:
            the RAM of each shard's row cache, as
            :class:`hostembed.Embedding`'s. Default: None
        cache_rows (int, optional): keyword-only: each shard's row cache,
            as :class:`hostembed.Embedding`'s. Default: None
    """

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, *, process_group=None, sparse=True,
                 dtype=None, share_within_host=False, device=None, _weight=None, _host=None, storage=None,
                 ram_budget=None, cache_rows=None):
        super().__init__(num_embeddings, embedding_dim, padding_idx, process_group, sparse, dtype, _weight,
                         share_within_host=share_within_host, device=device, _host=_host, storage=storage,
                         ram_budget=ram_budget, cache_rows=cache_rows)

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None, *, process_group=None, sparse=True,
                        share_within_host=False, device=None, _host=None, storage=None, ram_budget=None,
                        cache_rows=None):
        """A table holding `embeddings` (the whole [N, D] table, the same on
        every rank), each rank keeping its own rows."""
        check_pretrained(WHO, embeddings)
        module = cls(*embeddings.shape, padding_idx, process_group=process_group, sparse=sparse,
                     dtype=embeddings.dtype, share_within_host=share_within_host, device=device, _weight=embeddings,
                     _host=_host, storage=storage, ram_budget=ram_budget, cache_rows=cache_rows)
        module._shard_weight().requires_grad_(not freeze)
        return module

    def forward(self, input):
        """The rows of this rank's ids, from the ranks that hold them (a
        collective: every rank calls it, the same number of times).

        Args:
            input (Tensor): this rank's ids, of any shape ``(*)``,
                torch.int64 or torch.int32, on any device; an id outside
                ``[0, num_embeddings)`` on any rank raises IndexError on
                every rank.

        Returns:
            Tensor: shape ``(*, embedding_dim)``, ``table[input]`` in the
            table's dtype on ``output_device``; backward sends each row's
            gradient to the rank that holds it.
        """
        ids = prepare_ids(input, WHO)
        flat = ids.reshape(-1)
        rows, dedup, _, inverse = self._distinct_rows(flat)
        out = ExpandRows.apply(rows, flat, dedup, inverse, self.num_embeddings)
        return self._to_output(out.view(*ids.shape, self.embedding_dim))
