"""Tables on disk and forked processes, and the end of a process.

A table on disk is the process's that opened it: forked children (DataLoader
workers, multiprocessing's fork context, os.fork) neither use nor touch it
(their end writes nothing back, removes nothing, waits for nothing of the
parent's), get a clear error if they try, and train tables of their own as
any process does. The parent's table keeps the bits of the same table
trained in memory without the fork. At a clean exit a table is written
back and its records file removed."""
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import torch

import hostembed
from conftest import zipf_ids
from test_disk_table import ROWS, build, state_tensors, train

# Every wait for another process: past it the test fails (and kills what
# it started) instead of hanging.
TIMEOUT = 60
TESTS = os.path.dirname(os.path.abspath(__file__))
FORK_ERROR = "forked child"


def pair(directory, cache_rows=20):
    """A table in memory and the same table on disk (a small cache: rows
    are evicted, and so written in the background, every step), each with
    its SparseAdam (its state moves with the rows: the records file)."""
    memory, disk = build(), build(storage=directory, cache_rows=cache_rows)
    return (memory, hostembed.SparseAdam(memory.parameters(), lr=0.01),
            disk, hostembed.SparseAdam(disk.parameters(), lr=0.01))


def step(emb, opt, ids):
    loss = (emb(ids).float() - 0.5).pow(2).sum() / ids.numel()
    opt.zero_grad()
    loss.backward()
    opt.step()


def assert_same(memory, memory_opt, disk, disk_opt):
    rows = (disk.weight != memory.weight).any(dim=1).nonzero().view(-1).tolist()
    assert not rows, f"rows {rows} of the table on disk differ from the same table trained in memory without a fork"
    expected, got = state_tensors(memory_opt), state_tensors(disk_opt)
    assert got.keys() == expected.keys(), f"state {sorted(got)}, expected {sorted(expected)}"
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"the optimizer's {key!r} differs from the table's in memory"


def records(directory):
    return sorted(name for name in os.listdir(directory) if name.endswith("-records.bin"))


def state_files(directory):
    return sorted(name for name in os.listdir(directory) if name.startswith("state-"))


def run_script(code, tmp_path):
    """Runs `code` in a new interpreter (a real start and exit) with the
    tests' modules importable; returns the finished process."""
    script = tmp_path / "script.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS] + sys.path)}
    try:
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                              timeout=2 * TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the script did not end within {2 * TIMEOUT} s (a hang); its output so far:\n"
                             f"{exc.stdout}\n{exc.stderr}") from None


class Batches(torch.utils.data.Dataset):
    """Batches of ids, made in the workers; the first also tries the
    parent's table there and hands back what it raised."""

    def __init__(self, emb):
        self.emb = emb

    def __len__(self):
        return 6

    def __getitem__(self, i):
        ids = zipf_ids(ROWS, 128, generator=torch.Generator().manual_seed(100 + i))
        error = ""
        if i == 0:
            try:
                self.emb(ids)
                error = "no error: the worker looked rows up in its parent's table"
            except RuntimeError as exc:
                error = str(exc)
        return ids, error


def test_dataloader_workers_leave_a_table_on_disk_to_the_parent_which_trains_on_to_the_bits_of_memory(tmp_path):
    memory, memory_opt, disk, disk_opt = pair(tmp_path / "t")
    train(memory, memory_opt, 3)
    train(disk, disk_opt, 3)
    before = records(tmp_path / "t")
    assert before, "the table trained without a records file: nothing here would test it"
    loader = torch.utils.data.DataLoader(Batches(disk), batch_size=None, num_workers=2, timeout=TIMEOUT,
                                         multiprocessing_context="fork", persistent_workers=True)
    errors = []
    for ids, error in loader:  # the parent trains while the workers live
        step(memory, memory_opt, ids)
        step(disk, disk_opt, ids)
        errors.append(error)
    assert FORK_ERROR in errors[0] and str(tmp_path / "t") in errors[0], \
        f"a worker's lookup in its parent's table on disk should say why it cannot, got: {errors[0]!r}"
    train(memory, memory_opt, 2, seed=2)
    train(disk, disk_opt, 2, seed=2)
    assert records(tmp_path / "t") == before, f"records files {records(tmp_path / 't')}, expected {before}"
    assert_same(memory, memory_opt, disk, disk_opt)
    # The workers (still alive: persistent) hold none of the table's files:
    # the parent lets go of the table and opens it again.
    expected = disk.weight.detach().clone()
    loader.dataset.emb = None  # the parent's reference; the workers have theirs
    del disk, disk_opt
    gc.collect()
    assert sorted(os.listdir(tmp_path / "t")) == ["table.json", "weight.bin"], os.listdir(tmp_path / "t")
    again = build(storage=tmp_path / "t", cache_rows=20)
    assert torch.equal(again.weight, expected), "the table reopened without the rows it was closed with"
    del loader


