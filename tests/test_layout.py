"""The package's layers, read from its source: every import points down
(python/hostembed/__init__.py's docstring names the layers), no module
imports a private name from another layer, and no modules import each
other in a circle. Lazy imports inside functions count like the others."""
import ast
import os

import pytest

import hostembed

PACKAGE = os.path.dirname(os.path.abspath(hostembed.__file__))

# Bottom to top; a layer imports only from layers with a lower rank, and
# layers of one rank not from each other.
RANKS = {"_core": 0, "_cache": 1, "io": 1, "nn": 2, "optim": 2, "": 3, "distributed": 3}


def _modules():
    """{module name: path} of every .py file of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                parts = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(["hostembed"] + parts)] = path
    return found


MODULES = _modules()
KNOWN = set(MODULES) | {"hostembed._core._C"}


def layer_of(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(module, path):
    """(target module, names taken from it, line) for each import of a
    hostembed module in `module`'s source, and {local name: module} for the
    names bound to modules."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    edges, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hostembed":
                    edges.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "hostembed":
                continue
            plain = []
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in KNOWN:  # a module, not a name defined in `source`
                    edges.append((target, [], node.lineno))
                    bound[alias.asname or alias.name] = target
                else:
                    plain.append(alias.name)
            if plain:
                edges.append((source, plain, node.lineno))
    return tree, edges, bound


def _graph():
    return {module: _imports(module, path) for module, path in MODULES.items()}


def test_the_layers_are_what_the_test_knows():
    assert {layer_of(m) for m in MODULES} == set(RANKS)


def test_imports_point_down():
    wrong = []
    for module, (_, edges, _) in _graph().items():
        here = layer_of(module)
        for target, _, line in edges:
            there = layer_of(target)
            if there != here and not RANKS[there] < RANKS[here]:
                wrong.append(f"{module}:{line} imports {target} ({there or 'the package'} is not below "
                             f"{here or 'the package'})")
    assert not wrong, "\n".join(wrong)


def test_no_private_name_crosses_a_layer():
    wrong = []
    for module, (tree, edges, bound) in _graph().items():
        here = layer_of(module)
        for target, names, line in edges:
            if layer_of(target) != here:
                wrong += [f"{module}:{line} imports {name} from {target}" for name in names
                          if name.startswith("_")]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and node.value.id in bound \
                    and layer_of(bound[node.value.id]) != here:
                wrong.append(f"{module}:{node.lineno} uses {bound[node.value.id]}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def _circle(graph):
    """A list of modules that import each other in a circle, or None."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in graph.get(module, ()):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_circle():
    graph = {module: sorted({t for t, _, _ in edges if t in MODULES and t != module})
             for module, (_, edges, _) in _graph().items()}
    circle = _circle(graph)
    assert circle is None, "modules importing each other: " + " -> ".join(circle)


@pytest.mark.parametrize("graph, expected", [
    ({"a": ["b"], "b": ["c"], "c": []}, None),
    ({"a": ["b"], "b": ["c"], "c": ["a"]}, ["a", "b", "c", "a"]),
    ({"a": ["b", "c"], "b": [], "c": ["c2"], "c2": ["c"]}, ["c", "c2", "c"]),
])
def test_the_circle_finder_finds_circles(graph, expected):
    assert _circle(graph) == expected
