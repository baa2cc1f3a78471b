"""Every global name a fusekit function reads exists in its module (or builtins): a name lost in an
edit fails here on the CPU instead of at the first GPU call."""

from __future__ import annotations

import builtins
import dis
import importlib
import importlib.util
import pkgutil
import types

import pytest

import fusekit


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(fusekit.__path__, "fusekit.") if not m.name.endswith("__main__"))


def _code_objects(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


def _globals_read(mod: types.ModuleType) -> set[str]:
    names: set[str] = set()
    for obj in list(vars(mod).values()):
        funcs = []
        if isinstance(obj, types.FunctionType) and obj.__module__ == mod.__name__:
            funcs.append(obj)
        elif isinstance(obj, type) and obj.__module__ == mod.__name__:
            funcs += [f for f in vars(obj).values() if isinstance(f, types.FunctionType)]
            funcs += [f.fget for f in vars(obj).values() if isinstance(f, property) and f.fget is not None]
            funcs += [f.__func__ for f in vars(obj).values() if isinstance(f, (staticmethod, classmethod))]
        for f in funcs:
            if f.__globals__ is not vars(mod):  # made elsewhere (dataclass methods, decorators' wrappers)
                continue
            for code in _code_objects(f.__code__):
                names |= {ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"}
    return names


@pytest.mark.parametrize("name", _modules())
def test_global_names_resolve(name):
    try:
        mod = importlib.import_module(name)
    except ImportError as e:  # an optional dependency (PyTorch, ONNX) this machine lacks
        pytest.skip(f"{name} needs {e.name}")
    missing = sorted(n for n in _globals_read(mod) if n not in vars(mod) and not hasattr(builtins, n))
    assert not missing, f"{name} reads undefined globals: {missing}"


TESTS = __import__("pathlib").Path(__file__).resolve().parent
TEST_FILES = sorted(TESTS.rglob("*.py"))


def _undefined_in_source(path):
    """Global names the functions of a source file read that the file never defines (static: the
    GPU tests cannot be imported without a GPU library)."""
    import symtable

    top = symtable.symtable(path.read_text(), str(path), "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()} | {"__file__"}
    missing = set()

    def walk(t):
        for s in t.get_symbols():
            if s.is_global() and s.is_referenced() and s.get_name() not in defined and not hasattr(builtins, s.get_name()):
                missing.add(f"{t.get_name()}: {s.get_name()}")
        for c in t.get_children():
            walk(c)

    for c in top.get_children():
        walk(c)
    return sorted(missing)


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_test_modules_read_only_names_they_define(path):
    assert not _undefined_in_source(path), _undefined_in_source(path)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent that is a plain module, or an optional dependency this machine lacks
        return False


def _fusekit_bindings(body) -> dict[str, str]:
    """Names the statements ``body`` import as fusekit modules (``from fusekit.ops import pool`` -> pool)."""
    import ast

    out: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name.split(".")[0]): (a.name if a.asname else a.name.split(".")[0])
                    for a in node.names if a.name.startswith("fusekit")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusekit"):
            out |= {(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and isinstance(node.value, ast.Call) and getattr(node.value.func, "attr", getattr(node.value.func, "id", "")) == "importorskip"
              and node.value.args and isinstance(node.value.args[0], ast.Constant) and str(node.value.args[0].value).startswith("fusekit")):
            out[node.targets[0].id] = node.value.args[0].value  # ft = pytest.importorskip("fusekit.torch")
    return out


def _missing_module_attributes(path) -> list[str]:
    """``module.name`` reads in a test file whose fusekit module has no such attribute: the file's
    imports, or a function's own (a name the function assigns is its own, not the module)."""
    import ast

    tree = ast.parse(path.read_text())
    scopes = [(tree, _fusekit_bindings(tree.body))]
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own = {n.id for n in ast.walk(f) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            own |= {a.arg for a in ast.walk(f.args) if isinstance(a, ast.arg)}
            scopes.append((f, {k: v for k, v in {**scopes[0][1], **_fusekit_bindings(ast.walk(f))}.items() if k not in own}))
    missing = set()
    for scope, bound in scopes:
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                try:
                    mod = importlib.import_module(bound[node.value.id])
                except ImportError:  # an optional dependency this machine lacks
                    continue
                if not hasattr(mod, node.attr) and not _is_module(f"{mod.__name__}.{node.attr}"):
                    missing.add(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return sorted(missing)


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_test_modules_read_only_attributes_fusekit_has(path):
    assert not _missing_module_attributes(path)


def _code_strings(path) -> list[tuple[int, str]]:
    """String constants of a test file that are Python programs run in a child process (f-strings,
    whose pieces are not programs alone, are left out)."""
    import ast
    import re

    tree = ast.parse(path.read_text())
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in pieces and n.value.count("\n") > 1
            and re.search(r"^\s*(import|from) [\w.]+( import|,|\s*$)", n.value, re.M)]


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_child_programs_in_test_modules_compile(path):
    import textwrap

    for line, src in _code_strings(path):
        try:
            compile(textwrap.dedent(src), f"{path.name}:{line}", "exec")
        except SyntaxError as e:
            pytest.fail(f"the program at {path.name} line {line} does not compile: {e}")