# Kept alive to the child's end: the table is written back by the end of
# the process (multiprocessing's fork children end with os._exit), not by
# the module's.
_kept = []


def train_a_table_of_its_own(directory, expected):
    # torch's OpenMP threads do not survive a fork (torch's DataLoader
    # workers run one thread for the same reason).
    torch.set_num_threads(1)
    memory, memory_opt, disk, disk_opt = pair(directory)
    train(memory, memory_opt, 4, seed=7)
    train(disk, disk_opt, 4, seed=7)  # the second step waited for good on the parent's writer thread
    assert records(directory), "the child's table trained without a records file"
    torch.save(memory.weight.detach().clone(), expected)
    _kept.append((disk, disk_opt))


def test_a_multiprocessing_child_trains_a_table_of_its_own_while_the_parent_trains_on(tmp_path):
    memory, memory_opt, disk, disk_opt = pair(tmp_path / "parent")
    train(memory, memory_opt, 3)
    train(disk, disk_opt, 3)  # the last step's evictions still being written, maybe
    before = records(tmp_path / "parent")
    child = multiprocessing.get_context("fork").Process(
        target=train_a_table_of_its_own, args=(str(tmp_path / "child"), str(tmp_path / "expected.pt")))
    child.start()
    try:
        train(memory, memory_opt, 2, seed=2)
        train(disk, disk_opt, 2, seed=2)
        child.join(TIMEOUT)
        assert not child.is_alive(), f"the child did not end within {TIMEOUT} s (a hang)"
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0, f"the child ended with exit code {child.exitcode}, expected 0"
    train(memory, memory_opt, 2, seed=3)
    train(disk, disk_opt, 2, seed=3)
    assert records(tmp_path / "parent") == before, f"records files {records(tmp_path / 'parent')}, expected {before}"
    assert_same(memory, memory_opt, disk, disk_opt)
    # The child's table, written back at the child's end, its records gone.
    assert sorted(os.listdir(tmp_path / "child")) == ["table.json", "weight.bin"], os.listdir(tmp_path / "child")
    expected = torch.load(tmp_path / "expected.pt")
    got = hostembed.Embedding(ROWS, 128, storage=tmp_path / "child", cache_rows=10).weight
    assert torch.equal(got, expected), "the child's table on disk does not hold the rows it trained"


OS_FORK = """
import gc, os, select, sys, threading
import torch, hostembed
from hostembed._core import table_files
from test_disk_fork import TIMEOUT, FORK_ERROR, assert_same, pair, records, state_files, step, wait
from test_disk_table import train
from conftest import zipf_ids

directory = {directory!r}
in_flight = {in_flight!r}
memory, memory_opt, disk, disk_opt = pair(directory)
train(memory, memory_opt, 3)
train(disk, disk_opt, 3)
store = disk._table.cache.store
ids = zipf_ids(300, 128, generator=torch.Generator().manual_seed(9))
if in_flight:
    # The records file's next write waits on the writer's thread until the
    # fork is done: the child is forked while it is in flight.
    gate, started = threading.Event(), threading.Event()
    write = table_files.RowFile.write
    def held(self, rows, values):
        if self.path.endswith("-records.bin") and not gate.is_set():
            started.set()
            gate.wait()
        return write(self, rows, values)
    table_files.RowFile.write = held
    # Rows training used least: each lookup counts a use, until they are
    # used more than cached rows and take their slots; that lookup's
    # evictions go to the writer.
    ids = torch.arange(290, 300)
    evictions = disk._table.cache.stats["evictions"]
    for _ in range(100):
        out = disk(ids)
        if disk._table.cache.stats["evictions"] > evictions:
            break
    assert started.wait(TIMEOUT), "no write of the records file started"
else:
    store.settle()
    assert store._writing[0] is None and store._queued is None
    out = disk(ids)
    store.settle()
files = (records(directory), state_files(directory))
assert files[0], "no records file: nothing here would test it"
ready, done = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(done)
    # The child: its parent's table refuses, with a clear error.
    found = []
    # The last training step's gradient is still there: step() has one to apply.
    if disk_opt.param_groups[0]["params"][0].grad is None:
        found.append("no gradient for the optimizer's step to refuse")
    for attempt in (lambda: disk(ids), disk.flush_cache, lambda: hostembed.save(directory + ".pt", disk),
                    disk_opt.step):
        try:
            attempt()
            found.append("no error")
        except RuntimeError as exc:
            found.append(str(exc))
    bad = [text for text in found if FORK_ERROR not in text or directory not in text]
    if bad:
        print("child: expected the fork error, got", bad, file=sys.stderr)
    # A table of its own, trained while its parent's objects go (their
    # memory was never the child's: the child's may lie where it was).
    torch.set_num_threads(1)  # torch's OpenMP threads do not survive a fork
    if in_flight:
        table_files.RowFile.write = write
    own = pair(directory + "-child")
    del memory, memory_opt, disk, disk_opt, out, store
    gc.collect()
    train(own[0], own[1], 4, seed=5)
    train(own[2], own[3], 4, seed=5)
    assert_same(*own)
    torch.save(own[0].weight.detach().clone(), directory + "-child.pt")
    # Then it waits for its parent's next step, and ends as a script ends
    # (its own table written back then).
    select.select([ready], [], [], TIMEOUT)
    sys.exit(3 if bad else 0)
os.close(ready)
if in_flight:
    gate.set()
disk_opt.zero_grad()
((out.float() - 0.5).pow(2).sum() / ids.numel()).backward()
disk_opt.step()
step(memory, memory_opt, ids)
train(memory, memory_opt, 1, seed=2)
train(disk, disk_opt, 1, seed=2)
os.close(done)  # the child ends now, while the parent's table is open
code = wait(pid)
assert code == 0, f"the child ended with {{code}}, expected 0"
train(memory, memory_opt, 3, seed=3)
train(disk, disk_opt, 3, seed=3)
assert (records(directory), state_files(directory)) == files, \\
    f"files {{(records(directory), state_files(directory))}}, expected {{files}} (the parent's, while open)"
assert_same(memory, memory_opt, disk, disk_opt)
assert not os.path.exists(directory + ".pt"), "the child wrote a checkpoint of its parent's table"
assert sorted(os.listdir(directory + "-child")) == ["table.json", "weight.bin"], os.listdir(directory + "-child")
child_table = hostembed.Embedding(300, 128, storage=directory + "-child", cache_rows=10)
assert torch.equal(child_table.weight, torch.load(directory + "-child.pt")), "the child's table lost its rows"
print("parent done")
"""


