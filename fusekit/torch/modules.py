"""Drop-in ``torch.nn`` modules over the autograd Functions (same constructor arguments, parameters,
buffers and state-dict keys as their ``torch.nn`` counterparts)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import config
from ..engine.folding import bn_scale_shift, fold_into_conv
from ..engine.patterns import conv_out_size
from ..errors import OperandError
from ..ops.common import ACTIVATIONS, module_activation
from . import common
from .common import ADDED, _act_of, already_done, _apply_epilogue, _epilogue, _cast, _check_act, _dense, _explicit_padding, _f32, hand_on, is_dense, _like, _mark_relu_output, _needs_grad, padded_for_conv, relu_output_clip, _tag, tagged, _version, _zero_bias
from .functions import BatchNormAct, ConvBiasAct, ConvTransposeBiasAct, LinearBiasAct, ScaleShiftAct, _AddReLU, _AvgPool, _MaxPool, _ReLUFn, _Softmax

F = torch.nn.functional

class FusekitModule:
    """Marker and defaults of the fusekit.torch modules. ``_fk_bn`` / ``_fk_relu``: the module whose
    work this one does too (set by :func:`convert`, never registered as submodules)."""

    _fk_bn: Any = None
    _fk_relu: Any = None
    _fk_drelu = False  # (convolutions) every call's input is a ReLU output used only by this module
    _fk_epilogue: tuple[str, float] | None = None  # an activation the module's own ReLU graphs do not compute
    _fk_after: Any = None  # (set by convert) the activation module (SiLU, Hardswish, ...) whose work this one does too
    activation: Any = None

    def _fk_setup(self) -> None:
        """Check the torch attributes and set fusekit's (also run on a torch module :func:`convert` re-classes)."""

    def train(self, mode: bool = True) -> Any:
        self.__dict__.pop("_fk_memo", None)  # .train() / .eval() recompute what eval reuses (see _memo)
        return super().train(mode)  # type: ignore[misc]

    def _memo(self, fn: Any, tensors: tuple, extra: tuple = (), fast: Any = None) -> Any:
        """A value computed from ``tensors`` (eval's folded weights): ``fn()`` (differentiable) at every
        call when autograd needs it; ``fast()`` (default ``fn``; the same value without autograd) at every
        call while a CUDA graph is being captured (each replay computes it again from the tensors as they
        are then); else ``fast()`` once, reused while ``tensors`` are the same objects at the same
        addresses and versions. An in-place write through ``.data`` (which PyTorch's version counters do
        not count) is seen after the next ``.train()`` / ``.eval()``."""
        if _needs_grad(*tensors):
            return fn()
        fast = fast or fn
        if tensors[-1].is_cuda and torch.cuda.is_current_stream_capturing():  # (the last: a tensor, never None)
            return fast()
        key = (extra, tuple(None if t is None else (t.data_ptr(), _version(t)) for t in tensors))
        memo = self.__dict__.get("_fk_memo")
        if memo is not None and memo[0] == key and all(a is b for a, b in zip(memo[1], tensors)):
            return memo[2]
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, usable outside inference_mode too
            value = fast()
        self.__dict__["_fk_memo"] = (key, tensors, value)
        return value

    def _fk_done(self) -> tuple:
        """The modules whose work this one's output already holds (its linked ReLU or activation module)."""
        return tuple(m for m in (self._fk_relu, self._fk_after) if m is not None)

    def _fk_followers(self) -> str:
        bn = self._fk_bn
        chain = ([bn, *bn._fk_done()] if bn is not None else []) + list(self._fk_done())
        return ", fused with " + " -> ".join(type(m).__name__ for m in chain) if chain else ""

    def _fk_repr(self, base: str) -> str:
        act = f", activation={self.activation!r}" if self.activation else ""
        return base + act + self._fk_followers()


