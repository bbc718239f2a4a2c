"""A table on disk moves a row and its optimizer state as one record: a
missed row is one read, an evicted row one write (of a records file); the
tensors' own files get the rows back at a flush, and the results are the
bits of the same table in memory through loads, an optimizer's new state,
and a records file that cannot be made."""
import collections
import errno
import gc
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hostembed
from hostembed._core import table_files
from test_disk_table import OPTIMIZERS, ROWS, build, state_tensors, train


@pytest.fixture
def moves(monkeypatch):
    """Rows read and written, by file kind ("records", "weight", "state"),
    counted at the RowFile."""
    counts = collections.Counter()
    read, write = table_files.RowFile.read, table_files.RowFile.write

    def kind(row_file):
        name = os.path.basename(row_file.path)
        return "records" if name.endswith("-records.bin") else "weight" if name == "weight.bin" else "state"

    def counted_read(self, rows, **kwargs):
        counts["read", kind(self)] += rows.numel()
        return read(self, rows, **kwargs)

    def counted_write(self, rows, values):
        counts["write", kind(self)] += rows.numel()
        return write(self, rows, values)

    monkeypatch.setattr(table_files.RowFile, "read", counted_read)
    monkeypatch.setattr(table_files.RowFile, "write", counted_write)
    return counts


def _pair(tmp_path, optimizer, cache_rows=20):
    memory = build()
    disk = build(storage=tmp_path / "t", cache_rows=cache_rows)
    return memory, OPTIMIZERS[optimizer](memory.parameters()), disk, OPTIMIZERS[optimizer](disk.parameters())


def _assert_same(memory, memory_opt, disk, disk_opt):
    assert torch.equal(disk.weight, memory.weight)
    expected, got = state_tensors(memory_opt), state_tensors(disk_opt)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize("optimizer", ["sparse_adam", "sparse_adam_int8", "rowwise_adagrad"])
def test_a_missed_row_is_one_read_and_an_evicted_row_one_write_with_the_bits_of_memory(tmp_path, optimizer, moves):
    memory, memory_opt, disk, disk_opt = _pair(tmp_path, optimizer)
    train(memory, memory_opt, 2)
    train(disk, disk_opt, 2)  # the state is made, and the records file with it
    disk._table.cache.store.settle()  # the last eviction's write, in the background, counted before
    before, moves_before = dict(disk.cache_stats), dict(moves)
    train(memory, memory_opt, 10, seed=2)
    train(disk, disk_opt, 10, seed=2)
    disk._table.cache.store.settle()
    stats = {k: disk.cache_stats[k] - before[k] for k in ("fetches", "evictions", "bypassed")}
    steps = {k: moves[k] - moves_before.get(k, 0) for k in moves}
    assert stats["bypassed"] > 0 and stats["fetches"] > 0
    # Each missed row read once, whole (a bypassed row's forward read kept
    # for its update), each evicted or bypassed row written once; the
    # tensors' own files untouched until a flush.
    assert steps.get(("read", "records"), 0) == stats["fetches"] + stats["bypassed"]
    assert steps.get(("write", "records"), 0) == stats["evictions"] + stats["bypassed"]
    assert {k: v for k, v in steps.items() if k[1] != "records" and v} == {}
    _assert_same(memory, memory_opt, disk, disk_opt)
    disk.flush_cache()
    raw = torch.from_file(str(tmp_path / "t" / "weight.bin"), size=ROWS * 128).view(ROWS, 128)
    assert torch.equal(raw, memory.weight)


def test_write_backs_of_the_weight_then_of_everything_keep_the_caches_newer_rows(tmp_path):
    """Rows evicted (their records newer than the files), fetched again and
    updated in the cache: a write-back of the weight alone (reading
    `weight`), then of everything, leaves each field's newest values in
    its file, not an older record's."""
    memory, memory_opt, disk, disk_opt = _pair(tmp_path, "sparse_adam", cache_rows=8)
    for emb, opt in ((memory, memory_opt), (disk, disk_opt)):
        train(emb, opt, 12, count=40)
    assert torch.equal(disk.weight, memory.weight)  # the weight written back
    disk.flush_cache()  # then the state
    raw = torch.from_file(str(tmp_path / "t" / "weight.bin"), size=ROWS * 128).view(ROWS, 128)
    assert torch.equal(raw, memory.weight)
    _assert_same(memory, memory_opt, disk, disk_opt)


