"""CPU: the package layout holds: every import points down a layer, no import circles, and no
module reaches into another module's private names."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fusekit"

# Layer of each top-level part of the package; a module may import only from its own layer or below.
LAYERS = {
    "config": 0, "errors": 0, "tensors": 0, "adapters": 0, "session": 0, "timing": 0,
    "engine": 1,
    "dispatch": 2,
    "ops": 3,
    "nn": 4, "torch": 4, "pipeline": 4, "viz": 4,
    "cli": 5, "backend": 5,  # the torch.compile backend: over fusekit.torch (training) and fusekit.pipeline (inference)
    "__init__": 6, "__main__": 6,  # `python -m fusekit`: the CLI
}


def _module(path: Path) -> str:
    return ".".join(("fusekit",) + path.relative_to(ROOT).with_suffix("").parts)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported fusekit module, names taken from it) for every import in ``path``, function-level ones too."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("fusekit"):
                names = [a.name for a in node.names]
                if node.module is None or target == "fusekit":  # `from . import x`: x may be a module
                    for n in names:
                        out.append((f"{target}.{n}" if (ROOT / Path(*f"{target}.{n}".split(".")[1:])).exists()
                                    or (ROOT / Path(*f"{target}.{n}".split(".")[1:])).with_suffix(".py").exists() else target, [n]))
                else:
                    out.append((target, names))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("fusekit")]
    return out


FILES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_imports_point_down_and_use_public_names(path):
    here = _part(_module(path))
    for target, names in _imports(path):
        there = _part(target)
        if target == "fusekit" and here != "__init__":
            assert here in ("cli", "pipeline"), f"{path.name}: imports the package root (only the CLI may)"
            continue
        assert LAYERS[there] <= LAYERS[here], f"{_module(path)} imports {target}: up from layer {here} to {there}"
        if there != here:
            private = [n for n in names if n.startswith("_") and n != "__version__"]
            assert not private, f"{_module(path)} takes private names {private} from {target}"


def test_no_import_circles():
    graph: dict[str, set[str]] = {}
    for path in FILES:
        mod = _module(path)
        graph[mod] = {t for t, _ in _imports(path) if t != mod}
    seen: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state = seen.get(m)
        if state == 2:
            return
        assert state != 1, f"import circle: {' -> '.join(stack[stack.index(m):] + [m])}"
        seen[m] = 1
        for n in sorted(graph.get(m, ())):
            if n.startswith(m + "."):  # a package importing its own submodules is not a circle
                continue
            visit(n, stack + [m])
        seen[m] = 2

    for m in sorted(graph):
        visit(m, [])



def test_test_folders_do_not_shadow_modules_the_tests_import():
    """tests/ is on sys.path (its conftest), so a folder there named like a library is a namespace
    package that a failed `import torch` (a machine without PyTorch) silently resolves to."""
    import importlib.util
    import sys

    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    libraries = {"torch", "torchvision", "timm", "numpy", "cupy", "cudnn", "onnx", "onnxruntime", "click", "pytest", "hypothesis",
                 "matplotlib", "nbformat", "nbclient", "platformdirs", "fusekit", "helpers", "examples"}
    assert not folders & libraries, folders & libraries
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != tests]
    for name in folders:  # nor like any other top-level module importable here
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        assert spec is None, f"tests/{name} shadows {spec.origin or spec.submodule_search_locations}"


def _private_uses(path: Path) -> list[str]:
    """``name._x`` where ``name`` is bound to something imported from fusekit, and
    ``setattr(obj, "_x", ...)`` / ``setitem(obj._x, ...)`` forms, in one test or benchmark file."""
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fusekit"):
            aliases.update(a.asname or a.name for a in n.names)
        elif isinstance(n, ast.Import):
            aliases.update((a.asname or a.name).split(".")[0] for a in n.names if a.name.startswith("fusekit"))
        elif isinstance(n, ast.Assign) and "importorskip" in ast.unparse(n.value) and "fusekit" in ast.unparse(n.value):
            aliases.update(t.id for t in n.targets if isinstance(t, ast.Name))
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            root = n.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"{path.name}:{n.lineno}: {ast.unparse(n)}")
        elif (isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("setattr", "delattr") and len(n.args) >= 2
              and isinstance(n.args[1], ast.Constant) and str(n.args[1].value).startswith("_") and not str(n.args[1].value).startswith("__")
              and not (isinstance(n.args[0], ast.Name) and n.args[0].id not in aliases)):
            found.append(f"{path.name}:{n.lineno}: setattr {ast.unparse(n.args[0])}.{n.args[1].value}")
    return found


def test_no_test_probe_or_benchmark_names_a_private_of_fusekit():
    top = ROOT.parent
    files = sorted((top / "tests").rglob("*.py")) + sorted((top / "benchmarks").rglob("*.py"))
    found = [u for p in files for u in _private_uses(p)]
    assert not found, "\n".join(found)


def test_modules_and_functions_stay_small():
    """No module of fusekit over 600 lines and no function over 80: a newcomer reads one job at a time."""
    long_modules = [f"{p.relative_to(ROOT)}: {n}" for p in FILES if (n := len(p.read_text().splitlines())) > 600]
    long_functions = []
    for p in FILES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{p.relative_to(ROOT)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long_modules and not long_functions, long_modules + long_functions


#: Where runtime state may live: the session owner and the adapter registry.
STATE_OWNERS = {"session.py", "adapters.py"}
_MUTATORS = {"append", "add", "update", "pop", "popitem", "setdefault", "clear", "extend", "insert", "remove", "discard"}


def _module_tables(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to a dict, list or set (literal, comprehension or call)."""
    kinds = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    calls = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
    names = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        call = isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) in calls
        if value is not None and (isinstance(value, kinds) or call):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_module_level_tables_are_constants_outside_the_session_owner():
    """Runtime state lives in fusekit.session (and the adapter registry): a module-level dict, list or
    set anywhere else is a constant table, never written (no item assignment, del or mutating call
    on it in its own module)."""
    written = []
    for p in FILES:
        if p.name in STATE_OWNERS and p.parent == ROOT:
            continue
        tree = ast.parse(p.read_text())
        tables = _module_tables(tree) - {"__all__"}
        for node in ast.walk(tree):
            target = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                        target = t.value.id
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                    and isinstance(node.func.value, ast.Name):
                target = node.func.value.id
            if target in tables:
                written.append(f"{p.relative_to(ROOT)}:{node.lineno}: {target}")
    assert not written, "module-level tables written outside fusekit.session:\n" + "\n".join(written)


def test_the_capture_watch_plugin_wraps_names_that_exist():
    """benchmarks/probes/capture_watch.py (the device runs' pytest plugin) wraps fusekit functions by
    name at import: a renamed one would stop the whole GPU suite before it starts."""
    import importlib

    path = ROOT.parent / "benchmarks" / "probes" / "capture_watch.py"
    tree = ast.parse(path.read_text())
    aliases = {a.asname or a.name: a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names if a.name.startswith("fusekit")}
    aliases |= {a.asname or a.name: f"{n.module}.{a.name}" for n in tree.body if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("fusekit") for a in n.names}
    wrapped = [(ast.unparse(c.args[0]), c.args[1].value) for c in ast.walk(tree)
               if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "_wrap"]
    assert wrapped
    for owner, name in wrapped:
        base, *attrs = owner.split(".")
        target = importlib.import_module(aliases[base])
        for a in attrs:
            target = getattr(target, a)
        assert hasattr(target, name), f"capture_watch wraps {owner}.{name}, which does not exist"
