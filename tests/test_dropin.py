"""hostembed.Embedding where real training scripts take nn.Embedding:
DistributedDataParallel, torch.compile, forked DataLoader workers, weight
assignments, zero-width tables, impossible sizes, copies, clipping."""
import copy
import multiprocessing
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hostembed
from conftest import compile_matches_eager, pair, zipf_ids

HERE = os.path.dirname(os.path.abspath(__file__))


def test_is_an_nn_embedding():
    emb = hostembed.Embedding(10, 3)
    assert isinstance(emb, nn.Embedding)


def test_repr_says_where_the_table_and_outputs_are():
    model = nn.Sequential(hostembed.Embedding(10000, 16, padding_idx=0), nn.Embedding(5, 2))
    text = repr(model)
    assert "hostembed.Embedding(10000, 16, padding_idx=0, sparse=True, table in host memory, outputs on cpu)" in text
    assert "(1): Embedding(5, 2)" in text
    assert "outputs on meta" in repr(hostembed.Embedding(3, 2, device="meta"))


# ---- DistributedDataParallel

def _ddp_worker(rank, world, init_file, steps, result_file):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, HERE)
    from conftest import zipf_ids as ids_of

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(hostembed.Embedding(500, 8), nn.Linear(8, 1))
        ddp = DistributedDataParallel(model)
        opt = hostembed.SparseAdam(list(model[0].parameters()), lr=0.05)
        dense = torch.optim.SGD(model[1].parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            ids = ids_of(500, 64, generator=gen)
            local = ids.view(world, -1)[rank]
            loss = ddp(local).pow(2).mean()
            opt.zero_grad()
            dense.zero_grad()
            loss.backward()
            opt.step()
            dense.step()
        torch.save({"weight": model[0].weight.detach().clone(), "linear": model[1].weight.detach().clone()},
                   result_file)
    finally:
        dist.destroy_process_group()
    # Saved: leave without running destructors. Freeing the DDP reducer at
    # exit can deadlock in torch 2.13's gloo teardown (seen once here: the
    # main thread joins the process group's thread while holding the GIL,
    # and that thread needs the GIL to free a finished sparse allreduce).
    os._exit(0)


def test_ddp_trains_like_one_process_on_the_global_batch(tmp_path):
    steps, world = 5, 2
    ctx = torch.multiprocessing.get_context("spawn")
    files = [str(tmp_path / f"rank{r}.pt") for r in range(world)]
    # Daemons: a rank that hangs fails the test instead of holding the run at exit.
    procs = [ctx.Process(target=_ddp_worker, args=(r, world, str(tmp_path / "init"), steps, files[r]), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0, f"a DDP rank failed (exit code {p.exitcode})"
    results = [torch.load(f) for f in files]
    # Every rank ends with the same table.
    assert torch.equal(results[0]["weight"], results[1]["weight"])

    # One process over the whole batch: DDP averages the ranks' gradients
    # of their half-batch means, which is the gradient of the global mean.
    torch.manual_seed(0)
    model = nn.Sequential(hostembed.Embedding(500, 8), nn.Linear(8, 1))
    opt = hostembed.SparseAdam(list(model[0].parameters()), lr=0.05)
    dense = torch.optim.SGD(model[1].parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    initial = model[0].weight.detach().clone()
    for _ in range(steps):
        loss = model(zipf_ids(500, 64, generator=gen)).pow(2).mean()
        opt.zero_grad()
        dense.zero_grad()
        loss.backward()
        opt.step()
        dense.step()
    assert not torch.equal(initial, model[0].weight), "training changed nothing: nothing was compared"
    # Sums in another order: float32 rounding apart, not more.
    torch.testing.assert_close(results[0]["weight"], model[0].weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["linear"], model[1].weight.detach(), rtol=1e-5, atol=1e-6)


# ---- torch.compile

def test_compile_fullgraph_matches_eager():
    compile_matches_eager("cpu")


def _tied_pair(tied):
    """torch's embedding and output projection, and a copy with the table
    replaced by hostembed's (the tie kept), as a language model has them."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(200, 8), nn.Linear(8, 200, bias=False)
    if tied:
        head.weight = emb.weight
    reference = nn.ModuleDict({"emb": emb, "head": head})
    ours = copy.deepcopy(reference)
    hostembed.replace_embeddings(ours)
    return reference, ours


def _lm_loss(model, ids):
    return F.cross_entropy(model["head"](model["emb"](ids)).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_a_compiled_model_with_a_table_tied_or_not_trains_as_torch_with_no_graph_break(tied, fullgraph):
    """The lookup's backward inside the compiled graph: no graph break
    (inductor has no sparse outputs; a tie would add a sparse and a dense
    gradient in the graph), the gradient accumulated over two backward
    passes as torch's (row-sparse, or dense with the tie), then trained."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    reference, ours = _tied_pair(tied)
    step = torch.compile(_lm_loss, fullgraph=fullgraph)
    gen = torch.Generator().manual_seed(1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, ours)]
    for _ in range(2):
        for _ in range(2):  # accumulated
            ids = torch.randint(0, 200, (4, 6), generator=gen)
            _lm_loss(reference, ids).backward()
            step(ours, ids).backward()
        grad = ours["emb"].weight.grad
        assert grad.is_sparse != tied
        # Inductor's kernels round the tied head's part unlike eager's (by
        # 2e-7 of 0.04 with torch's scalar kernels, ATEN_CPU_CAPABILITY=
        # default); a lost or doubled part would be the gradient's size.
        torch.testing.assert_close(grad.to_dense(), reference["emb"].weight.grad, rtol=1e-5, atol=1e-6)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert (ours["head"].weight is ours["emb"].weight) == tied
    torch.testing.assert_close(ours["emb"].weight.detach(), reference["emb"].weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [dict(padding_idx=3, scale_grad_by_freq=True), dict(dtype=torch.bfloat16)])
def test_a_compiled_lookups_gradient_is_eagers_with_padding_frequency_scaling_and_half_tables(options):
    torch._dynamo.reset()
    tables = []
    for _ in range(2):
        torch.manual_seed(0)
        tables.append(hostembed.Embedding(50, 8, **options))
    head = nn.Linear(8, 1)
    step = torch.compile(lambda emb, ids: head(emb(ids).float()).pow(2).sum())
    ids = torch.tensor([[3, 3, 0, 7], [7, 1, 3, 49]])
    for _ in range(2):
        step(tables[0], ids).backward()
        head(tables[1](ids).float()).pow(2).sum().backward()
    assert torch.equal(tables[0].weight.grad.to_dense(), tables[1].weight.grad.to_dense())


def test_a_compiled_lookups_gradient_goes_to_grad_only_in_a_backward_that_accumulates_it():
    """Compiled, the table's gradient reaches .grad when the backward pass
    ends: not in torch.autograd.grad (which returns gradients), nor in
    backward(inputs=...) without the table; a plain backward the eager one."""
    torch._dynamo.reset()
    _, ours = _tied_pair(False)
    _, eager = _tied_pair(False)
    ids = torch.randint(0, 200, (4, 6), generator=torch.Generator().manual_seed(2))
    loss = torch.compile(_lm_loss)(ours, ids)
    (head,) = torch.autograd.grad(loss, [ours["head"].weight], retain_graph=True)
    assert head.shape == (200, 8) and ours["emb"].weight.grad is None
    loss.backward(inputs=[ours["head"].weight], retain_graph=True)
    assert ours["emb"].weight.grad is None
    loss.backward()
    _lm_loss(eager, ids).backward()
    torch.testing.assert_close(ours["emb"].weight.grad.to_dense(), eager["emb"].weight.grad.to_dense(),
                               rtol=1e-6, atol=1e-7)


# ---- forked workers

def _child(conn, what, emb, captured):
    try:
        if what == "call":
            emb(torch.tensor([1, 2]))
        elif what == "weight":
            emb.weight[torch.tensor([1, 2])].sum().item()
        else:
            captured[torch.tensor([1, 2])].sum().item()
        conn.send(("no error", ""))
    except Exception as exc:  # what the child saw, sent to the test
        conn.send((type(exc).__name__, str(exc)))


@pytest.mark.parametrize("what", ["call", "weight", "captured"])
def test_forked_child_gets_a_clear_error_not_a_crash(what):
    emb = hostembed.Embedding(100, 4)
    captured = emb.weight  # a reference taken before the fork
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, what, emb, captured))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, f"the forked child died (exit code {proc.exitcode})"
    kind, message = parent.recv()
    if what == "captured":
        # Only the module can say why; a raw tensor is at least never read.
        assert kind == "IndexError"
    else:
        assert kind == "RuntimeError"
        assert "not inherited by forked processes" in message and "DataLoader" in message
    # The parent is untouched.
    assert emb(torch.tensor([1])).shape == (1, 4)


def _big_pool_in_child(conn):
    torch.set_num_threads(1)  # torch's own OpenMP ops would hang in a fork (DataLoader workers do this too)
    table = hostembed.EmbeddingBag(50_000, 64, mode="sum")
    ids = torch.randint(0, 50_000, (200_000,))
    out = table(ids, torch.arange(0, 200_000, 4))
    conn.send(out.shape[0])


def test_a_forked_child_runs_the_cores_threaded_loops_after_the_parent_did():
    """The core's loops run on OpenMP's threads, which a fork leaves behind
    in the parent: the child's own tables still work (serially) instead of
    waiting forever for threads that are not there."""
    table = hostembed.EmbeddingBag(50_000, 64, mode="sum")
    ids = torch.randint(0, 50_000, (200_000,))
    table(ids, torch.arange(0, 200_000, 4))  # big enough for the threads
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_big_pool_in_child, args=(child,))
    proc.start()
    proc.join(60)
    if proc.exitcode is None:
        proc.kill()
    assert proc.exitcode == 0, f"the forked child hung or died (exit code {proc.exitcode})"
    assert parent.recv() == 50_000


