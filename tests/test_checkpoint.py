"""Checkpoints: torch.save/torch.load(mmap=True) round trips, hostembed.save/load,
resuming bit-identically, interrupted saves, refusing checkpoints that do not fit."""
import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import hostembed
from hostembed._core.table import table_of

from conftest import zipf_ids

ROWS, DIM = 500, 8


class Model(nn.Module):
    """A host table, an ordinary nn.Embedding and a dense layer, as in real models."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.users = hostembed.Embedding(ROWS, DIM)
        self.small = nn.Embedding(7, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.users(ids) + self.small(ids % 7)).sum()


def optimizers(model):
    return [hostembed.SparseAdam(model.users.parameters(), lr=0.05),
            torch.optim.Adam(list(model.small.parameters()) + list(model.head.parameters()), lr=0.01)]


def train(model, opts, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = zipf_ids(ROWS, 64, generator=gen)
        for opt in opts:
            opt.zero_grad()
        model(ids).backward()
        for opt in opts:
            opt.step()


def assert_same_training_state(a, a_opts, b, b_opts):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    for oa, ob in zip(a_opts, b_opts):
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for pid in sa["state"]:
            for key, value in sa["state"][pid].items():
                other = sb["state"][pid][key]
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (pid, key)


def test_resume_from_hostembed_checkpoint_continues_bit_identically(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    straight = Model()
    straight_opts = optimizers(straight)
    train(straight, straight_opts, 6, seed=1)
    hostembed.save(path, straight, straight_opts, extra={"epoch": 2, "batch": 6})
    train(straight, straight_opts, 6, seed=2)

    resumed = Model(seed=99)  # different initial weights: everything must come from the file
    resumed_opts = optimizers(resumed)
    extra = hostembed.load(path, resumed, resumed_opts)
    assert extra == {"epoch": 2, "batch": 6}
    assert table_of(resumed.users.weight) is not None
    assert isinstance(resumed_opts[0].state[resumed.users.weight]["step"], int)
    train(resumed, resumed_opts, 6, seed=2)
    assert_same_training_state(straight, straight_opts, resumed, resumed_opts)


def test_plain_torch_save_and_mmap_load_round_trip(tmp_path):
    emb = hostembed.Embedding(ROWS, DIM, padding_idx=3)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.1)
    train_single(emb, opt, 4)
    torch.save(emb.state_dict(), tmp_path / "emb.pt")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")

    fresh = hostembed.Embedding(ROWS, DIM, padding_idx=3)
    fresh_opt = hostembed.SparseAdam(fresh.parameters(), lr=0.1)
    table = fresh.weight.data_ptr()
    fresh.load_state_dict(torch.load(tmp_path / "emb.pt", mmap=True, weights_only=True))
    fresh_opt.load_state_dict(torch.load(tmp_path / "opt.pt", mmap=True, weights_only=True))
    assert fresh.weight.data_ptr() == table  # copied into the host table, not swapped for the mapped file
    for moment in ("exp_avg", "exp_avg_sq"):
        assert fresh_opt.state[fresh.weight][moment].data_ptr() != 0
    train_single(emb, opt, 3)
    train_single(fresh, fresh_opt, 3)
    assert torch.equal(emb.weight, fresh.weight)
    assert torch.equal(opt.state[emb.weight]["exp_avg_sq"], fresh_opt.state[fresh.weight]["exp_avg_sq"])


def train_single(emb, opt, steps):
    gen = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        opt.zero_grad()
        (emb(zipf_ids(ROWS, 32, generator=gen)) ** 2).sum().backward()
        opt.step()


def test_load_state_dict_converts_dtype_chunk_by_chunk(tmp_path, monkeypatch):
    from hostembed.io import stream as _stream

    monkeypatch.setattr(_stream, "CHUNK_BYTES", 100)
    source = torch.randn(ROWS, DIM, dtype=torch.float64)
    torch.save({"weight": source}, tmp_path / "w.pt")
    emb = hostembed.Embedding(ROWS, DIM)
    emb.load_state_dict(torch.load(tmp_path / "w.pt", mmap=True, weights_only=True))
    assert torch.equal(emb.weight.detach(), source.float())


def test_checkpoint_is_readable_by_plain_torch_load(tmp_path):
    model = Model()
    opts = optimizers(model)
    train(model, opts, 2, seed=0)
    hostembed.save(tmp_path / "c.pt", model, opts[0])
    plain = torch.load(tmp_path / "c.pt", mmap=True, weights_only=True)
    assert torch.equal(plain["model"]["users.weight"], model.users.weight)
    assert torch.equal(plain["optimizer"]["state"][0]["exp_avg"], opts[0].state[model.users.weight]["exp_avg"])


def test_failed_save_keeps_the_previous_checkpoint_and_no_stray_file(tmp_path, monkeypatch):
    path = str(tmp_path / "c.pt")
    model = Model()
    hostembed.save(path, model)
    before = model.users.weight.detach().clone()
    with torch.no_grad():
        model.users.weight.add_(1.0)

    def crash(*args):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        hostembed.save(path, model)
    monkeypatch.undo()
    assert glob.glob(path + ".tmp-*") == []
    restored = Model(seed=5)
    hostembed.load(path, restored)
    assert torch.equal(restored.users.weight, before)


def test_process_killed_between_write_and_rename_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "c.pt")
    model = Model()
    hostembed.save(path, model)
    # A child process writes a second checkpoint and dies (os._exit, no
    # cleanup, like SIGKILL) right before the rename.
    script = textwrap.dedent(f"""
        import os, torch, hostembed
        emb = hostembed.Embedding({ROWS}, {DIM})
        os.replace = lambda *a: os._exit(9)
        hostembed.save({path!r}, emb)
    """)
    child = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert child.returncode == 9
    assert len(glob.glob(path + ".tmp-*")) == 1  # the dead write stays aside
    restored = Model(seed=5)
    hostembed.load(path, restored)
    assert torch.equal(restored.users.weight, model.users.weight)


def snapshot(model, opts):
    return [t.clone() for t in model.state_dict().values()] + [
        v.clone() for opt in opts for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def assert_unchanged(before, model, opts):
    after = snapshot(model, opts)
    assert len(before) == len(after) and all(torch.equal(b, a) for b, a in zip(before, after))


def test_checkpoint_that_does_not_fit_changes_nothing(tmp_path):
    big = Model()
    big.users = hostembed.Embedding(ROWS + 1, DIM)
    big_opts = optimizers(big)
    train(big, big_opts, 1, seed=0)
    hostembed.save(tmp_path / "big.pt", big, big_opts)

    model = Model()
    opts = optimizers(model)
    train(model, opts, 1, seed=3)
    before = snapshot(model, opts)
    with pytest.raises(RuntimeError, match=rf"'users.weight' has shape \[{ROWS + 1}, {DIM}\] in the checkpoint, "
                                           rf"\[{ROWS}, {DIM}\] in the model"):
        hostembed.load(tmp_path / "big.pt", model, opts)
    assert_unchanged(before, model, opts)

    other = nn.Sequential(nn.Linear(DIM, 1))
    hostembed.save(tmp_path / "other.pt", other)
    with pytest.raises(RuntimeError, match=r"missing keys \['head.bias'.*unexpected keys \['0.bias', '0.weight'\]"):
        hostembed.load(tmp_path / "other.pt", model)
    with pytest.raises(ValueError, match="holds the state of 2 optimizer"):
        hostembed.load(tmp_path / "big.pt", big, big_opts[0])
    assert_unchanged(before, model, opts)


def test_optimizer_state_shapes_are_checked_before_loading(tmp_path):
    model = Model()
    opts = optimizers(model)
    train(model, opts, 1, seed=0)
    state = opts[0].state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(ROWS, DIM + 1)
    torch.save({"model": model.state_dict(), "optimizer": state}, tmp_path / "bad.pt")
    before = snapshot(model, opts)
    with pytest.raises(RuntimeError, match=rf"'exp_avg' .* shape \[{ROWS}, {DIM + 1}\], the parameter has "
                                           rf"\[{ROWS}, {DIM}\]"):
        hostembed.load(tmp_path / "bad.pt", model, opts[0])
    assert_unchanged(before, model, opts)


def test_load_errors_for_missing_damaged_and_foreign_files(tmp_path):
    model = Model()
    with pytest.raises(FileNotFoundError, match="no such file"):
        hostembed.load(tmp_path / "nope.pt", model)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="cannot read .* as a checkpoint"):
        hostembed.load(tmp_path / "junk.pt", model)
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(ValueError, match="not a checkpoint written by hostembed.save.*found Tensor"):
        hostembed.load(tmp_path / "tensor.pt", model)
    hostembed.save(tmp_path / "noopt.pt", model)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        hostembed.load(tmp_path / "noopt.pt", model, optimizers(model)[0])


MEMORY_SCRIPT = """
import gc, json, os, sys, torch, hostembed
from hostembed.io import stream as _stream
def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
path, per_thread_bytes = sys.argv[1], int(sys.argv[2])
info = dict(dim=64, readers=1, chunk_bytes=_stream.CHUNK_BYTES, core_threads=hostembed.get_num_threads(),
            torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count())
