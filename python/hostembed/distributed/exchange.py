"""What a row-sharded lookup sends between ranks, on torch.distributed: the
split of a batch's distinct ids by owner, the ids' exchange, and the rows'
exchange as an autograd Function whose backward sends the gradient rows
back the way the rows came; the expansion of the distinct ids' rows to
the batch's positions, whose backward sums them with the core; and the
check that tells every rank of an id out of range on any rank."""
import torch
import torch.distributed as dist

from .._core.ops import cpu as cpu_ops
from .._core.ops.common import scratch


def split_by_owner(unique: torch.Tensor, bounds: torch.Tensor) -> list:
    """How many of `unique` (ascending) each rank owns, rank r owning rows
    [bounds[r], bounds[r + 1]): ascending ids are already grouped by owner."""
    edges = torch.searchsorted(unique, bounds)
    return (edges[1:] - edges[:-1]).tolist()


def comm_device(group) -> torch.device:
    """Where a collective of `group` takes its tensors: the CPU, unless the
    group's only backend is NCCL (then this process's current GPU). A
    group made with backend "cpu:gloo,cuda:nccl" keeps the tables' traffic
    on the CPU, where their rows are."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "cpu:" not in backend:  # "nccl", "cuda:nccl"
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def first_out_of_range(ids: torch.Tensor, num_rows: int) -> list:
    """[id, position] of the first of `ids` (flattened) outside [0,
    num_rows), or [0, -1] when there is none."""
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return [0, -1]
    low, high = torch.aminmax(flat)  # one pass; the position only for a batch that has a bad id
    if int(low) >= 0 and int(high) < num_rows:
        return [0, -1]
    at = int(((flat < 0) | (flat >= num_rows)).nonzero()[0, 0])
    return [int(flat[at]), at]


def out_of_range_on_ranks(first_bad: list, group) -> list:
    """Every rank's first_out_of_range, in rank order, from one all-gather
    (every rank must call it: it is a barrier too)."""
    device = comm_device(group)
    got = torch.empty(dist.get_world_size(group), len(first_bad), dtype=torch.int64, device=device)
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single, which torch 2.1 lacks.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(got, torch.tensor([first_bad], dtype=torch.int64, device=device), group=group)
    return got.tolist()


def exchange_counts(send: list, group) -> list:
    """recv[r]: how many entries rank r sends here, for send[r] sent there."""
    device = comm_device(group)
    recv = torch.empty(len(send), dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, torch.tensor(send, dtype=torch.int64, device=device), group=group)
    return recv.tolist()


def exchange(tensor: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    """tensor's rows, send[r] of them to rank r in rank order; returns the
    rows received, recv[r] from rank r in rank order, on tensor's device
    (through the group's comm_device)."""
    device = comm_device(group)
    shape = (sum(recv), *tensor.shape[1:])
    # CPU buffers from the core's scratch cache: a fresh 30 MB tensor a step
    # costs more in page faults than the exchange itself.
    out = scratch(*shape, dtype=tensor.dtype) if device.type == "cpu" else torch.empty(
        shape, dtype=tensor.dtype, device=device)
    dist.all_to_all_single(out, tensor.to(device).contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=group)
    return out.to(tensor.device)


class ExchangeRows(torch.autograd.Function):
    """exchange() of rows, differentiable: backward sends each received
    row's gradient back to the rank it came from."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


class ExpandRows(torch.autograd.Function):
    """rows[inverse]: each position's row from its distinct id's. Backward
    sums each distinct id's gradient rows with the core's threads, in
    position order, reusing the forward's sort of the ids (dedup), where
    torch's index_select backward adds them one by one."""

    @staticmethod
    def forward(ctx, rows, ids, dedup, inverse, num_rows):
        ctx.ids, ctx.dedup, ctx.num_rows = ids, dedup, num_rows
        out = scratch(inverse.numel(), rows.shape[1], dtype=rows.dtype)
        return torch.index_select(rows, 0, inverse, out=out)

    @staticmethod
    def backward(ctx, grad):
        # Every distinct id has a position: the sums come one per row of `rows`, in order.
        _, sums = cpu_ops.reduce_rows(ctx.ids, grad, ctx.num_rows, -1, False, ctx.dedup, rounded=True)
        return sums, None, None, None, None
