"""Tables kept on disk (Embedding(storage=...)): training gives the bits of
the same table in memory at every cache size, optimizer and dtype; a table
reopens with its rows; full disks, I/O errors, files cut short or removed
raise OSError and lose nothing the last completed step wrote."""
import copy
import errno
import gc
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

import hostembed
from conftest import zipf_ids
from hostembed._core import _C

ROWS = 300

OPTIMIZERS = {
    "sparse_adam": lambda p: hostembed.SparseAdam(p, lr=0.01),
    "sparse_adam_int8": lambda p: hostembed.SparseAdam(p, lr=0.01, state_dtype=torch.int8),
    "rowwise_adagrad": lambda p: hostembed.RowWiseAdagrad(p, lr=0.05),
    "adagrad": lambda p: hostembed.Adagrad(p, lr=0.05),
    "sgd": lambda p: hostembed.SGD(p, lr=0.1),
}


@pytest.fixture(autouse=True)
def no_injected_errors():
    yield
    _C.inject_io_error(0, 0)


def build(dim=128, dtype=torch.float32, seed=0, **kwargs):
    torch.manual_seed(seed)
    return hostembed.Embedding(ROWS, dim, dtype=dtype, **kwargs)


def train(emb, opt, steps, seed=1, count=128):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = zipf_ids(ROWS, count, generator=gen)
        loss = (emb(ids).float() - 0.5).pow(2).sum() / count
        opt.zero_grad()
        loss.backward()
        opt.step()


def state_tensors(opt):
    return {k: v for k, v in opt.state_dict()["state"].get(0, {}).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("cache_rows", [4, 60, ROWS])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_training_on_disk_gives_the_bits_of_the_table_in_memory(tmp_path, optimizer, cache_rows):
    memory = build()
    memory_opt = OPTIMIZERS[optimizer](memory.parameters())
    disk = build(storage=tmp_path / "t", cache_rows=cache_rows)
    disk_opt = OPTIMIZERS[optimizer](disk.parameters())
    train(memory, memory_opt, 12)
    train(disk, disk_opt, 12)
    stats = disk.cache_stats
    assert stats["fetches"] > 0
    if cache_rows == 4:
        assert stats["bypassed"] > 0  # rows updated through the files, not the cache
    assert torch.equal(disk.weight, memory.weight)
    expected = state_tensors(memory_opt)
    got = state_tensors(disk_opt)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def direct_io_works(directory):
    probe = os.path.join(directory, "probe")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.mark.parametrize("dim,dtype", [(40, torch.float32), (64, torch.bfloat16), (40, torch.float16),
                                       (64, torch.float64), (9, torch.float32)])
def test_every_dtype_and_rows_that_are_not_whole_sectors_train_the_same(tmp_path, dim, dtype):
    # 160, 128 and 80 bytes a row: direct I/O inside the sectors that hold
    # them (a write reads them first); float64 rows of 512 bytes: whole
    # sectors; 36 bytes: the page cache. SparseAdam's state as its rows.
    memory = build(dim, dtype)
    memory_opt = hostembed.SparseAdam(memory.parameters(), lr=0.01)
    disk = build(dim, dtype, storage=tmp_path / "t", cache_rows=30)
    disk_opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    weight_file = disk._table.files.row_file_of(disk._table.tensor)
    direct = dim * dtype.itemsize >= 64 and direct_io_works(tmp_path)
    assert (weight_file.direct_fd is not None) == direct
    train(memory, memory_opt, 10)
    train(disk, disk_opt, 10)
    assert torch.equal(disk.weight, memory.weight)
    disk.flush_cache()
    raw = torch.from_file(str(tmp_path / "t" / "weight.bin"), size=ROWS * dim, dtype=dtype).view(ROWS, dim)
    assert torch.equal(raw, memory.weight)


def test_cpu_outputs_and_a_checkpoint_round_trip(tmp_path):
    disk = build(storage=tmp_path / "t", cache_rows=50)
    opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    train(disk, opt, 5)
    hostembed.save(tmp_path / "ckpt", disk, opt)
    memory = build(seed=7)
    memory_opt = hostembed.SparseAdam(memory.parameters(), lr=0.01)
    hostembed.load(tmp_path / "ckpt", memory, memory_opt)
    assert torch.equal(memory.weight, disk.weight)
    train(memory, memory_opt, 4, seed=2)
    train(disk, opt, 4, seed=2)
    assert torch.equal(memory.weight, disk.weight)


def test_a_flushed_table_reopens_with_its_rows_without_reading_them(tmp_path):
    disk = build(storage=tmp_path / "t", cache_rows=50)
    opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    train(disk, opt, 5)
    disk.flush_cache()
    expected = disk.weight.detach().clone()
    del disk, opt
    gc.collect()
    assert not [n for n in os.listdir(tmp_path / "t") if n.startswith("state-")]  # went with the optimizer
    torch.manual_seed(123)  # an open draws nothing
    again = hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", ram_budget="64KiB")
    assert again.cache_rows == (64 << 10) // (128 * 12)
    assert torch.equal(again.weight, expected)


def clean(directory):
    """What the table's table.json says: whether every row is written back."""
    with open(directory / "table.json") as f:
        return json.load(f)["clean"]


def test_a_table_is_one_modules_at_a_time(tmp_path):
    disk = build(storage=tmp_path / "t", cache_rows=50)
    with pytest.raises(RuntimeError, match="open in another module"):
        hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10)
    del disk
    gc.collect()
    hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10)


