"""The product's import graph has no circles, and the import-linter contracts hold without
exceptions (no ``ignore_imports``): types sit at the bottom of a package, so helpers import
them, not the class that uses the helpers."""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

PRODUCT = ("schemas", "pipelines", "services")
ROOT = Path(__file__).resolve().parents[2]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each
    sorted; every import counts, also those inside functions or under TYPE_CHECKING."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def test_no_import_cycle_among_product_modules() -> None:
    graph = grimp.build_graph(*PRODUCT, cache_dir=None)
    found = []
    for comp in _cycles(graph):
        a, b = comp[0], comp[1]
        there = graph.find_shortest_chain(importer=a, imported=b) or ()
        back = graph.find_shortest_chain(importer=b, imported=a) or ()
        found.append(" -> ".join([*there, *back[1:]]))
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(m)
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a")):
        graph.add_import(importer=importer, imported=imported)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_import_contracts_have_no_exceptions() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    ignored = {c["name"]: c["ignore_imports"] for c in conf["contracts"] if "ignore_imports" in c}
    assert not ignored, f"contracts with ignore_imports: {ignored}"
