"""The shape of the package, checked: imports go one way through its
layers, no module imports another's private name, modules stay small, one
place swaps a module's class, and the code carries no lab diary."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_streaming"
ROOT = PACKAGE.parent
TESTS = ROOT / "tests"

# Each unit (a top-level module or subpackage) may import from its own layer
# and those before it, never from a later one.
LAYERS = [
    {"errors", "config", "config_doc", "system", "cli", "flags", "supported",
     "mlx_lm_adapter", "version"},
    {"format"},
    {"models"},
    {"io"},
    {"conversion"},
    {"hub"},
    {"runtime"},
    {"decode"},
    {"generate", "server", "check", "convert", "demo", "testing", "bench", "sharded", "__init__",
     "__main__", "predict"},
]
MAX_LINES = 450
# Tables of model families, long by nature.
LONG_MODULES = {"testing/families.py"}
# Stop numbers, sessions and the code names of measured models belong in
# docs/results.md, not in the code.
DIARY = re.compile(r"\b(stop \d+|this stop|a later stop|earlier session|this session|"
                   r"T2|T8|T12|TW|TW12|S3|models? T|--model T\b|T/(?:mlx|stream))")


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _unit(module: str) -> str:
    """The top-level unit of a dotted module name inside the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts)


def _imports(path: Path):
    """``(line, imported module, names)`` of every import in ``path``,
    relative ones resolved, lazy ones (inside functions) included."""
    module = _name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if path.name == "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            if not node.module and node.level:
                # ``from . import x``: x is a module of the package.
                for n in names:
                    yield node.lineno, f"{target}.{n}", []
            else:
                yield node.lineno, target, names


def _layer(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"unit {unit!r} is in no layer of tests/test_house.py")


def test_imports_go_one_way_through_the_layers():
    wrong = []
    for path in _modules():
        unit = _unit(_name(path))
        for line, target, _ in _imports(path):
            if not target.startswith("mlx_streaming.") or target == "mlx_streaming._ext":
                continue
            other = _unit(target)
            if other != unit and _layer(other) > _layer(unit):
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_module_imports_another_modules_private_name():
    private = []
    for path in _modules():
        for line, target, names in _imports(path):
            if not target.startswith("mlx_streaming"):
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__") and n != "_ext":
                    private.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}.{n}")
            if re.search(r"\._[a-z]", target.replace("mlx_streaming._ext", "")):
                private.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
    assert not private, "\n".join(private)


def test_modules_stay_small():
    long = [f"{p.relative_to(PACKAGE)}: {n} lines" for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES
            and str(p.relative_to(PACKAGE)) not in LONG_MODULES]
    assert not long, "\n".join(long)


def test_one_place_swaps_a_modules_class():
    swaps = [str(p.relative_to(PACKAGE)) for p in _modules()
             if re.search(r"(?<!\])\.__class__ = ", p.read_text())]
    assert swaps == ["runtime/wrap.py"], swaps


def _comments_and_docstrings(path: Path):
    text = path.read_text()
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.lineno if hasattr(node, "lineno") else 1, doc
    for i, line in enumerate(text.splitlines(), 1):
        if "#" in line:
            yield i, line[line.index("#"):]


@pytest.mark.parametrize("path", _modules() + sorted((ROOT / "scripts").glob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_lab_diary_in_the_code(path):
    found = []
    for line, text in _comments_and_docstrings(path):
        found += [f"{line}: {m.group(0)!r}" for m in DIARY.finditer(text)]
    assert not found, f"{path.relative_to(ROOT)} mentions " + ", ".join(found)


def test_every_test_asserts():
    """A test checks something: an assert, an expected error or warning, or a
    helper that asserts (``check_*``, ``assert_*``)."""
    empty = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                src = ast.unparse(node)
                if not re.search(r"\bassert\b|raises|warns|\bcheck_\w+\(|\bassert_\w+\(", src):
                    empty.append(f"{path.relative_to(TESTS)}::{node.name}")
    assert not empty, "tests that assert nothing: " + ", ".join(empty)


def test_every_subpackage_says_what_it_is():
    """Each ``__init__.py`` opens with a docstring naming what its
    subpackage holds."""
    silent = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")
              if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not silent, f"no docstring: {silent}"


def test_module_names_are_unique():
    """One name per idea: no two modules of the package share a file name
    (a package's __init__ and __main__ aside)."""
    names = [p.name for p in _modules() if p.name not in ("__init__.py", "__main__.py")]
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, repeated
