"""The GPU cache's SGD, Adagrad and row-wise Adagrad (optim_cached in
cuda/he_cuda_optim_cached.cuh), run on the host and compared bit for bit
with the CPU core, so that CI checks the kernel's arithmetic without a GPU.

A row's weight and state move between GPU records and host rows, and the
core updates the rows the cache does not hold, so the kernel must give the
core's bits. tests/kernel_twin/optim_rows.cpp compiles the kernel's own
source with g++ over device_shim.h (one thread a lane, the warp's shuffles
and __syncwarp on a barrier, the _rn intrinsics as unfused IEEE float
operations, __fmaf_rn as fmaf) with the launcher's own per-step scalars.
Each step, rows whose entry names a slot are updated in the records by
slot, the others in the host rows by id, and every array is compared with
update_rows of the core on the same rows: Adagrad's lr_decay over several
steps, maximize, dims of 1, of a part of the 8 lanes and of several lanes
and a tail, and several launch shapes (grids too small for the rows, so
that a warp's groups run out of rows while others still shuffle).

weight_decay: the core's rules for these three optimizers take none (the
Python optimizers refuse it), so with it on the core and the kernel must
still agree: it is ignored by both.

Not covered: the GPU's own rounding of each intrinsic (IEEE by CUDA's
specification; tests/test_cache_gpu.py runs the kernel on a GPU)."""
import struct
import subprocess

import numpy as np
import pytest
import torch

from hostembed._core.ops import update as _ops
from hostembed._core.table import HostTable

from kernel_twin_build import build_twin
from test_compact_kernel_twin import cached_entries, twin_gradients

KINDS = {"SGD": (_ops.SGD, None), "Adagrad": (_ops.ADAGRAD, "sum"), "RowWiseAdagrad": (_ops.ROWWISE_ADAGRAD, "row_sum")}


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    return build_twin(tmp_path_factory.mktemp("optim_twin"), "optim_rows")


def _part(count, dim, key, gen):
    """A table of `count` rows (host rows, or records) and its state."""
    table = HostTable(count, dim)
    table.tensor.copy_(torch.randn(count, dim, generator=gen))
    if key is None:
        return table, {}
    state = table.zeros(per_row=key == "row_sum")
    state.copy_(torch.rand(state.shape, generator=gen) * 0.5)  # an accumulator's start: >= 0
    return table, {key: state}


def _arrays(part):
    table, state = part
    return [table.tensor, *state.values()]


