"""Several Python threads on one table at once.

The core releases the GIL, so lookups, backward passes, optimizer steps and
set_num_threads from different threads really run together. Each op that
reads or writes a table holds the table's lock around that work
(HostTable.lock), so every op is atomic relative to the others; the core's
thread pool serves one caller at a time and runs any other caller on its
own thread, and set_num_threads waits for the job in flight. These tests
compare what the threads see and leave behind with a serial run of the
same work. Each is bounded in time (a deadlock fails, it does not hang).
"""
import threading
import time

import pytest
import torch

import hostembed

DEADLINE_S = 20.0


class Workers:
    """Threads that record their first exception. join() waits for the
    workers, then stops the background threads (stop is set), re-raises the
    first exception and fails on a thread still running after the deadline."""

    def __init__(self):
        self.threads, self.background, self.errors = [], [], []
        self.stop = threading.Event()
        self.started = time.monotonic()

    def spawn(self, fn, *args, background=False):
        def run():
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in join()
                self.errors.append(exc)
                self.stop.set()

        thread = threading.Thread(target=run, daemon=True, name=getattr(fn, "__name__", "worker"))
        (self.background if background else self.threads).append(thread)
        thread.start()

    def join(self):
        for thread in self.threads:
            thread.join(max(0.1, DEADLINE_S - (time.monotonic() - self.started)))
        self.stop.set()
        for thread in self.background:
            thread.join(max(0.1, DEADLINE_S - (time.monotonic() - self.started)))
        alive = [t.name for t in self.threads + self.background if t.is_alive()]
        if self.errors:
            raise self.errors[0]
        assert not alive, f"still running after {DEADLINE_S} s (a deadlock?): {alive}"


@pytest.fixture(autouse=True)
def restore_threads():
    before = hostembed.get_num_threads()
    yield
    hostembed.set_num_threads(before)


def flip_threads(workers, counts=(1, 3, 2, 4)):
    """Keeps changing the core's thread count while the others work."""
    i = 0
    while not workers.stop.is_set():
        n = counts[i % len(counts)]
        hostembed.set_num_threads(n)
        assert hostembed.get_num_threads() == n  # this thread alone sets it
        i += 1
        time.sleep(0.001)


def row_grad(rows, dim, gen):
    """A row-sparse gradient over `rows` (repeats and all, unsorted), with
    values that are multiples of 1/4, so any summation order is exact."""
    values = torch.randint(-8, 9, (rows.numel(), dim), generator=gen).float() / 4
    return rows, values


def test_lookups_backward_and_steps_race_like_a_serial_run():
    """Lookup threads (forward + backward via autograd.grad) on all rows,
    one thread stepping SparseAdam on rows [0, 1000) only, one changing
    the thread count. A lookup sees rows the optimizer never touches exactly
    as they started, and the optimizer's rows all from one and the same
    step (each op is atomic); gradients are exact; the final table and state
    equal a serial run of the same steps."""
    # Steps of 12000 gradient rows (unsorted, with repeats: the core sorts
    # and sums them, then updates nearly all 3000 rows), long enough for a
    # lookup to land in the middle of one now and then if the lock did not
    # keep it out (test_ops_hold_the_table_lock checks the lock directly).
    num_rows, dim, trained, steps = 6000, 32, 3000, 40
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(num_rows, dim, generator=gen)
    grads = []
    for _ in range(steps):
        rows = torch.randint(0, trained, (12000,), generator=gen)
        grads.append(row_grad(rows, dim, gen))

    def make():
        emb = hostembed.Embedding(num_rows, dim)
        with torch.no_grad():
            emb.weight.copy_(init)
        return emb, hostembed.SparseAdam(emb.parameters(), lr=0.05)

    def set_grad(emb, indices, values):
        emb.weight.grad = torch.sparse_coo_tensor(indices.unsqueeze(0), values, (num_rows, dim))

    # The serial run: the trained rows after each step.
    ref, ref_opt = make()
    trajectory = [ref.weight.detach()[:trained].clone()]
    for indices, values in grads:
        set_grad(ref, indices, values)
        ref_opt.step()
        trajectory.append(ref.weight.detach()[:trained].clone())
    history = torch.stack(trajectory)  # [steps + 1, trained, dim]

    emb, opt = make()
    workers = Workers()
    lookups = [0] * 3
    seen_steps = set()

    def look(k):
        g = torch.Generator().manual_seed(100 + k)
        while not workers.stop.is_set():
            ids = torch.randint(0, num_rows, (128, 8), generator=g)
            if k == 0:
                ids = ids.int()
            out = emb(ids)
            flat, rows = ids.reshape(-1).long(), out.detach().reshape(-1, dim)
            untouched = flat >= trained
            assert torch.equal(rows[untouched], init[flat[untouched]]), "an untouched row changed"
            # All trained rows of this lookup from one step of the serial run.
            t_ids, t_rows = flat[~untouched], rows[~untouched]
            if t_ids.numel():
                match = (history[:, t_ids] == t_rows).all(dim=2).all(dim=1).nonzero()
                assert match.numel(), "a lookup saw the trained rows between two steps (or a wrong row)"
                seen_steps.add(int(match[0]))
            if lookups[k] % 3 == 0:
                grad_out = torch.randint(-4, 5, out.shape, generator=g).float()
                (grad,) = torch.autograd.grad(out, emb.weight, grad_out)
                want = torch.zeros(num_rows, dim).index_add_(0, flat, grad_out.reshape(-1, dim))
                assert torch.equal(grad.to_dense(), want), "backward differs from the serial sum"
            lookups[k] += 1

    def train():
        for indices, values in grads:
            set_grad(emb, indices, values)
            opt.step()
            time.sleep(0)  # let lookups in between steps
        workers.stop.set()

    for k in range(len(lookups)):
        workers.spawn(look, k)
    workers.spawn(flip_threads, workers, background=True)
    workers.spawn(train)
    workers.join()

    assert all(lookups), f"lookups per thread: {lookups}"
    assert torch.equal(emb.weight.detach(), ref.weight.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[emb.weight][key], ref_opt.state[ref.weight][key])
    assert opt.state[emb.weight]["step"] == steps
    assert len(seen_steps) > 1, f"lookups saw only steps {sorted(seen_steps)}: no overlap exercised"


