"""hostembed.distributed.ShardedEmbedding on gloo process groups of 2 and 3
ranks, spawned by each test (tests/distributed_workers.py runs the ranks)
and bounded in time: training equals one process training a plain table
on the ranks' batches together; bad ids and mismatched tables fail on every
rank; DDP leaves the table alone."""
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import hostembed
from distributed_workers import OPTIMIZERS, STEPS, _train_steps, bags, batch, initial_table, worker

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TIMEOUT_S = 150


def run_ranks(world, job, tmp_path, *args, dying=()):
    """Each rank's result (None for the ranks in `dying`, which exit on
    their own); fails if a rank raised, crashed or ran past TIMEOUT_S."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank, world, str(tmp_path), job, args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    stuck = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not stuck, f"ranks {stuck} ran past {TIMEOUT_S} s"
    results = []
    for rank, p in enumerate(procs):
        if rank in dying:
            assert p.exitcode != 0, f"rank {rank} was to exit mid-training"
            results.append(None)
            continue
        path = os.path.join(tmp_path, f"rank{rank}.pt")
        assert p.exitcode == 0 and os.path.exists(path), f"rank {rank} exited with {p.exitcode}"
        result = torch.load(path, weights_only=False)
        assert "error" not in result, f"rank {rank}: {result['error']}"
        results.append(result)
    return results


def reference(optimizer, fused, world):
    """One process, a plain table, each step on every rank's batch together
    (the gradient of the sum of the ranks' losses)."""
    emb = hostembed.Embedding.from_pretrained(initial_table(), freeze=False)
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(emb.parameters(), fused=fused, **hyper)
    for step in range(STEPS):
        pairs = [batch(step, rank) for rank in range(world)]
        ids, target = torch.cat([i for i, _ in pairs]), torch.cat([t for _, t in pairs])
        (emb(ids) - target).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return emb, opt


@pytest.mark.parametrize("world, optimizer, fused", [
    (2, "SGD", False), (2, "SparseAdam", False), (3, "SparseAdam", True), (3, "RowWiseAdagrad", False),
    (2, "SparseAdamInt8", True)])
def test_ranks_train_like_one_table_on_their_batches_together(tmp_path, world, optimizer, fused):
    results = run_ranks(world, "train", tmp_path, optimizer, fused)
    emb, opt = reference(optimizer, fused, world)
    assert [r["range"] for r in results] == [(600 * k // world, 600 * (k + 1) // world) for k in range(world)]
    state = opt.state[emb.weight]
    for r in results:
        start, end = r["range"]
        # The owner sums each rank's partial sums of a row's gradient, one
        # process sums them all in order: equal to float32 rounding.
        torch.testing.assert_close(r["weight"], emb.weight.detach()[start:end], rtol=1e-5, atol=1e-6)
        assert set(r["state"]) == {k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
        for key, value in r["state"].items():
            torch.testing.assert_close(value, state[key][start:end], rtol=1e-5, atol=1e-6)
    assert not torch.equal(emb.weight.detach(), initial_table()), "training changed nothing"


@pytest.mark.parametrize("world, optimizer, fused", [(2, "SparseAdam", False), (3, "RowWiseAdagrad", True)])
def test_shards_on_disk_train_like_one_table_and_open_again(tmp_path, world, optimizer, fused):
    directory = str(tmp_path / "table")
    results = run_ranks(world, "train_on_disk", tmp_path, optimizer, fused, directory)
    emb, opt = reference(optimizer, fused, world)
    state = opt.state[emb.weight]
    for r in results:
        start, end = r["range"]
        assert r["fetches"] > 0
        torch.testing.assert_close(r["weight"], emb.weight.detach()[start:end], rtol=1e-5, atol=1e-6)
        for key, value in r["state"].items():
            torch.testing.assert_close(value, state[key][start:end], rtol=1e-5, atol=1e-6)
    assert sorted(os.listdir(directory)) == [f"rank{r}-of-{world}" for r in range(world)]
    (tmp_path / "again").mkdir()
    reopened = run_ranks(world, "reopen_on_disk", tmp_path / "again", directory)
    for first, again in zip(results, reopened):
        assert torch.equal(first["weight"], again["weight"])


@pytest.mark.parametrize("world, optimizer, fused, mode", [
    (2, "SGD", False, "mean"), (3, "SparseAdam", True, "sum"), (2, "RowWiseAdagrad", False, "sum"),
    (2, "SGD", False, "max")])
def test_sharded_bags_train_like_one_embedding_bag_on_the_ranks_bags_together(tmp_path, world, optimizer, fused,
                                                                              mode):
    """ShardedEmbeddingBag (2-D mean or max bags, or 1-D bags with offsets,
    include_last_offset and per-sample weights; padding_idx in both) trains
    its shards as one hostembed.EmbeddingBag trains on every rank's bags
    together."""
    results = run_ranks(world, "train_bags", tmp_path, optimizer, fused, mode)
    last = mode == "sum"
    emb = hostembed.EmbeddingBag.from_pretrained(initial_table(), freeze=False, mode=mode, padding_idx=5,
                                                 include_last_offset=last)
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(emb.parameters(), fused=fused, **hyper)
    for step in range(STEPS):
        parts = [bags(step, rank) for rank in range(world)]
        if last:
            flat = torch.cat([p[1] for p in parts])
            starts = torch.tensor([0] + [p[1].numel() for p in parts]).cumsum(0)
            offsets = torch.cat([p[2][:-1] + start for p, start in zip(parts, starts)] + [starts[-1:]])
            out, target = emb(flat, offsets, torch.cat([p[3] for p in parts])), torch.cat([p[5] for p in parts])
        else:
            out, target = emb(torch.cat([p[0] for p in parts])), torch.cat([p[4] for p in parts])
        (out - target).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state[emb.weight]
    changed = False
    for r in results:
        start, end = r["range"]
        # The owner sums the ranks' partial sums of a row's gradient: equal to float32 rounding.
        torch.testing.assert_close(r["weight"], emb.weight.detach()[start:end], rtol=1e-5, atol=1e-6)
        changed |= not torch.equal(r["weight"], initial_table()[start:end])
        for key, value in r["state"].items():
            torch.testing.assert_close(value, state[key][start:end], rtol=1e-5, atol=1e-6)
    assert changed
    assert torch.equal(emb.weight.detach()[5], initial_table()[5])  # padding never trained


@pytest.mark.parametrize("optimizer, bag, fused", [
    ("SGD", False, False), ("RowWiseAdagrad", False, True), ("SparseAdam", True, False), ("SparseAdam", True, True)])
def test_rows_sharded_over_hosts_and_shared_within_each_train_like_one_table(tmp_path, optimizer, bag, fused):
    """2 played hosts x 2 ranks, share_within_host=True: each host holds
    half the rows once (its two ranks map one file), each rank updates a
    quarter; the result is one process training on all four ranks'
    batches, with the updates in step() or in backward (fused). An id out
    of range on the last rank raises on every rank."""
    results = run_ranks(4, "train_host_sharded", tmp_path, optimizer, bag, fused)
    if bag:
        emb = hostembed.EmbeddingBag.from_pretrained(initial_table(), freeze=False, mode="sum")
        cls, hyper = OPTIMIZERS[optimizer]
        opt = cls(emb.parameters(), **hyper)
        for step in range(STEPS):
            pairs = [batch(step, rank) for rank in range(4)]
            ids, target = torch.cat([i for i, _ in pairs]), torch.cat([t.sum(1) for _, t in pairs])
            (emb(ids) - target).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    else:
        emb, opt = reference(optimizer, False, 4)
    state = opt.state[emb.weight]
    assert [r["rows"] for r in results] == [(0, 300), (0, 300), (300, 600), (300, 600)]
    assert [r["own"] for r in results] == [(0, 150), (150, 300), (300, 450), (450, 600)]
    assert results[0]["mapping"] == results[1]["mapping"] != results[2]["mapping"] == results[3]["mapping"]
    for r in results:
        start, end = r["rows"]
        torch.testing.assert_close(r["weight"], emb.weight.detach()[start:end], rtol=1e-5, atol=1e-6)
        own_start, own_end = r["own"]
        for key, value in r["state"].items():
            torch.testing.assert_close(value, state[key][own_start:own_end], rtol=1e-5, atol=1e-6)
        assert r["message"] is not None and "rank 3" in r["message"] and f"id {600 + 7}" in r["message"]


def test_sharing_within_hosts_needs_as_many_ranks_on_every_host(tmp_path):
    for r in run_ranks(3, "uneven_hosts", tmp_path):
        assert r["message"] is not None and "2 on 'host0'" in r["message"] and "1 on 'host1'" in r["message"]


def test_an_id_out_of_range_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_ranks(2, "out_of_range", tmp_path)
    for r in results:
        assert r["message"] is not None, "no IndexError"
        assert "id 605" in r["message"] and "rank 1" in r["message"]
        assert r["unchanged"] and r["good"]


def test_an_id_out_of_range_on_one_rank_of_a_shared_table_raises_on_every_rank(tmp_path):
    for r in run_ranks(2, "shared_out_of_range", tmp_path):
        assert r["message"] is not None, "no IndexError"
        assert "id 605 at position 1 of rank 1" in r["message"], r["message"]
        assert r["unchanged"] and r["trained"]


def test_ranks_building_different_tables_are_refused_on_every_rank(tmp_path):
    results = run_ranks(2, "mismatched", tmp_path)
    for r in results:
        assert r["message"] is not None and "rank 0" in r["message"] and "rank 1" in r["message"]


@pytest.mark.parametrize("kind", ["ShardedEmbedding", "ShardedEmbeddingBag", "SharedEmbedding"])
def test_ddp_averages_the_dense_part_and_leaves_the_table_out(tmp_path, kind):
    results = run_ranks(2, "with_ddp", tmp_path, kind)
    mean = torch.stack([r["own_dense_grad"] for r in results]).mean(0)
    for r in results:
        torch.testing.assert_close(r["dense_grad"], mean)
        assert r["ignored"] == ["emb.shard.weight" if kind.startswith("Sharded") else "emb.table.weight"]
        assert r["table_grad_same"]


def _whole(results, key):
    """The table-sized tensor `key` put together from the ranks' rows."""
    return torch.cat([r[key] for r in sorted(results, key=lambda r: r["range"])])


# (name, world, ranks a played host) of each run: the first saves, the
# others load what it saved.
RESHARD_RUNS = {
    "sharded": [("saved", 2, 1), ("same", 2, 1), ("one", 1, 1), ("three", 3, 1)],
    "shared": [("saved", 2, 2), ("same", 2, 2), ("one", 1, 1), ("three", 3, 3)],
    # 2 hosts x 2 ranks into 1 x 1, 1 host x 3 ranks, 3 hosts x 1 rank.
    "hosts": [("saved", 4, 2), ("same", 4, 2), ("one", 1, 1), ("three", 3, 3), ("three hosts", 3, 1)],
}


@pytest.mark.parametrize("kind", RESHARD_RUNS)
def test_checkpoints_load_into_the_same_fewer_and_more_ranks(tmp_path, kind):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    runs = {}
    (_, written_by, _), *_ = RESHARD_RUNS[kind]
    for name, world, per_host in RESHARD_RUNS[kind]:
        (tmp_path / name).mkdir()
        runs[name] = run_ranks(world, "reshard", tmp_path / name, str(checkpoints),
                               0 if name == "saved" else written_by, kind, per_host)
    assert sorted(os.listdir(checkpoints)) == [f"rank{r}.pt" for r in range(written_by)]
    saved = runs["saved"]
    # The same number of ranks restores exactly: the same bits after two more steps.
    for before, after in zip(saved, runs["same"]):
        for key in ("weight", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(before[key]), torch.as_tensor(after[key])), key
    # Other numbers of ranks: the same rows and state, then two steps whose
    # sums add the ranks' partial sums in another grouping (float32 rounding).
    for name in runs.keys() - {"saved", "same"}:
        assert [r["step"] for r in runs[name]] == [5] * len(runs[name])
        if kind != "sharded" and name != "one":
            # hostembed.load of another layout's file, which a shared
            # table's shape alone would not tell: refused, nothing changed.
            for r in runs[name][:written_by]:
                message, unchanged = r["refused"]
                assert "load_resharded" in message and unchanged, r["refused"]
        for key in ("weight", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(_whole(runs[name], key), _whole(saved, key), rtol=1e-5, atol=1e-6)
    assert not torch.equal(_whole(saved, "weight"), initial_table())


def test_compact_state_checkpoints_load_into_more_ranks(tmp_path):
    """8-bit codes, their scales and a row-wise second moment are rows like
    the others: two ranks' checkpoints load into three, codes and scales
    as saved."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    runs = {}
    for name, world, written_by in (("saved", 2, 0), ("three", 3, 2)):
        (tmp_path / name).mkdir()
        runs[name] = run_ranks(world, "reshard", tmp_path / name, str(checkpoints), written_by, "sharded", 1,
                               "SparseAdamInt8")
    saved, three = runs["saved"], runs["three"]
    assert _whole(saved, "exp_avg").dtype == torch.int8 and _whole(saved, "exp_avg_sq").dim() == 1
    assert set(saved[0]) >= {"exp_avg_scale"}
    # Two more steps after the load, their sums in another grouping: equal
    # to float32 rounding, a code at most a step apart.
    torch.testing.assert_close(_whole(three, "weight"), _whole(saved, "weight"), rtol=1e-4, atol=1e-5)
    assert (_whole(three, "exp_avg").int() - _whole(saved, "exp_avg").int()).abs().max() <= 1
    torch.testing.assert_close(_whole(three, "exp_avg_sq"), _whole(saved, "exp_avg_sq"), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("kind, world, per_host", [("sharded", 2, 1), ("shared", 2, 2), ("hosts", 4, 2)])
def test_a_single_process_checkpoint_loads_into_ranks_and_theirs_back_into_one(tmp_path, kind, world, per_host):
    """A single process's model (a plain hostembed.Embedding where the
    ranks have a ShardedEmbedding, a SharedEmbedding, or a ShardedEmbedding
    shared within 2 played hosts) trains 3 steps and saves; the ranks load
    it (each its rows and their state, bit for bit), train 2 more steps and
    save a file each; those files load back into a single process's plain
    model, bit for bit."""
    import hostembed.distributed as hd

    def plain_model():
        model = torch.nn.Module()
        model.emb = hostembed.Embedding.from_pretrained(initial_table(), freeze=False)
        return model, hostembed.SparseAdam(model.parameters(), lr=0.01)

    model, opt = plain_model()
    _train_steps(model, opt, range(3), 0, 1)
    hostembed.save(tmp_path / "plain.pt", model, opt)
    (tmp_path / "ranks").mkdir()
    (tmp_path / "run").mkdir()
    results = run_ranks(world, "from_single_process", tmp_path / "run", str(tmp_path / "plain.pt"),
                        str(tmp_path / "ranks"), kind, per_host)
    state = opt.state[model.emb.weight]
    for r in results:
        start, end = r["loaded"]["range"]
        assert torch.equal(r["loaded"]["weight"], model.emb.weight.detach()[start:end])
        assert torch.equal(r["loaded"]["exp_avg"], state["exp_avg"][start:end])
        assert torch.equal(r["loaded"]["exp_avg_sq"], state["exp_avg_sq"][start:end])
        assert r["loaded"]["step"] == int(state["step"]) == 3
    back, back_opt = plain_model()
    hd.load_resharded([tmp_path / "ranks" / f"rank{r}.pt" for r in range(world)], back, back_opt)
    assert torch.equal(back.emb.weight.detach(), _whole(results, "weight"))
    assert torch.equal(back_opt.state[back.emb.weight]["exp_avg"], _whole(results, "exp_avg"))


def test_checkpoints_of_another_table_are_refused(tmp_path):
    # Files that do not hold the rows the ranks would have: a plain table's.
    model = torch.nn.Module()
    model.emb = hostembed.Embedding(10, 4)
    for r in range(3):
        hostembed.save(tmp_path / f"rank{r}.pt", model)
    (tmp_path / "run").mkdir()
    results = run_ranks(2, "load_foreign", tmp_path / "run", str(tmp_path))
    for r in results:
        assert "does not hold rows" in r["message"] and r["unchanged"]


def test_a_rank_that_dies_mid_training_fails_the_others_promptly(tmp_path):
    results = run_ranks(2, "rank_dies", tmp_path, dying=(1,))
    assert results[0]["message"] is not None, "the surviving rank did not fail"
    assert results[0]["seconds"] < 60, "it failed only at the process group's timeout"


@pytest.mark.parametrize("world, optimizer, fused", [
    (2, "SGD", False), (2, "SparseAdam", False), (3, "RowWiseAdagrad", False), (2, "Adam", False),
    (2, "SparseAdam", True), (3, "RowWiseAdagrad", True), (2, "SparseAdamInt8", True)])
def test_ranks_sharing_one_copy_train_like_one_table(tmp_path, world, optimizer, fused):
    """Every optimizer, fused=True too (bit for bit as unfused: the same
    exchanged rows, summed in the same order); Adam steps each row of the
    table once a step (its weight decay would show twice)."""
    results = run_ranks(world, "train_shared", tmp_path, optimizer, fused)
    emb, opt = reference(optimizer, False, world)
    state = opt.state[emb.weight]
    for r in results:
        # Every rank sees the whole table, every rank's updates in it.
        torch.testing.assert_close(r["table"], emb.weight.detach(), rtol=1e-5, atol=1e-6)
        start, end = r["range"]
        for key, value in r["state"].items():
            torch.testing.assert_close(value, state[key][start:end], rtol=1e-5, atol=1e-6)
    # One copy: every rank's rows are the same shared mapping of one
    # (unlinked) /dev/shm file.
    perms, inode, path = results[0]["mapping"]
    assert perms.endswith("s") and "hostembed-" in path, results[0]["mapping"]
    assert all(r["mapping"][1] == inode for r in results)
    assert not torch.equal(emb.weight.detach(), initial_table()), "training changed nothing"
    assert all(torch.equal(r["table"], r["unfused_table"]) for r in results)


def test_a_shared_table_is_one_copy_in_memory_whatever_the_ranks(tmp_path):
    """Measured, not inferred: every page of the table's mapping is resident
    and shared (none private to a rank, each rank's proportional share a
    third with 3 ranks), and no rank's private memory grew by more than a
    fraction of the table."""
    rows, dim, world = 200_000, 32, 3
    table_kib = rows * dim * 4 // 1024
    for r in run_ranks(world, "shared_memory", tmp_path, rows, dim):
        m = r["mapping"]
        assert m["Rss"] >= table_kib and m["Private_Clean"] + m["Private_Dirty"] == 0, m
        assert m["Pss"] <= table_kib / world + 64, m
        assert r["private_gain_kib"] < table_kib / 2, (r["private_gain_kib"], table_kib)


def test_a_shared_table_refuses_ranks_on_other_hosts_and_casts(tmp_path):
    for r in run_ranks(2, "shared_refusals", tmp_path):
        assert "one host" in r["hosts"] and "'host1'" in r["hosts"]
        # A cast would give the rank a copy of its own: refused, nothing changed.
        assert r["cast"] is not None and "dtype=torch.float16" in r["cast"] and r["unchanged"]


@pytest.mark.parametrize("shared", [False, True], ids=["sharded", "shared"])
def test_the_torchrun_example_trains_saves_and_resumes_on_more_ranks(tmp_path, shared):
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                           "train_sharded.py")

    def torchrun(ranks, *extra):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   example, "--steps", "3", "--users", "2000", "--items", "500", "--batch", "64",
                   "--checkpoint-dir", str(tmp_path)] + (["--shared"] if shared else []) + list(extra)
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "step 2: loss" in done.stdout
        return done.stdout

    torchrun(2)
    assert sorted(os.listdir(tmp_path)) == ["rank0.pt", "rank1.pt"]
    # A user's restart on 3 ranks, the tables fused this time.
    assert "resumed from 2 ranks' checkpoints" in torchrun(3, "--resume", "--fused")
    assert sorted(os.listdir(tmp_path)) == ["rank0.pt", "rank1.pt", "rank2.pt"]


def test_one_rank_casts_its_shard_keeps_outputs_on_the_cpu_and_names_a_bad_id(tmp_path):
    (r,) = run_ranks(1, "moves_and_casts", tmp_path)
    assert (r["dtype"], r["device"], r["shard"], r["equal"]) == ("torch.float64", "cpu", "torch.float64", True)
    assert f"id {600 + 3} at position 1 of rank 0's ids" in r["bad"], r["bad"]
    if not torch.cuda.is_available():
        assert "CUDA is not available" in r["no_cuda"]


def test_needs_an_initialised_process_group():
    import hostembed.distributed as hd

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        hd.ShardedEmbedding(10, 4)


@pytest.mark.parametrize("backend, on_cpu", [("gloo", True), ("cpu:gloo,cuda:nccl", True), ("nccl", False),
                                              ("cuda:nccl", False)])
def test_the_traffic_goes_where_the_groups_backend_takes_tensors(monkeypatch, backend, on_cpu):
    from hostembed.distributed import exchange

    monkeypatch.setattr(exchange.dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(exchange.torch.cuda, "current_device", lambda: 3)
    assert exchange.comm_device(None) == (torch.device("cpu") if on_cpu else torch.device("cuda", 3))
