"""Tables over several processes, on torch.distributed: ShardedEmbedding
spreads one table's rows over the ranks of a process group (all-to-all of
ids and rows; each rank's optimizer updates its own rows), and
exclude_from_ddp keeps such tables out of DistributedDataParallel.

Imported on its own (``import hostembed.distributed``); a layer above nn/
and optim/."""
from .sharded_embedding import ShardedEmbedding, exclude_from_ddp

__all__ = ["ShardedEmbedding", "exclude_from_ddp"]