allowance = (info["readers"] * info["chunk_bytes"]
             + (info["core_threads"] + info["torch_threads"]) * per_thread_bytes)
rows = 1 << 18                                       # 64 MiB at dim 64
while 3 * rows * info["dim"] * 4 // 8 < allowance:   # until table/8 + allowance <= table/2
    rows *= 2
emb = hostembed.Embedding(rows, info["dim"])
opt = hostembed.SparseAdam(emb.parameters())
emb(torch.arange(rows)).sum().backward()
opt.step()                                           # both moments resident
hostembed.save(path, emb, opt)
torch.save(emb.state_dict(), path + ".sd")
gc.collect()
hostembed.empty_cache()                              # the lookup's scratch buffers: out of the baseline
reset_peak(); base = peak_kib()
hostembed.load(path, emb, opt)
info["grew_checkpoint_kib"] = peak_kib() - base
reset_peak(); base = peak_kib()
emb.load_state_dict(torch.load(path + ".sd", mmap=True, weights_only=True))
info["grew_state_dict_kib"] = peak_kib() - base
info["rows"] = rows
print(json.dumps(info))
"""

# What loading may legitimately add to peak RSS per thread: the pages of
# its stack and malloc arena a thread touches while copying. On the 16-core
# H100 box (2026-11-22) the peak grew 17,960 KiB: one 16 MiB chunk and
# 1,576 KiB, ~50 KiB for each of its 32 threads at most.
PER_THREAD_BYTES = 256 << 10


def test_loading_does_not_hold_the_table_twice(tmp_path):
    """The linear-memory property itself (not a timing): loading a table and
    its two moments in place must not add the file's size to peak RSS."""
    import json

    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "m.pt"), str(PER_THREAD_BYTES)],
                         check=True, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    info = json.loads(out.stdout)
    table_bytes = info["rows"] * info["dim"] * 4
    # The bound: what may grow while a checkpoint is copied in place.
    # * readers x CHUNK_BYTES: hostembed.load and load_state_dict of a
    #   torch.load(mmap=True) result both go through _stream.copy_rows,
    #   which copies one chunk at a time and pages the mapped file's chunk
    #   out after it: one chunk of the file is resident at a time.
    #   (read_rows, for .npy/.safetensors files, would have up to 4 readers,
    #   each with a chunk buffer; it is not used here.)
    # * threads x PER_THREAD_BYTES for the core's and torch's threads, which
    #   split each chunk's copy: their count grows with the machine's cores.
    # * table / 8 for the rest: unpickling, the zip reader, pages the kernel
    #   maps around a faulting one.
    # The core's scratch cache is emptied before the baseline. The table is
    # sized (in the script) so that the bound is at most half of it: a
    # second copy of the table (3 tables for the checkpoint: weight and both
    # moments) overshoots it by at least a factor of two.
    threads = info["core_threads"] + info["torch_threads"]
    bound = table_bytes // 8 + info["readers"] * info["chunk_bytes"] + threads * PER_THREAD_BYTES
    assert 2 * bound <= table_bytes, info
    detail = f"bound {bound // 1024} KiB for a {table_bytes // 1024} KiB table: {info}"
    assert info["grew_checkpoint_kib"] * 1024 < bound, detail
    assert info["grew_state_dict_kib"] * 1024 < bound, detail