def test_backward_from_several_threads_accumulates_like_a_serial_run():
    """Threads calling module(ids).backward() on one table: weight.grad
    ends as the serial sum (exact: the values are multiples of 1/4)."""
    num_rows, dim, threads, rounds = 500, 8, 4, 25
    gen = torch.Generator().manual_seed(1)
    batches = [[(torch.randint(0, num_rows, (200,), generator=gen),
                 torch.randint(-4, 5, (200, dim), generator=gen).float() / 4) for _ in range(rounds)]
               for _ in range(threads)]
    emb = hostembed.Embedding(num_rows, dim, padding_idx=3)
    want = torch.zeros(num_rows, dim)
    for batch in batches:
        for ids, grad_out in batch:
            want.index_add_(0, ids, grad_out)
    want[3] = 0
    workers = Workers()

    def run(batch):
        for ids, grad_out in batch:
            emb(ids).backward(grad_out)

    for batch in batches:
        workers.spawn(run, batch)
    workers.spawn(flip_threads, workers, background=True)
    workers.join()
    assert torch.equal(emb.weight.grad.to_dense(), want)


def test_max_norm_lookups_from_several_threads_renorm_each_row_whole():
    """max_norm lookups write the rows they read (renorm in place). From
    several threads on overlapping ids, the table ends as the same lookups
    made one after another leave it: a row's renorms never interleave
    (each depends only on the row, so any order of whole renorms agrees)."""
    num_rows, dim, threads, rounds = 300, 32, 4, 30
    gen = torch.Generator().manual_seed(2)
    init = torch.randn(num_rows, dim, generator=gen) * 3
    batches = [[torch.randint(0, num_rows, (256,), generator=gen) for _ in range(rounds)] for _ in range(threads)]

    def make():
        emb = hostembed.Embedding(num_rows, dim, max_norm=1.0, norm_type=3.0)
        with torch.no_grad():
            emb.weight.copy_(init)
        return emb

    ref = make()
    for batch in batches:
        for ids in batch:
            ref(ids)
    emb = make()
    workers = Workers()

    def run(batch):
        for ids in batch:
            out = emb(ids)
            norms = out.detach().norm(p=3.0, dim=1)
            assert (norms <= 1.0 + 1e-5).all(), "a lookup returned a row over max_norm"

    for batch in batches:
        workers.spawn(run, batch)
    workers.spawn(flip_threads, workers, background=True)
    workers.join()
    assert torch.equal(emb.weight.detach(), ref.weight.detach())


def test_set_num_threads_during_a_long_lookup():
    """set_num_threads while a big gather runs waits for it (or the gather
    runs on its own thread) and the result is still exact."""
    emb = hostembed.Embedding(50_000, 64)
    ids = torch.randint(0, 50_000, (400_000,))
    want = emb.weight.detach()[ids]
    workers = Workers()
    results = []

    def look():
        for _ in range(3):
            results.append(torch.equal(emb(ids), want))
        workers.stop.set()

    workers.spawn(look)
    workers.spawn(flip_threads, workers, background=True)
    workers.join()
    assert results == [True, True, True]


def test_ops_hold_the_table_lock():
    """Lookups (with and without max_norm) and steps wait while another
    thread holds the table's lock, and finish once it is released."""
    emb = hostembed.Embedding(100, 8, max_norm=2.0)
    plain = hostembed.Embedding(100, 8)
    opt = hostembed.SparseAdam(plain.parameters())
    plain(torch.tensor([1, 2])).sum().backward()

    def lookup_max_norm():
        emb(torch.tensor([3, 4]))

    def lookup_plain():
        plain(torch.tensor([5]))

    def step():
        opt.step()

    for fn, table in ((lookup_max_norm, emb._table), (lookup_plain, plain._table), (step, plain._table)):
        done = threading.Event()

        def run():
            fn()
            done.set()

        with table.lock:
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            assert not done.wait(0.3), f"{fn.__name__} ran while another thread held the table's lock"
        assert done.wait(DEADLINE_S), f"{fn.__name__} did not finish once the lock was released"
        thread.join()
    assert opt.state[plain.weight]["step"] == 1
