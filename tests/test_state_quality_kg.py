"""benchmarks/clients/state_quality.py's knowledge-graph case: its filtered MRR
against a loop over the definition, its skip where PyKEEN is missing, and
a --quick run where PyKEEN is installed."""
import importlib.util
import json
import math
import pathlib
import random

import pytest
import torch
from torch import nn

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def sq(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS / "clients"))
    import state_quality
    return state_quality


def graph_task(sq, folder, seed):
    """A KGTask over a random small graph written to folder."""
    rng = random.Random(seed)
    triples = sorted({(f"e{rng.randrange(9)}", f"r{rng.randrange(3)}", f"e{rng.randrange(9)}") for _ in range(60)})
    rng.shuffle(triples)
    for name, part in (("train", triples[:40]), ("valid", triples[40:45]), ("test", triples[45:])):
        (folder / f"{name}.txt").write_text("".join("\t".join(t) + "\n" for t in part))
    task = sq.KGTask("umls", 1)
    task.folder, task.unavailable, task._splits, task.dim = str(folder), None, None, 4
    return task


def loop_mrr(task, model):
    """Filtered MRR by the definition: for each test triple, its tail and
    its head query; the other known triples left out; a tie counts half."""
    splits = task.splits()
    known = {tuple(t) for s in splits.values() for t in s.tolist()}
    ent, rel = model.entities.weight.detach().double(), model.relations.weight.detach().double()

    def score(h, r, t):
        return float((ent[h] * rel[r] * ent[t]).sum())

    reciprocal = []
    for h, r, t in splits["test"].tolist():
        for side in ("tail", "head"):
            answer = t if side == "tail" else h
            true = score(h, r, t)
            higher = ties = 0
            for e in range(task.num_entities):
                cand = (h, r, e) if side == "tail" else (e, r, t)
                if e == answer or cand in known:
                    continue
                s = score(*cand)
                higher += s > true
                ties += s == true
            reciprocal.append(1 / (1 + higher + ties / 2))
    return sum(reciprocal) / len(reciprocal)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filtered_mrr_matches_the_definition(sq, tmp_path, seed):
    task = graph_task(sq, tmp_path, seed)
    task.pool(64)
    model = task.model(lambda rows, dim, bag=False: nn.Embedding(rows, dim, dtype=torch.float64), seed)
    if seed == 2:  # ties: every entity the same but two
        with torch.no_grad():
            model.entities.weight[2:] = model.entities.weight[2]
    got = task.evaluate(model, tuple(task.splits()["test"].unbind(1)), None)
    assert math.isclose(got, loop_mrr(task, model), rel_tol=1e-12)


def test_pool_negatives_differ_from_the_triple(sq, tmp_path):
    task = graph_task(sq, tmp_path, 0)
    (h, r, t, neg_h, neg_t), *_ = task.pool(500)
    assert h.numel() == 500
    assert bool(((neg_h != h) ^ (neg_t != t)).all())  # exactly one side replaced, by another entity


def test_after_step_keeps_entities_at_unit_norm(sq, tmp_path):
    task = graph_task(sq, tmp_path, 0)
    model = task.model(lambda rows, dim, bag=False: nn.Embedding(rows, dim), 0)
    with torch.no_grad():
        model.entities.weight.mul_(3)
    task.after_step(model)
    assert torch.allclose(model.entities.weight.norm(dim=1), torch.ones(task.num_entities))


def test_skips_where_pykeen_is_missing(sq, monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pykeen" else real(name, *a))
    task = sq.KGTask("umls", 1)
    assert "PyKEEN is not installed" in task.unavailable and task.steps == 0
    monkeypatch.setitem(sq.TASKS, "kg_umls", task)
    sq.main(["--quick", "--models", "kg_umls", "--forms", "fp32", "--threads", "1",
             "--out-json", str(tmp_path / "r.json"), "--out-png", str(tmp_path / "r.png")])
    assert "kg_umls skipped: PyKEEN is not installed" in capsys.readouterr().err
    assert json.loads((tmp_path / "r.json").read_text())["models"] == {}


@pytest.mark.skipif(importlib.util.find_spec("pykeen") is None, reason="PyKEEN is not installed")
def test_quick_run_on_nations(sq, tmp_path):
    sq.main(["--quick", "--models", "kg_nations", "--forms", "fp32,rowwise", "--threads", "1", "--kg-diagnostics",
             "--out-json", str(tmp_path / "r.json"), "--out-png", str(tmp_path / "r.png")])
    runs = json.loads((tmp_path / "r.json").read_text())["models"]["kg_nations"]
    assert 0 < runs["fp32"]["metric_mean"] <= 1 and "delta" in runs["rowwise"]
