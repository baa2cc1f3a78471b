"""fusekit's CuPy kernels as a stage's alternative to its cuDNN graph (fusekit.pipeline.runtime times
each against the graph and PyTorch's kernel per stage): a depthwise convolution, and the per-channel
pointwise stages (a scale-shift, a lone or residual activation, a squeeze-excitation gate)."""

from __future__ import annotations

from typing import Any, Callable

from .ir import Stage, extra_padding

__all__ = ["channelwise_kernel", "depthwise_kernel"]

#: The stages ops.channelwise runs.
CHANNELWISE_PATTERNS = ("channel_scale_shift_act", "act", "add_act", "channel_gate")


def _dense_images(*ts: Any) -> bool:
    import torch

    return all(t.dim() == 4 and (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)) for t in ts)


def depthwise_kernel(s: Stage, x: Any, y: Any, device: Any) -> Callable[[], None] | None:
    """A depthwise conv stage (one filter per channel) as fusekit's CuPy kernel, its filter as
    float32 taps from the float64 weights (x and y may be channel slices: a chunk, a concatenation's
    part); None for another conv."""
    import torch

    from ..ops import depthwise

    w64, c = s.weights["w"], int(x.shape[1])
    if int(s.attrs.get("groups", 1)) != c or tuple(w64.shape[:2]) != (c, 1) or int(y.shape[1]) != c:
        return None
    taps = depthwise.depthwise_taps(torch.as_tensor(w64, dtype=torch.float32, device=device))
    b = None if s.weights.get("b") is None else torch.as_tensor(s.weights["b"], dtype=torch.float32, device=device)
    act, alpha = s.attrs.get("act") or ("identity", 0.0)
    conv = {k: tuple(int(e) for e in s.attrs[k]) for k in ("padding", "stride", "dilation")}
    return lambda: depthwise.depthwise_conv2d(x, taps, b, activation=act, alpha=float(alpha), extra_padding=extra_padding(s), out=y, **conv)


def channelwise_kernel(s: Stage, operands: tuple, attrs: dict[str, Any], y: Any) -> Callable[[], None] | None:
    """A per-channel pointwise stage on its fused operands (ir.fused_operands) as fusekit's CuPy kernel
    (ops.channelwise); None for another stage, or operands that are not dense images."""
    from ..ops import channelwise

    if s.pattern not in CHANNELWISE_PATTERNS:
        return None
    x, act = operands[0], {k: attrs[k] for k in ("activation", "alpha") if k in attrs}
    if not _dense_images(x, y, *operands[1:2] if s.pattern in ("add_act", "channel_gate") else ()):
        return None
    if s.pattern == "channel_gate":
        gate = operands[1]
        return None if tuple(gate.shape) != (x.shape[0], x.shape[1], 1, 1) else lambda: channelwise.gate(x, gate, out=y)
    if s.pattern == "add_act":
        z = operands[1]
        return None if z.shape != x.shape else lambda: channelwise.pointwise(x, z=z, out=y, **act)
    if s.pattern == "act":
        return lambda: channelwise.pointwise(x, out=y, **act)
    g, b = (t.reshape(-1).float().contiguous() for t in operands[1:3])
    return lambda: channelwise.pointwise(x, g, b, out=y, **act)
