"""The row cache (private): Embedding(cache_rows=N) keeps its most used
rows, with their optimizer state, in the slots of a cache (records in GPU
memory for a float32 table with GPU outputs, else host memory).

  row_cache.py   RowCache, records in host memory moved as the CPU's
                 planner (_core/ops/cache_plan.py) says: fetches,
                 evictions, the rows a lookup reads, the optimizers'
                 updates of rows wherever they are, write-back, coherence
                 with host memory; the optimizers' hooks (flush, forget)
  gpu_cache.py   GpuRowCache, records and planner in GPU memory
                 (_core/ops/gpu_cache.py): a step that waits for the GPU
                 only for its dedup; and HostTwinState, which runs the same
                 executor on the CPU planner and host records (the tests)

The lookup through a cache is in nn/lookup/cached.py; the update reaches it
from _core/ops/update.py through HostTable.cache.
"""
