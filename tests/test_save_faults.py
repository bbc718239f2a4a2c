"""I/O faults while hostembed.save writes a checkpoint over a previous one: a
full disk (RLIMIT_FSIZE in a child, where write() then fails with EFBIG;
a 1 MiB tmpfs for a real ENOSPC when this runs as root), failing fsync,
rename and directory fsync, a non-I/O error, and SIGKILL at random points.
In every case the previous checkpoint is still at `path` bit for bit (or,
once the rename happened, the new one, whole), and no partial file is ever
taken for a checkpoint."""
import glob
import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
from torch import nn

import hostembed

ROWS, DIM = 300, 8


def build(seed):
    torch.manual_seed(seed)
    emb = hostembed.Embedding(ROWS, DIM)
    model = nn.Sequential(emb, nn.Linear(DIM, 1))
    opts = [hostembed.SparseAdam(emb.parameters(), lr=0.01), torch.optim.Adam(model[1].parameters(), lr=0.01)]
    model(torch.arange(ROWS)).sum().backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return model, opts


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def assert_loads_as(path, model, opts):
    """`path` loads into a fresh model bit for bit equal to `model`/`opts`."""
    fresh, fresh_opts = build(seed=99)
    hostembed.load(path, fresh, fresh_opts)
    for (key, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), key
    for opt, other in zip(opts, fresh_opts):
        mine, theirs = opt.state_dict(), other.state_dict()
        assert mine["param_groups"] == theirs["param_groups"]
        for pid, state in mine["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs["state"][pid][key])), (pid, key)


@pytest.fixture
def previous(tmp_path):
    """A checkpoint at `path` of a model, and a second, different model to save over it."""
    path = str(tmp_path / "ckpt.pt")
    model, opts = build(seed=1)
    hostembed.save(path, model, opts, extra={"epoch": 1})
    newer, newer_opts = build(seed=2)
    return path, model, opts, newer, newer_opts


def assert_previous_intact(path, before_digest, model, opts, *, strays_allowed=False):
    assert digest(path) == before_digest
    assert_loads_as(path, model, opts)
    if not strays_allowed:
        assert glob.glob(path + ".tmp-*") == []


CHILD = textwrap.dedent("""
    import os, resource, signal, sys, torch, hostembed
    from torch import nn
    path, limit = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(5)
    model = nn.Sequential(hostembed.Embedding(20000, 32), nn.Linear(32, 1))  # ~2.5 MB: over the limit
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # else the kernel kills us; now write() fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        hostembed.save(path, model)
    except OSError as exc:
        print("OSError", exc)
    except BaseException as exc:
        print("OTHER", type(exc).__name__, exc)
    else:
        print("SAVED")
""")


def test_full_disk_efbig_keeps_previous_checkpoint(previous):
    path, model, opts, _, _ = previous
    before = digest(path)
    limit = os.path.getsize(path) + 4096  # the previous file fits, the new one does not
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(limit)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("OSError hostembed.save: writing"), out.stdout
    assert "the previous checkpoint at" in out.stdout and "is untouched" in out.stdout
    assert_previous_intact(path, before, model, opts)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_enospc_on_a_tiny_tmpfs_keeps_previous_checkpoint(tiny_tmpfs):
    path = str(tiny_tmpfs / "ckpt.pt")
    model, opts = build(seed=1)
    hostembed.save(path, model, opts)  # ~30 KB
    before = digest(path)
    torch.manual_seed(3)
    big = nn.Sequential(hostembed.Embedding(20000, 32), nn.Linear(32, 1))  # 2.5 MB > 1 MiB
    with pytest.raises(OSError, match=r"hostembed.save: writing .* failed .* bytes free there\); the previous "
                                      r"checkpoint at .* is untouched"):
        hostembed.save(path, big)
    assert_previous_intact(path, before, model, opts)


def test_failed_fsync_keeps_previous_checkpoint(previous, monkeypatch):
    path, model, opts, newer, newer_opts = previous
    before = digest(path)

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match=r"hostembed.save: the fsync of .*\.tmp-.* failed \(Input/output error\); the "
                                      r"previous checkpoint at .* is untouched") as info:
        hostembed.save(path, newer, newer_opts)
    assert info.value.errno == 5
    monkeypatch.undo()
    assert_previous_intact(path, before, model, opts)