def test_a_table_whose_process_died_unflushed_refuses_to_open(tmp_path):
    code = f"""
import os, torch, hostembed
disk = hostembed.Embedding(300, 128, storage={str(tmp_path / 't')!r}, cache_rows=50)
opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
disk(torch.arange(100)).sum().backward()
opt.step()
os._exit(0)  # killed: no finalizer writes the cache back
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with pytest.raises(RuntimeError, match="not closed cleanly"):
        hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10)


def test_another_file_moved_over_the_weight_file_is_refused_and_a_copied_directory_opens(tmp_path):
    import shutil
    for name, seed in (("a", 0), ("b", 1)):
        emb = build(seed=seed, storage=tmp_path / name, cache_rows=10)
        expected = emb.weight.detach().clone() if name == "b" else None
        del emb
        gc.collect()
    os.replace(tmp_path / "b" / "weight.bin", tmp_path / "a" / "weight.bin")  # same shape, other rows
    with pytest.raises(RuntimeError, match="does not hold the rows .* was closed with.*checkpoint into it"):
        hostembed.Embedding(ROWS, 128, storage=tmp_path / "a", cache_rows=10)
    build(seed=1, storage=tmp_path / "b2", cache_rows=10)
    gc.collect()
    shutil.copytree(tmp_path / "b2", tmp_path / "copy")  # a table copied elsewhere is still itself
    assert torch.equal(hostembed.Embedding(ROWS, 128, storage=tmp_path / "copy", cache_rows=10).weight, expected)


def test_a_table_dropped_unflushed_is_written_back(tmp_path):
    disk = build(storage=tmp_path / "t", cache_rows=50)
    opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    train(disk, opt, 3)
    assert not clean(tmp_path / "t")  # records newer than the files
    train(disk, opt, 2, seed=3)
    memory = build()
    memory_opt = hostembed.SparseAdam(memory.parameters(), lr=0.01)
    train(memory, memory_opt, 3)
    train(memory, memory_opt, 2, seed=3)
    del disk, opt  # the module's end writes its cache back
    gc.collect()
    assert torch.equal(hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10).weight, memory.weight)


def test_a_script_that_ends_without_flushing_leaves_a_table_that_opens(tmp_path):
    code = f"""
import torch, hostembed
from conftest import zipf_ids
torch.manual_seed(0)
memory = hostembed.Embedding(300, 128)
torch.manual_seed(0)
disk = hostembed.Embedding(300, 128, storage={str(tmp_path / 't')!r}, cache_rows=40)
for emb in (memory, disk):
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        opt.zero_grad()
        emb(zipf_ids(300, 128, generator=gen)).pow(2).sum().backward()
        opt.step()
torch.save(memory.weight.detach().clone(), {str(tmp_path / 'expected.pt')!r})
assert disk._table.cache.dirty  # nothing written back before the end
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__)] + sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    expected = torch.load(tmp_path / "expected.pt")
    assert torch.equal(hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10).weight, expected)


