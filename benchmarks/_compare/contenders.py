"""compare.py's contenders: the tables and their optimizer in each of the
eight set-ups, the model built for one, and why one cannot run here."""
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from _common import DENSE_ADAM_WARMUP, GIB, mem_available_bytes, progress, require_hostembed

from .workload import RecModel, seeded_mlp

hostembed = require_hostembed()

# Memory each contender needs per table element (fp32), to skip what cannot fit.
SPARSE_ADAM_BYTES = 12  # weight, exp_avg, exp_avg_sq (hostembed's moments are lazy, but
                        # with huge pages most of them become resident anyway)
DENSE_ADAM_BYTES = 24   # + the dense gradient and the two table-sized temporaries of
                        # torch's single-tensor Adam (sqrt, then the division): cpu_step.py
                        # measured 6.1 GiB at peak for a 1 GiB table
HOST_HEADROOM = GIB     # the rest of the process: batches, MLP, scratch buffers
GPU_HEADROOM = GIB      # activations, the sparse gradient, allocator slack


@dataclass(frozen=True)
class Contender:
    number: int
    key: str
    label: str
    make_table: Callable      # (rows, cfg, out_device) -> embedding module
    table_optimizer: Callable  # torch.optim class over the tables
    on_gpu: bool = False      # tables on out_device (which must be a GPU)
    dense: bool = False       # dense Adam: fewer steps
    host_bytes: int = SPARSE_ADAM_BYTES  # host memory per table element, to skip what cannot fit

    def table_device(self, out_device):
        return out_device if self.on_gpu else torch.device("cpu")

    def steps(self, cfg):
        """(warm-up steps, timed steps)."""
        return (DENSE_ADAM_WARMUP, cfg.adam_steps) if self.dense else (cfg.warmup, cfg.steps)


def _torch_table(rows, cfg, out_device):
    return nn.Embedding(rows, cfg.dim)


def _torch_sparse_table(rows, cfg, out_device):
    return nn.Embedding(rows, cfg.dim, sparse=True)


def _torch_gpu_table(rows, cfg, out_device):
    # Drawn on the CPU and then moved: the CUDA generator would draw other
    # weights, and every contender must start from the same ones.
    return nn.Embedding(rows, cfg.dim, sparse=True).to(out_device)


def _hostembed_table(rows, cfg, out_device):
    return hostembed.Embedding(rows, cfg.dim, device=out_device)


def _hostembed_cached_table(rows, cfg, out_device):
    return hostembed.Embedding(rows, cfg.dim, device=out_device, cache_rows=max(1, int(cfg.cache_fraction * rows)))


TORCH_ADAM = Contender(1, "torch_adam", "torch nn.Embedding (CPU) + torch.optim.Adam (dense)",
                       _torch_table, torch.optim.Adam, dense=True, host_bytes=DENSE_ADAM_BYTES)
TORCH_SPARSE = Contender(2, "torch_sparse_cpu", "torch nn.Embedding(sparse=True) (CPU) + torch.optim.SparseAdam",
                         _torch_sparse_table, torch.optim.SparseAdam)
TORCH_GPU = Contender(3, "torch_sparse_gpu", "torch nn.Embedding(sparse=True) (GPU) + torch.optim.SparseAdam",
                      _torch_gpu_table, torch.optim.SparseAdam, on_gpu=True)
HOSTEMBED = Contender(4, "hostembed", "hostembed.Embedding + hostembed.SparseAdam",
                      _hostembed_table, hostembed.SparseAdam)
HOSTEMBED_FUSED = Contender(5, "hostembed_fused", "hostembed.Embedding + hostembed.SparseAdam(fused=True)",
                            _hostembed_table, functools.partial(hostembed.SparseAdam, fused=True))
TORCH_ADAM_FUSED = Contender(6, "torch_adam_fused", "torch nn.Embedding (CPU) + torch.optim.Adam(fused=True) (dense)",
                             _torch_table, functools.partial(torch.optim.Adam, fused=True), dense=True,
                             host_bytes=DENSE_ADAM_BYTES)
SWAP_ADAM = Contender(7, "hostembed_adam", "hostembed.Embedding + torch.optim.Adam (dense, plain swap)",
                      _hostembed_table, torch.optim.Adam, dense=True)
HOSTEMBED_CACHED = Contender(8, "hostembed_cached",
                             "hostembed.Embedding(cache_rows) + SparseAdam(fused=True), GPU cache",
                             _hostembed_cached_table, functools.partial(hostembed.SparseAdam, fused=True))
CONTENDERS = (TORCH_ADAM, TORCH_SPARSE, TORCH_GPU, HOSTEMBED, HOSTEMBED_FUSED, TORCH_ADAM_FUSED, SWAP_ADAM,
              HOSTEMBED_CACHED)
AGREEING = (TORCH_SPARSE, TORCH_GPU, HOSTEMBED, HOSTEMBED_FUSED, HOSTEMBED_CACHED)  # must follow the same loss curve
DENSE = (TORCH_ADAM, TORCH_ADAM_FUSED, SWAP_ADAM)                # and these the same one of dense Adam


def build(contender, cfg, out_device):
    """The model and its optimizers; tables drawn after the same seed by every contender."""
    torch.manual_seed(cfg.seed)
    users, items = (contender.make_table(rows, cfg, out_device)
                    for rows in progress((cfg.users, cfg.items), f"{contender.key}: table init"))
    model = RecModel(users, items, seeded_mlp(cfg, out_device), contender.table_device(out_device), out_device)
    optimizers = [contender.table_optimizer(model.tables(), lr=cfg.lr),
                  torch.optim.Adam(model.mlp.parameters(), lr=cfg.lr)]
    return model, optimizers


def _host_shortfall(need, what):
    available = mem_available_bytes()
    if available is None or need + HOST_HEADROOM <= available:
        return None
    return f"does not fit in host RAM: {what} need ~{need / GIB:.1f} GiB, {available / GIB:.1f} GiB available"


def skip_reason(contender, cfg, out_device) -> Optional[str]:
    """Why the contender cannot run here, judged just before it would (None: it runs)."""
    elements = (cfg.users + cfg.items) * cfg.dim
    if contender.dense and cfg.adam_steps == 0:
        return "--adam-steps 0"
    if contender is HOSTEMBED_CACHED and out_device.type != "cuda":
        return "a row cache in GPU memory needs GPU outputs"
    if contender.dense:
        gradients = " and dense gradients" if contender.host_bytes > SPARSE_ADAM_BYTES else ""
        return _host_shortfall(contender.host_bytes * elements,
                               f"the tables with Adam state{gradients} ({contender.host_bytes} bytes/element)")
    if not contender.on_gpu:
        return _host_shortfall(SPARSE_ADAM_BYTES * elements,
                               f"the tables with SparseAdam state ({SPARSE_ADAM_BYTES} bytes/element)")
    if out_device.type != "cuda":
        return "no GPU" if not torch.cuda.is_available() else "outputs are on the CPU (--device cpu)"
    need = SPARSE_ADAM_BYTES * elements
    free, total = torch.cuda.mem_get_info(out_device)
    if need + GPU_HEADROOM > free:
        return (f"does not fit in GPU memory: the tables with SparseAdam state need ~{need / GIB:.1f} GiB, "
                f"{free / GIB:.1f} of {total / GIB:.1f} GiB free")
    # Each table is drawn on the CPU before it moves to the GPU.
    return _host_shortfall(4 * max(cfg.users, cfg.items) * cfg.dim, "the largest table, drawn on the CPU,")