def wait(pid):
    """The exit code of child `pid` (negative: the signal that ended it),
    or AssertionError if it has not ended within TIMEOUT (killed first)."""
    for _ in range(TIMEOUT * 20):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child did not end within {TIMEOUT} s (a hang)")


def _os_fork(tmp_path, in_flight):
    done = run_script(OS_FORK.format(directory=str(tmp_path / "t"), in_flight=in_flight), tmp_path)
    assert done.returncode == 0 and "parent done" in done.stdout, \
        f"exit code {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    # Neither process's end has rows enough to announce.
    assert "hostembed: writing back" not in done.stderr, done.stderr


def test_an_os_fork_child_with_no_write_in_flight_ends_without_touching_the_parents_table(tmp_path):
    _os_fork(tmp_path, in_flight=False)


def test_an_os_fork_child_forked_while_a_write_is_in_flight_ends_at_once(tmp_path):
    _os_fork(tmp_path, in_flight=True)


def test_a_clean_exit_writes_the_table_back_removes_its_records_file_and_says_so(tmp_path):
    code = f"""
import os, torch, hostembed
from hostembed._cache import row_cache
from test_disk_fork import pair, records
from test_disk_table import train
memory, memory_opt, disk, disk_opt = pair({str(tmp_path / 't')!r})
train(memory, memory_opt, 6)
train(disk, disk_opt, 6)
assert records({str(tmp_path / 't')!r}) and disk._table.cache.dirty, "nothing left to write back at the exit"
torch.save(memory.weight.detach().clone(), {str(tmp_path / 'expected.pt')!r})
row_cache.END_MESSAGE_SECONDS = 0  # announced however small the table
"""
    done = run_script(code, tmp_path)
    assert done.returncode == 0, f"exit code {done.returncode}\nstderr: {done.stderr}"
    assert sorted(os.listdir(tmp_path / "t")) == ["table.json", "weight.bin"], \
        f"after a clean exit the table's folder holds {sorted(os.listdir(tmp_path / 't'))}"
    lines = [line for line in done.stderr.splitlines() if line.startswith("hostembed:")]
    assert len(lines) == 2 and "writing back" in lines[0] and str(tmp_path / "t") in lines[0] \
        and "before the process exits" in lines[0] and "written back in" in lines[1], done.stderr
    expected = torch.load(tmp_path / "expected.pt")
    got = hostembed.Embedding(ROWS, 128, storage=tmp_path / "t", cache_rows=10).weight
    assert torch.equal(got, expected), "the rows on disk after the exit are not the trained ones"