def test_opening_checks_shape_dtype_and_arguments(tmp_path):
    build(storage=tmp_path / "t", cache_rows=10).flush_cache()
    gc.collect()
    with pytest.raises(ValueError, match=r"is \[300, 128\] float32; the module asks for \[300, 64\] float32"):
        hostembed.Embedding(ROWS, 64, storage=tmp_path / "t", cache_rows=10)
    with pytest.raises(ValueError, match="already holds a table"):
        hostembed.Embedding(ROWS, 128, _weight=torch.zeros(ROWS, 128), storage=tmp_path / "t", cache_rows=10)
    with pytest.raises(ValueError, match="one of the two"):
        hostembed.Embedding(ROWS, 128, storage=tmp_path / "u")
    with pytest.raises(ValueError, match="must be bytes"):
        hostembed.Embedding(ROWS, 128, storage=tmp_path / "u", ram_budget="lots")
    with pytest.raises(ValueError, match="give storage= too"):
        hostembed.Embedding(ROWS, 128, ram_budget="1GiB")
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "table.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as a table"):
        hostembed.Embedding(ROWS, 128, storage=tmp_path / "v", cache_rows=10)


def _trained_pair(tmp_path, steps):
    memory = build()
    memory_opt = hostembed.SparseAdam(memory.parameters(), lr=0.01)
    disk = build(storage=tmp_path / "t", cache_rows=40)
    disk_opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    train(memory, memory_opt, steps)
    train(disk, disk_opt, steps)
    return memory, disk, disk_opt


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
def test_a_failed_read_or_write_loses_nothing_of_the_last_completed_step(tmp_path, error):
    memory, disk, disk_opt = _trained_pair(tmp_path, 6)
    _C.inject_io_error(0, error)
    with pytest.raises(OSError, match=os.strerror(error)):
        train(disk, disk_opt, 1, seed=9)
    with pytest.raises(RuntimeError, match="failed in an earlier step"):
        train(disk, disk_opt, 1, seed=9)
    disk.flush_cache()  # what the cache holds, written once the cause is gone
    del disk, disk_opt
    gc.collect()
    again = hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10)
    assert torch.equal(again.weight, memory.weight)


def test_a_failed_flush_leaves_the_table_unclean_until_one_succeeds(tmp_path):
    memory, disk, disk_opt = _trained_pair(tmp_path, 4)
    _C.inject_io_error(0, errno.ENOSPC)
    with pytest.raises(OSError, match="No space left"):
        disk.flush_cache()
    assert not clean(tmp_path / "t")
    disk.flush_cache()
    assert clean(tmp_path / "t")
    del disk, disk_opt
    assert torch.equal(hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10).weight, memory.weight)


@pytest.mark.parametrize("fault", ["truncated", "removed"])
def test_a_file_cut_short_or_removed_under_the_table_raises_not_zero_rows(tmp_path, fault):
    _, disk, disk_opt = _trained_pair(tmp_path, 3)
    path = tmp_path / "t" / "weight.bin"
    if fault == "truncated":
        os.truncate(path, 1024)
    else:
        os.unlink(path)
    with pytest.raises(OSError, match=fault):
        train(disk, disk_opt, 2, seed=5)
        # A step's rows move through the records file (weight and state):
        # the weight's own file is met at the write-back.
        disk.flush_cache()
    if fault == "truncated":  # long enough again for the write-back at the module's end
        os.truncate(path, ROWS * 128 * 4)
    if fault == "removed":  # its rows live while it is open: they can still be saved
        hostembed.save(tmp_path / "ckpt", disk)
        memory = build(seed=4)
        hostembed.load(tmp_path / "ckpt", memory)
        assert torch.equal(memory.weight, disk.weight)
        assert memory.weight.abs().min() > 0  # the rows trained, not zeros


def test_a_removed_directory_stops_training_and_a_checkpoint_still_saves_every_row_and_state(tmp_path):
    """rm -rf of the table's directory: the step refuses, and hostembed.save
    (which marks nothing clean on a disk that no longer has the table)
    saves the last completed step's rows and optimizer state."""
    import shutil
    memory = build()
    memory_opt = hostembed.SparseAdam(memory.parameters(), lr=0.01)
    disk = build(storage=tmp_path / "t", cache_rows=40)
    disk_opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    train(memory, memory_opt, 3)
    train(disk, disk_opt, 3)
    shutil.rmtree(tmp_path / "t")
    with pytest.raises(OSError, match="removed while the table was open.*save a checkpoint"):
        train(disk, disk_opt, 1, seed=5)
    hostembed.save(tmp_path / "ckpt", disk, disk_opt)
    again = build(seed=4)
    again_opt = hostembed.SparseAdam(again.parameters(), lr=0.01)
    hostembed.load(tmp_path / "ckpt", again, again_opt)
    assert torch.equal(again.weight, memory.weight)
    for key, value in state_tensors(memory_opt).items():
        assert torch.equal(state_tensors(again_opt)[key], value), key


