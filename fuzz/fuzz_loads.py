"""Fuzzing hostembed.load, SparseAdam.load_state_dict and
Embedding.load_state_dict with hostile checkpoints (atheris, libFuzzer).

    pip install atheris
    python fuzz/fuzz_loads.py fuzz/corpus/loads -max_total_time=30
    python fuzz/fuzz_loads.py fuzz/corpus/loads -max_total_time=1800 -print_final_stats=1
    python fuzz/fuzz_loads.py /tmp/fuzz_loads_artifacts/crash-<sha>     # replay one input

The corpus directories given are only read: libFuzzer writes the inputs it
finds interesting into its first corpus directory, so this script puts a new
temporary directory (/tmp/fuzz_loads_corpus_*, left behind for inspection)
in front of them. Findings go to /tmp/fuzz_loads_artifacts/ unless
-artifact_prefix= is given. The checkpoint each input is written to lives in
/dev/shm/fuzz_loads_*/ (a few KB; libFuzzer exits without Python's cleanup).

Each input is a recipe read with atheris.FuzzedDataProvider: which entries of
a valid checkpoint of a small model (a hostembed.Embedding, a BatchNorm1d
and a Linear; hostembed.SparseAdam on the table, torch.optim.Adam on the
rest, one step taken) to change, and to what: wrong types, shapes, dtypes,
layouts, None, strings, huge and non-finite numbers, missing and extra keys,
nested junk. It is then either saved with torch.save and loaded with
hostembed.load, or handed straight to SparseAdam.load_state_dict or
Embedding.load_state_dict (which also sees objects torch.save would not
write). The property checked:

* the load succeeds, and a training step after it runs (hostembed's part of
  it always; torch's Adam step may refuse extreme values its own
  constructor accepts, e.g. weight_decay=1e308: raised inside torch.optim,
  that is torch's behaviour, not a finding); or
* it raises ValueError, TypeError or RuntimeError (the documented
  exceptions; never "partially loaded": nothing here fails while copying),
  and every parameter, buffer, optimizer state tensor, step and
  hyperparameter is bitwise what it was.

Anything else (another exception, a changed model after a refusal, a step
that fails after an accepted load) is a finding: the script raises, and
libFuzzer saves the input.
"""
import copy
import os
import struct
import sys
import tempfile
import traceback
import warnings

import atheris

import torch  # not instrumented: only hostembed's code is
from torch import nn

with atheris.instrument_imports(include=["hostembed"]):
    import hostembed

warnings.simplefilter("ignore")
torch.set_num_threads(1)
hostembed.set_num_threads(1)

ROWS, DIM = 8, 4
DOCUMENTED = (ValueError, TypeError, RuntimeError)


def build():
    torch.manual_seed(0)
    emb = hostembed.Embedding(ROWS, DIM)
    model = nn.Sequential(emb, nn.BatchNorm1d(DIM), nn.Linear(DIM, 2))
    opts = [hostembed.SparseAdam(emb.parameters(), lr=0.01),
            torch.optim.Adam(list(model[1].parameters()) + list(model[2].parameters()), lr=0.01)]
    train(model, opts)
    return model, opts


def train(model, opts):
    model(torch.tensor([1, 3, 5, 3])).sum().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


# ---- bitwise comparison of everything a load may change


def same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
            return False
        return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                           b.detach().reshape(-1).contiguous().view(torch.uint8))
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def snapshot(model, opts):
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "table": model[0].weight.data_ptr(),
        "groups": [copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in o.param_groups])
                   for o in opts],
        "state": [{id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in s.items()}
                   for p, s in o.state.items()} for o in opts],
        "objects": [{(id(p), k): id(v) for p, s in o.state.items() for k, v in s.items()} for o in opts],
    }


def changed_parts(before, model, opts):
    after = snapshot(model, opts)
    return [part for part in before if not same(before[part], after[part])]


# ---- mutations


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.complex64, torch.int8]
KEYS = ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "lr", "betas", "eps", "maximize", "amsgrad",
        "weight_decay", "foreach", "fused", "capturable", "params", "param_names", "initial_lr", "weight", "bias",
        "running_mean", "num_batches_tracked", "state", "param_groups", "model", "optimizer", "extra", "format",
        "version", "0.weight", "1.weight", "2.bias", "junk", 0, 1, 2, 3, -1, 7, 1 << 40]
NUMBERS = [0, 1, -1, 2, 0.0, -0.0, 1.0, 0.5, 0.9, 0.999, 1e-8, -1e-8, 1e308, -1e308, 5e-324, float("nan"),
           float("inf"), float("-inf"), 1 << 62, (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63), 10 ** 30, True, False]


