"""The import graph of src/draftsmith, read from the AST (module-level and function-local imports
alike): no cycle, no import running back up the layers of docs/architecture.md, and no stage
importing a sibling stage (STAGES: what two stages share sits a layer below them); inside
speculate/ no cycle either (its files are layers of their own: tree/cache, verifier, proposers,
the loop) and no file reaches into another's private names (`x._verify(...)`, `from .a import _b`);
and no module imports a name it never uses. Nothing is imported or run; the files are parsed.

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
                          "draftsmith.vocab", "draftsmith.train", "draftsmith.evaluate",
                          "draftsmith.export", "draftsmith.plan", "draftsmith.status", "draftsmith.doctor",
                          "draftsmith.probe", "draftsmith.serve", "draftsmith.testing")),
    ("engine", ("draftsmith.speculate",)),
    ("models and formats", ("draftsmith.draft", "draftsmith.target.model", "draftsmith.target.online",
                            "draftsmith.data.shards", "draftsmith.data.batch", "draftsmith.data.readers",
                            "draftsmith.data.template", "draftsmith.data.conversations",
                            # each stage's measured figures (manifests.Figures): the stage writes them, the tools
                            # read them, so they sit below both, beside the other formats
                            "draftsmith.figures")),
    ("foundations", ("draftsmith.config", "draftsmith.messages", "draftsmith.fileio", "draftsmith.manifests",
                     "draftsmith.rundir", "draftsmith.distributed", "draftsmith.costmodel", "draftsmith.compat",
                     "draftsmith.tritonlib")),
]
PACKAGES = ("draftsmith", "draftsmith.data", "draftsmith.target", "draftsmith.draft", "draftsmith.figures")  # namespaces only: no code
TOOLS = ("draftsmith.plan", "draftsmith.status", "draftsmith.doctor")
"""They read manifests and the cost model: they import no stage, no pipeline, no CLI."""
STAGES = ("draftsmith.data.prepare", "draftsmith.data.regenerate", "draftsmith.target.capture", "draftsmith.vocab",
          "draftsmith.train", "draftsmith.evaluate", "draftsmith.export")
"""The stages' modules (a package: all its files): a stage reads another's output from the run
directory, never its code; what two stages share sits a layer below (engine, models and formats)."""
ENGINE = "draftsmith.speculate"
"""The engine's files are one node in the package-wide check; `engine_violations` checks inside it."""


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


def stage_of(mod: str) -> str | None:
    return next((p for p in STAGES if mod == p or mod.startswith(p + ".")), None)


def node(mod: str) -> str:
    return ENGINE if mod == ENGINE or mod.startswith(ENGINE + ".") else mod


def cycles(graph: dict[str, set[str]], collapse=node) -> list[list[str]]:
    """Strongly connected components of more than one node, modules mapped by `collapse` (default:
    speculate/ as one node) (Tarjan)."""
    g: dict[str, set[str]] = {}
    for a, bs in graph.items():
        g.setdefault(collapse(a), set()).update(collapse(b) for b in bs if collapse(b) != collapse(a))
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


