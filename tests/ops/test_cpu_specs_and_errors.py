"""CPU: operand specs, pointer alignment, and every user error of the public API raised before cuDNN.

The public-API tests run on fake "device arrays" read by a fake Adapter registered in
``adapters.registered``; everything that would reach cuDNN or the GPU is replaced by a tripwire.
"""

import numpy as np
import pytest

import fusekit
from fusekit import adapters, dispatch
from fusekit.engine import keys, runtime
from fusekit.engine import lower as lower_mod
from fusekit.errors import FusekitError, OperandError
from fusekit.tensors import TensorSpec, alignment, make_spec


def np_strides(shape, layout, dtype=np.float32):
    """Element strides of a dense NumPy array of logical NCHW ``shape`` in ``layout``."""
    n, c, h, w = shape
    if layout == "NHWC":
        a = np.empty((n, h, w, c), dtype=dtype).transpose(0, 3, 1, 2)
    else:
        a = np.empty(shape, dtype=dtype)
    return tuple(s // a.itemsize for s in a.strides)


# ----------------------------------------------------------------------------------------------
# make_spec
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("kind", ["image", "filter"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (8, 16, 3, 3), (3, 7, 5, 2)])
def test_make_spec_detects_layout(shape, layout, kind):
    strides = np_strides(shape, layout)
    spec = make_spec("p", "x", kind, shape, strides, "float16", 0)
    assert spec == TensorSpec(shape, strides, "float16", 0, layout)
    assert spec == TensorSpec.build(shape, "float16", 0, layout)


def test_nchw_and_nhwc_specs_differ():
    shape = (2, 3, 4, 5)
    a = make_spec("p", "x", "image", shape, np_strides(shape, "NCHW"), "float32", 0)
    b = make_spec("p", "x", "image", shape, np_strides(shape, "NHWC"), "float32", 0)
    assert a != b
    assert a.layout == "NCHW" and b.layout == "NHWC"
    assert a.strides != b.strides


@pytest.mark.parametrize(
    "shape, strides, layout",
    [
        ((1, 3, 4, 5), (999, 20, 5, 1), "NCHW"),  # batch 1: its stride is meaningless
        ((1, 3, 4, 5), (7, 1, 15, 3), "NHWC"),
        ((2, 1, 4, 5), (20, 123, 5, 1), "NCHW"),  # one channel
        ((2, 3, 1, 1), (3, 1, 42, 42), "NHWC"),  # 1x1 spatial: NCHW and NHWC coincide; channels-last for cuDNN
        ((2, 3, 1, 1), (3, 1, 1, 1), "NHWC"),
        ((2, 3, 1, 5), (15, 1, 77, 3), "NHWC"),
        ((1, 1, 1, 1), (5, 6, 7, 8), "NHWC"),
    ],
)
def test_make_spec_ignores_strides_of_size_one_dims(shape, strides, layout):
    spec = make_spec("p", "x", "image", shape, strides, "float16", 0)
    assert spec.layout == layout
    assert spec.strides == np_strides(shape, layout)  # canonical, whatever was given for size-1 dims
    # so views that differ only there share one spec (one plan)
    assert spec == make_spec("p", "x", "image", shape, np_strides(shape, layout), "float16", 0)


@pytest.mark.parametrize("c", [1, 5, 64])
def test_make_spec_channel_vector(c):
    vec = make_spec("p", "b", "channel", (c,), (1,), "bfloat16", 1)
    four = make_spec("p", "b", "channel", (1, c, 1, 1), (c, 1, 1, 1), "bfloat16", 1)
    assert vec == four
    assert vec.shape == (1, c, 1, 1)
    assert vec.strides == np_strides((1, c, 1, 1), "NCHW")
    assert vec.layout == "NCHW" and vec.device == 1 and vec.dtype == "bfloat16"


@pytest.mark.parametrize(
    "kind, shape, strides, dtype, device, message",
    [
        ("image", (3, 4, 5), (20, 5, 1), "float16", 0, r"expected a 4-D image with logical dims \(N, C, H, W\), got rank 3"),
        ("filter", (3, 4, 5), (20, 5, 1), "float16", 0, r"expected a 4-D filter with logical dims \(K, C, R, S\)"),
        ("image", (2, 3, 4, 5, 6), (360, 120, 30, 6, 1), "float16", 0, r"got rank 5"),
        ("image", (2, 3, 4, 5), (120, 40, 10, 2), "float16", 0, r"neither dense NCHW .* nor dense NHWC"),
        ("image", (2, 3, 4, 5), (60, 1, 5, 20), "float16", 0, r"neither dense NCHW"),  # a transposed view
        ("image", (2, 3, 4, 5), (60, 20, 5, 1), "float64", 0, r"unsupported dtype float64"),
        ("image", (2, 3, 4, 5), (60, 20, 5, 1), "int32", 0, r"unsupported dtype int32"),
        ("image", (2, 3, 4, 5), (60, 20, 5, 1), "int8", 0, r"unsupported dtype int8"),
        ("image", (2, 3, 4, 5), (60, 20, 5, 1), "float16", None, r"host \(CPU\) memory"),
        ("channel", (5,), (1,), "float16", None, r"host \(CPU\) memory"),
        ("image", (2, 0, 4, 5), (0, 20, 5, 1), "float16", 0, r"every dim >= 1"),
        ("channel", (5,), (2,), "float16", 0, r"contiguous vector"),
        ("channel", (1, 5, 1, 1), (10, 2, 1, 1), "float16", 0, r"contiguous vector"),
        ("channel", (5, 1), (1, 1), "float16", 0, r"expected shape \(C,\) or \(1, C, 1, 1\)"),
        ("channel", (2, 5, 1, 1), (5, 1, 1, 1), "float16", 0, r"expected shape \(C,\) or \(1, C, 1, 1\)"),
    ],
)
def test_make_spec_rejects(kind, shape, strides, dtype, device, message):
    with pytest.raises(OperandError, match=message) as ei:
        make_spec("mypat", "opnd", kind, shape, strides, dtype, device)
    assert ei.value.operand == "opnd"
    assert str(ei.value).startswith("mypat: operand 'opnd': ")


def _alignment_by_definition(ptr):
    for p in (32, 16, 8, 4, 2, 1):
        if ptr % p == 0:
            return p


@pytest.mark.parametrize("base", [0, 0x7F3A_0000_0000, 0x1000, 0x7F3A_0000_0100 + 3])
def test_alignment(base):
    for off in range(0, 80):
        ptr = base + off
        assert alignment(ptr) == _alignment_by_definition(ptr), hex(ptr)


def test_alignment_examples():
    assert {alignment(p) for p in (0, 256, 0x7F00_0000_0020)} == {32}
    assert alignment(0x7F00_0000_0010) == 16
    assert alignment(0x7F00_0000_0008) == 8
    assert alignment(0x7F00_0000_0002) == 2
    assert alignment(0x7F00_0000_0001) == 1


# ----------------------------------------------------------------------------------------------
# public API errors, no GPU: fake device arrays and a tripwire on everything cuDNN
# ----------------------------------------------------------------------------------------------
class FakeArray:
    """A 'device array' that only knows its metadata."""

    def __init__(self, shape, dtype="float16", device=0, layout="NCHW", strides=None, ptr=0x7F00_0000_0000):
        self.shape = tuple(shape)
        if strides is None:
            if layout == "NHWC" and len(self.shape) == 4:
                strides = np_strides(self.shape, "NHWC")
            else:
                strides = tuple(int(s) for s in np.cumprod((1,) + self.shape[:0:-1])[::-1]) if self.shape else ()
        self.strides = tuple(strides)
        self.dtype, self.device, self.ptr = dtype, device, ptr


class FakeAdapter(adapters.Adapter):
    name = "fake"

    def probe(self, a):
        return (a.shape, a.strides, a.dtype, a.device, alignment(a.ptr)), a.ptr

    def describe(self, a):
        return a.shape, a.strides, a.dtype, a.device

    def stream(self, device):
        return 0  # the dispatch fast path asks for it before resolving

    def device_properties(self, device):
        return "FakeGPU", (9, 0)

    def empty(self, spec):
        raise AssertionError("allocated an output")

    def bytes(self, nbytes, device):
        raise AssertionError("allocated a workspace")

    def use_device(self, device):
        raise AssertionError("switched device")


class CPUProducer:
    """A __dlpack__ producer that lives on the host (kDLCPU = 1)."""

    def __dlpack__(self, **kw):
        raise AssertionError("must not be imported")

    def __dlpack_device__(self):
        return (1, 0)


def _tripwire(*args, **kwargs):
    raise AssertionError("reached cuDNN")


@pytest.fixture
def fake(monkeypatch, fresh_session):
    monkeypatch.setattr(runtime, "versions", _tripwire)
    monkeypatch.setattr(keys, "versions", _tripwire)  # keys imported the name
    monkeypatch.setattr(runtime, "load_cudnn", _tripwire)
    monkeypatch.setattr(runtime.Runtime, "handle", _tripwire)
    monkeypatch.setattr(runtime.Runtime, "workspace", _tripwire)
    monkeypatch.setattr(lower_mod, "build", _tripwire)
    monkeypatch.setattr(lower_mod, "lower", _tripwire)
    monkeypatch.setattr(lower_mod, "load_cudnn", _tripwire)
    cache = fusekit.default_cache()
    before = (len(cache), cache.stats.builds, cache.stats.misses)
    with adapters.registered(FakeArray, FakeAdapter()):
        yield
    assert fresh_session.calls == {}, "a failed call left a dispatch entry"
    assert (len(cache), cache.stats.builds, cache.stats.misses) == before, "a failed call touched the plan cache"


def good_operands(dtype="float16"):
    x = FakeArray((2, 8, 9, 9), dtype, layout="NHWC")
    w = FakeArray((16, 8, 3, 3), dtype, layout="NHWC")
    b = FakeArray((16,), dtype)
    return x, w, b


def raises_operand(name, match, what="operand"):
    return pytest.raises(OperandError, match=rf"^conv_bias_relu: {what} '{name}': .*{match}")


def test_valid_operands_reach_the_tripwire(fake):
    """Control: valid operands get past every check, so each error below is raised by a check."""
    x, w, b = good_operands()
    with pytest.raises(AssertionError, match="reached cuDNN"):
        fusekit.conv_bias_relu(x, w, b, padding=1)
    with pytest.raises(AssertionError, match="reached cuDNN"):
        fusekit.conv_bias_relu(x, w, FakeArray((1, 16, 1, 1)), padding=1, out=FakeArray((2, 16, 9, 9), layout="NHWC", ptr=0x7F00_1000_0000))
    with pytest.raises(AssertionError, match="reached cuDNN"):
        fusekit.plan_for("conv", x, w, padding=(1, 1))


def test_wrong_rank(fake):
    x, w, b = good_operands()
    with raises_operand("x", r"expected a 4-D image .* got rank 3") as ei:
        fusekit.conv_bias_relu(FakeArray((8, 9, 9)), w, b)
    assert ei.value.operand == "x" and ei.value.pattern == "conv_bias_relu"
    with raises_operand("w", r"expected a 4-D filter .* got rank 2"):
        fusekit.conv_bias_relu(x, FakeArray((16, 72)), b)
    with raises_operand("b", r"expected shape \(C,\) or \(1, C, 1, 1\)"):
        fusekit.conv_bias_relu(x, w, FakeArray((16, 1)))


def test_channel_mismatch(fake):
    x, _, b = good_operands()
    with raises_operand("w", r"expected 8 input channels to match 'x'"):
        fusekit.conv_bias_relu(x, FakeArray((16, 4, 3, 3), layout="NHWC"), b, padding=1)


def test_bias_wrong_length(fake):
    x, w, _ = good_operands()
    with raises_operand("b", r"expected length 16 \(one per output channel\), got shape 15"):
        fusekit.conv_bias_relu(x, w, FakeArray((15,)), padding=1)
    with raises_operand("b", r"expected length 16"):
        fusekit.conv_bias_relu(x, w, FakeArray((1, 32, 1, 1)), padding=1)


def test_mixed_devices(fake):
    x, w, b = good_operands()
    with raises_operand("w", r"is on cuda:1 but 'x' is on cuda:0"):
        fusekit.conv_bias_relu(x, FakeArray((16, 8, 3, 3), device=1, layout="NHWC"), b)
    with raises_operand("b", r"is on cuda:2 but 'x' is on cuda:0"):
        fusekit.conv_bias_relu(x, w, FakeArray((16,), device=2))


def test_cpu_arrays(fake):
    x, w, b = good_operands()
    with raises_operand("x", r"NumPy array in host \(CPU\) memory"):
        fusekit.conv_bias_relu(np.zeros((2, 8, 9, 9), np.float16), w, b)
    with raises_operand("b", r"host \(CPU\)"):
        fusekit.conv_bias_relu(x, w, np.zeros(16, np.float16))
    # an adapter reporting host memory (a CPU torch tensor, say)
    with raises_operand("w", r"host \(CPU\) memory"):
        fusekit.conv_bias_relu(x, FakeArray((16, 8, 3, 3), device=None, layout="NHWC"), b)
    # a __dlpack__ producer living on the host
    with raises_operand("x", r"expected a CUDA device array, got a __dlpack__ producer on device type 1"):
        fusekit.conv_bias_relu(CPUProducer(), w, b)


@pytest.mark.parametrize("dtype", ["float64", "int8", "int32", "float8_e4m3fn"])
def test_unsupported_dtype(fake, dtype):
    x, w, b = good_operands(dtype)
    with raises_operand("x", rf"unsupported dtype {dtype}; expected one of float16, bfloat16, float32"):
        fusekit.conv_bias_relu(x, w, b)


def test_mixed_dtypes(fake):
    x, w, b = good_operands("float16")
    with raises_operand("w", r"expected dtype float16 like 'x', got float32"):
        fusekit.conv_bias_relu(x, FakeArray((16, 8, 3, 3), "float32", layout="NHWC"), b)
    with raises_operand("b", r"expected dtype float16 like 'x', got bfloat16"):
        fusekit.conv_bias_relu(x, w, FakeArray((16,), "bfloat16"))


def test_non_dense_strides(fake):
    _, w, b = good_operands()
    # x[:, :, ::2, ::2] of a contiguous (2, 8, 18, 18)
    sliced = FakeArray((2, 8, 9, 9), strides=(8 * 18 * 18, 18 * 18, 36, 2))
    with raises_operand("x", r"neither dense NCHW"):
        fusekit.conv_bias_relu(sliced, w, b, padding=1)
    # a filter in some exotic permutation (K, C, R, S) seen with C innermost-but-one
    odd = FakeArray((16, 8, 3, 3), strides=(72, 9, 1, 3))
    with raises_operand("w", r"neither dense NCHW"):
        fusekit.conv_bias_relu(good_operands()[0], odd, b, padding=1)


def test_unknown_attribute(fake):
    x, w, b = good_operands()
    with raises_operand("group", what="attribute", match=r"unknown attribute; this pattern takes \['dilation', 'groups', 'padding', 'stride'\]"):
        fusekit.call("conv_bias_relu", x, w, b, group=2)
    with pytest.raises(TypeError):  # the typed wrapper has no such keyword at all
        fusekit.conv_bias_relu(x, w, b, group=2)


@pytest.mark.parametrize(
    "attr, value, match",
    [("padding", -1, r"expected values >= 0"), ("stride", 0, r"expected values >= 1"), ("dilation", (1, 2, 3), r"sequence of 2 ints")],
)
def test_bad_attribute_value(fake, attr, value, match):
    x, w, b = good_operands()
    with raises_operand(attr, match, what="attribute"):
        fusekit.conv_bias_relu(x, w, b, **{attr: value})


def test_bad_out(fake):
    x, w, b = good_operands()
    with raises_operand("y", r"expected out of shape \(2, 16, 9, 9\), dtype float16 on cuda:0, got shape \(2, 16, 8, 8\)"):
        fusekit.conv_bias_relu(x, w, b, padding=1, out=FakeArray((2, 16, 8, 8), layout="NHWC"))
    with raises_operand("y", r"expected out of shape \(2, 16, 7, 7\), dtype float16 .* got shape \(2, 16, 7, 7\), dtype float32"):
        fusekit.conv_bias_relu(x, w, b, out=FakeArray((2, 16, 7, 7), "float32"))
    with raises_operand("y", r"on cuda:0, got .* on cuda:1"):
        fusekit.conv_bias_relu(x, w, b, out=FakeArray((2, 16, 7, 7), device=1))
    with raises_operand("y", r"host \(CPU\)"):
        fusekit.conv_bias_relu(x, w, b, out=np.empty((2, 16, 7, 7), np.float16))
    with raises_operand("out", r"expected 1 output array\(s\) \('y',\), got 2"):
        fusekit.conv_bias_relu(x, w, b, out=(FakeArray((2, 16, 7, 7)), FakeArray((2, 16, 7, 7))))


def test_wrong_operand_count(fake):
    x, w, b = good_operands()
    with pytest.raises(TypeError, match=r"conv_bias_relu takes 3 array operands \('x', 'w', 'b'\), got 2"):
        fusekit.call("conv_bias_relu", x, w)
    with pytest.raises(TypeError, match=r"conv takes 2 array operands \('x', 'w'\), got 3"):
        fusekit.call("conv", x, w, b)
    with pytest.raises(TypeError, match=r"got 2"):
        fusekit.plan_for("conv_bias", x, w)


@pytest.mark.parametrize("junk", [object(), "x.npy", [[1.0, 2.0]], 3.0, None])
def test_not_an_array(fake, junk):
    x, w, b = good_operands()
    with raises_operand("w", r"expected a CuPy array, a torch tensor or a __dlpack__ producer, got builtins\."):
        fusekit.conv_bias_relu(x, junk, b)
    with raises_operand("x", r"expected a CuPy array"):
        fusekit.conv_bias_relu(junk, w, b)


def test_errors_through_plan_for_and_other_wrappers(fake):
    x, w, b = good_operands()
    bad_w = FakeArray((16, 4, 3, 3), layout="NHWC")
    with pytest.raises(OperandError, match=r"^conv: operand 'w': expected 8 input channels"):
        fusekit.conv2d(x, bad_w)
    with pytest.raises(OperandError, match=r"^conv_bias: operand 'b': expected length 16"):
        fusekit.conv_bias(x, w, FakeArray((8,)))
    with pytest.raises(OperandError, match=r"^conv_bias_relu: operand 'x': spatial size"):
        fusekit.plan_for("conv_bias_relu", FakeArray((2, 8, 2, 2)), w, b)


def test_all_errors_are_fusekit_errors_and_value_errors(fake):
    x, w, b = good_operands()
    with pytest.raises(OperandError) as ei:
        fusekit.conv_bias_relu(x, w, FakeArray((3,)))
    assert isinstance(ei.value, FusekitError) and isinstance(ei.value, ValueError)


def test_same_error_twice(fake):
    """A failed call leaves nothing behind: the second identical call fails the same way."""
    x, w, _ = good_operands()
    for _ in range(2):
        with raises_operand("b", r"expected length 16"):
            fusekit.conv_bias_relu(x, w, FakeArray((15,)), padding=1)


def test_linear_backward_names_a_gradient_that_is_not_a_matrix():
    """The Linear bias gradient runs on a (rows, features, 1, 1) view of dy: a dy or y of another rank
    is reported as a fusekit error naming it, before any view or cuDNN call."""
    x, w = np.zeros((4, 3), np.float32), np.zeros((5, 3), np.float32)
    with pytest.raises(OperandError, match=r"^linear_bias_backward: operand 'dy': expected a \(rows, features\) matrix, got shape \(4, 5, 2\)"):
        fusekit.linear_bias_backward(np.zeros((4, 5, 2), np.float32), x, w)
    with pytest.raises(OperandError, match=r"^linear_bias_relu_backward: operand 'y': expected a \(rows, features\) matrix, got shape \(20,\)"):
        fusekit.linear_bias_relu_backward(np.zeros((4, 5), np.float32), x, w, np.zeros(20, np.float32))


def test_layer_norm_names_its_operands_before_choosing_a_layout():
    """layernorm looks at x's layout first (channels-last runs on an NCHW copy): bad operands are
    reported under layernorm's name, not a generic one."""
    g = np.ones((1, 3, 4, 4), np.float32)
    with pytest.raises(OperandError, match=r"^layernorm: operand 'x': expected a CUDA device array"):
        fusekit.ops.layernorm(np.zeros((2, 3, 4, 4), np.float32), g, g)
    with pytest.raises(OperandError, match=r"^layernorm_backward: operand 'x': expected a CUDA device array"):
        fusekit.ops.layernorm_backward(np.zeros((2, 3, 4, 4), np.float32), np.zeros((2, 3, 4, 4), np.float32), g, g, g)


def test_pattern_that_cannot_be_captured_raises_capture_error_before_cudnn(fake, monkeypatch):
    """A pattern declaring ``not_capturable`` raises CaptureError inside a capture, before any
    handle, plan or workspace, and its calls stay out of the dispatch table (each one re-checks)."""
    from fusekit.errors import CaptureError

    assert "unwritten" in fusekit.get_pattern("instancenorm_backward").not_capturable
    assert fusekit.get_pattern("instancenorm").not_capturable == ""
    x = FakeArray((2, 8, 6, 6), layout="NHWC")
    dy = FakeArray((2, 8, 6, 6), layout="NHWC")
    g = FakeArray((8,), "float32")
    stats = FakeArray((2, 8, 1, 1), "float32")
    monkeypatch.setattr(FakeAdapter, "capturing", lambda self, device: True, raising=False)
    with pytest.raises(CaptureError, match=r"instancenorm_backward cannot run inside a CUDA-graph capture: .*dgamma"):
        fusekit.ops.instancenorm_backward(dy, x, g, stats, stats)
    monkeypatch.setattr(FakeAdapter, "capturing", lambda self, device: False, raising=False)
    with pytest.raises(AssertionError, match="reached cuDNN"):  # outside a capture it goes on to cuDNN
        fusekit.ops.instancenorm_backward(dy, x, g, stats, stats)


def test_not_capturable_must_be_a_string():
    text = fusekit.get_pattern("relu").text.replace('saved = ["y"]', 'saved = ["y"]\nnot_capturable = 3')
    with pytest.raises(fusekit.PatternError, match="'not_capturable' must be a string"):
        fusekit.parse_pattern(text)


def test_memory_only_pattern_is_never_loaded_from_or_written_to_disk():
    """instance-norm backward plans stay in memory: the planner offers no loader, so the plan cache
    builds them without reading or writing its disk store."""
    from types import SimpleNamespace

    from fusekit.engine.cache import DiskStore, PlanCache
    from fusekit.engine.planner import planner

    pat = fusekit.get_pattern("instancenorm_backward")
    assert "serialized" in pat.memory_only and fusekit.get_pattern("instancenorm").memory_only == ""
    key = SimpleNamespace(specs=((n, SimpleNamespace(device=0)) for n in pat.operand_names), attrs=())
    build, load = planner(pat, key, adapter=None, handle=None, cache=None)
    assert load is None and callable(build)

    class Store(DiskStore):
        def __init__(self):
            self.touched = []

        def read(self, key):
            self.touched.append("read")

        def write(self, *a):
            self.touched.append("write")

    store = Store()
    cache = PlanCache(store=store)
    plan = SimpleNamespace(key="k", graph=None)
    assert cache.get_or_build("k", lambda: plan, None) is plan
    assert store.touched == [] and cache.stats.builds == 1
    with pytest.raises(fusekit.PatternError, match="'memory_only' must be a string"):
        fusekit.parse_pattern(fusekit.get_pattern("relu").text.replace('saved = ["y"]', 'saved = ["y"]\nmemory_only = true'))


def test_out_overlapping_an_input_is_refused(fake):
    """``out=`` sharing memory with an operand (conv's x, a view into it, another output) is an
    OperandError naming both, before cuDNN; a separate output goes on to cuDNN."""
    x, w, b = good_operands()
    with raises_operand("y", r"out overlaps the memory of 'x'"):
        fusekit.conv_bias_relu(x, w, FakeArray((16,)), padding=1, out=FakeArray((2, 16, 9, 9), layout="NHWC", ptr=x.ptr))
    inside = x.ptr + 2 * 8 * 9 * 9 - 64  # starts inside x's last bytes
    with raises_operand("y", r"out overlaps the memory of 'x'"):
        fusekit.conv_bias_relu(x, w, FakeArray((16,)), padding=1, out=FakeArray((2, 16, 9, 9), layout="NHWC", ptr=inside))
    just_after = x.ptr + 2 * 8 * 9 * 9 * 2  # x is 2*8*9*9 float16 elements
    with pytest.raises(AssertionError, match="reached cuDNN"):
        fusekit.conv_bias_relu(x, w, FakeArray((16,)), padding=1, out=FakeArray((2, 16, 9, 9), layout="NHWC", ptr=just_after))


def test_in_place_only_where_the_pattern_allows_it_exactly(fake):
    """relu declares in_place = { y = "x" }: out=x is allowed; an out shifted into x is not."""
    x = FakeArray((2, 8, 4, 4), layout="NHWC")
    with pytest.raises(AssertionError, match="reached cuDNN"):
        fusekit.call("relu", x, out=FakeArray((2, 8, 4, 4), layout="NHWC", ptr=x.ptr))
    with pytest.raises(OperandError, match=r"relu: operand 'y': out overlaps the memory of 'x'.*exactly 'x'"):
        fusekit.call("relu", x, out=FakeArray((2, 8, 4, 4), layout="NHWC", ptr=x.ptr + 32))
    assert fusekit.get_pattern("conv_bias_relu").in_place == {}


def test_two_outputs_sharing_memory_are_refused(fake):
    dy = FakeArray((2, 8, 4, 4), layout="NHWC")
    x = FakeArray((2, 8, 4, 4), layout="NHWC", ptr=0x7F00_0010_0000)
    g, m, v = FakeArray((8,), "float32", ptr=0x7F00_0020_0000), FakeArray((8,), "float32", ptr=0x7F00_0030_0000), FakeArray((8,), "float32", ptr=0x7F00_0040_0000)
    dx = FakeArray((2, 8, 4, 4), layout="NHWC", ptr=0x7F00_0050_0000)
    dg = FakeArray((8,), "float32", ptr=0x7F00_0060_0000)
    with pytest.raises(OperandError, match=r"batchnorm_backward: operand 'dbeta': out overlaps the memory of 'dgamma'"):
        fusekit.call("batchnorm_backward", dy, x, g, m, v, out=(dx, dg, FakeArray((8,), "float32", ptr=dg.ptr)))


def test_warn_once_warns_once_per_key_and_category():
    import warnings as _w

    from fusekit.errors import LayoutWarning, NumericsWarning, forget_warnings, warn_once

    forget_warnings()
    with _w.catch_warnings(record=True) as got:
        _w.simplefilter("always")
        assert warn_once(("k",), "first", LayoutWarning, stacklevel=1) is True  # as warnings.warn's: 1 = this line
        assert warn_once(("k",), "again", LayoutWarning) is False
        assert warn_once(("k",), "other category", NumericsWarning) is True
        forget_warnings()
        assert warn_once(("k",), "after forgetting", LayoutWarning) is True
    assert [str(w.message) for w in got] == ["first", "other category", "after forgetting"]
    assert got[0].filename == __file__


def test_a_pointer_off_cudnns_alignment_is_refused_before_cudnn(fake):
    """cuDNN's graph tensors are 16-byte aligned: an operand or out= view starting elsewhere (a channel
    slice at an odd offset) is an OperandError naming it, not CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER."""
    x, w, b = good_operands()
    odd = FakeArray(x.shape, layout="NHWC", ptr=x.ptr + 6)
    with raises_operand("x", r"2-byte aligned; cuDNN's graphs need 16-byte aligned arrays \(float16: a view must start at a multiple of 8"):
        fusekit.conv_bias_relu(odd, w, FakeArray((16,)), padding=1)
    with raises_operand("y", r"8-byte aligned"):
        fusekit.conv_bias_relu(x, w, FakeArray((16,)), padding=1, out=FakeArray((2, 16, 9, 9), layout="NHWC", ptr=0x7F00_1000_0008))


def test_channel_slices_of_one_buffer_interleave_without_overlapping(fake):
    """A conv reading channels [0, 8) of a 32-channel channels-last buffer may write channels [8, 24) of
    it (in every pixel the two ranges are apart); writing [0, 16) would overwrite what it reads."""
    pitch, base = 32, 0x7F00_2000_0000
    st = (9 * 9 * pitch, 1, 9 * pitch, pitch)
    x = FakeArray((2, 8, 9, 9), strides=st, ptr=base)
    w = FakeArray((16, 8, 3, 3), layout="NHWC")
    with pytest.raises(AssertionError, match="reached cuDNN"):
        fusekit.conv_bias_relu(x, w, FakeArray((16,)), padding=1, out=FakeArray((2, 16, 9, 9), strides=st, ptr=base + 8 * 2))
    with raises_operand("y", r"out overlaps the memory of 'x'"):
        fusekit.conv_bias_relu(x, w, FakeArray((16,)), padding=1, out=FakeArray((2, 16, 9, 9), strides=st, ptr=base))
