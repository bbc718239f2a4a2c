"""Every table of docs/results.md, collected from the benchmark groups: each
benchmarks/<group>/_tables.py declares TABLES (name -> Table) for the
rows its group's benchmarks write, so a new benchmark's table lives beside
it and appears on the page once its marker is there."""
import glob
import importlib.util
import os
import sys

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(path):
    """A group's _tables.py as a module of its own name (every group's file
    is called _tables), with its group's folder importable while it loads
    (a definition may use its group's helpers, as cache/'s uses the oracles)."""
    group = os.path.basename(os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(f"_tables_{group.lstrip('_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
    return module


def collect(root=BENCHMARKS):
    """name -> (Table, the file declaring it); a name declared twice is an error."""
    found = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "_tables.py"))):
        for name, table in _load(path).TABLES.items():
            if name in found:
                raise ValueError(f"table {name} is declared in {found[name][1]} and {path}")
            found[name] = (table, os.path.relpath(path, root))
    return found


DECLARED = collect()
TABLES = {name: table for name, (table, _) in DECLARED.items()}