def test_failed_rename_keeps_previous_checkpoint(previous, monkeypatch):
    path, model, opts, newer, newer_opts = previous
    before = digest(path)

    def failing_replace(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match=r"the rename of .* failed \(Invalid cross-device link\)"):
        hostembed.save(path, newer, newer_opts)
    monkeypatch.undo()
    assert_previous_intact(path, before, model, opts)


def test_failed_directory_fsync_after_the_rename_says_the_new_checkpoint_is_there(previous, monkeypatch):
    path, model, opts, newer, newer_opts = previous
    real = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match=r"holds the new checkpoint, whole, but the fsync of its directory failed"):
        hostembed.save(path, newer, newer_opts)
    monkeypatch.undo()
    assert_loads_as(path, newer, newer_opts)
    assert glob.glob(path + ".tmp-*") == []


def test_a_non_io_error_while_writing_propagates_and_keeps_previous_checkpoint(previous):
    path, model, opts, newer, newer_opts = previous
    before = digest(path)
    with pytest.raises(Exception) as info:
        hostembed.save(path, newer, newer_opts, extra={"not saveable": lambda: None})
    assert not isinstance(info.value, OSError)  # not an I/O failure: reported as torch reports it
    assert_previous_intact(path, before, model, opts)


KILLED = textwrap.dedent("""
    import sys, torch, hostembed
    from torch import nn
    path = sys.argv[1]
    emb = hostembed.Embedding(200_000, 64)                   # 51 MB rows + 102 MB of moments
    opt = hostembed.SparseAdam(emb.parameters())
    emb(torch.arange(200_000)).sum().backward(); opt.step()
    for generation in range(1, 1000):
        with torch.no_grad():
            emb.weight.fill_(float(generation))
            for key in ("exp_avg", "exp_avg_sq"):
                opt.state[emb.weight][key].fill_(float(generation))
        hostembed.save(path, emb, opt, extra={"generation": generation})
        print(generation, flush=True)
""")


def _generation_of(path):
    """The generation a checkpoint file holds, checked whole: every row and
    both moments carry it (a torn file would mix two)."""
    emb = hostembed.Embedding(200_000, 64)
    opt = hostembed.SparseAdam(emb.parameters())
    extra = hostembed.load(path, emb, opt)
    generation = float(extra["generation"])
    for tensor in (emb.weight, opt.state[emb.weight]["exp_avg"], opt.state[emb.weight]["exp_avg_sq"]):
        assert bool((tensor == generation).all()), f"{path} mixes generations"
    return extra["generation"]


def test_sigkill_at_random_points_never_leaves_a_partial_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    rng = random.Random(20261122)
    last_seen = 0
    strays_checked = 0
    for attempt in range(6):
        child = subprocess.Popen([sys.executable, "-c", KILLED, path], stdout=subprocess.PIPE, text=True, env=env)
        try:
            first = child.stdout.readline()  # one whole save done: the previous checkpoint exists
            assert first.strip().isdigit(), first
            time.sleep(rng.uniform(0.0, 1.5))  # then die somewhere inside a later save
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == -signal.SIGKILL
        printed = [int(line) for line in [first] + child.stdout.read().split() if line.strip().isdigit()]
        generation = _generation_of(path)
        # The file is the last save that completed (printed), or the one
        # after it if the kill came between its rename and the print.
        assert generation in (printed[-1], printed[-1] + 1), (generation, printed)
        assert generation >= 1
        last_seen = generation
        for stray in glob.glob(path + ".tmp-*"):
            # A stray is a save the kill interrupted: never mistaken for a
            # checkpoint unless it is whole.
            try:
                _generation_of(stray)
            except ValueError as exc:
                assert "cannot read" in str(exc)
            strays_checked += 1
            os.unlink(stray)
    assert last_seen >= 1
    print(f"{strays_checked} stray files checked")


def test_load_of_a_partly_written_temporary_file_fails_clearly(tmp_path):
    """What a kill mid-write leaves: every prefix of a checkpoint is refused."""
    model, opts = build(seed=1)
    path = str(tmp_path / "c.pt")
    hostembed.save(path, model, opts)
    data = open(path, "rb").read()
    for size in sorted(set([0, 1, 100, len(data) // 4, len(data) // 2, len(data) - 22, len(data) - 1])):
        partial = str(tmp_path / f"c.pt.tmp-{uuid.uuid4().hex}")
        with open(partial, "wb") as f:
            f.write(data[:size])
        with pytest.raises(ValueError, match="cannot read .* as a checkpoint"):
            hostembed.load(partial, *build(seed=2))
