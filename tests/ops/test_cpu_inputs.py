"""CPU: what a new user meets first with the Python API on a machine without a GPU: host arrays
given to ops, fusekit.nhwc on a wrong rank, and the CuPy / PyTorch modules without their library."""

from __future__ import annotations

import importlib
import re
import sys

import numpy as np
import pytest

import fusekit
from fusekit.errors import OperandError

X = np.zeros((2, 3, 4, 4), np.float32)
C = np.ones(3, np.float32)


@pytest.mark.parametrize(
    "op, args, operand",
    [
        ("bn_normalize", (X,), "x"),
        ("bn_normalize_backward", (X, X, C, C), "x"),
        ("batchnorm", (X, C, C), "x"),  # no running statistics: the normalize-only path
        ("fold_batchnorm", (np.zeros((8, 3, 3, 3), np.float32), None, C, C, C, C), "w"),
        ("affine_identity", (X,), "x"),
    ],
)
def test_host_array_names_the_op_and_operand(op, args, operand):
    """A NumPy array is refused naming the op and its operand, like every other op (not 'array')."""
    with pytest.raises(OperandError, match=rf"^{op}: operand '{operand}': expected a CUDA device array, got a NumPy array") as ei:
        getattr(fusekit.ops, op)(*args)
    assert ei.value.pattern == op and ei.value.operand == operand


def test_host_array_error_matches_the_other_ops():
    with pytest.raises(OperandError, match=r"^conv_bias_relu: operand 'x': ") as ei:
        fusekit.ops.conv_bias_relu(X, np.zeros((8, 3, 3, 3), np.float32), np.zeros(8, np.float32))
    with pytest.raises(OperandError) as ei2:
        fusekit.ops.bn_normalize(X)
    assert str(ei2.value).split(": ", 2)[2] == str(ei.value).split(": ", 2)[2]


@pytest.mark.parametrize("shape", [(2, 4, 4), (4,), (1, 2, 3, 4, 5)])
def test_nhwc_needs_a_4d_array(shape):
    with pytest.raises(OperandError, match=rf"nhwc: operand 'a': expected a 4-D \(N, H, W, C\) array, got shape {re.escape(str(shape))}"):
        fusekit.nhwc(np.zeros(shape))


def test_nhwc_needs_an_array():
    with pytest.raises(OperandError, match=r"expected a 4-D \(N, H, W, C\) array, got builtins\.list"):
        fusekit.nhwc([1, 2, 3, 4])


def test_nhwc_views_4d_arrays():
    a = np.arange(2 * 5 * 6 * 3).reshape(2, 5, 6, 3)
    v = fusekit.nhwc(a)
    assert v.shape == (2, 3, 5, 6) and np.shares_memory(v, a)
    np.testing.assert_array_equal(v[1, 2], a[1, :, :, 2])
    torch = pytest.importorskip("torch")
    assert tuple(fusekit.nhwc(torch.zeros(2, 5, 6, 3)).shape) == (2, 3, 5, 6)


def _fresh_import(monkeypatch, module: str, missing: str):
    """Import ``module`` anew with ``missing`` made unimportable (None in sys.modules); monkeypatch
    restores both entries afterwards."""
    monkeypatch.setitem(sys.modules, missing, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    return importlib.import_module(module)


@pytest.mark.parametrize(
    "module, missing, extras",
    [
        ("fusekit.nn", "cupy", ("fusekit[cu12]", "fusekit[cu13]")),
        ("fusekit.torch", "torch", ("fusekit[torch]",)),
    ],
)
def test_import_without_the_array_library_says_which_extra(monkeypatch, module, missing, extras):
    had = sys.modules.get(module)
    with pytest.raises(ImportError) as ei:
        _fresh_import(monkeypatch, module, missing)
    assert isinstance(ei.value, ModuleNotFoundError)  # still what `except ImportError` / ModuleNotFoundError catch
    assert ei.value.name == missing
    msg = str(ei.value)
    assert msg.startswith(f"{module} needs ") and "is not installed" in msg
    for extra in extras:
        assert extra in msg
    assert ei.value.__cause__ is None and ei.value.__suppress_context__
    monkeypatch.undo()
    assert sys.modules.get(module) is had  # restored for the other tests


def test_import_with_a_broken_library_is_an_import_error(monkeypatch):
    """A library that is installed but fails to import: ImportError (not ModuleNotFoundError), saying so."""

    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "cupy":
                raise ImportError("libcudart.so.12: cannot open shared object file", name="cupy")
            return None

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.delitem(sys.modules, "fusekit.nn", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with pytest.raises(ImportError, match=r"fusekit.nn needs CuPy, which failed to import \(libcudart") as ei:
        importlib.import_module("fusekit.nn")
    assert not isinstance(ei.value, ModuleNotFoundError)


def test_modules_import_when_the_libraries_are_there(monkeypatch):
    for module, lib in (("fusekit.nn", "cupy"), ("fusekit.torch", "torch")):
        pytest.importorskip(lib)
        attr = module.split(".")[1]
        monkeypatch.setattr(fusekit, attr, getattr(fusekit, attr, None), raising=False)  # the fresh import rebinds it
        monkeypatch.delitem(sys.modules, module, raising=False)
        assert hasattr(importlib.import_module(module), "__file__")
