"""The row cache (private): Embedding(cache_rows=N) keeps its most used
rows, with their optimizer state, in the slots of a cache (records in GPU
memory for a float32 table with GPU outputs, else host memory).

  row_cache.py   RowCache, the executor of the planner's plans
                 (_core/ops/cache_plan.py): fetches, evictions, the rows a
                 lookup reads, the optimizers' updates of rows wherever they
                 are, write-back; the optimizers' hooks (flush, forget)

The lookup through a cache is in nn/lookup/cached.py; the update reaches it
from _core/ops/update.py through HostTable.cache.
"""
