"""The CUDA part where there may be no GPU: how the extension was built,
what the GPU path reports without a GPU, and its fallbacks."""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hostembed
from hostembed._core import _C
from hostembed._core import cuda as _cuda

REPO = Path(__file__).resolve().parent.parent
NO_GPU_PATH = pytest.mark.skipif(hostembed.cuda_available(), reason="the GPU path can run here")


def _nvcc_like_setup_py():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def test_cuda_compiled_in_exactly_when_the_build_could():
    mode = os.environ.get("HOSTEMBED_CUDA", "")
    if mode == "0":
        assert not hostembed.cuda_compiled()
    elif mode == "1" or _nvcc_like_setup_py():
        # CI builds with nvcc on PATH: the kernels must have compiled in.
        assert hostembed.cuda_compiled(), "nvcc is here but the extension was built without CUDA"
    else:
        pytest.skip("no nvcc here and HOSTEMBED_CUDA unset: either build is legitimate")
    assert hostembed.cuda_compiled() == hasattr(_C, "cuda_dedup")


def test_cuda_available_needs_both_the_kernels_and_a_gpu():
    assert hostembed.cuda_available() == (hostembed.cuda_compiled() and torch.cuda.is_available())


@NO_GPU_PATH
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_outputs_refused_with_the_reason(device):
    reason = _cuda.unavailable_reason()
    assert reason and ("without CUDA" in reason or "no CUDA GPU is visible" in reason)
    with pytest.raises(RuntimeError, match="needs the GPU path, but") as info:
        hostembed.Embedding(10, 4, device=device)
    assert reason in str(info.value)


@NO_GPU_PATH
@pytest.mark.parametrize("move", [lambda m: m.cuda(), lambda m: m.to("cuda"), lambda m: m.to(torch.device("cuda", 0))])
def test_moving_outputs_to_the_gpu_refused_and_nothing_changes(move):
    emb = hostembed.Embedding(10, 4)
    with pytest.raises(RuntimeError, match="needs the GPU path, but"):
        move(emb)
    assert emb.output_device == torch.device("cpu")
    assert emb(torch.tensor([1])).device.type == "cpu"


def test_dtype_cast_keeps_the_output_device():
    emb = hostembed.Embedding(10, 4, device="meta")
    emb.half()
    assert emb.output_device == torch.device("meta")
    assert emb.weight.dtype == torch.float16 and emb.weight.device.type == "cpu"


@pytest.mark.skipif(not hostembed.cuda_compiled() or torch.cuda.is_available(),
                    reason="needs the CUDA kernels compiled in and no usable GPU")
def test_registration_without_a_driver_fails_cleanly():
    buf = _C.HostBuffer(1 << 20)
    with pytest.raises(RuntimeError, match="CUDA: .* failed"):
        buf.cuda_register(0)
    assert buf.device_address is None and buf.cuda_device is None
    memoryview(buf)[:4] = b"abcd"  # still ordinary host memory
    assert bytes(memoryview(buf)[:4]) == b"abcd"


@pytest.mark.skipif(torch.cuda.is_available(), reason="registration would succeed on this machine")
def test_registration_failure_warns_and_falls_back_to_unpinned():
    # What a GPU lookup does first: pin the table. Here CUDA refuses (no
    # driver, or no CUDA compiled in), and the table must stay usable.
    emb = hostembed.Embedding(50, 8)
    with pytest.warns(RuntimeWarning, match=r"could not pin 1600 bytes of host memory for the GPU \(.*CUDA"):
        assert emb._table.device_address(emb.weight, torch.device("cuda", 0)) is None
    assert not emb.weight.is_pinned() and not emb._table.registered
    # Refused once, not asked again (no warning per step).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert emb._table.device_address(emb.weight, torch.device("cuda", 0)) is None
    torch.manual_seed(0)
    ref = torch.nn.Embedding(50, 8)
    emb.weight.data.copy_(ref.weight.data)
    ids = torch.tensor([3, 49, 3])
    assert torch.equal(emb(ids), ref(ids))
    assert emb._last_lookup_path == "cpu"


