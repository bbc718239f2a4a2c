"""The boundary to the C core (private): the only layer that calls the
extension, and the bookkeeping every layer above shares. Nothing here
imports from those layers (_cache, io, nn, optim).

  ids.py       the ids a lookup takes: checked and made contiguous
  table.py     HostTable: one table's host memory, its CUDA registration,
               the ordering of GPU work on it, its optimizer-state buffers
  cuda.py      whether the GPU path can run here, and why not
  fused.py     the update in backward (fused=True): which optimizer owns a
               table, the lookup gradients a backward pass hands over
  ops/         the calls into the extension (_C): custom ops on the CPU, the
               optimizers' updates in host memory, the GPU path, the cache
               planners (CPU and GPU)

Adding a table dtype: its code in include/he_dtype.h and table.py's
DTYPE_CODES (with its compute dtype), then the core's conversions
(csrc/convert.c); every loop takes it from there, the row functions in the
compute dtype.
"""
