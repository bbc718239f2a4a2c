"""The optimizers: torch.optim classes whose update of a hostembed table
runs in place in host memory, in one threaded pass of the core over the
gradient's rows, one optimizer a file over one base.

  base.py             HostStep, the step() they share (torch's own step for
                      every other parameter), and the gradient checks
  sparse_adam.py      SparseAdam (its update on the CPU or on the GPU)
  sgd.py              SGD
  adagrad.py          Adagrad
  rowwise_adagrad.py  RowWiseAdagrad (torch's Adagrad for other parameters)
  adam.py             Adam and AdamW: torch's dense semantics, each table
                      stepped by the core without a dense gradient
  update_choice.py    where SparseAdam updates a table with GPU outputs,
                      settled by timing both
  torch_optimizers.py torch's own optimizers on host tables (the gradient
                      each can take; Adam and AdamW by the core, without a
                      dense gradient), through torch's global step hooks

SGD, Adagrad and SparseAdam are torch's classes with torch's signature,
validation, state keys and numerics (the core computes what torch's
sparse-gradient branch computes: SGD to the bit, Adagrad within an ulp,
since torch's vectorised sqrt is not always correctly rounded); only the
hyperparameters that make a sparse step touch every row are refused for
host tables (the classes say why). ``fused=True`` applies a host table's
update in backward, from the lookup's output gradient (_core/fused.py): the
same bits, no weight.grad, step() after each backward. For other
parameters it keeps torch's meaning.

Adding an optimizer: base.py says how.
"""
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .rowwise_adagrad import RowWiseAdagrad
from .sgd import SGD
from .sparse_adam import SparseAdam
from .torch_optimizers import route as torch_optimizer_route  # registers the step hooks

__all__ = ["SparseAdam", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "AdamW", "torch_optimizer_route"]
