"""The house's rules, read from the source: no import cycle in certrag/ (imports inside functions included), data
flows one way (no stage imports the engine, the faces, the evaluation harness or the training wing), retrieval knows
nothing of answering, and `import certrag` with its public names loads no torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "certrag"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Python modules by name, with the compiled core (a leaf: it imports nothing of certrag)."""
    modules = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {**modules, "certrag._core": None}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every certrag module the file imports, anywhere in it (top level, functions, methods)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from a.b import c` imports the module a.b.c when there is one, else the name c of a.b
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import certrag.x.y` -> the deepest module that exists
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, set(modules)) if path else set() for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle_hidden_inside_a_function(tmp_path):
    pkg = tmp_path / "certrag"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from certrag.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    (pkg / "c.py").write_text("import certrag.a\n")
    known = {"certrag", "certrag.sub", "certrag.a", "certrag.sub.b", "certrag.c"}
    paths = {"certrag.a": pkg / "a.py", "certrag.sub.b": pkg / "sub" / "b.py", "certrag.c": pkg / "c.py"}
    g = {n: _imports(p, n, known) for n, p in paths.items()}
    assert g == {"certrag.a": {"certrag.sub.b"}, "certrag.sub.b": {"certrag.a"}, "certrag.c": {"certrag.a"}}
    assert _cycles(g) == [["certrag.a", "certrag.sub.b"]]


def test_no_import_cycle_in_the_package(graph):
    assert len(graph) > 30  # the walk saw the package
    assert _cycles(graph) == []


FACES_AND_HARNESSES = ("certrag.cli", "certrag.serve", "certrag.eval", "certrag.train", "certrag.integrations",
                       "certrag.scale")
ABOVE_THE_STAGES = ("certrag.engine", *FACES_AND_HARNESSES)


def _in(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_no_stage_imports_the_engine_a_face_the_harness_or_the_training_wing(graph):
    stages = [m for m in graph if m != "certrag" and not _in(m, ABOVE_THE_STAGES)]
    assert "certrag.retrieval" in stages and "certrag.certify.conformal" in stages
    bad = {m: sorted(t for t in graph[m] if _in(t, ABOVE_THE_STAGES)) for m in stages}
    assert {m: t for m, t in bad.items() if t} == {}
    # the engine composes stages; it does not import a face, the harness or training either
    assert not [t for t in graph["certrag.engine"] if _in(t, FACES_AND_HARNESSES)]


def test_retrieval_knows_nothing_of_answering(graph):
    retrieval = ("certrag.retrieval", "certrag.index", "certrag.store", "certrag.embed", "certrag.rerank",
                 "certrag.select", "certrag.segment", "certrag.documents")
    answering = ("certrag.answering", "certrag.strategies", "certrag.llm", "certrag.certify")
    bad = {m: sorted(t for t in graph[m] if _in(t, answering)) for m in graph if _in(m, retrieval)}
    assert {m: t for m, t in bad.items() if t} == {}


@pytest.mark.slow  # starts a subprocess
def test_the_public_names_load_without_torch():
    code = ("import sys, certrag\n"
            "for name in certrag.__all__:\n"
            "    if name not in ('Embedder', 'CrossEncoderReranker', 'LocalLLM', 'Segmenter', 'SegmenterHead'):\n"
            "        getattr(certrag, name)\n"
            "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    import certrag

    assert certrag.Engine.__module__ == "certrag.engine" and certrag.EngineConfig.__module__ == "certrag.config"
    assert certrag.Answer.__module__ == "certrag.answering"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        certrag.Nope  # noqa: B018


def test_the_native_stub_names_what_the_compiled_core_has():
    """certrag/_core.pyi against the compiled module: the same functions, classes, methods and properties."""
    from certrag import _core

    stub = ast.parse((PACKAGE / "_core.pyi").read_text())

    def public(names) -> set[str]:
        return {n for n in names if not n.startswith("_") or n == "__init__"}

    declared = {}
    for node in stub.body:
        if isinstance(node, ast.ClassDef):
            declared[node.name] = public(f.name for f in node.body if isinstance(f, ast.FunctionDef))
        elif isinstance(node, ast.FunctionDef):
            declared[node.name] = None
    compiled = {}
    for name in public(dir(_core)):
        obj = getattr(_core, name)
        if isinstance(obj, type):
            own = set(vars(obj)) if not issubclass(obj, BaseException) else set()
            compiled[name] = public(own) if own else set()
        elif callable(obj):
            compiled[name] = None
    assert declared == compiled


def _private_reads(files: dict[str, str]) -> list[str]:
    """Reads of another certrag module's underscore names: `from certrag.x import _y` (the compiled core, a module
    named _core, aside), and `obj._y` / getattr(obj, "_y") on anything but self or cls where _y is defined
    (assigned, a def or a class) in some other module of the package and not in the reading one. Names the package
    never defines (torch's, the standard library's) are not certrag's to police here."""
    trees = {name: ast.parse(text) for name, text in files.items()}

    def defined(tree) -> set[str]:
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
        return out

    own = {name: defined(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        elsewhere = set().union(*(v for k, v in own.items() if k != name)) - own[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("certrag"):
                found += [f"{name}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_core"]
            attr, target = None, None
            if isinstance(node, ast.Attribute):
                attr, target = node.attr, node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                attr, target = node.args[1].value, node.args[0]
            if (attr and attr.startswith("_") and not attr.startswith("__") and attr in elsewhere
                    and not (isinstance(target, ast.Name) and target.id in ("self", "cls"))):
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_private_read_finder_finds_one_across_modules():
    files = {"certrag/a.py": "class A:\n    def __init__(self):\n        self._x = 1\n",
             "certrag/b.py": "from certrag.a import _helper\ndef f(a):\n    return a._x + getattr(a, '_x')\n",
             "certrag/c.py": "import torch\ndef g():\n    return torch._int_mm\n"}
    assert _private_reads(files) == ["certrag/b.py:1 from certrag.a import _helper", "certrag/b.py:3 a._x",
                                     "certrag/b.py:3 getattr(a, '_x')"]


def test_no_module_reads_another_modules_private_names():
    files = {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(files) > 30
    assert _private_reads(files) == []
