"""Every CUDA source fusekit ships compiles with NVRTC for sm_90, as CuPy compiles it on the GPU, for
every storage dtype: NVRTC needs no GPU, so a kernel that would not build (and take every pooling
kernel of its module with it) fails here, on the CPU. Skipped where no NVRTC library is installed."""

import ctypes
import glob
import itertools
import os
import site

import pytest

from fusekit.ops import pool


def _nvrtc():
    """NVRTC from an installed NVIDIA wheel (nvidia/cu13, nvidia/cuda_nvrtc), with its builtins loaded first."""
    roots = site.getsitepackages() + [site.getusersitepackages()]
    for root in roots:
        for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so.*"))):
            if ".alt." in lib:
                continue
            builtins = sorted(glob.glob(os.path.join(os.path.dirname(lib), "libnvrtc-builtins.so.*")))
            try:
                for b in builtins:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(lib)
            except OSError:
                continue
    pytest.skip("no NVRTC library installed (an nvidia-cuda-nvrtc wheel) to compile the kernels without a GPU")


def _compile(lib, source: str, name: str) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) == 0
    opts = (ctypes.c_char_p * 1)(b"--gpu-architecture=compute_90")
    rc = lib.nvrtcCompileProgram(prog, 1, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


@pytest.fixture(scope="module")
def nvrtc():
    return _nvrtc()


@pytest.mark.parametrize("dtype", pool.FLOAT_DTYPES)
def test_pool_kernels_compile_for_sm90(nvrtc, dtype):
    rc, log = _compile(nvrtc, pool.kernel_source(dtype), f"pool_{dtype}.cu")
    assert rc == 0 and "warning" not in log.lower(), log[-3000:]


@pytest.mark.parametrize("dtypes", list(itertools.product(pool.FLOAT_DTYPES, repeat=2)), ids=str)
def test_fold_batchnorm_kernel_compiles_for_sm90(nvrtc, dtypes):
    """The fold's module as ops.norm.fold_batchnorm builds it: w, b, the BN vectors and the output each
    with a storage type of its own (here w and the output vary)."""
    w, o = dtypes
    src = "".join(pool.dtype_prelude(d, s) for d, s in zip((w, w, "float32", o), ("_w", "_b", "_p", "_o"))) + pool.kernel_file("fold_batchnorm.cu")
    rc, log = _compile(nvrtc, src, "fold_batchnorm.cu")
    assert rc == 0 and "warning" not in log.lower(), log[-3000:]