def test_the_records_file_goes_with_the_table_and_one_left_by_a_dead_process_at_the_next_open(tmp_path):
    _, _, disk, disk_opt = _pair(tmp_path, "sparse_adam")
    train(disk, disk_opt, 5)
    assert any(name.endswith("-records.bin") for name in os.listdir(tmp_path / "t"))
    del disk, disk_opt
    gc.collect()
    assert sorted(os.listdir(tmp_path / "t")) == ["table.json", "weight.bin"]
    (tmp_path / "t" / "state-999999-1-records.bin").write_bytes(bytes(4096))
    again = build(storage=tmp_path / "t", cache_rows=20)
    assert sorted(os.listdir(tmp_path / "t")) == ["table.json", "weight.bin"]
    del again


def test_loads_into_a_table_whose_records_hold_newer_rows_give_the_bits_of_memory(tmp_path):
    """A checkpoint loaded mid-training (the weight rewritten whole, the
    optimizer's state replaced) while the records file holds rows newer
    than the tensors' files: the loaded values win, the rest are kept."""
    memory, memory_opt, disk, disk_opt = _pair(tmp_path, "sparse_adam")
    train(memory, memory_opt, 3)
    hostembed.save(tmp_path / "ckpt", memory, memory_opt)
    train(memory, memory_opt, 2, seed=3)
    train(disk, disk_opt, 5)
    for emb, opt in ((memory, memory_opt), (disk, disk_opt)):
        hostembed.load(tmp_path / "ckpt", emb, opt)
        train(emb, opt, 4, seed=4)
    _assert_same(memory, memory_opt, disk, disk_opt)


def test_a_new_optimizer_on_a_table_whose_records_hold_its_rows_gives_the_bits_of_memory(tmp_path):
    """A second optimizer (other state) after SparseAdam: the records of the
    first one's rows are written back, and new records made for the new."""
    memory, memory_opt, disk, disk_opt = _pair(tmp_path, "sparse_adam")
    train(memory, memory_opt, 4)
    train(disk, disk_opt, 4)
    memory_opt = OPTIMIZERS["rowwise_adagrad"](memory.parameters())
    disk_opt = OPTIMIZERS["rowwise_adagrad"](disk.parameters())
    train(memory, memory_opt, 4, seed=5)
    train(disk, disk_opt, 4, seed=5)
    _assert_same(memory, memory_opt, disk, disk_opt)


def _records_writes(monkeypatch, before):
    """Every write of a records file (in the background) runs before(rows)
    first."""
    write = table_files.RowFile.write

    def patched(self, rows, values):
        if self.path.endswith("-records.bin"):
            before(rows)
        return write(self, rows, values)

    monkeypatch.setattr(table_files.RowFile, "write", patched)


def test_a_row_missed_while_its_eviction_is_still_being_written_is_read_after_the_write(tmp_path, monkeypatch):
    """Evictions are written in the background: a slow write, and steps
    that miss the rows the last one evicted (a cache of 4 rows), still give
    the bits of memory."""
    import time
    _records_writes(monkeypatch, lambda rows: time.sleep(0.02))
    memory, memory_opt, disk, disk_opt = _pair(tmp_path, "sparse_adam", cache_rows=4)
    train(memory, memory_opt, 8)
    train(disk, disk_opt, 8)
    _assert_same(memory, memory_opt, disk, disk_opt)


def test_a_failed_background_write_stops_the_next_step_and_loses_nothing(tmp_path, monkeypatch):
    """The eviction of step 7 fails on the writer's thread: step 7 is
    complete (its rows go back to their own files), and the error is
    raised by the cache's next move to the files (step 7's write of rows
    that bypassed the cache, or step 8's plan, before step 8 changes
    anything); a flush leaves step 7's bits."""
    memory, memory_opt, disk, disk_opt = _pair(tmp_path, "sparse_adam")
    train(memory, memory_opt, 6)
    train(disk, disk_opt, 6)
    disk._table.cache.store.settle()
    failing = []

    def fail_once(rows):
        if not failing:
            failing.append(rows.numel())
            raise OSError(errno.EIO, "injected: the records write failed")

    _records_writes(monkeypatch, fail_once)
    train(memory, memory_opt, 1, seed=7)
    with pytest.raises(OSError, match="injected"):
        train(disk, disk_opt, 1, seed=7)
        train(disk, disk_opt, 1, seed=8)
    assert failing and failing[0] > 0
    with pytest.raises(RuntimeError, match="failed in an earlier step"):
        train(disk, disk_opt, 1, seed=8)
    disk.flush_cache()
    _assert_same(memory, memory_opt, disk, disk_opt)


