"""SharedEmbedding: one copy of a table in a host's memory for all the
ranks of a torch.distributed group on that host."""
import functools
import os
import socket
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from .._core.fused import RowGradient
from .._core.ids import check_ids
from .._core.ops import update as update_ops
from .._core.table import HostTable, map_shared
from ..io.stream import copy_rows
from ..nn.embedding import Embedding
from ..nn.host_module import UNINITIALISED
from .agreement import agree, check_pretrained
from .exchange import exchange, exchange_counts, first_out_of_range, out_of_range_on_ranks, split_by_owner

WHO = "hostembed.distributed.SharedEmbedding"


class SharedEmbedding(nn.Module):
    r"""An embedding table whose rows every rank of a process group on one
    host reads and writes in the same memory: one copy of the table
    whatever the number of ranks (a file in ``/dev/shm`` that each rank
    maps, unlinked once they all have), where each rank would otherwise
    hold its own.

    ``forward(ids)`` looks each rank's own ids up straight from the shared
    rows (no traffic), into outputs on ``device`` (the CPU by default, as
    ``.to()`` moves them; a GPU reads the shared rows through its own
    registration of them, as hostembed.Embedding's GPU path reads a
    table). Each rank updates only the rows of its
    range, ``[r * N // W, (r + 1) * N // W)``: after backward, the ranks
    exchange their gradient rows by range (all-to-all), so each rank's
    ``weight.grad`` holds the rows of its range from every rank's batch
    (the gradient of the sum of the ranks' losses), and its optimizer
    updates those rows, and their state, which stays in the rank's own
    memory (only its range's pages are ever written). Each forward starts
    with a barrier, so no rank reads a row another rank is still updating;
    an id outside the table on any rank raises ``IndexError`` there on
    every rank, naming the id and its rank, before anything is read.
    Every rank must call forward and backward the same number of times,
    like any collective.

    Optimizers: every hostembed optimizer, ``fused=True`` too (the ranks
    then exchange their gradient rows when the backward pass ends, and each
    updates its range there, bit for bit as unfused), and torch's that take
    row-sparse gradients. Adam and AdamW (hostembed's, or torch's through
    the swap) step every row of the rank's range, as torch steps every row
    of a table. Every rank must build the same table (``ValueError``
    otherwise, on every rank).

    Args:
        num_embeddings (int): the table's number of rows, ``N``, as
            :class:`hostembed.Embedding`'s (the same on every rank).
        embedding_dim (int): the size of each embedding vector, as
            :class:`hostembed.Embedding`'s.
        padding_idx (int, optional): as :class:`hostembed.Embedding`'s: the
            row kept out of the gradient (zeros in a new table).
            Default: None
        process_group (torch.distributed.ProcessGroup, optional):
            keyword-only: the ranks that share the table, which must all be
            on this host (``ValueError`` otherwise;
            :class:`ShardedEmbedding` spreads a table over hosts); its
            traffic (the gradient rows) goes as :class:`ShardedEmbedding`'s
            does. Default: None (the world)
        dtype (torch.dtype, optional): keyword-only: the table's dtype, as
            :class:`hostembed.Embedding`'s. Default: None (torch's default
            dtype)
        device (torch.device or str, optional): keyword-only: where the
            outputs land, as :class:`hostembed.Embedding`'s; the rows stay
            in the shared host memory. Default: None (the CPU)
    """

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, *, process_group=None, dtype=None,
                 device=None, _weight=None, _host=None):
        super().__init__()
        # _host: which host this rank is on, for tests that play several.
        agreed = agree(WHO, num_embeddings, embedding_dim, padding_idx, dtype, process_group, _weight,
                       extra=socket.gethostname() if _host is None else _host)
        group, rank, world, padding_idx, dtype, bounds, hosts = agreed
        if len(set(hosts)) > 1:
            raise ValueError(f"{WHO}: the ranks of one shared table must be on one host, got "
                             f"{', '.join(f'rank {r} on {h!r}' for r, h in enumerate(hosts))}; "
                             "hostembed.distributed.ShardedEmbedding spreads a table over hosts")
        self.num_embeddings, self.embedding_dim, self.padding_idx = int(num_embeddings), int(embedding_dim), padding_idx
        self.process_group, self.rank, self.world_size = group, rank, world
        self._bounds = torch.tensor(bounds, dtype=torch.int64)
        self.row_range = (bounds[rank], bounds[rank + 1])
        # Which row of a bigger table is this table's row 0 (set by
        # ShardedEmbedding(share_within_host=True)): what its checkpoints
        # say they hold.
        self._first_row = 0
        table = HostTable(num_embeddings, embedding_dim, dtype=dtype,
                          rows_buffer=_map_group_file(num_embeddings * embedding_dim * dtype.itemsize, group))
        self.table = Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype, device=device,
                               _weight=UNINITIALISED)
        self.table._use_table(table)
        start, end = self.row_range
        with torch.no_grad():  # each rank writes its own rows; then all of them may read
            if _weight is not None:
                copy_rows(table.tensor[start:end], _weight[start:end])
            else:
                table.tensor[start:end].normal_()  # torch's init: N(0, 1), the padding row zero
                if padding_idx is not None and start <= padding_idx < end:
                    table.tensor[padding_idx].zero_()
        dist.barrier(group=group)
        self.table.weight.register_post_accumulate_grad_hook(self._exchange_gradient)
        # What the optimizers read: the rows this rank updates, and (fused)
        # how a backward pass's gradients become them. Not bound to the
        # module: the table would hold it alive.
        table.update_rows, table.sharded = self.row_range, True
        if world > 1:  # (one rank's gradient is its range's already: the fused pass as it is)
            table.gradient_exchange = functools.partial(_exchange_fused, self._bounds, group)

    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None, *, process_group=None, device=None):
        """A shared table holding `embeddings` (the whole [N, D] table; each
        rank copies its range in)."""
        check_pretrained(WHO, embeddings)
        module = cls(*embeddings.shape, padding_idx, process_group=process_group, dtype=embeddings.dtype,
                     device=device, _weight=embeddings)
        module.table.weight.requires_grad_(not freeze)
        return module

    def forward(self, input):
        """The rows of this rank's ids, read straight from the shared table
        (a collective: every rank calls it, the same number of times; it
        starts with a barrier).

        Args:
            input (Tensor): this rank's ids, of any shape ``(*)``,
                torch.int64 or torch.int32 (IdDtypeError for any other
                dtype); an id outside ``[0, num_embeddings)`` on any rank
                raises IndexError on every rank.

        Returns:
            Tensor: shape ``(*, embedding_dim)``, in the table's dtype, on
            the module's ``device``; backward leaves in
            ``table.weight.grad`` the
            rows of this rank's range from every rank's batch.
        """
        # One all-gather of each rank's first id out of range: the barrier
        # after which no rank reads a row another is still updating, and an
        # IndexError on every rank for a bad id on any, before anything is
        # read (a rank left to go on would wait in backward's exchange).
        check_ids(input, WHO)
        first_bad = first_out_of_range(input, self.num_embeddings)
        for rank, (bad_id, position) in enumerate(out_of_range_on_ranks(first_bad, self.process_group)):
            if position >= 0:
                raise IndexError(f"{WHO}: id {bad_id} at position {position} of rank {rank}'s ids is out of range "
                                 f"for a table of {self.num_embeddings} rows (raised on every rank; nothing was "
                                 "looked up)")
        return self.table(input)

    def _exchange_gradient(self, param):
        """weight.grad becomes the rows of this rank's range from every
        rank's gradient, in rank order (the optimizers sum repeated rows in
        that order)."""
        grad = param.grad
        if grad is None:  # a fused optimizer took the gradient: exchanged when the pass ends (_exchange_fused)
            return
        if not grad.is_sparse:
            raise RuntimeError(f"{WHO}: the ranks exchange row-sparse gradients; this one is dense (an optimizer "
                               "that needs dense gradients cannot update a shared table)")
        if self.world_size == 1:  # its gradient is its range's already
            return
        mine, rows = _exchange_rows(grad._indices()[0], grad._values(), self._bounds, self.process_group)
        param.grad = torch.sparse_coo_tensor(mine.unsqueeze(0), rows, grad.shape, check_invariants=False)

    def get_extra_state(self):
        """Saved with the state dict: the rows of the whole table that this
        table holds, and those this rank updates (whose optimizer state its
        checkpoint holds), for load_resharded."""
        start, end = self.row_range
        first = self._first_row
        return {"table_rows": (first, first + self.num_embeddings), "state_rows": (first + start, first + end)}

    def set_extra_state(self, state):
        problem = self.check_extra_state(state)
        if problem is not None:
            raise ValueError(problem)

    def check_extra_state(self, state):
        """None if a checkpoint with this extra state loads as it is (the
        same rows, the same rank's optimizer state), else why not."""
        mine = self.get_extra_state()
        try:
            theirs = {key: tuple(int(v) for v in state[key]) for key in mine}
        except (TypeError, KeyError, ValueError):
            return f"{WHO}: the checkpoint's layout entry {state!r} is not one a shared table writes"
        if theirs != mine:
            return (f"{WHO}: the checkpoint holds rows {theirs['table_rows']} with the optimizer state of rows "
                    f"{theirs['state_rows']}, this rank's table rows {mine['table_rows']} and its state rows "
                    f"{mine['state_rows']}: written by another number of ranks or hosts, it loads with "
                    "hostembed.distributed.load_resharded")
        return None

    def extra_repr(self):
        start, end = self.row_range
        return (f"{self.num_embeddings}, {self.embedding_dim}, one copy for {self.world_size} ranks, rank "
                f"{self.rank} updates rows [{start}, {end})")


