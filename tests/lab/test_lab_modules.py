"""The lab's modules form no import circle and use only each other's public names."""

import ast
from pathlib import Path

import attnscale.lab

LAB = Path(attnscale.lab.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(LAB.glob("*.py")) if p.stem != "__init__"}


def _lab_imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(lab module, names imported from it) for every import of a sibling module, however nested."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.append((node.module.split(".")[0], [a.name for a in node.names]))
            else:  # from . import a, b
                found += [(a.name, []) for a in node.names]
    return found


def test_no_import_circles():
    modules = _modules()
    graph = {name: {m for m, _ in _lab_imports(tree) if m in modules} for name, tree in modules.items()}

    def cycle_from(start, node, path):
        for nxt in graph[node]:
            if nxt == start:
                return [*path, nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, [*path, nxt])
                if found:
                    return found
        return None

    for name in graph:
        assert cycle_from(name, name, [name]) is None, " -> ".join(cycle_from(name, name, [name]))


def test_no_private_names_across_modules():
    modules = _modules()
    for name, tree in modules.items():
        siblings = {alias for m, _ in _lab_imports(tree) for alias in [m] if m in modules}
        for module, names in _lab_imports(tree):
            assert not [n for n in names if n.startswith("_")], f"{name} imports private names from {module}: {names}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in siblings:
                assert not node.attr.startswith("_"), f"{name} uses {node.value.id}.{node.attr}"
