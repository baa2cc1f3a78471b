"""PyTorch integration: drop-in modules over fusekit's fused forward and backward graphs, the
autograd Functions under them, and :func:`convert`, which moves a whole model onto them.

The modules subclass their ``torch.nn`` counterparts: same constructor arguments, initialization,
parameters, buffers and state-dict keys. ``Conv2d``, ``ConvTranspose2d``, ``Linear`` and
``BatchNorm2d`` take ``activation="relu"`` to fuse a ReLU into their graph (``Conv2d`` and
``BatchNorm2d`` also ``"relu6"``, MobileNet's ReLU6).

    import fusekit.torch as ft
    model, report = ft.convert(torchvision.models.resnet50())
    print(report)                      # what was replaced, fused, left alone
    model = model.cuda().to(memory_format=torch.channels_last)
    model = ft.graphed(model)          # training forward + backward replayed as CUDA graphs
    # or model = ft.replayed(model): training steps replayed from a recorded tape, no CUDA graphs

Where a module runs:

- CUDA tensors of float16, bfloat16 or float32 (4-D images for convolutions, batch norm and
  pooling): on fusekit's graphs. Under ``torch.autocast("cuda")`` they compute as ``torch.nn`` does:
  convolutions and Linear in the autocast dtype (their float32 parameters get float32 gradients),
  Softmax in float32, batch norm, ReLU and pooling in their input's dtype.
- Empty batches and ``torch.fx`` tracing: PyTorch's own implementation (exact ``torch.nn``
  behaviour, gradients included).
- CPU tensors, float64 and input ranks the graphs do not take: PyTorch's own implementation, with a
  :class:`TorchFallbackWarning` once per module type and case.

Inputs that are neither dense NCHW nor dense channels-last (slices, transposes) run on a dense copy,
with a :class:`fusekit.errors.LayoutWarning` once per module type.

The package: ``functions`` (the autograd Functions), ``modules`` (the drop-in modules), ``conversion``
(``convert``), ``graphs`` (``graphed``, ``replayed``), ``replay`` and ``tape`` (recorded-tape replay), and
``common`` (what they share, among it the backend they run on).
"""

from __future__ import annotations

from ..errors import import_or_explain

torch = import_or_explain("torch", "fusekit.torch", "fusekit[torch]", "PyTorch")

from ..errors import TorchFallbackWarning  # noqa: E402
from .conversion import ConvertReport, FxTracer, convert  # noqa: E402
from .functions import BatchNormAct, ConvBiasAct, ConvTransposeBiasAct, LinearBiasAct, ScaleShiftAct  # noqa: E402
from .graphs import graphed, replayed  # noqa: E402
from .modules import (AvgPool2d, BatchNorm2d, ChannelScaleShift, Conv2d, ConvTranspose2d, Linear, LogSoftmax, MaxPool2d,  # noqa: E402
                      ReLU, ReLU6, Softmax)

__all__ = [
    "AvgPool2d",
    "BatchNorm2d",
    "BatchNormAct",
    "ChannelScaleShift",
    "Conv2d",
    "ConvBiasAct",
    "ConvTranspose2d",
    "ConvTransposeBiasAct",
    "ConvertReport",
    "FxTracer",
    "Linear",
    "LinearBiasAct",
    "LogSoftmax",
    "MaxPool2d",
    "ReLU",
    "ReLU6",
    "ScaleShiftAct",
    "Softmax",
    "TorchFallbackWarning",
    "convert",
    "graphed",
    "replayed",
]

for _name in __all__:  # the public names are fusekit.torch's (their repr, pickles of converted models)
    if getattr(globals()[_name], "__module__", "").startswith("fusekit.torch."):
        globals()[_name].__module__ = __name__
del _name