def test_tables_are_not_pinned_until_a_gpu_lookup():
    # A CPU-only user on a GPU box pays nothing: no pinning, no CUDA context.
    # In a fresh process: other tests may have made a context in this one.
    code = """
import ctypes, torch, hostembed
emb = hostembed.Embedding(100, 8)
opt = hostembed.SparseAdam(emb.parameters())
emb(torch.tensor([1, 2, 3])).sum().backward()
opt.step()
assert not emb._table.registered
assert not torch.cuda.is_initialized(), "torch made a CUDA context"
# The driver's view, before anything below may make one (is_pinned does):
# no device has an active primary context, whoever would have made it.
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    cuda = None  # no driver: no context either
if cuda is not None and cuda.cuInit(0) == 0:
    count = ctypes.c_int(0)
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    for ordinal in range(count.value):
        device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert cuda.cuDeviceGet(ctypes.byref(device), ordinal) == 0
        assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
        assert active.value == 0, f"a CUDA context is active on device {ordinal}"
assert not emb.weight.is_pinned() and not opt.state[emb.weight]["exp_avg"].is_pinned()
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_update_mode_is_validated():
    emb = hostembed.Embedding(10, 2)
    with pytest.raises(ValueError, match=r"update must be one of \('auto', 'gpu', 'cpu'\), got 'fast'"):
        hostembed.SparseAdam(emb.parameters(), update="fast")


def test_gpu_and_auto_update_modes_use_the_cpu_core_for_cpu_lookups():
    # No GPU twin of the gradient (the lookups ran on the CPU): same bits as
    # update="cpu", and nothing for "auto" to time.
    weights = []
    for update in ("gpu", "auto", "cpu"):
        torch.manual_seed(0)
        emb = hostembed.Embedding(100, 8)
        opt = hostembed.SparseAdam(emb.parameters(), lr=0.1, update=update)
        for step in range(3):
            opt.zero_grad()
            emb(torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            opt.step()
        assert opt._last_update == "cpu" and emb._table.update_chooser is None
        weights.append(emb.weight.detach().clone())
    assert torch.equal(weights[0], weights[2]) and torch.equal(weights[1], weights[2])


def _setuptools_major():
    try:
        from importlib.metadata import version
        return int(version("setuptools").split(".")[0])
    except Exception:  # not installed, or an odd version string
        return 0


# setup() itself reads pyproject.toml, whose license field needs setuptools
# >= 77; the HOSTEMBED_CUDA checks run before it and need nothing.
NEEDS_SETUP = pytest.mark.skipif(_setuptools_major() < 77,
                                 reason="setup() needs setuptools >= 77 for pyproject.toml's license field")


def _run_setup(env_updates, *args):
    env = dict(os.environ, **env_updates)
    env.pop("CUDA_HOME", None)
    env.pop("CUDA_PATH", None)
    return subprocess.run([sys.executable, "setup.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_forcing_cuda_without_nvcc_fails_clearly(tmp_path):
    # An empty PATH: no nvcc (and setup.py needs nothing else from PATH to
    # decide).
    res = _run_setup({"HOSTEMBED_CUDA": "1", "PATH": str(tmp_path)}, "--name")
    assert res.returncode != 0
    assert "HOSTEMBED_CUDA=1 but nvcc was found neither on PATH nor under $CUDA_HOME or $CUDA_PATH" in res.stderr


def test_bad_cuda_mode_refused(tmp_path):
    res = _run_setup({"HOSTEMBED_CUDA": "yes", "PATH": str(tmp_path)}, "--name")
    assert res.returncode != 0
    assert "HOSTEMBED_CUDA must be 0" in res.stderr


@NEEDS_SETUP
def test_skipping_cuda_needs_no_nvcc(tmp_path):
    res = _run_setup({"HOSTEMBED_CUDA": "0", "PATH": str(tmp_path)}, "--name")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "hostembed"


@NEEDS_SETUP
def test_build_never_imports_torch():
    # A poisoned torch on the path: any import of it by setup.py fails.
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; "
            "runpy.run_path('setup.py', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HOSTEMBED_CUDA="0"))
    assert res.returncode == 0, res.stderr
