"""The staged network in NumPy float64 on the host: fusekit stages through ``fusekit.engine.oracle``,
pooling and softmax through the oracle's references, the rest in NumPy or (fallbacks)
PyTorch float64 on the CPU. What the CPU tests check the rewrites with."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..engine import oracle
from .ir import (FUSEKIT_PATTERNS, Program, Stage, concat_parts, from_pixel_rows, fused_operands, pool_options,
                 run_torch_stage)


def evaluate_stage(s: Stage, env: dict[str, np.ndarray]) -> np.ndarray:
    xs = [env[n] for n in s.inputs]
    p = s.pattern
    if p in FUSEKIT_PATTERNS:
        ops, attrs = fused_operands(s, env, s.weights)
        y = oracle.evaluate(p, *ops, **attrs)[0]
        return from_pixel_rows(y, s.out_shape) if p == "layernorm" or p.startswith("batched_matmul") else y
    if p == "max_pool2d":
        return oracle.max_pool2d_reference(xs[0], s.attrs["kernel_size"], s.attrs["stride"], s.attrs["padding"], **pool_options(s))[0]
    if p == "avg_pool2d":
        return oracle.avg_pool2d_reference(xs[0], s.attrs["kernel_size"], s.attrs["stride"], s.attrs["padding"], **pool_options(s))
    if p == "softmax":
        return oracle.softmax_reference(xs[0], s.attrs["axis"])
    if p == "radix_softmax":
        return oracle.radix_softmax_reference(xs[0], s.attrs["radix"], s.attrs["cardinality"])
    if p == "upsample_nearest2d":
        return oracle.upsample_nearest2d_reference(xs[0], s.attrs["scale"])
    if p == "channel_shuffle":
        return oracle.channel_shuffle_reference(xs[0], s.attrs["groups"])
    if p == "reshape":
        return xs[0].reshape(s.out_shape)
    if p == "concat":
        return np.concatenate([env[n] for n in concat_parts(s)], axis=1)
    if p == "channel_slice":
        first = int(s.attrs["channel_slice"])
        return xs[0][:, first:first + s.out_shape[1]]
    if p == "torch":
        import torch

        fn = s.fn
        if isinstance(fn, torch.nn.Module):
            fn = copy.deepcopy(fn).double()
        tenv = {n: torch.from_numpy(np.ascontiguousarray(env[n], dtype=np.float64)) for n in s.inputs}
        y = run_torch_stage(s, tenv, fn, {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in s.weights.items()},
                            dtype=torch.float64)
        return y.detach().numpy().astype(np.float64)
    raise ValueError(f"pipeline reference: stage {s.name} has no pattern (lower the program first)")


def evaluate(prog: Program, x: Any, keep: bool = False) -> Any:
    """The program's output for ``x`` (NCHW, any array NumPy takes), in float64; with ``keep``,
    every value's array (dict name -> array)."""
    env = {prog.input: np.asarray(x, dtype=np.float64)}
    for s in prog.stages:
        y = evaluate_stage(s, env)
        if tuple(y.shape) != tuple(s.out_shape):
            raise AssertionError(f"stage {s.name}: reference gave shape {y.shape}, the plan says {s.out_shape}")
        env[s.output] = y
    return env if keep else env[prog.output]