def test_a_failed_sync_or_description_write_names_its_file(tmp_path, monkeypatch):
    _, disk, disk_opt = _trained_pair(tmp_path, 2)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left") as raised:
        disk.flush_cache()
    assert str(tmp_path / "t") in str(raised.value) and raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    disk.flush_cache()
    assert clean(tmp_path / "t")


def test_a_relative_storage_path_stays_the_tables_after_a_change_of_directory(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "t").mkdir(parents=True)
    other = tmp_path / "b" / "t" / "state-keep.bin"
    monkeypatch.chdir(tmp_path / "a")
    emb = hostembed.Embedding(ROWS, 128, storage="t", cache_rows=10)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.1)
    train(emb, opt, 1)
    monkeypatch.chdir(tmp_path / "b")
    other.write_bytes(b"another table's")
    del opt, emb  # the state files go: those of the table in a/t, not b/t's
    gc.collect()
    assert other.exists() and not [n for n in os.listdir(tmp_path / "a" / "t") if n.startswith("state-")]


def test_storage_that_is_a_file_and_budgets_that_are_not_numbers_are_clear_errors(tmp_path):
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        hostembed.Embedding(10, 128, storage=tmp_path / "f", cache_rows=4)
    for budget in ("inf", "1e999GiB", "nan"):
        with pytest.raises(ValueError, match="ram_budget must be bytes"):
            hostembed.Embedding(10, 128, storage=tmp_path / "t", ram_budget=budget)