class _LookupDataset(torch.utils.data.Dataset):
    def __init__(self, emb):
        self.emb = emb

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.emb(torch.tensor([i]))


def test_dataloader_worker_that_looks_up_raises_the_clear_error():
    loader = torch.utils.data.DataLoader(_LookupDataset(hostembed.Embedding(10, 2)), num_workers=2,
                                         multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="not inherited by forked processes"):
        list(loader)


# ---- the weight stays the table

def test_assigning_a_non_contiguous_weight_copies_it_into_the_table():
    emb = hostembed.Embedding(6, 4)
    new = torch.randn(4, 6).t()  # [6, 4], not contiguous
    emb.weight.data = new
    ids = torch.tensor([0, 5, 3])
    assert torch.equal(emb(ids), F.embedding(ids, new))
    assert torch.equal(emb.weight, new) and emb.weight.data_ptr() == emb._table.tensor.data_ptr()


def test_assigning_a_float64_weight_converts_it():
    emb = hostembed.Embedding(6, 4)
    new = torch.randn(6, 4, dtype=torch.float64)
    emb.weight.data = new
    ids = torch.tensor([1, 2])
    assert torch.equal(emb(ids), F.embedding(ids, new.float()))
    assert emb.weight.dtype == torch.float32


def test_assigning_a_new_parameter_keeps_training_in_the_core():
    emb = hostembed.Embedding(6, 4)
    new = torch.randn(6, 4)
    emb.weight = nn.Parameter(new.clone())
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.1)
    ref = nn.Embedding.from_pretrained(new.clone(), freeze=False, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    ids = torch.tensor([1, 4, 4])
    for model, o in ((emb, opt), (ref, ref_opt)):
        model(ids).sum().backward()
        o.step()
    torch.testing.assert_close(emb.weight.detach(), ref.weight.detach(), rtol=0, atol=1e-6)


# torch itself refuses integer data for a weight that requires grad: frozen here.
# Another number of rows is a resize (test_resize_token_embeddings_pattern...).
@pytest.mark.parametrize("bad, frozen", [(torch.randn(6, 5), False), (torch.zeros(6, 4, dtype=torch.long), True)],
                         ids=["width", "integer"])
def test_assigning_what_cannot_be_the_table_is_refused(bad, frozen):
    emb = hostembed.Embedding(6, 4, _freeze=frozen)
    before = emb._table.tensor.clone()
    emb.weight.data = bad
    with pytest.raises(RuntimeError, match=r"keeps its shape \[6, 4\]"):
        emb(torch.tensor([0]))
    assert torch.equal(emb._table.tensor, before), "the table changed"


def test_ops_refuse_a_weight_that_is_not_the_table():
    emb = hostembed.Embedding(6, 4)
    with pytest.raises(RuntimeError, match="is not one"):
        hostembed._core.ops.cpu.embedding_lookup(torch.randn(6, 4), torch.tensor([0]), -1, None, 2.0, False, True)
    assert emb(torch.tensor([0])).shape == (1, 4)  # a live table beside it is unaffected


def test_edited_attributes_do_not_reach_the_core():
    emb = hostembed.Embedding(8, 4, max_norm=1.0)
    emb.num_embeddings = 1 << 26  # the core uses the table's own size
    with pytest.raises(IndexError, match=r"\[0, 8\)"):
        emb(torch.tensor([9]))
    assert emb(torch.tensor([7])).shape == (1, 4)


# ---- sizes

def test_zero_width_table_trains_like_torch():
    ref, ours = pair(5, 0, sparse=True)
    ids = torch.tensor([1, 3, 3])
    for model in (ref, ours):
        out = model(ids)
        assert out.shape == (3, 0)
        out.sum().backward()
    assert ours.weight.grad.shape == ref.weight.grad.shape == (5, 0)
    opt = hostembed.SparseAdam(ours.parameters())
    opt.step()
    assert ours.weight.shape == (5, 0)


def test_impossible_size_is_a_memory_error_with_the_bytes():
    with pytest.raises(MemoryError, match=r"\[4611686018427387904, 4\] float32 table \(73786976294838206464 bytes\)"):
        hostembed.Embedding(2 ** 62, 4)


# ---- copies

def test_deepcopy_gets_its_own_table():
    emb = hostembed.Embedding(10, 3, padding_idx=2)
    twin = copy.deepcopy(emb)
    assert isinstance(twin, hostembed.Embedding) and twin.padding_idx == 2
    assert torch.equal(twin.weight, emb.weight)
    assert twin.weight.data_ptr() != emb.weight.data_ptr()
    with torch.no_grad():
        twin.weight[0] += 1
    assert not torch.equal(twin.weight, emb.weight)
    ids = torch.tensor([0, 9])
    assert torch.equal(twin(ids), F.embedding(ids, twin.weight.detach()))


# ---- replace_embeddings

class CustomBag(nn.EmbeddingBag):
    """A subclass replace_embeddings cannot know how to convert."""


def test_replace_warns_once_per_skipped_module_type():
    model = nn.Sequential(CustomBag(50, 4), CustomBag(60, 4), nn.Embedding(70, 4), nn.EmbeddingBag(80, 4))
    with pytest.warns(UserWarning, match=r"test_dropin.CustomBag modules are not replaced") as seen:
        hostembed.replace_embeddings(model)
    assert len([w for w in seen if "not replaced" in str(w.message)]) == 1
    assert type(model[0]) is CustomBag and type(model[1]) is CustomBag
    assert isinstance(model[2], hostembed.Embedding) and isinstance(model[3], hostembed.EmbeddingBag)


# ---- clipping sparse gradients

def test_clip_grad_norm_of_sparse_and_dense_gradients_matches_dense_torch():
    torch.manual_seed(0)
    emb = hostembed.Embedding(20, 3)
    lin = nn.Linear(3, 2)
    ids = torch.tensor([1, 1, 5, 7])
    lin(emb(ids)).sum().backward()
    emb(torch.tensor([5, 9])).sum().backward()  # a second backward: an uncoalesced gradient
    dense = [emb.weight.grad.to_dense().clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]
    expected_total = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in dense]).double())
    total = hostembed.clip_grad_norm_([emb.weight, *lin.parameters()], max_norm=0.5)
    torch.testing.assert_close(total.double(), expected_total, rtol=1e-6, atol=0)
    scale = 0.5 / (expected_total + 1e-6)
    for got, before in zip([emb.weight.grad.to_dense(), lin.weight.grad, lin.bias.grad], dense):
        torch.testing.assert_close(got.double(), before.double() * scale, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("foreach", [None, False])
def test_torchs_own_clipping_takes_a_sparse_gradient_as_the_dense_one(norm_type, foreach):
    """torch.nn.utils.clip_grad_norm_, get_total_norm and clip_grad_value_
    (as Hugging Face's Trainer calls them) on a plain swap's row-sparse
    gradient, uncoalesced (a row looked up twice, two backward passes):
    the dense gradient's norm and clipped values."""
    torch.manual_seed(0)
    emb, lin = hostembed.Embedding(20, 3), nn.Linear(3, 2)
    lin(emb(torch.tensor([1, 1, 5, 7]))).sum().backward()
    lin(emb(torch.tensor([5, 9, 9]))).pow(2).sum().backward()
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    params = [emb.weight, *lin.parameters()]
    dense = [p.grad.to_dense().double() for p in params]
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in dense]), norm_type)
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, foreach=foreach)
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=0)
    total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type, foreach=foreach)
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=0)
    scale = min(1.0, 0.5 / (float(expected) + 1e-6))
    for p, before in zip(params, dense):
        torch.testing.assert_close(p.grad.to_dense().double(), before * scale, rtol=1e-6, atol=1e-7)
    clipped = [p.grad.to_dense().double() for p in params]
    torch.nn.utils.clip_grad_value_(params, 0.02, foreach=foreach)
    for p, before in zip(params, clipped):
        torch.testing.assert_close(p.grad.to_dense().double(), before.clamp(-0.02, 0.02), rtol=1e-6, atol=1e-7)
    with pytest.raises(NotImplementedError, match="bounds that exclude 0"):
        emb.weight.grad.clamp_min_(0.5)


