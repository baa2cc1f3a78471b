"""A plan key for tests that need one without a GPU (shared by the cache, store and CLI tests)."""

from fusekit.engine.cache import PlanKey
from fusekit.tensors import TensorSpec


def specs(dtype="float16", layout="NHWC", n=2):
    return (
        ("x", TensorSpec.build((n, 8, 9, 9), dtype, 0, layout)),
        ("w", TensorSpec.build((16, 8, 3, 3), dtype, 0, layout)),
        ("b", TensorSpec.build((1, 16, 1, 1), dtype, 0, "NCHW")),
        ("y", TensorSpec.build((n, 16, 9, 9), dtype, 0, layout)),
    )


BASE = dict(
    pattern="conv_bias_relu",
    digest="0123456789abcdef",
    specs=specs(),
    alignments=(32, 32, 32, 32),
    attrs=(("padding", (1, 1)), ("stride", (1, 1)), ("dilation", (1, 1))),
    compute_dtype="float32",
    gpu="NVIDIA H200",
    cc=(9, 0),
    cudnn_backend=91000,
    frontend="1.32.0",
    tf32=False,
)


def key(**changes) -> PlanKey:
    return PlanKey(**{**BASE, **changes})
