"""The Python fuzz targets (fuzz/fuzz_files.py, fuzz/fuzz_loads.py) run
briefly on their seed corpora: no finding. (The C core's libFuzzer target
runs in test_core_sanitized.py.) Long runs: see fuzz/README.md."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SECONDS = int(os.environ.get("HOSTEMBED_FUZZ_SECONDS", "12"))

try:
    import atheris  # noqa: F401
    MISSING = None
except ImportError as exc:
    MISSING = f"atheris is not installed ({exc}); pip install '.[test]'"


@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
@pytest.mark.parametrize("target", ["files", "loads"])
def test_fuzz_target_finds_nothing(target, tmp_path):
    res = subprocess.run(
        [sys.executable, str(REPO / "fuzz" / f"fuzz_{target}.py"), str(REPO / "fuzz" / "corpus" / target),
         f"-max_total_time={SECONDS}", f"-artifact_prefix={tmp_path}/", "-print_final_stats=1"],
        cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 240,
    )
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"fuzz_{target} reported a finding (exit {res.returncode}):\n{tail}"
    assert "stat::number_of_executed_units" in res.stderr, f"fuzz_{target} did not run:\n{tail}"
    assert not any(p.name.startswith(("crash-", "timeout-", "oom-")) for p in tmp_path.iterdir()), tail