def test_output_can_be_changed_in_place_like_torch():
    ref, ours = pair(30, 4)
    ids = torch.tensor([[1, 2], [2, 29]])
    pos = torch.randn(2, 4)
    outs = []
    for model in (ref, ours):
        x = model(ids)
        x += pos  # autograd refuses this on a view returned by a Function
        x.sum().backward()
        outs.append(x)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(ours.weight.grad.to_dense(), ref.weight.grad.to_dense())


def test_max_norm_training_step_sorts_the_ids_once(monkeypatch):
    real = hostembed._core.ops.cpu._C.Dedup
    built = []

    def counting(**kwargs):
        built.append(kwargs["count"])
        return real(**kwargs)

    monkeypatch.setattr(hostembed._core.ops.cpu._C, "Dedup", counting)
    ref, ours = pair(50, 4, max_norm=1.0)
    ids = torch.tensor([3, 7, 3, 49])
    for model in (ref, ours):
        model(ids).pow(2).sum().backward()
    assert built == [4], f"the ids were sorted {len(built)} times"
    torch.testing.assert_close(ours.weight.grad.to_dense(), ref.weight.grad.to_dense(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.weight.detach(), ref.weight.detach(), rtol=0, atol=1e-6)


def test_whole_model_torch_save_and_load_gets_a_table(tmp_path):
    model = nn.Sequential(hostembed.Embedding(10, 3, padding_idx=1), nn.Linear(3, 1))
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    emb = loaded[0]
    assert isinstance(emb, hostembed.Embedding) and emb.padding_idx == 1
    assert torch.equal(emb.weight, model[0].weight)
    assert emb._table.views(emb.weight), "the loaded module's weight is not its host table"
    opt = hostembed.SparseAdam(emb.parameters())
    emb(torch.tensor([2, 9])).sum().backward()
    opt.step()
    assert not torch.equal(emb.weight, model[0].weight)


def _resize_as_transformers(old, new_rows, make):
    """transformers' _get_resized_embeddings: a new module (of the class
    nn.Embedding names, hostembed's after a plain swap), its first rows
    copied, then old.weight.data = new.weight.data."""
    new = make(new_rows, old.embedding_dim)
    n = min(old.num_embeddings, new_rows)
    new.weight.data[:n, :] = old.weight.data[:n, :]
    old.weight.data = new.weight.data
    old.num_embeddings = new.weight.data.shape[0]
    return old


@pytest.mark.parametrize("new_rows", [70, 30])
@pytest.mark.parametrize("swapped", [True, False])
def test_resize_token_embeddings_pattern_grows_or_shrinks_the_table_and_keeps_the_tie(new_rows, swapped):
    def build(cls):
        torch.manual_seed(0)
        model = nn.ModuleDict({"emb": cls(50, 6), "head": nn.Linear(6, 50, bias=False)})
        model["head"].weight = model["emb"].weight
        return model

    reference, model = build(nn.Embedding), build(hostembed.Embedding)
    for m, make in ((reference, nn.Embedding), (model, hostembed.Embedding if swapped else nn.Embedding)):
        torch.manual_seed(1)
        _resize_as_transformers(m["emb"], new_rows, make)
        m["head"].weight = m["emb"].weight  # transformers' tie_weights after a resize
    ids = torch.tensor([[0, new_rows - 1, 3], [5, 5, 1]])
    assert torch.equal(model["head"](model["emb"](ids)), reference["head"](reference["emb"](ids)))
    assert model["emb"].weight.shape == (new_rows, 6) and model["emb"]._table.num_rows == new_rows
    assert model["head"].weight is model["emb"].weight
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (reference, model)]
    for _ in range(3):
        for m, opt in zip((reference, model), opts):
            opt.zero_grad()
            m["head"](m["emb"](ids)).logsumexp(-1).sum().backward()
            opt.step()
    torch.testing.assert_close(model["emb"].weight, reference["emb"].weight, rtol=1e-5, atol=1e-6)
    with pytest.raises(IndexError, match=f"not in \\[0, {new_rows}\\)"):
        model["emb"](torch.tensor([new_rows]))


def test_a_table_on_disk_refuses_a_resize_saying_what_to_do(tmp_path):
    emb = hostembed.Embedding(50, 128, storage=tmp_path / "t", cache_rows=8)
    _resize_as_transformers(emb, 60, nn.Embedding)
    with pytest.raises(RuntimeError, match="table kept on disk .* keeps its rows"):
        emb(torch.tensor([1]))