def _exchange_rows(indices, values, bounds, group):
    """(indices, rows): the gradient rows of this rank's range from every
    rank's (indices, values), in rank order, each rank's in ascending
    index order (stable: several lookups' rows, concatenated, keep their
    order)."""
    if indices.numel() > 1 and not bool((indices[1:] >= indices[:-1]).all()):
        order = torch.argsort(indices, stable=True)
        indices, values = indices[order], values[order]
    send = split_by_owner(indices, bounds)
    recv = exchange_counts(send, group)
    return exchange(indices, send, recv, group), exchange(values, send, recv, group)


def _exchange_fused(bounds, group, table, gradients):
    """HostTable.gradient_exchange of a shared table: a fused backward
    pass's lookup gradients, each reduced as its unfused backward would
    (weight.grad's rows), concatenated in the order autograd would have
    accumulated them, then exchanged as _exchange_gradient exchanges
    weight.grad."""
    indices, values = update_ops.joined([update_ops.reduce_to_host(table, g) for g in gradients])
    return RowGradient(*_exchange_rows(indices, values, bounds, group))


def _map_group_file(nbytes, group):
    """A HostBuffer over a new /dev/shm file that every rank of `group`
    maps: made and sized by the group's first rank, opened by the others,
    unlinked once all have it mapped (the memory lives until the last
    rank drops it)."""
    rank = dist.get_rank(group)
    fd = path = None
    if rank == 0:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="hostembed-", dir=directory)
    paths = [path]
    try:
        if rank == 0:
            os.ftruncate(fd, max(nbytes, 1))
        dist.broadcast_object_list(paths, group_src=0, group=group)
        if rank != 0:
            fd = os.open(paths[0], os.O_RDWR)
        return map_shared(fd, nbytes)
    finally:
        if fd is not None:
            os.close(fd)
        # Every rank has mapped it (or failed to) before the name goes.
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path)
