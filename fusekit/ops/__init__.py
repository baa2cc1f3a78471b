"""Functional primitives on arrays, by family, each a thin layer over :mod:`fusekit.dispatch`.

Forward functions return their outputs; backward functions take the upstream gradient and the
saved tensors positionally and return the gradients of the forward's operands (None where not
requested). ``pool`` holds pooling and softmax (CuPy kernels: cuDNN's graph API has no node for them).
"""

from ..dispatch import call, plan_for
from . import depthwise, pool, reduce
from .act import act, add_act, channel_gate, channel_scale_shift_act, conv_bias_act, conv_bias_add_act, conv_bias_hardswish, linear_bias_act
from .conv import (
    conv2d,
    conv2d_backward,
    conv_bias,
    conv_bias_add,
    conv_bias_add_relu,
    conv_bias_backward,
    conv_bias_relu,
    conv_bias_relu6,
    conv_bias_relu_backward,
    conv_genstats,
    conv_transpose_bias,
    conv_transpose_bias_act,
    conv_transpose_bias_relu,
    conv_transpose_bias_relu_backward,
    relu_backward,
)
from .linear import linear_bias, linear_bias_backward, linear_bias_relu, linear_bias_relu_backward
from .norm import (
    affine_identity,
    batchnorm,
    batchnorm_backward,
    batchnorm_inference,
    bn_normalize,
    bn_normalize_backward,
    channel_scale_shift,
    channel_scale_shift_backward,
    fold_batchnorm,
    instancenorm,
    instancenorm_backward,
    inv_std,
    layernorm,
    layernorm_backward,
)

__all__ = [
    "call", "plan_for", "depthwise", "pool", "reduce",
    "act", "add_act", "channel_gate", "channel_scale_shift_act", "conv_bias_act", "conv_bias_add_act", "conv_bias_hardswish", "linear_bias_act",
    "conv2d", "conv2d_backward", "conv_bias", "conv_bias_add", "conv_bias_add_relu", "conv_bias_backward", "conv_bias_relu",
    "conv_bias_relu6", "conv_bias_relu_backward", "conv_genstats", "conv_transpose_bias", "conv_transpose_bias_act", "conv_transpose_bias_relu",
    "conv_transpose_bias_relu_backward", "relu_backward",
    "linear_bias", "linear_bias_backward", "linear_bias_relu", "linear_bias_relu_backward",
    "affine_identity", "batchnorm", "batchnorm_backward", "batchnorm_inference", "bn_normalize", "bn_normalize_backward",
    "channel_scale_shift", "channel_scale_shift_backward", "fold_batchnorm", "instancenorm", "instancenorm_backward",
    "inv_std", "layernorm", "layernorm_backward",
]
