"""The GPU cache's SparseAdam on compact moments (adam_compact_cached in
cuda/he_cuda_compact.cuh), run on the host and compared bit for bit with
the CPU core, so that CI checks the kernel's arithmetic without a GPU.

A row's moments move between GPU records and host rows, and the core
updates the rows the cache does not hold, so the kernel must give the
core's bits. tests/kernel_twin/compact_adam.cpp compiles the kernel's own
source with g++ over device_shim.h (one thread a lane, the warp's max
reduction on a barrier, the _rn intrinsics as unfused IEEE float
operations) and links the core's he_adam_make_consts. Each step, rows
whose entry names a slot are updated in the records by slot, the others
in the host rows by id, and every array is compared with update_rows of
the core on the same rows.

Not covered: the GPU's own rounding of each intrinsic (IEEE by CUDA's
specification; tests/test_cache_gpu.py runs the kernel on a GPU), nor the
bits of a NaN weight: the GPU's float arithmetic gives one NaN,
0x7FFFFFFF, where x86 gives others, so a weight's NaNs match any NaN.
The moments' NaNs are constants the kernel writes, compared bit for bit."""
import struct
import subprocess

import numpy as np
import pytest
import torch

from hostembed._core.ops import update as _ops
from hostembed._core.table import STATE_CODES, HostTable

from kernel_twin_build import build_twin

# include/he_cache_policy.h: an entry is slot + 1 below this bit, a use count above.
SLOT_BITS = 28

