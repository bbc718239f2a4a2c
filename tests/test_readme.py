"""The README's usage example, and the prefetch example of the training
scripts guide, do what they say (tests/test_docs.py runs every example)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
TRAINING_SCRIPTS = README.parent / "docs" / "guides" / "training-scripts.md"


def test_usage_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace = {}
    exec(compile(blocks[0], "README.md example", "exec"), namespace)
    emb = namespace["emb"]
    assert namespace["opt"].state[emb.weight]["step"] == 10


def test_prefetch_example_runs_and_takes_every_prefetch(monkeypatch):
    # tests/test_docs.py runs every example; this one also checks that each
    # lookup after the first took the rows prefetched for it.
    import hostembed

    blocks = re.findall(r"```python\n(.*?)```", TRAINING_SCRIPTS.read_text(), flags=re.S)
    example = next(b for b in blocks if ".prefetch(" in b)
    outcomes = []
    forward = hostembed.Embedding.forward

    def recording(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        outcomes.append(self._table.prefetch_outcome)
        return out

    monkeypatch.setattr(hostembed.Embedding, "forward", recording)
    namespace = {}
    exec(compile(example, "training-scripts.md prefetch example", "exec"), namespace)
    assert namespace["opt"].state[namespace["emb"].weight]["step"] == 4
    assert len(outcomes) == 4 and outcomes[0] is None and all(o.startswith("taken") for o in outcomes[1:]), outcomes
