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