class FusekitActModule(FusekitModule):
    """A fusekit module over a torch layer with an optional fused activation: ``"relu"`` / ``"relu6"``
    (forward and backward graphs where the module has them), or any of ``silu``, ``gelu``, ``gelu_tanh``,
    ``sigmoid``, ``tanh``, ``hardswish``, ``hardsigmoid``, ``leaky_relu``, ``elu`` (``(name, alpha)`` for
    the last two): fused into the forward graph where autograd records nothing (inference), else the
    layer's graph then PyTorch's activation, whose backward autograd runs."""

    def __init__(self, *args: Any, activation: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fk_setup(activation)

    def extra_repr(self) -> str:
        return self._fk_repr(super().extra_repr())

    def _fk_fuses(self, ep: tuple[str, float] | None, *tensors: Any) -> bool:
        """Whether epilogue ``ep`` runs inside the layer's forward graph: where autograd records nothing,
        not for the activations cuDNN lowers with scalar constants (hardsigmoid, ELU with alpha != 1:
        wrong values or refused plans; benchmarks/NOTES.md, "Wrong results"), and hardswish only in
        Conv2d (its graph takes hardswish's constants as channel operands)."""
        if ep is None or _needs_grad(*tensors) or ep[0] == "hardsigmoid" or (ep[0] == "elu" and ep[1] != 1.0):
            return False
        return ep[0] != "hardswish" or isinstance(self, torch.nn.Conv2d)

    def _fk_ep(self) -> tuple[str, float] | None:
        """The activation beyond the ReLU graphs this layer ends with: its own, or that of the activation
        module it does the work of (set by convert)."""
        return self._fk_epilogue if self._fk_after is None else module_activation(self._fk_after)

    def _fk_set_activation(self, activation: Any, who: str, graphs: tuple[str, ...] = ("relu", "relu6")) -> None:
        """Check and set ``activation``; one the module's own ReLU ``graphs`` lack becomes its epilogue."""
        self._fk_epilogue = _epilogue(activation, who, graphs)
        self.activation = activation

    def _torch_forward(self, x: Any, *args: Any) -> Any:
        """The torch layer's own forward, then the activation: CPU tensors, tracing, what cuDNN cannot run."""
        y = super().forward(x, *args)
        if self._fk_epilogue is not None:
            return _apply_epilogue(y, self._fk_epilogue)
        return F.relu6(y) if self.activation == "relu6" else F.relu(y) if self.activation == "relu" else y

    def _fk_act(self) -> str | None:
        """The ReLU this module's graph ends with: its own, or that of the ReLU / ReLU6 module it does
        the work of (set by convert); None for another activation (Conv2d's epilogues)."""
        if self._fk_relu is not None:
            return _act_of(self._fk_relu)
        return None if self._fk_epilogue is not None else self.activation


class Conv2d(FusekitActModule, torch.nn.Conv2d):
    """torch.nn.Conv2d as a fused cuDNN graph, with an optional fused activation (FusekitActModule's;
    a batch norm folded in eval brings its own).

    Takes every torch argument cuDNN can run: ``bias=False``, ``groups`` (grouped and depthwise),
    ``padding`` as ints, "valid" or "same" (an odd total "same" padding pads the input's last row /
    column first, as PyTorch). ``padding_mode`` "reflect", "replicate" and "circular" pad the input
    with ``F.pad`` and convolve unpadded, as PyTorch does."""

    def _fk_setup(self, activation: Any = None) -> None:  # type: ignore[override]
        self._fk_set_activation(activation, "fusekit.torch.Conv2d")
        if self.padding_mode == "zeros":
            self._fk_pad, self._fk_extra = _explicit_padding(self.padding, self.kernel_size, self.dilation)
        else:  # cuDNN pads with zeros only: the input is padded first (torch.nn.Conv2d's own route), the conv pads nothing
            pad = tuple(int(p) for p in self._reversed_padding_repeated_twice)
            self._fk_pad, self._fk_extra = (0, 0), (pad if any(pad) else None)

    def _folded(self, bn: torch.nn.BatchNorm2d, dtype: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(w', b') in ``dtype`` with conv(x, w') + b' = bn(conv(x, w) + b) for ``bn`` in eval mode,
        computed in float32: differentiable at every call when autograd needs it (gradients reach the
        conv's and BN's parameters as in PyTorch), else by common.ops.fold_batchnorm (one kernel) at every call
        inside a CUDA-graph capture or once while the tensors are unchanged (_memo)."""

        def fold() -> tuple[torch.Tensor, torch.Tensor]:
            scale, shift = bn._scale_shift()  # bn(y) = y * scale + shift
            w, b = fold_into_conv(_f32(self.weight), None if self.bias is None else _f32(self.bias), scale, shift)
            return w.to(dtype), b.to(dtype)

        def kernel() -> tuple[torch.Tensor, torch.Tensor]:
            gamma, beta = (bn.weight, bn.bias) if bn.affine else (None, None)
            if len({t.dtype for t in (bn.running_mean, bn.running_var, gamma, beta) if t is not None}) > 1:
                return fold()  # the kernel takes the BN vectors in one dtype
            return common.ops.fold_batchnorm(self.weight, self.bias, bn.running_mean, bn.running_var, gamma, beta, bn.eps,
                                      dtype=str(dtype).removeprefix("torch."))

        return self._memo(fold, (self.weight, self.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var), (dtype, bn.eps, bn), kernel)

    def _out_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The output shape of this conv on (padded) ``x``."""
        hw = (conv_out_size(int(x.shape[2 + i]), self.kernel_size[i], self._fk_pad[i], self.stride[i], self.dilation[i]) for i in range(2))
        return (int(x.shape[0]), self.out_channels, *hw)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """conv(x) [+ the fused BN / ReLU work]. ``residual``: what :func:`convert`'s rewrite of a
        residual block end passes when this conv's BN is then called as bn(y, residual); in eval
        without autograd the conv, the folded BN, the add and the ReLU run as one graph (else unused)."""
        if not common.on_graphs(x, "Conv2d"):
            return self._torch_forward(x)
        amp = common.amp_dtype()
        x = _cast(_dense(x, "Conv2d"), amp)
        act, ep = self._fk_act(), self._fk_ep()
        bn = self._fk_bn
        folded = bn is not None and not bn.training and bn.running_mean is not None and bn.running_var is not None
        if folded:
            w, b = self._folded(bn, x.dtype)  # eval: BN folded into this conv's weights and bias
            act, ep = bn._fk_act(), bn._fk_ep()
            done = (bn, *bn._fk_done())
        else:
            w, b = _cast(self.weight, amp), _cast(self.bias, amp)
            done = self._fk_done()
        if self._fk_extra is not None:
            x = padded_for_conv(x, self._fk_extra, "constant" if self.padding_mode == "zeros" else self.padding_mode)
        if (folded and act is None and ep is None and residual is not None and common.on_graphs(residual, "Conv2d") and residual.shape == self._out_shape(x)
                and not _needs_grad(x, w, b, residual)):
            z = _like(_cast(_dense(residual, "Conv2d"), x.dtype), x)
            y = common.ops.conv_bias_add_relu(x, w, b, z, padding=self._fk_pad, stride=self.stride, dilation=self.dilation, groups=self.groups)
            return hand_on(_tag(_mark_relu_output(y), ADDED, id(residual)), done)
        input_clip = relu_output_clip(x) if self._fk_drelu else None
        if ep is not None:  # the conv's own or a folded BN's (convert links nothing to a conv with an activation)
            if self._fk_fuses(ep, x, w, b):
                y = common.ops.conv_bias_act(x, w, b, activation=ep[0], alpha=ep[1], padding=self._fk_pad, stride=self.stride,
                                             dilation=self.dilation, groups=self.groups)
                return hand_on(y, done)
            y = ConvBiasAct.apply(x, w, b, self._fk_pad, self.stride, self.dilation, self.groups, None, input_clip)
            return hand_on(_apply_epilogue(y, ep), done)
        y = ConvBiasAct.apply(x, w, b, self._fk_pad, self.stride, self.dilation, self.groups, act, input_clip)
        return hand_on(y if act is None else _mark_relu_output(y, ACTIVATIONS[act]), done)


class ConvTranspose2d(FusekitActModule, torch.nn.ConvTranspose2d):
    """torch.nn.ConvTranspose2d as cuDNN dgrad-as-forward (``bias=False`` and ``groups`` too), with an
    optional fused activation (ReLU's backward fused too); ``output_size`` in forward works as in PyTorch."""

    def _fk_setup(self, activation: Any = None) -> None:  # type: ignore[override]
        self._fk_set_activation(activation, "fusekit.torch.ConvTranspose2d", ("relu",))
        if self.padding_mode != "zeros":
            raise OperandError("fusekit.torch.ConvTranspose2d", "padding_mode", "only 'zeros' is supported", what="argument")

    def forward(self, x: torch.Tensor, output_size: Any = None) -> torch.Tensor:  # type: ignore[override]
        if not common.on_graphs(x, "ConvTranspose2d"):
            return self._torch_forward(x, output_size)
        amp = common.amp_dtype()
        x = _cast(_dense(x, "ConvTranspose2d"), amp)
        op = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 2, self.dilation)  # type: ignore[arg-type]
        relu, done, ep = self.activation == "relu" or self._fk_relu is not None, self._fk_done(), self._fk_ep()
        w, b = _cast(self.weight, amp), _cast(self.bias, amp)
        if self._fk_fuses(ep, x, w, b):  # inference: one graph with the activation
            bias = b if b is not None else _zero_bias(int(w.shape[1]) * self.groups, x)
            return hand_on(common.ops.conv_transpose_bias_act(x, _like(w, x), bias, activation=ep[0], alpha=ep[1], padding=self.padding, stride=self.stride,
                                                      dilation=self.dilation, output_padding=tuple(op), groups=self.groups), done)
        y = ConvTransposeBiasAct.apply(x, w, b, self.padding, self.stride, self.dilation, tuple(op), self.groups, "relu" if relu else None)
        return hand_on(y if ep is None else _apply_epilogue(y, ep), done)


class Linear(FusekitActModule, torch.nn.Linear):
    """torch.nn.Linear as a fused cuDNN matmul graph (inputs of any rank >= 1, ``bias=False`` too),
    with an optional fused activation (ReLU's backward fused too). Float32 under a numerics policy that keeps matmuls IEEE (the default,
    as PyTorch's) runs PyTorch's own linear: cuDNN 9.19 has no IEEE float32 matmul plan, and its TF32
    one is ~3e-4 off float64 where PyTorch's is ~1e-7 (float16 / bfloat16 and autocast run cuDNN)."""

    def _fk_setup(self, activation: Any = None) -> None:  # type: ignore[override]
        self._fk_set_activation(activation, "fusekit.torch.Linear", ("relu",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not common.on_graphs(x, "Linear", None) or x.dim() == 0:
            return self._torch_forward(x)
        if x.shape[-1] != self.in_features:
            raise OperandError("fusekit.torch.Linear", "x", f"expected last dim {self.in_features} (in_features), got shape {tuple(x.shape)}")
        amp = common.amp_dtype()
        if (amp or x.dtype) == torch.float32 and not config.allow_tf32().matmul:
            return self._torch_forward(x)
        x2 = _cast(_dense(x, "Linear", rows=True), amp)
        if x2.dim() != 2:
            x2 = x2.reshape(-1, self.in_features)
        relu, done, ep = self.activation == "relu" or self._fk_relu is not None, self._fk_done(), self._fk_ep()
        # other activations than ReLU run after the matmul graph: cuDNN 9.19's matmul epilogue is not
        # trusted for them (wrong values for hardswish; benchmarks/NOTES.md, "Wrong results")
        y = LinearBiasAct.apply(x2, _cast(self.weight, amp), _cast(self.bias, amp), "relu" if relu else None)
        y = y if ep is None else _apply_epilogue(y, ep)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return hand_on(y, done)


class BatchNorm2d(FusekitActModule, torch.nn.BatchNorm2d):
    """torch.nn.BatchNorm2d on cuDNN graphs (train: fused BN [+ ReLU / ReLU6]; eval: one scale-shift
    [+ activation] graph from the running statistics, with gradients as PyTorch's; other activations
    than ReLU / ReLU6 run after the training BN graph as PyTorch's). Parameters and buffers may be
    float16 / bfloat16 (``model.half()``): statistics are computed in float32 and the running stats
    written back in their own dtype. ``affine=False`` runs normalize only."""

    def _fk_setup(self, activation: Any = None) -> None:  # type: ignore[override]
        self._fk_set_activation(activation, "fusekit.torch.BatchNorm2d")

    def _check_input_dim(self, input: Any) -> None:
        if isinstance(input, torch.Tensor):  # an fx Proxy (tracing) has no dim() to check
            super()._check_input_dim(input)

    def _affine(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.affine:
            return _f32(self.weight), _f32(self.bias)
        ones, zeros, _ = common.ops.affine_identity(x)
        return ones, zeros

    def _scale_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Eval mode: float32 (scale, shift) with bn(x) = x * scale + shift, from the running statistics
        (differentiable in weight and bias at every call when autograd needs it, else reused: _memo)."""

        def fold() -> tuple[torch.Tensor, torch.Tensor]:
            return bn_scale_shift(_f32(self.running_mean), _f32(self.running_var), self.eps,
                                  _f32(self.weight) if self.affine else None, _f32(self.bias) if self.affine else None)

        return self._memo(fold, (self.weight, self.bias, self.running_mean, self.running_var), (self.eps,))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """bn(x) [+ the fused ReLU]; with ``residual`` (how :func:`convert` rewrites a residual block's
        end), relu(bn(x) + residual): training runs BN + add + ReLU as one graph."""
        if residual is not None:
            if self._fk_act() is not None or self._fk_ep() is not None:
                raise OperandError("fusekit.torch.BatchNorm2d", "residual", "is added before a ReLU of its own: this module's activation must be None",
                                   what="argument")
            if tagged(x, ADDED) == id(residual) and already_done(x, self):  # eval: the conv before did BN, add and ReLU
                return x
            if not (isinstance(residual, torch.Tensor) and residual.shape == x.shape  # else: a broadcast, or off cuDNN's graphs
                    and common.on_graphs(x, "BatchNorm2d") and common.on_graphs(residual, "BatchNorm2d")):
                return F.relu(self.forward(x) + residual)  # as written (bn(x) passes a folded conv's output on)
            residual = _dense(residual, "BatchNorm2d")
        if already_done(x, self):  # eval: folded into the conv before
            return x if residual is None else _mark_relu_output(_AddReLU.apply(x, _cast(residual, x.dtype)))
        if not common.on_graphs(x, "BatchNorm2d"):
            return self._torch_forward(x)
        x = _dense(x, "BatchNorm2d")
        act = "relu" if residual is not None else self._fk_act()
        if residual is not None:
            residual = _like(_cast(residual, x.dtype), x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if batch_stats:
            n, _, h, w = x.shape
            if n * h * w == 1:
                raise OperandError("fusekit.torch.BatchNorm2d", "x", f"expected more than 1 value per channel when training, got shape {tuple(x.shape)}")
            track = self.training and self.track_running_stats and self.running_mean is not None
            gamma, beta = self._affine(x)
            y = BatchNormAct.apply(
                x, gamma, beta, self.running_mean if track else None, self.running_var if track else None, self.eps, factor, act, residual
            )
        else:
            scale, shift = self._scale_shift()
            ep = self._fk_ep()
            if residual is None and self._fk_fuses(ep, x, scale, shift):  # inference: one scale-shift graph with the activation
                y = common.ops.channel_scale_shift_act(x, scale, shift, activation=ep[0], alpha=ep[1])
                return hand_on(y, self._fk_done())
            if residual is None:
                y = ScaleShiftAct.apply(x, scale, shift, act)
            else:
                y = _AddReLU.apply(ScaleShiftAct.apply(x, scale, shift, None), residual)
        if act is not None and (batch_stats or residual is not None):
            _mark_relu_output(y, ACTIVATIONS[act])
        ep = self._fk_ep()
        if ep is not None:
            y = _apply_epilogue(y, ep)
        return hand_on(y, self._fk_done())


def _relu_forward(m: Any, x: Any, clip: float, who: str, torch_forward: Any) -> Any:
    if already_done(x, m):
        return x
    if not common.on_graphs(x, who, (1, 2, 4)):
        return torch_forward(m, x)
    if not is_dense(x):
        if m.inplace:
            return torch_forward(m, x)  # write through the caller's strides, as PyTorch does
        x = _dense(x, who)
    return _mark_relu_output(_ReLUFn.apply(x, m.inplace, clip), clip)


class ReLU(FusekitModule, torch.nn.ReLU):
    """torch.nn.ReLU as a cuDNN pointwise graph (1-, 2- and 4-D inputs; ``inplace=True`` writes into x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _relu_forward(self, x, math.inf, "ReLU", torch.nn.ReLU.forward)


def _passing_on(base: type) -> type:
    """``base`` (a torch.nn activation) as a fusekit module that passes on a layer's output already
    holding its work (:func:`convert` links it to that layer), and is ``base`` on anything else."""

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return x if already_done(x, self) else base.forward(self, x)

    doc = f"torch.nn.{base.__name__}; passes on the output of the layer before it where that layer did its work (set by convert)."
    return type(base.__name__, (FusekitModule, base), {"forward": forward, "__doc__": doc, "__module__": __name__})


#: torch.nn activation -> the fusekit module convert re-classes it as when the layer before it fuses it.
PASSING_ON: dict[type, type] = {t: _passing_on(t) for t in (torch.nn.SiLU, torch.nn.GELU, torch.nn.Hardswish, torch.nn.Hardsigmoid,
                                                         torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.LeakyReLU, torch.nn.ELU)}


class ReLU6(FusekitModule, torch.nn.ReLU6):
    """torch.nn.ReLU6 (min(max(x, 0), 6)) as a cuDNN pointwise graph (1-, 2- and 4-D inputs;
    ``inplace=True`` writes into x). Its backward passes the gradient where 0 < y < 6, as PyTorch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _relu_forward(self, x, ACTIVATIONS["relu6"], "ReLU6", torch.nn.ReLU6.forward)


class ChannelScaleShift(FusekitModule, torch.nn.Module):
    """y = x * gamma + beta per channel (``scale``/``shift`` choose which exist), optional fused ReLU
    (``activation="relu"`` or ``"relu6"``)."""

    def __init__(self, num_features: int, scale: bool = True, shift: bool = True, activation: str | None = None, device: Any = None) -> None:
        super().__init__()
        self.activation = _check_act(activation, "fusekit.torch.ChannelScaleShift")
        if not (scale or shift) or (self.activation and not (scale and shift)):
            raise OperandError("fusekit.torch.ChannelScaleShift", "scale", "needs a scale or a shift, and both for a fused ReLU", what="argument")
        self.weight = torch.nn.Parameter(torch.ones(num_features, device=device)) if scale else None
        self.bias = torch.nn.Parameter(torch.zeros(num_features, device=device)) if shift else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return ScaleShiftAct.apply(x, self.weight, self.bias, self.activation)


class MaxPool2d(FusekitModule, torch.nn.MaxPool2d):
    """torch.nn.MaxPool2d through fusekit's CuPy kernel (int32 argmax saved for the backward), with
    ``ceil_mode``, ``dilation`` and ``return_indices`` (int64 indices, as PyTorch's, for
    ``F.max_unpool2d``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fk_setup()

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        if not common.on_graphs(x, "MaxPool2d"):
            return torch.nn.MaxPool2d.forward(self, x)
        x = _dense(x, "MaxPool2d")
        args = (self.kernel_size, self.stride, self.padding)
        if not _needs_grad(x):  # no backward: argmax written only for return_indices
            y, argmax = common.pool.max_pool2d(x, *args, ceil_mode=self.ceil_mode, dilation=self.dilation, indices=self.return_indices)
        else:
            y, argmax = _MaxPool.apply(x, *args, self.ceil_mode, self.dilation)
        return (y, argmax.long()) if self.return_indices else y


class AvgPool2d(FusekitModule, torch.nn.AvgPool2d):
    """torch.nn.AvgPool2d through fusekit's CuPy kernel (PyTorch's divisors; ``count_include_pad``,
    ``ceil_mode`` and ``divisor_override`` too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fk_setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not common.on_graphs(x, "AvgPool2d"):
            return torch.nn.AvgPool2d.forward(self, x)
        stride = self.stride if self.stride is not None else self.kernel_size
        return _AvgPool.apply(
            _dense(x, "AvgPool2d"), self.kernel_size, stride, self.padding, self.count_include_pad, self.ceil_mode, self.divisor_override
        )


def _softmax_forward(m: Any, x: Any, log: bool, who: str) -> Any:
    if not common.on_graphs(x, who, (2, 4)):
        return (F.log_softmax if log else F.softmax)(x, m.dim)
    if common.amp_dtype() is not None:
        x = _cast(x, torch.float32)  # autocast runs softmax and log_softmax in float32
    dim = 1 if m.dim is None else m.dim  # PyTorch's implicit dim for 2-D and 4-D inputs
    return _Softmax.apply(_dense(x, who), dim, log)


class Softmax(FusekitModule, torch.nn.Softmax):
    """Softmax (``log=True``: log-softmax) over ``dim`` (default 1) through fusekit's kernel, for 2-D
    and 4-D inputs; the backward reads the output, not the input."""

    def __init__(self, dim: int | None = 1, log: bool = False) -> None:
        super().__init__(dim)
        self._fk_setup(log)

    def _fk_setup(self, log: bool = False) -> None:  # type: ignore[override]
        self.log = bool(log)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _softmax_forward(self, x, self.log, "Softmax")


class LogSoftmax(FusekitModule, torch.nn.LogSoftmax):
    """torch.nn.LogSoftmax through fusekit's kernel (2-D and 4-D inputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _softmax_forward(self, x, True, "LogSoftmax")