def private_reaches(path: Path) -> list[str]:
    """`obj._name` where obj is not self/cls/an imported module and no def or `self._name =` of this
    file defines _name; and `from .mod import _name`. Private names stay in the file that owns them."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, own, out = set(), set(), []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            out += [f"{path.name}:{n.lineno} imports the private {a.name} from {n.module}" for a in n.names
                    if a.name.startswith("_") and not a.name.startswith("__") and n.module != "__future__"]
            modules.update(a.asname or a.name for a in n.names)  # `from torch import nn`: a module or a name
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            own.add(n.attr)
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") and n.attr not in own:
            base = n.value
            if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in modules):
                continue
            out.append(f"{path.name}:{n.lineno} reaches into .{n.attr} of another file's object")
    return out


def engine_violations(src: Path) -> list[str]:
    """Inside speculate/: no import cycle between its files, no private reach across them."""
    graph = imports(src)
    inside = {a: {b for b in bs if node(b) == ENGINE} for a, bs in graph.items() if node(a) == ENGINE}
    out = [f"cycle in speculate/: {' <-> '.join(c)}" for c in cycles(inside, collapse=lambda m: m)]
    for mod, path in module_files(src).items():
        if node(mod) == ENGINE:
            out += [f"speculate/{r}" for r in private_reaches(path)]
    return out


def violations(src: Path) -> list[str]:
    graph = imports(src)
    out = [f"cycle: {' <-> '.join(c)}" for c in cycles(graph)] + engine_violations(src)
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
            elif stage_of(a) and stage_of(b) and stage_of(a) != stage_of(b):
                out.append(f"stage imports a sibling stage: {a} imports {b}")
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


def unused_imports(src: Path) -> list[str]:
    """`FILE:LINE: NAME imported, never used` for each import a module never reads (pyflakes' F401,
    which the project venv does not ship). `import x as x` and names in `__all__` count as
    re-exports; names inside string annotations count as used."""
    out = []
    for mod, path in module_files(src).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported: dict[str, int] = {}
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and not (isinstance(n, ast.ImportFrom) and n.module == "__future__"):
                for a in n.names:
                    if a.name != "*" and a.asname != a.name:
                        imported.setdefault((a.asname or a.name).split(".")[0], n.lineno)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        for n in ast.walk(tree):
            notes = [getattr(n, "annotation", None), getattr(n, "returns", None)]
            for a in notes:
                if isinstance(a, ast.Constant) and isinstance(a.value, str):
                    used |= {x.id for x in ast.walk(ast.parse(a.value, mode="eval")) if isinstance(x, ast.Name)}
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
                used |= {e.value for e in getattr(n.value, "elts", []) if isinstance(e, ast.Constant)}
        rel = path.relative_to(src)
        out += [f"{rel}:{line}: {name} imported, never used" for name, line in imported.items() if name not in used]
    return out


def package(root, files: dict) -> None:
    """A tiny draftsmith package under root: __init__.py and `files` (name -> source)."""
    pkg = root / "draftsmith"
    pkg.mkdir()
    for name, text in {"__init__.py": "", **files}.items():
        (pkg / name).write_text(text)


def test_no_unused_imports():
    found = unused_imports(SRC)
    assert not found, "\n".join(found)


def test_unused_imports_are_found(tmp_path):
    """The checker itself: an unused name is reported, a used one, a re-export and a string annotation are not."""
    package(tmp_path, {"a.py": "from __future__ import annotations\nimport os, json\nfrom .b import best_of, keep, Shown as Shown\n"
                                "from typing import Optional\ndef f(x: 'Optional[int]'):\n    return keep(os.sep)\n"})
    assert unused_imports(tmp_path) == ["draftsmith/a.py:2: json imported, never used", "draftsmith/a.py:3: best_of imported, never used"]


def test_no_cycles_and_no_upward_imports():
    found = violations(SRC)
    assert not found, "\n".join(found)


def test_the_graph_sees_function_local_imports(tmp_path):
    """The checker itself: an import inside a function counts, and a cycle through it is found."""
    package(tmp_path, {"config.py": "def f():\n    from .fileio import x\n", "fileio.py": "from . import config\n",
                       "cli.py": "", "status.py": "def g():\n    from .cli import main\n"})
    found = violations(tmp_path)
    assert "cycle: draftsmith.config <-> draftsmith.fileio" in found
    assert "upward: draftsmith.status (stages and tools) imports draftsmith.cli (cli)" in found


def test_a_stage_importing_a_sibling_stage_is_found(tmp_path):
    """The checker itself: train/ importing evaluate/ is reported; a stage's own files, and a
    stage importing a layer below it, are not."""
    for folder in ("train", "evaluate", "speculate"):
        (tmp_path / "draftsmith" / folder).mkdir(parents=True)
        (tmp_path / "draftsmith" / folder / "__init__.py").write_text("")
    (tmp_path / "draftsmith" / "__init__.py").write_text("")
    (tmp_path / "draftsmith" / "speculate" / "methods.py").write_text("")
    (tmp_path / "draftsmith" / "evaluate" / "stage.py").write_text("from ..speculate import methods\n")
    (tmp_path / "draftsmith" / "train" / "heldout.py").write_text("from ..evaluate.stage import x\nfrom . import loop\n")
    (tmp_path / "draftsmith" / "train" / "loop.py").write_text("from ..speculate.methods import y\n")
    found = [f for f in violations(tmp_path) if f.startswith("stage")]
    assert found == ["stage imports a sibling stage: draftsmith.train.heldout imports draftsmith.evaluate.stage"]


def test_speculate_cycles_and_private_reaches_are_found(tmp_path):
    """The checker on speculate/: a cycle between two of its files (through a function-local import)
    and a call of another file's private method are both reported; a file's own privates are not."""
    spec = tmp_path / "draftsmith" / "speculate"
    spec.mkdir(parents=True)
    for f in ("draftsmith/__init__.py", "draftsmith/speculate/__init__.py"):
        (tmp_path / f).write_text("")
    (spec / "fast.py").write_text("class FastTarget:\n    def _verify(self):\n        return self._keep()\n"
                                  "    def _keep(self):\n        return 1\n"
                                  "def g():\n    from .engine import generate\n")
    (spec / "engine.py").write_text("from .fast import FastTarget\nfrom .fast import _helper\n"
                                    "def generate(ft):\n    return ft._verify()\n")
    found = engine_violations(tmp_path)
    assert "cycle in speculate/: draftsmith.speculate.engine <-> draftsmith.speculate.fast" in found
    assert "speculate/engine.py:4 reaches into ._verify of another file's object" in found
    assert "speculate/engine.py:2 imports the private _helper from fast" in found
    assert not [f for f in found if f.startswith("speculate/fast.py")]


if __name__ == "__main__":
    problems = violations(Path(sys.argv[1]) if len(sys.argv) > 1 else SRC)
    print("\n".join(problems) or "no violations")
    sys.exit(1 if problems else 0)