# update_rows' arrays of a table and its state, in he_cuda_cache_compact's
# order (the harness's files follow it).
NAMES = ("weight", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")

FORMS = {"bfloat16": (torch.bfloat16, torch.bfloat16), "int8": (torch.int8, torch.uint8),
         "int8-int8": (torch.int8, torch.int8)}


def cached_entries(rows, slots, gen):
    """The cache's entries of `rows` rows, `slots` of them cached (slot + 1
    below SLOT_BITS, a random use count above it, which a kernel must mask
    off), and each row's slot (-1: not cached)."""
    entry = torch.randint(0, 16, (rows,), generator=gen, dtype=torch.int64) << SLOT_BITS
    entry[torch.randperm(rows, generator=gen)[:slots]] += torch.arange(1, slots + 1)
    return entry, (entry & ((1 << SLOT_BITS) - 1)) - 1


def twin_gradients(rows, nnz, dim, slot_of, scales, gen):
    """A step's (step, scale, indices, values, slot, cached) for each of
    `scales`: `nnz` sorted distinct rows, some cached and some not, their
    gradients at that scale with every fifth row zero, and at step 2 a 1e30
    (an infinite square) in a cached row and in an uncached one."""
    for step, scale in enumerate(scales, start=1):
        indices = torch.sort(torch.randperm(rows, generator=gen)[:nnz]).values
        values = torch.randn(nnz, dim, generator=gen) * scale
        values[::5] = 0.0
        slot = slot_of[indices]
        cached = slot >= 0
        assert 0 < int(cached.sum()) < nnz
        if step == 2:
            values[cached.nonzero()[0, 0], 0] = 1e30
            values[(~cached).nonzero()[-1, 0], -1] = -1e30
        yield step, scale, indices, values, slot, cached


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    # he_adam_make_consts and the he_fail it needs, from the core itself.
    return build_twin(tmp_path_factory.mktemp("kernel_twin"), "compact_adam", ("optimizers", "status"))


def _states(table, form):
    m_dtype, v_dtype = FORMS[form]
    blocks = -(-table.dim // 256)
    return {key: (table.zeros(dtype=dtype),
                  None if dtype == torch.bfloat16 else table.zeros(dtype=torch.float32, width=blocks), False)
            for key, dtype in (("exp_avg", m_dtype), ("exp_avg_sq", v_dtype))}


def _arrays(table, state):
    """{name: tensor} in NAMES' order, a bfloat16 moment's scales left out."""
    found = {"weight": table.tensor, "exp_avg": state["exp_avg"][0], "exp_avg_sq": state["exp_avg_sq"][0],
             "exp_avg_scale": state["exp_avg"][1], "exp_avg_sq_scale": state["exp_avg_sq"][1]}
    return {name: found[name] for name in NAMES if found[name] is not None}


def _bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _launch(harness, folder, parts, entry, indices, values, hyper, grid, block):
    """The kernel's arrays after one launch on copies of parts' ({"host":
    (table, state), "records": ...}), as {part: {name: tensor}}."""
    (host, host_state), (records, _) = parts["host"], parts["records"]
    codes = (STATE_CODES[host_state["exp_avg"][0].dtype], STATE_CODES[host_state["exp_avg_sq"][0].dtype])
    blob = [struct.pack("=10q5d", host.num_rows, records.num_rows, host.dim, *codes, indices.numel(),
                        hyper["step"], int(hyper["maximize"]), grid, block, hyper["lr"], hyper["beta1"],
                        hyper["beta2"], hyper["eps"], hyper["weight_decay"]),
            entry.numpy().astype(np.uint32).tobytes()]
    blob += [_bytes(t) for part in ("host", "records") for t in _arrays(*parts[part]).values()]
    blob += [_bytes(indices), _bytes(values)]
    (folder / "in.bin").write_bytes(b"".join(blob))
    res = subprocess.run([harness, folder / "in.bin", folder / "out.bin"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, f"the kernel's twin failed ({res.returncode}): {res.stderr}"
    data, at, got = (folder / "out.bin").read_bytes(), 0, {}
    for part in ("host", "records"):
        got[part] = {}
        for name, t in _arrays(*parts[part]).items():
            n = t.numel() * t.element_size()
            got[part][name] = torch.frombuffer(bytearray(data[at:at + n]), dtype=t.dtype).view(t.shape)
            at += n
    assert at == len(data), "the twin wrote more than the arrays"
    return got


BITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}


def _first_difference(name, mine, core):
    """Where two arrays first differ, bit for bit (a weight's NaNs
    matching any NaN: see above), or None."""
    differ = mine.view(BITS[mine.element_size()]) != core.view(BITS[core.element_size()])
    if name == "weight":
        differ &= ~(mine.isnan() & core.isnan())
    if not differ.any():
        return None
    row, col = differ.nonzero()[0].tolist()
    return f"row {row} column {col}: kernel {mine[row, col].item()!r}, core {core[row, col].item()!r}"


CASES = [
    # form, dim (a block of 256 columns or several, and a part), grid, block (warps), weight_decay, maximize
    ("bfloat16", 6, 1, 32, 0.0, False),
    ("bfloat16", 514, 3, 32, 0.1, False),
    ("int8", 8, 1, 64, 0.0, True),
    ("int8", 260, 3, 32, 0.01, True),
    ("int8", 600, 1, 96, 0.0, False),
    ("int8-int8", 300, 2, 32, 0.1, False),
]


@pytest.mark.parametrize("form, dim, grid, block, weight_decay, maximize", CASES,
                         ids=[f"{c[0]}-dim{c[1]}-{c[2]}x{c[3]}" for c in CASES])
def test_the_compact_kernel_gives_the_cores_bits(harness, tmp_path, form, dim, grid, block, weight_decay, maximize):
    rows, slots, nnz = 200, 32, 64
    gen = torch.Generator().manual_seed(dim)
    parts = {}
    for part, count in (("host", rows), ("records", slots)):
        table = HostTable(count, dim)
        table.tensor.copy_(torch.randn(count, dim, generator=gen))
        parts[part] = (table, _states(table, form))
    entry, slot_of = cached_entries(rows, slots, gen)
    # Gradients of every size, zero rows (a block left 0 at the first step,
    # its scale 0), 1e30 (infinite squares: NaN scales, then NaN rows) and
    # 1e-19 (subnormal squares).
    for step, _, indices, values, slot, cached in twin_gradients(rows, nnz, dim, slot_of, [1.0, 1e-3, 1e-19, 1e2],
                                                                 gen):
        hyper = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=step, maximize=maximize,
                     weight_decay=weight_decay)
        got = _launch(harness, tmp_path, parts, entry, indices, values, hyper, grid, block)
        for part, chosen, where in (("host", ~cached, indices), ("records", cached, slot)):
            table, state = parts[part]
            _ops.update_rows(_ops.ADAM, table, state, where[chosen], values[chosen], lr_decay=0.0, **hyper)
            for name, core in _arrays(table, state).items():
                diff = _first_difference(name, got[part][name], core)
                assert diff is None, f"step {step}, {part} {name}: {diff}"
