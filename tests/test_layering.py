"""The import graph of src/draftsmith, read from the AST (module-level and function-local imports
alike): no cycle outside speculate/, and no import running back up the layers of
docs/architecture.md. Nothing is imported or run; the files are parsed.

    python tests/test_layering.py [SRC]    # prints the violations of another tree (e.g. /work/main/src)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Top first. A module belongs to the layer of its longest matching prefix; it may import its own
# layer and the layers below it, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("draftsmith.cli",)),
    ("pipeline and stage table", ("draftsmith.pipeline", "draftsmith.stages")),
    ("stages and tools", ("draftsmith.data.prepare", "draftsmith.data.regenerate", "draftsmith.target.capture",
                          "draftsmith.target.online", "draftsmith.vocab", "draftsmith.train", "draftsmith.evaluate",
                          "draftsmith.export", "draftsmith.plan", "draftsmith.status", "draftsmith.doctor",
                          "draftsmith.probe", "draftsmith.serve", "draftsmith.testing")),
    ("engine", ("draftsmith.speculate",)),
    ("models and formats", ("draftsmith.draft", "draftsmith.target.model", "draftsmith.data.shards",
                            "draftsmith.data.batch", "draftsmith.data.readers", "draftsmith.data.template")),
    ("foundations", ("draftsmith.config", "draftsmith.artifacts", "draftsmith.distributed", "draftsmith.costmodel",
                     "draftsmith.compat")),
]
PACKAGES = ("draftsmith", "draftsmith.data", "draftsmith.target", "draftsmith.draft")  # namespaces only: no code
TOOLS = ("draftsmith.plan", "draftsmith.status", "draftsmith.doctor")
"""They read manifests and the cost model: they import no stage, no pipeline, no CLI."""
ENGINE = "draftsmith.speculate"
"""The engine's own files are one node here (their cycle belongs to the engine's issue)."""


def module_files(src: Path) -> dict[str, Path]:
    out = {}
    for p in sorted((src / "draftsmith").rglob("*.py")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(src: Path) -> dict[str, set[str]]:
    """module -> the draftsmith modules it imports, anywhere in the file."""
    files = module_files(src)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from pkg import name`: name is a submodule or an attribute of pkg
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # `import a.b.c` of an attribute path: its module
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def layer_of(mod: str) -> int:
    best, where = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, where = len(p), i
    if where is None:
        raise AssertionError(f"{mod}: in no layer of tests/test_layering.py; add it to LAYERS (and docs/architecture.md)")
    return where


def node(mod: str) -> str:
    return ENGINE if mod == ENGINE or mod.startswith(ENGINE + ".") else mod


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node, speculate/ collapsed to one node (Tarjan)."""
    g: dict[str, set[str]] = {}
    for a, bs in graph.items():
        g.setdefault(node(a), set()).update(node(b) for b in bs if node(b) != node(a))
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def violations(src: Path) -> list[str]:
    graph = imports(src)
    out = [f"cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    for a in sorted(graph):
        if a in PACKAGES:
            continue
        for b in sorted(graph[a]):
            if b in PACKAGES:
                continue
            if layer_of(b) < layer_of(a):
                out.append(f"upward: {a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})")
            elif a in TOOLS and layer_of(b) == layer_of(a) and b not in TOOLS:
                out.append(f"tool imports a stage: {a} imports {b}")
            elif a.startswith("draftsmith.draft.") and layer_of(b) == layer_of(a) and not b.startswith("draftsmith.draft."):
                out.append(f"draft/ is not self-contained: {a} imports {b}")
            elif a.startswith("draftsmith.target.") and b.startswith("draftsmith.train."):
                out.append(f"target/ feeds train/, never the reverse: {a} imports {b}")
    for a in sorted(graph):
        if a in PACKAGES and graph[a]:
            out.append(f"{a}: a namespace package with imports ({sorted(graph[a])})")
    model = module_files(src).get("draftsmith.draft.model")
    if model is not None:
        text = model.read_text(encoding="utf-8")
        if "artifacts" in text or "safetensors" in text:
            out.append("draftsmith.draft.model does file I/O (artifacts/safetensors); that belongs in draft/io.py")
    return out


def test_no_cycles_and_no_upward_imports():
    found = violations(SRC)
    assert not found, "\n".join(found)


def test_the_graph_sees_function_local_imports(tmp_path):
    """The checker itself: an import inside a function counts, and a cycle through it is found."""
    pkg = tmp_path / "draftsmith"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from .artifacts import x\n")
    (pkg / "artifacts.py").write_text("from . import config\n")
    (pkg / "cli.py").write_text("")
    (pkg / "status.py").write_text("def g():\n    from .cli import main\n")
    found = violations(tmp_path)
    assert "cycle: draftsmith.artifacts <-> draftsmith.config" in found
    assert "upward: draftsmith.status (stages and tools) imports draftsmith.cli (cli)" in found


if __name__ == "__main__":
    problems = violations(Path(sys.argv[1]) if len(sys.argv) > 1 else SRC)
    print("\n".join(problems) or "no violations")
    sys.exit(1 if problems else 0)
