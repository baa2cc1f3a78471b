"""float64 copies for PyTorch reference computations (shared by the GPU tests and their CPU check).

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


def rel(a, ref):
    """Normwise relative error of ``a`` (a result, which must exist and be finite) against ``ref``."""
    import torch

    assert a is not None, "no result"
    a = a.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))