def junk_tensor(fdp):
    dims = fdp.ConsumeIntInRange(0, 3)
    shape = [fdp.PickValueInList([0, 1, 2, ROWS, DIM, 3, 9]) for _ in range(dims)]
    dtype = fdp.PickValueInList(DTYPES)
    kind = fdp.ConsumeIntInRange(0, 5)
    t = torch.zeros(shape, dtype=dtype)
    if kind == 1 and t.numel():
        t = torch.full(shape, fdp.PickValueInList([float("nan"), float("inf"), -1.0, 3.0]),
                       dtype=dtype if dtype.is_floating_point or dtype.is_complex else torch.float32)
    elif kind == 2 and dims == 2:
        t = t.t()  # not contiguous
    elif kind == 3 and dims >= 1 and dtype not in (torch.bool,) and not dtype.is_complex:
        try:
            t = t.to_sparse()
        except RuntimeError:
            pass
    elif kind == 4:
        t = torch.empty(shape, dtype=dtype, device="meta")
    return t


def junk(fdp, depth=0):
    choice = fdp.ConsumeIntInRange(0, 11)
    if choice == 0:
        return None
    if choice == 1:
        return fdp.PickValueInList(NUMBERS)
    if choice == 2:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 9))
    if choice == 3:
        return fdp.ConsumeFloat()
    if choice == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 8))
    if choice == 5:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8))
    if choice == 6:
        return junk_tensor(fdp)
    if choice == 7 and depth < 3:
        return [junk(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    if choice == 8 and depth < 3:
        return tuple(junk(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3)))
    if choice == 9 and depth < 3:
        return {fdp.PickValueInList(KEYS): junk(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}
    if choice == 10:
        return fdp.PickValueInList(["0", "0.1", "True", "nan", "", "step", "hostembed.checkpoint"])
    return torch.tensor(fdp.PickValueInList([0, 1, 3, -1, 1.5, float("nan"), 1e30]))


def mutate_value(fdp, value):
    """A nearby value: the same kind of thing, slightly or badly off."""
    if isinstance(value, torch.Tensor):
        op = fdp.ConsumeIntInRange(0, 6)
        if op == 0:
            return value.to(fdp.PickValueInList(DTYPES))
        if op == 1 and value.dim():
            shape = list(value.shape)
            shape[fdp.ConsumeIntInRange(0, len(shape) - 1)] += fdp.PickValueInList([-1, 1])
            return torch.zeros([max(0, s) for s in shape], dtype=value.dtype)
        if op == 2:
            return value.reshape(-1)
        if op == 3:
            return value.unsqueeze(0)
        if op == 4 and value.is_floating_point():
            return torch.full_like(value, fdp.PickValueInList([float("nan"), float("inf"), -1.0]))
        if op == 5 and value.dim() == 2:
            return value.t()
        return value.reshape(()) if value.numel() == 1 else junk_tensor(fdp)
    if isinstance(value, tuple) and value:
        items = list(value)
        items[fdp.ConsumeIntInRange(0, len(items) - 1)] = fdp.PickValueInList(NUMBERS + [None, "0.9"])
        return tuple(items) if fdp.ConsumeBool() else items
    if isinstance(value, (bool, int, float)):
        try:
            as_tensor = torch.tensor(value)
        except (OverflowError, RuntimeError, ValueError):  # an int beyond int64
            as_tensor = torch.tensor(float(value))
        return fdp.PickValueInList(NUMBERS + [str(value), None, as_tensor])
    if isinstance(value, list) and value:
        items = list(value)
        items[fdp.ConsumeIntInRange(0, len(items) - 1)] = junk(fdp)
        return items
    if isinstance(value, dict):
        return {}
    return junk(fdp)


def slots(obj, out):
    """Every (container, key) in nested dicts and lists."""
    if isinstance(obj, dict):
        for key in list(obj):
            out.append((obj, key))
            slots(obj[key], out)
    elif isinstance(obj, list):
        for index in range(len(obj)):
            out.append((obj, index))
            slots(obj[index], out)
    return out


def mutate(fdp, root):
    """Applies 1-4 mutations; False when the recipe itself could not be
    carried out (a harness limit, not a finding)."""
    try:
        _mutate(fdp, root)
    except (OverflowError, RuntimeError, ValueError, TypeError, MemoryError):
        return False
    return True


def _mutate(fdp, root):
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        places = slots(root, [])
        if not places:
            return
        container, key = places[fdp.ConsumeIntInRange(0, len(places) - 1)]
        op = fdp.ConsumeIntInRange(0, 9)
        if op <= 1:
            container[key] = junk(fdp)
        elif op == 2:
            del container[key]
        elif op == 3:
            if isinstance(container, dict):
                container[fdp.PickValueInList(KEYS)] = junk(fdp)
            else:
                container.append(junk(fdp))
        elif op == 4:
            metadata = getattr(root.get("model"), "_metadata", None) if isinstance(root, dict) else None
            if metadata:
                entry = metadata[fdp.PickValueInList(list(metadata))]
                entry["version"] = junk(fdp)
            else:
                container[key] = mutate_value(fdp, container[key])
        else:
            container[key] = mutate_value(fdp, container[key])


# ---- the target


class Target:
    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="fuzz_loads_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.path = os.path.join(self.directory, "ckpt.pt")
        model, opts = build()
        hostembed.save(self.path, model, opts, extra={"epoch": 1})
        self.base = torch.load(self.path, weights_only=True)
        with torch.no_grad():  # a load that copies anything shows
            self.base["model"]["0.weight"] += 1.0
        self.model = None

    def fresh(self):
        if self.model is None:
            self.model, self.opts = build()
        return self.model, self.opts

    def __call__(self, data):
        fdp = atheris.FuzzedDataProvider(data)
        mode = fdp.ConsumeIntInRange(0, 4)
        model, opts = self.fresh()
        if mode <= 2:
            ck = copy.deepcopy(self.base)
            if not mutate(fdp, ck):
                return
            try:
                torch.save(ck, self.path)
            except Exception:  # noqa: BLE001 - not a checkpoint anyone could write
                return
            what, call = "hostembed.load", lambda: hostembed.load(self.path, model, opts)
        elif mode == 3:
            box = {"sd": copy.deepcopy(self.base["optimizer"][0])}
            if not mutate(fdp, box):
                return
            what, call = "SparseAdam.load_state_dict", lambda: opts[0].load_state_dict(box.get("sd"))
        else:
            box = {"sd": {"weight": self.base["model"]["0.weight"].clone()}}
            if not mutate(fdp, box):
                return
            strict = fdp.ConsumeBool()
            what, call = "Embedding.load_state_dict", lambda: model[0].load_state_dict(box.get("sd"), strict=strict)
        before = snapshot(model, opts)
        try:
            call()
        except DOCUMENTED as exc:
            if "partially loaded" in str(exc):
                raise AssertionError(f"{what} reported a partial load with no I/O fault: {exc}") from exc
            changed = changed_parts(before, model, opts)
            if changed:
                raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}\nbut changed {changed}") from exc
            return
        # Accepted: the state must train. hostembed's part (forward,
        # backward, SparseAdam's step) must not fail. torch's Adam may: its
        # constructor (whose checks hostembed applies to a loaded state)
        # accepts values its step then refuses, e.g. weight_decay=1e308
        # ("value cannot be converted to type float without overflow"), and
        # no fixed bound avoids that (lr / (1 - beta1**t) overflows for beta1
        # near 1); such a failure raised inside torch/optim is torch's.
        self.model = None
        try:
            model(torch.tensor([1, 3, 5, 3])).sum().backward()
            opts[0].step()
        except Exception as exc:
            raise AssertionError(f"{what} accepted a state that training then fails on: "
                                 f"{type(exc).__name__}: {exc}") from exc
        try:
            opts[1].step()
        except Exception as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            if not frames or "/torch/optim/" not in frames[-1].filename.replace(os.sep, "/"):
                raise AssertionError(f"{what} accepted a state that torch.optim.Adam's step then fails on outside "
                                     f"torch.optim: {type(exc).__name__}: {exc}") from exc


def main():
    args = sys.argv[1:]
    flags = [a for a in args if a.startswith("-")]
    paths = [a for a in args if not a.startswith("-")]
    if not any(f.startswith("-artifact_prefix=") for f in flags):
        os.makedirs("/tmp/fuzz_loads_artifacts", exist_ok=True)
        flags.append("-artifact_prefix=/tmp/fuzz_loads_artifacts/")
    if paths and all(os.path.isdir(p) for p in paths):
        # libFuzzer writes new inputs into its first corpus directory: not the seeds'.
        paths.insert(0, tempfile.mkdtemp(prefix="fuzz_loads_corpus_"))
    target = Target()
    atheris.Setup([sys.argv[0]] + flags + paths, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