def _launch(harness, folder, kind, parts, entry, indices, values, hyper, grid, block, nudge=False):
    """The kernel's arrays after one launch on copies of parts' ({"host":
    (table, state), "records": ...}), as {part: [weight, state...]}."""
    host = parts["host"][0]
    blob = [struct.pack("=9q4d", host.num_rows, parts["records"][0].num_rows, host.dim, kind, indices.numel(),
                        hyper["step"], int(hyper["maximize"]), grid, block, hyper["lr"], hyper["eps"],
                        hyper["lr_decay"], hyper["weight_decay"]),
            entry.numpy().astype(np.uint32).tobytes()]
    blob += [t.contiguous().numpy().tobytes() for part in ("host", "records") for t in _arrays(parts[part])]
    blob += [indices.numpy().tobytes(), values.contiguous().numpy().tobytes()]
    (folder / "in.bin").write_bytes(b"".join(blob))
    res = subprocess.run([harness, folder / "in.bin", folder / "out.bin", *(["nudge"] if nudge else [])],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"the kernel's twin failed ({res.returncode}): {res.stderr}"
    data, at, got = (folder / "out.bin").read_bytes(), 0, {}
    for part in ("host", "records"):
        got[part] = []
        for t in _arrays(parts[part]):
            n = t.numel() * 4
            got[part].append(torch.frombuffer(bytearray(data[at:at + n]), dtype=torch.float32).view(t.shape))
            at += n
    assert at == len(data), "the twin wrote more than the arrays"
    return got


def _first_difference(mine, core):
    """Where two float32 arrays first differ bit for bit, or None."""
    differ = mine.view(torch.int32) != core.view(torch.int32)
    if not differ.any():
        return None
    at = tuple(differ.nonzero()[0].tolist())
    return f"at {at}: kernel {mine[at].item()!r}, core {core[at].item()!r}"


def _sequential_row_sums(old, values):
    """Row-wise Adagrad's new row_sum were the squares summed one column
    after another (not in the core's 8 lanes), in float32."""
    g = values.numpy()
    with np.errstate(over="ignore"):  # the 1e30 gradients' squares are infinite, as in the core
        squares = np.cumsum(g * g, axis=1, dtype=np.float32)[:, -1]
        return torch.from_numpy(old.numpy() + squares / np.float32(g.shape[1]))


def _run(harness, folder, name, dim, grid, block, weight_decay, maximize, steps=4, nudge=False):
    """Trains host rows and records alike through the kernel's twin and the
    core; returns the first difference (None: every bit equal) and whether
    a sequential sum of row-wise Adagrad's squares would have differed."""
    kind, key = KINDS[name]
    rows, slots, nnz = 200, 32, 61  # 61: a warp's last groups run out of rows
    gen = torch.Generator().manual_seed(dim * 7 + grid)
    parts = {"host": _part(rows, dim, key, gen), "records": _part(slots, dim, key, gen)}
    entry, slot_of = cached_entries(rows, slots, gen)
    order_tells = False
    # Gradients of every size, zero rows, 1e30 (infinite squares) and
    # 1e-19 (subnormal squares).
    scales = [1.0, 1e-3, 1e-19, 1e2, 0.5, 3.0][:steps]
    for step, scale, indices, values, slot, cached in twin_gradients(rows, nnz, dim, slot_of, scales, gen):
        hyper = dict(lr=0.05, eps=1e-8, lr_decay=0.01, step=step, maximize=maximize, weight_decay=weight_decay)
        got = _launch(harness, folder, kind, parts, entry, indices, values, hyper, grid, block, nudge)
        for part, chosen, where in (("host", ~cached, indices), ("records", cached, slot)):
            table, state = parts[part]
            before = [t.clone() for t in _arrays(parts[part])]
            if key == "row_sum":
                sequential = _sequential_row_sums(state[key][where[chosen]], values[chosen])
            _ops.update_rows(kind, table, state, where[chosen], values[chosen], **hyper)
            if key == "row_sum":
                order_tells |= not torch.equal(sequential, state[key][where[chosen]])
            if scale >= 1e-3:  # the reference did update rows (a test that compares no change proves nothing)
                assert not torch.equal(before[0], table.tensor), f"step {step}: the core changed no {part} weight"
            for i, (mine, core) in enumerate(zip(got[part], _arrays(parts[part]))):
                assert not core.isnan().any(), "a NaN would compare as bits the GPU does not promise"
                diff = _first_difference(mine, core)
                if diff is not None:
                    return f"step {step}, {part} {'weight' if i == 0 else key}: {diff}", order_tells
    return None, order_tells


CASES = [
    # dim (1; a part of the 8 lanes; lanes and a tail, not a multiple of 4;
    # whole lanes; many), grid, block (grid * block / 8 rows at once),
    # weight_decay, maximize
    (1, 1, 32, 0.0, False),
    (6, 2, 64, 0.1, True),
    (13, 1, 32, 0.0, True),
    (64, 3, 32, 0.1, False),
    (300, 1, 96, 0.0, False),
]


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("dim, grid, block, weight_decay, maximize", CASES,
                         ids=[f"dim{c[0]}-{c[1]}x{c[2]}{'-wd' if c[3] else ''}{'-max' if c[4] else ''}"
                              for c in CASES])
def test_the_optimizer_kernel_gives_the_cores_bits(harness, tmp_path, name, dim, grid, block, weight_decay,
                                                   maximize):
    diff, order_tells = _run(harness, tmp_path, name, dim, grid, block, weight_decay, maximize)
    assert diff is None, diff
    if name == "RowWiseAdagrad" and dim > 8:
        # The data tells the core's 8-lane order from a column-by-column
        # sum, so matching the core checks the kernel's order too.
        assert order_tells, "no row's sum of squares depends on the order: the test cannot check it"


@pytest.mark.parametrize("name", list(KINDS))
def test_a_one_ulp_change_of_the_step_is_caught(harness, tmp_path, name):
    # The step's scalar one ulp off (the harness's nudge) must fail the
    # comparison above, in the first step.
    diff, _ = _run(harness, tmp_path, name, 13, 1, 32, 0.0, False, steps=1, nudge=True)
    assert diff is not None and diff.startswith("step 1"), diff
