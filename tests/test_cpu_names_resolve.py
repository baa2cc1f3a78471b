"""Every global name a fusekit function reads exists in its module (or builtins): a name lost in an
edit fails here on the CPU instead of at the first GPU call."""

from __future__ import annotations

import builtins
import dis
import importlib
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


@pytest.mark.parametrize("path", sorted(__import__("pathlib").Path(__file__).parent.glob("*.py")), ids=lambda p: p.name)
def test_test_modules_read_only_names_they_define(path):
    assert not _undefined_in_source(path), _undefined_in_source(path)
