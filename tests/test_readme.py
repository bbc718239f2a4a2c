"""The README's usage example runs as written."""
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_usage_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace = {}
    exec(compile(blocks[0], "README.md example", "exec"), namespace)
    emb = namespace["emb"]
    assert namespace["opt"].state[emb.weight]["step"] == 10


def test_load_and_save_example_runs(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    import hostembed

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "hostembed.save(" in b)
    monkeypatch.chdir(tmp_path)
    vectors = torch.randn(50, 8)
    save_file({"embeddings": vectors, "other": torch.zeros(2)}, "vectors.safetensors")
    model = torch.nn.Sequential(hostembed.Embedding(30, 8), torch.nn.Linear(8, 1))
    sparse_opt = hostembed.SparseAdam(model[0].parameters())
    dense_opt = torch.optim.Adam(model[1].parameters())
    namespace = {"hostembed": hostembed, "model": model, "sparse_opt": sparse_opt, "dense_opt": dense_opt,
                 "epoch": 4}
    exec(compile(example, "README.md load/save example", "exec"), namespace)
    assert torch.equal(namespace["emb"].weight, vectors)
    assert namespace["extra"] == {"epoch": 4}


def test_prefetch_example_runs_and_takes_every_prefetch():
    import torch

    import hostembed

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if ".prefetch(" in b)
    torch.manual_seed(0)
    emb = hostembed.Embedding(100_000, 8)
    head = torch.nn.Linear(8, 1)
    opt = hostembed.SparseAdam(emb.parameters(), lr=0.01, fused=True)
    loader = [(torch.randint(0, 100_000, (32,)), torch.randn(32, 1)) for _ in range(6)]
    outcomes = []

    class Model(torch.nn.Module):
        def forward(self, rows):
            outcomes.append(emb._table.prefetch_outcome)
            return head(rows)

    namespace = {"emb": emb, "loader": loader, "model": Model(), "opt": opt,
                 "loss_fn": torch.nn.functional.mse_loss}
    exec(compile(example, "README.md prefetch example", "exec"), namespace)
    assert opt.state[emb.weight]["step"] == 5
    assert outcomes[0] is None and all(o.startswith("taken") for o in outcomes[1:]), outcomes


def test_table_on_disk_example_runs(tmp_path):
    import torch

    import hostembed

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "storage=" in b)
    # The example's sizes, shrunk; its directory, a temporary one.
    example = example.replace("500_000_000", "2_000").replace('"/nvme/items"', repr(str(tmp_path / "items")))
    example = example.replace('"32GiB"', '"256KiB"')
    namespace = {"hostembed": hostembed}
    torch.manual_seed(0)
    exec(compile(example, "README.md table on disk example", "exec"), namespace)
    torch.manual_seed(0)
    in_memory = hostembed.Embedding(2_000, 128)  # the same draws: the rows the example made, flushed and opened
    assert torch.equal(namespace["emb"].weight, in_memory.weight)