def test_a_disk_too_small_for_the_table_is_an_error_at_creation(tmp_path):
    # RLIMIT_FSIZE stands for a full disk: files may not grow past 1 MiB.
    code = f"""
import resource, signal, torch, hostembed
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    hostembed.Embedding(100_000, 128, storage={str(tmp_path / 't')!r}, cache_rows=10)
except OSError as exc:
    print('refused:', exc)
hostembed.Embedding(2_000, 128, storage={str(tmp_path / 'u')!r}, cache_rows=10)  # 1 MiB: fits
print('made')
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "refused: [Errno 27] hostembed: cannot reserve 51200000 bytes" in done.stdout
    assert "made" in done.stdout
    assert os.listdir(tmp_path / "t") == []  # nothing half made is left: no rows, no description
    emb = hostembed.Embedding(100_000, 128, storage=tmp_path / "t", cache_rows=10)  # so it is made, given room
    assert emb.weight.shape == (100_000, 128)


def test_sizes_given_as_numpy_integers_make_and_open_a_table(tmp_path):
    # torch's modules take them (DLRM's script passes numpy.int64 sizes).
    np = pytest.importorskip("numpy")
    made = hostembed.EmbeddingBag(np.int64(ROWS), np.int64(16), mode="sum", storage=tmp_path / "t", cache_rows=10)
    made.flush_cache()
    rows = made.weight.detach().clone()
    del made
    gc.collect()
    opened = hostembed.EmbeddingBag(np.int64(ROWS), np.int64(16), mode="sum", storage=tmp_path / "t", cache_rows=10)
    assert torch.equal(opened.weight, rows)
    assert json.loads((tmp_path / "t" / "table.json").read_text())["num_rows"] == ROWS


def test_casts_copies_and_dropping_the_cache_of_a_table_on_disk_are_refused(tmp_path):
    disk = build(storage=tmp_path / "t", cache_rows=10)
    with pytest.raises(RuntimeError, match="kept in"):
        disk.half()
    with pytest.raises(RuntimeError, match="is not copied"):
        copy.deepcopy(disk)
    with pytest.raises(RuntimeError, match="is not pickled"):
        pickle.dumps(disk)
    with pytest.raises(ValueError, match="through its row cache"):
        disk.cache_rows = None
    disk.cache_rows = 20  # another size is fine: the cache is written back and made anew
    assert disk.cache_rows == 20
    assert torch.equal(disk.weight, build().weight)


@pytest.mark.gpu
def test_gpu_outputs_of_a_table_on_disk_give_the_bits_of_cpu_outputs(tmp_path):
    if not hostembed.cuda_available():
        pytest.skip("needs CUDA")
    memory = build()
    memory_opt = hostembed.SparseAdam(memory.parameters(), lr=0.01)
    disk = build(storage=tmp_path / "t", cache_rows=40, device="cuda")
    disk_opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        ids = zipf_ids(ROWS, 128, generator=gen)
        for emb, opt in ((memory, memory_opt), (disk, disk_opt)):
            out = emb(ids.to("cuda") if emb is disk else ids)
            assert out.device.type == ("cuda" if emb is disk else "cpu")
            opt.zero_grad()
            ((out.float() - 0.5).pow(2).sum() / 128).backward()
            opt.step()
    assert disk.cache_stats["fetches"] > 0
    assert torch.equal(disk.weight, memory.weight)


def test_rows_from_a_file_and_a_checkpoint_become_a_table_on_disk(tmp_path):
    rows = torch.randn(ROWS, 128, generator=torch.Generator().manual_seed(3))
    torch.save({"weight": rows}, tmp_path / "rows.pt")
    disk = hostembed.Embedding.from_pretrained(tmp_path / "rows.pt", freeze=False, storage=tmp_path / "t",
                                               cache_rows=40)
    assert torch.equal(disk.weight, rows)
    del disk
    gc.collect()
    assert torch.equal(hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=5).weight, rows)

    # A checkpoint of a table in memory, loaded into a new table on disk:
    # training goes on with the same bits.
    memory = build()
    memory_opt = hostembed.SparseAdam(memory.parameters(), lr=0.01)
    train(memory, memory_opt, 5)
    hostembed.save(tmp_path / "ckpt", memory, memory_opt)
    disk = build(seed=9, storage=tmp_path / "u", cache_rows=40)
    disk_opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    train(disk, disk_opt, 2, seed=4)  # records in the cache that the load supersedes
    hostembed.load(tmp_path / "ckpt", disk, disk_opt)
    assert not clean(tmp_path / "u")  # loaded, not yet flushed
    train(memory, memory_opt, 5, seed=2)
    train(disk, disk_opt, 5, seed=2)
    assert torch.equal(disk.weight, memory.weight)
    for key, value in state_tensors(memory_opt).items():
        assert torch.equal(state_tensors(disk_opt)[key], value), key


@pytest.mark.parametrize("mode,weighted,freq", [("sum", False, False), ("mean", False, False), ("max", False, False),
                                              ("sum", True, False), ("mean", False, True)])
@pytest.mark.parametrize("cache_rows", [4, 60])
def test_bags_on_disk_train_to_the_bits_of_bags_in_memory(tmp_path, mode, weighted, freq, cache_rows):
    def bag(**kwargs):
        torch.manual_seed(0)
        return hostembed.EmbeddingBag(ROWS, 64, mode=mode, padding_idx=3, scale_grad_by_freq=freq, **kwargs)

    memory, disk = bag(), bag(storage=tmp_path / "t", cache_rows=cache_rows)
    memory_opt = hostembed.SparseAdam(memory.parameters(), lr=0.01)
    disk_opt = hostembed.SparseAdam(disk.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        ids = zipf_ids(ROWS, 12_000 if step % 2 else 96, generator=gen)  # the core's pooling and torch's op
        ids[::17] = 3
        offsets = torch.arange(0, ids.numel(), 4)
        weights = torch.rand(ids.numel(), generator=gen) if weighted else None
        for emb, opt in ((memory, memory_opt), (disk, disk_opt)):
            out = emb(ids, offsets, per_sample_weights=weights)
            opt.zero_grad()
            (out - 0.25).pow(2).sum().backward()
            opt.step()
    assert disk._last_lookup_path == "cache" and disk.cache_stats["fetches"] > 0
    assert torch.equal(disk.weight, memory.weight)
    if cache_rows == 4 and mode == "sum" and not weighted:  # a bag table's files open as an Embedding's do
        disk.flush_cache()
        again = hostembed.EmbeddingBag.from_pretrained(disk.weight.detach(), mode="sum", storage=tmp_path / "u",
                                                       cache_rows=8)
        # The files are let go with the last reference to the table: the
        # module, its optimizer, an output that holds the autograd graph.
        assert torch.equal(again.weight, memory.weight)
        del disk, disk_opt, emb, opt, out, again
        for path in ("t", "u"):
            reopened = hostembed.EmbeddingBag(ROWS, 64, mode="sum", storage=tmp_path / path, cache_rows=8)
            assert torch.equal(reopened.weight, memory.weight)
            del reopened


@pytest.mark.gpu
def test_bags_on_disk_with_gpu_outputs_give_the_bits_of_cpu_outputs(tmp_path):
    if not hostembed.cuda_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    memory = hostembed.EmbeddingBag(ROWS, 64, mode="sum")
    torch.manual_seed(0)
    disk = hostembed.EmbeddingBag(ROWS, 64, mode="sum", storage=tmp_path / "t", cache_rows=40, device="cuda")
    opts = [hostembed.SparseAdam(m.parameters(), lr=0.01) for m in (memory, disk)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = zipf_ids(ROWS, 4096, generator=gen)
        offsets = torch.arange(0, ids.numel(), 4)
        for emb, opt in zip((memory, disk), opts):
            out = emb(ids.cuda(), offsets.cuda()) if emb is disk else emb(ids, offsets)
            assert out.device.type == ("cuda" if emb is disk else "cpu")
            opt.zero_grad()
            (out.float() - 0.25).pow(2).sum().backward()
            opt.step()
    assert torch.equal(disk.weight, memory.weight)


@pytest.mark.parametrize("optimizer", ["SGD", "SparseAdam", "Adagrad"])
def test_torchs_optimizers_after_a_plain_swap_train_a_table_on_disk_to_the_same_bits(tmp_path, optimizer):
    make = {"SGD": lambda p: torch.optim.SGD(p, lr=0.1), "SparseAdam": lambda p: torch.optim.SparseAdam(list(p)),
            "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05)}[optimizer]
    memory, disk = build(64), build(64, storage=tmp_path / "t", cache_rows=30)
    opts = [make(memory.parameters()), make(disk.parameters())]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = zipf_ids(ROWS, 128, generator=gen)
        for emb, opt in zip((memory, disk), opts):
            opt.zero_grad()
            (emb(ids) - 0.5).pow(2).sum().backward()
            opt.step()
    assert disk.cache_stats["fetches"] > 0
    assert torch.equal(disk.weight, memory.weight)


@pytest.mark.parametrize("initial", [0.0, 0.25])
def test_torchs_adagrad_makes_its_state_of_a_table_on_disk_in_a_file_not_in_ram(tmp_path, initial):
    """torch.optim.Adagrad makes its sum with full_like(weight) at
    construction; for a table on disk that is a file of the table, never a
    table-sized tensor in RAM."""
    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    rows = 400_000  # 205 MB of float32 state
    disk = hostembed.Embedding(rows, 128, storage=tmp_path / "t", cache_rows=64)
    before = rss()
    opt = torch.optim.Adagrad(disk.parameters(), lr=0.05, initial_accumulator_value=initial)
    grown = rss() - before
    total = opt.state[disk.weight]["sum"]
    assert disk._table.files.row_file_of(total) is not None, "sum is not in a file of the table"
    assert grown < 40 << 20, f"RSS grew {grown >> 20} MiB at construction"
    assert type(total) is torch.Tensor and float(total[rows - 1, 0]) == initial
    # torch's other functions on the weight are torch's, with plain tensors.
    assert type(disk.weight.detach()) is torch.Tensor and type(torch.zeros_like(disk.weight, dtype=torch.float64)) \
        is torch.Tensor
    ids = torch.tensor([1, 5, 5, rows - 1])
    disk(ids).sum().backward()
    opt.step()
    disk.flush_cache()
    assert float(total[5, 0]) == initial + 4.0 and float(total[2, 0]) == initial


@pytest.mark.parametrize("module", ["bags", "rows"])
@pytest.mark.parametrize("on_disk", [False, True])
def test_torchs_sgd_on_a_cached_table_moves_only_the_rows_it_steps(tmp_path, module, on_disk):
    # torch steps host memory (a table on disk: its mapping); the cache then
    # reads again only the records of the rows torch wrote, and its view of
    # host memory is current right after the step, not at the next lookup
    # with every record read again. The uncached table's results.
    def make(**kwargs):
        torch.manual_seed(0)
        if module == "bags":
            return hostembed.EmbeddingBag(ROWS, 64, mode="sum", **kwargs)
        return hostembed.Embedding(ROWS, 64, **kwargs)

    memory, cached = make(), make(cache_rows=40, **({"storage": tmp_path / "t"} if on_disk else {}))
    opts = [torch.optim.SGD(memory.parameters(), lr=0.1), torch.optim.SGD(cached.parameters(), lr=0.1)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = zipf_ids(ROWS, 128, generator=gen)
        for emb, opt in zip((memory, cached), opts):
            opt.zero_grad()
            out = emb(ids.view(32, 4)) if module == "bags" else emb(ids)
            (out - 0.5).pow(2).sum().backward()
            opt.step()
        assert cached._table.cache.version["weight"] == cached._table.tensor._version
    assert cached.cache_stats["fetches"] > 0
    if module == "rows":
        assert torch.equal(cached.weight, memory.weight)
    else:  # a cached bag's gradient holds each row once, summed; torch's step sums a row's entries its own way
        torch.testing.assert_close(cached.weight, memory.weight, rtol=1e-5, atol=1e-5)


def test_a_collection_looks_up_a_bag_table_on_disk_with_the_others(tmp_path):
    def tables(storage=None):
        torch.manual_seed(0)
        return hostembed.EmbeddingBagCollection([
            hostembed.EmbeddingBag(ROWS, 16, mode="sum"),
            hostembed.EmbeddingBag(ROWS, 16, mode="sum", **({} if storage is None else
                                                             dict(storage=storage, cache_rows=20)))])
    memory, disk = tables(), tables(tmp_path / "t")
    opts = [hostembed.SparseAdam(c.parameters(), lr=0.01) for c in (memory, disk)]
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        ids = [zipf_ids(ROWS, 64, generator=gen) for _ in range(2)]
        offsets = [torch.arange(0, 64, 4)] * 2
        for collection, opt in zip((memory, disk), opts):
            opt.zero_grad()
            sum(out.pow(2).sum() for out in collection(ids, offsets)).backward()
            opt.step()
    for k in range(2):
        assert torch.equal(disk[k].weight, memory[k].weight)


def test_a_refused_open_leaves_the_table_free(tmp_path):
    build(storage=tmp_path / "t", cache_rows=10).flush_cache()
    gc.collect()
    with pytest.raises(ValueError, match="already holds a table"):
        hostembed.Embedding(ROWS, 128, _weight=torch.zeros(ROWS, 128), storage=tmp_path / "t", cache_rows=10)
    with pytest.raises(ValueError, match="asks for"):
        hostembed.Embedding(ROWS, 64, storage=tmp_path / "t", cache_rows=10)
    assert torch.equal(hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10).weight, build().weight)


def test_repr_says_the_tables_folder_and_the_rows_it_holds_in_memory(tmp_path):
    """print(model) of a table on disk: its folder and its row cache (what
    ram_budget bought, in the rows the module counts), not "host memory"."""
    # A float32 record is the row and two rows of optimizer state: 8 * 12
    # bytes, so this budget holds 50 rows.
    emb = hostembed.Embedding(ROWS, 8, padding_idx=0, storage=tmp_path / "emb", ram_budget=8 * 12 * 50)
    bag = hostembed.EmbeddingBag(ROWS, 4, dtype=torch.float16, storage=tmp_path / "bag", cache_rows=7)
    expected = (f"hostembed.Embedding({ROWS}, 8, padding_idx=0, sparse=True, table on disk in "
                f"{str(tmp_path / 'emb')!r} (cache_rows=50 in memory), outputs on cpu)")
    assert repr(emb) == expected, f"expected {expected!r}, got {repr(emb)!r}"
    text = repr(torch.nn.Sequential(emb, bag))
    assert f"float16 table on disk in {str(tmp_path / 'bag')!r} (cache_rows=7 in memory)" in text, text
    assert "host memory" not in text, f"a table on disk described as in host memory: {text}"
    emb.cache_rows = 20
    assert "(cache_rows=20 in memory)" in repr(emb), f"the repr kept the old cache size: {emb!r}"
    # A table in memory, with or without a row cache, reads as before.
    assert repr(hostembed.Embedding(10, 3, cache_rows=4)) == \
        "hostembed.Embedding(10, 3, sparse=True, table in host memory, outputs on cpu)"
