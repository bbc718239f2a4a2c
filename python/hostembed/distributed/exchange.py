"""What a row-sharded lookup sends between ranks, on torch.distributed: the
split of a batch's distinct ids by owner, the ids' exchange, and the rows'
exchange as an autograd Function whose backward sends the gradient rows
back the way the rows came."""
import torch
import torch.distributed as dist


def split_by_owner(unique: torch.Tensor, bounds: torch.Tensor) -> list:
    """How many of `unique` (ascending) each rank owns, rank r owning rows
    [bounds[r], bounds[r + 1]): ascending ids are already grouped by owner."""
    edges = torch.searchsorted(unique, bounds)
    return (edges[1:] - edges[:-1]).tolist()


def exchange_counts(send: list, group) -> list:
    """recv[r]: how many entries rank r sends here, for send[r] sent there."""
    recv = torch.empty(len(send), dtype=torch.int64)
    dist.all_to_all_single(recv, torch.tensor(send, dtype=torch.int64), group=group)
    return recv.tolist()


def exchange(tensor: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    """tensor's rows, send[r] of them to rank r in rank order; returns the
    rows received, recv[r] from rank r in rank order."""
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


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