def test_rows_of_a_failed_background_write_whose_own_files_fail_too_are_written_by_the_next_flush(
        tmp_path, monkeypatch):
    memory, memory_opt, disk, disk_opt = _pair(tmp_path, "sparse_adam")
    train(memory, memory_opt, 6)
    train(disk, disk_opt, 6)
    disk._table.cache.store.settle()
    failed = []
    write = table_files.RowFile.write

    def failing(self, rows, values):
        # The first records write, then the first write of a table's own
        # file after it (the rows' way back), fail.
        records = self.path.endswith("-records.bin")
        if len(failed) == (0 if records else 1):
            failed.append(self.path)
            raise OSError(errno.EIO, f"injected: {os.path.basename(self.path)}")
        return write(self, rows, values)

    monkeypatch.setattr(table_files.RowFile, "write", failing)
    train(memory, memory_opt, 1, seed=7)
    with pytest.raises(OSError, match="injected: state-.*-records.bin"):
        train(disk, disk_opt, 1, seed=7)
        train(disk, disk_opt, 1, seed=8)
    assert len(failed) == 2
    disk.flush_cache()
    _assert_same(memory, memory_opt, disk, disk_opt)


def test_a_records_file_that_cannot_be_made_warns_and_rows_move_file_by_file(tmp_path, monkeypatch, moves):
    def full(self, record_bytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(table_files.TableFiles, "new_records", full)
    memory, memory_opt, disk, disk_opt = _pair(tmp_path, "sparse_adam")
    train(memory, memory_opt, 6)
    with pytest.warns(RuntimeWarning, match="records file .* could not be made .*No space left"):
        train(disk, disk_opt, 6)
    assert moves["read", "state"] > 0 and moves.get(("read", "records"), 0) == 0
    _assert_same(memory, memory_opt, disk, disk_opt)


_HOT = 48  # the rows the sequences touch: each is missed, evicted and written again
_OPS = st.lists(st.one_of(
    st.tuples(st.just("step"), st.integers(1, 40), st.integers(0, 9)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("read_weight")),
    st.tuples(st.just("write_row"), st.integers(0, _HOT - 1)),
    st.tuples(st.just("checkpoint")),
    st.tuples(st.just("optimizer"), st.sampled_from(["sparse_adam", "rowwise_adagrad", "sparse_adam_int8"])),
), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(ops=_OPS)
def test_any_sequence_of_steps_write_backs_writes_loads_and_new_optimizers_keeps_the_bits_of_memory(ops):
    """The records file's coherence with the tensors' files (rows newer in
    one or the other, given up, written back, superseded by a load or a
    write through torch) against the same table in memory."""
    with tempfile.TemporaryDirectory() as directory:
        memory, disk = build(), build(storage=os.path.join(directory, "t"), cache_rows=8)
        pair = [[memory, OPTIMIZERS["sparse_adam"](memory.parameters())],
                [disk, OPTIMIZERS["sparse_adam"](disk.parameters())]]
        for op in [("step", 30, 0)] + ops:
            for emb_opt in pair:
                emb, opt = emb_opt
                if op[0] == "step":
                    gen = torch.Generator().manual_seed(op[2])
                    ids = torch.randint(0, _HOT, (op[1],), generator=gen)
                    opt.zero_grad()
                    (emb(ids) - 0.5).pow(2).sum().backward()
                    opt.step()
                elif op[0] == "flush":
                    emb.flush_cache()
                elif op[0] == "read_weight":
                    emb.weight.sum()
                elif op[0] == "write_row":
                    with torch.no_grad():
                        emb.weight[op[1]] = float(op[1])
                elif op[0] == "checkpoint":
                    path = os.path.join(directory, f"ckpt-{emb is disk}")
                    hostembed.save(path, emb, opt)
                    hostembed.load(path, emb, opt)
                else:
                    emb_opt[1] = OPTIMIZERS[op[1]](emb.parameters())
        _assert_same(memory, pair[0][1], disk, pair[1][1])
        del pair, memory, disk
        gc.collect()
