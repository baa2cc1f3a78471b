"""The tests' shared helpers: float64 copies for PyTorch reference computations, random data, and
the relative error every numerical check uses.

``t.double().contiguous()`` is not an NCHW copy in general: torch ignores the strides of size-1
dims when it decides that a tensor is contiguous, so ``.contiguous()`` returns the tensor as it is,
yet its kernels pick a memory format from all the strides (``suggest_memory_format``). A CuPy NHWC
buffer viewed as (N, C, H, W) (``fusekit.nhwc``) has stride 1 on C; with C = 1 (or H = W = 1) it is
"contiguous" for torch and still channels-last to its kernels, so a reference computed from it runs
through torch's channels-last kernels, among them the CUDA avg_pool2d backward that drops the
padding offset (pytorch/pytorch#188344). A torch ``channels_last`` tensor with C = 1 does not show
this: ``.contiguous(memory_format=torch.channels_last)`` leaves its NCHW strides alone.
"""


def float64_nchw(t):
    """A float64 copy of torch tensor ``t`` with the canonical row-major (NCHW) strides of its
    shape, size-1 dims included, so that torch computes on it in its contiguous memory format."""
    import torch

    return torch.empty(tuple(t.shape), dtype=torch.float64, device=t.device).copy_(t.detach())


def rnd(shape, dtype, cl=False, scale=1.0):
    """Standard-normal CUDA data times ``scale``, rounded to ``dtype`` (a name), channels-last with ``cl``."""
    import torch

    t = (torch.randn(shape, device="cuda") * scale).to(getattr(torch, dtype))
    return t.contiguous(memory_format=torch.channels_last) if cl and t.dim() == 4 else t


def host64(a):
    """``a`` (a torch tensor, a CuPy or a NumPy array) as a float64 NumPy array on the host."""
    import numpy as np

    if hasattr(a, "detach"):  # torch, any device and dtype
        import torch

        return a.detach().to(device="cpu", dtype=torch.float64).numpy()
    if hasattr(a, "get") and hasattr(a, "__cuda_array_interface__"):  # CuPy
        return np.asarray(a.get(), dtype=np.float64)
    return np.asarray(a, dtype=np.float64)


def rel(a, ref):
    """Normwise relative error of ``a`` (a result, which must exist and be finite) against ``ref``;
    either may be a torch tensor, a CuPy or a NumPy array (compared in float64 on the host)."""
    import numpy as np

    assert a is not None, "no result"
    a, ref = host64(a), host64(ref)
    assert np.isfinite(a).all(), "non-finite values"
    return float(np.linalg.norm(a - ref) / max(float(np.linalg.norm(ref)), 1e-30))


def rel_max(a, ref):
    """Largest absolute difference of ``a`` from ``ref`` relative to ``ref``'s largest magnitude (host arrays)."""
    import numpy as np

    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-300))


def as_module(fn):
    """A parameter-free torch module around a function (a reference activation after a layer)."""
    import torch

    class Fn(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    return Fn()


def with_fallback(c_in, c_mid, c_out):
    """A small CNN around ops fusekit has no pattern for (cumsum, then a scale), with a skip
    connection crossing them and a pooled head: what the backend cuts into fused segments and a
    fallback between them."""
    import torch

    class WithFallback(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = torch.nn.Conv2d(c_in, c_mid, 3, padding=1), torch.nn.BatchNorm2d(c_mid)
            self.c2, self.c3 = torch.nn.Conv2d(c_mid, c_mid, 3, padding=1), torch.nn.Conv2d(c_mid, c_out, 1)

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            z = torch.cumsum(y, dim=1) * (1.0 / c_mid)
            return self.c3(torch.relu(self.c2(z) + y)).mean((2, 3))

    return WithFallback()
