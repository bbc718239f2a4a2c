"""The calls into the C core: hostembed's custom ops (torch.library,
namespace ``hostembed``) and the cache planner, by engine:

  common.py      registering an op; tensors as the core's arguments; the
                 per-step scratch buffers; weight.grad from reduced rows
  cpu.py         a lookup on the CPU: gather, renorm, the gradient's reduce
                 per unique id, the dedup
  update.py      the optimizers' updates in host memory, from weight.grad's
                 rows or (fused) from a lookup's output gradient
  gpu.py         the GPU path: the zero-copy gather from pinned host memory,
                 the GPU dedup and reduce, SparseAdam's kernel, weight.grad's
                 GPU twin
  cache_plan.py  the row cache's planner on the CPU: which slot holds which
                 row, what a batch moves
  gpu_cache.py   the same planner on the GPU (its state in GPU memory), and
                 the cache's moves, gather and SparseAdam there
  sparse_aten.py kernels torch lacks for sparse gradients (norms, clamps),
                 registered into aten so torch's clipping utilities take them

Adding an op: the core function in csrc/ (or a launcher in cuda/), its
keyword-only binding in binding/, then a function here, in the file of its
engine, that checks its tensors, takes their addresses (common.address)
and calls it, registered with common.custom_op when torch.compile must
trace it (with a fake implementation, and an autograd formula if it is
differentiable). Modules and optimizers call these, never _C.
"""
