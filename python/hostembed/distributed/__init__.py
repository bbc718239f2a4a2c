"""Tables over several processes, on torch.distributed: ShardedEmbedding
spreads one table's rows over the ranks of a process group (all-to-all of
ids and rows; each rank's optimizer updates its own rows),
ShardedEmbeddingBag pools bags from such a table, SharedEmbedding
keeps one copy of a table in a host's memory for the ranks on that host,
exclude_from_ddp keeps such tables out of DistributedDataParallel, and
load_resharded loads the ranks' checkpoints into another number of ranks.

Imported on its own (``import hostembed.distributed``); a layer above nn/
and optim/."""
from .checkpoint import load_resharded
from .ddp import exclude_from_ddp
from .shared_embedding import SharedEmbedding
from .sharded_embedding import ShardedEmbedding
from .sharded_embedding_bag import ShardedEmbeddingBag

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "SharedEmbedding", "exclude_from_ddp", "load_resharded"]
