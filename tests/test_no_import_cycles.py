"""Contract: the project's packages import each other in one direction only. No module of sglang_sparse,
radix_sparse or flashinfer_ext is reachable from itself through imports, counting imports inside functions
(a deferred import is still a dependency), and radix_sparse / flashinfer_ext never import sglang_sparse."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sglang_sparse", "radix_sparse", "flashinfer_ext")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            parts = f.relative_to(REPO).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges = {m: set() for m in mods}
    for m, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = m.split(".") if is_pkg else m.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                    if target in mods and target != m:
                        edges[m].add(target)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    assert _cycles(_edges(_modules())) == []


def test_lower_packages_do_not_import_sglang_sparse():
    edges = _edges(_modules())
    up = {m: sorted(t for t in ts if t.startswith("sglang_sparse"))
          for m, ts in edges.items() if not m.startswith("sglang_sparse")}
    assert {m: t for m, t in up.items() if t} == {}


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
