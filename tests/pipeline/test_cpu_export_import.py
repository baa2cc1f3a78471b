"""CPU: the torch.export importer (``importer="export"``): an ATen graph read into the same primitive
stages and lowered by the same rules as the fx importer's, checked against float64 eager."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import fusekit.pipeline as fp  # noqa: E402
from fusekit.errors import OperandError, UnsupportedError  # noqa: E402
from helpers import rel_max  # noqa: E402


def _check(m, shape, importer="export", seed=0):
    x = np.random.default_rng(seed).standard_normal(shape) * 2
    prog = fp.lower_model(m, shape, importer=importer)
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    m.float()
    assert rel_max(fp.Pipeline(prog).reference(x), want) < 1e-12, str(prog)
    return prog


def _randomize_bn(m):
    g = torch.Generator().manual_seed(0)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(torch.rand(mod.num_features, generator=g) - 0.5)
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
    return m.eval()


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "shufflenet_v2_x0_5", "efficientnet_b0", "densenet121", "convnext_tiny"])
def test_torchvision_models_lower_as_the_fx_importer_lowers_them(name):
    """The same stages (patterns in order) as torch.fx gives, matching float64 eager."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    m = _randomize_bn(tv.models.get_model(name))
    shape = (2, 3, 48, 48)
    prog = _check(m, shape)
    assert prog.source == "torch.export"
    assert [s.pattern for s in prog.stages] == [s.pattern for s in fp.lower_model(m, shape).stages]


class Forms(nn.Module):
    """Module and functional forms of the same layers."""

    def __init__(self, functional):
        super().__init__()
        self.functional = functional
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.Linear(8, 5)
        self.act, self.pool = nn.SiLU(), nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        y = self.conv(x)
        if self.functional:
            y = F.silu(F.batch_norm(y, self.bn.running_mean, self.bn.running_var, self.bn.weight, self.bn.bias, False, 0.1, self.bn.eps))
            return self.fc(y.mean((2, 3)))
        return self.fc(torch.flatten(self.pool(self.act(self.bn(y))), 1))


def test_module_and_functional_forms_are_one_stage_list():
    mod, fun = _randomize_bn(Forms(False)), _randomize_bn(Forms(True))
    fun.load_state_dict(mod.state_dict())
    a, b = _check(mod, (2, 3, 8, 8)), _check(fun, (2, 3, 8, 8))
    assert [s.pattern for s in a.stages] == [s.pattern for s in b.stages] == ["conv_bias_act", "avg_pool2d", "reshape", "linear_bias"]


class Branchy(nn.Module):
    """Python control flow on the input's size: torch.fx cannot trace it, torch.export specializes it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)

    def forward(self, x):
        return F.relu(self.a(x) if x.shape[-1] > 6 else self.b(x))


def test_shape_control_flow_is_specialized_where_fx_falls_back():
    m = Branchy().eval()
    prog = _check(m, (1, 3, 8, 8))
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu"] and prog.stages[0].weights["w"].shape[2:] == (3, 3)
    with pytest.raises(UnsupportedError, match='torch.fx cannot trace Branchy.*importer="export"'):
        fp.lower_model(m, (1, 3, 8, 8))


class Leftovers(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, 1)
        y = torch.cat([b.clamp_(min=-0.5), a], 1)  # an in-place op without a rule
        return y.permute(0, 1, 3, 2)


def test_ops_without_rules_are_out_of_place_fallbacks_and_channel_items_are_views():
    x = torch.randn(1, 16, 4, 5)
    prog = _check(Leftovers().eval(), tuple(x.shape))
    clamp = next(s for s in prog.stages if s.attrs.get("op", "").startswith("clamp"))
    assert clamp.fallback and clamp.attrs["op"] == "clamp" and not str(clamp.fn).endswith("_.Tensor") and "clamp_" not in str(clamp.fn)
    assert sorted(s.attrs["channel_slice"] for s in prog.stages if "channel_slice" in s.attrs) == [0, 8]
    assert any(s.pattern == "concat" for s in prog.stages) and prog.stages[-1].attrs.get("op") == "permute"


def test_importer_is_checked_and_an_unexportable_model_is_named():
    with pytest.raises(OperandError, match="importer"):
        fp.lower_model(nn.Conv2d(3, 4, 1), (1, 3, 4, 4), importer="onnx")

    class Bad(nn.Module):
        def forward(self, x):
            return x.sum() if float(x.sum()) > 0 else x  # data-dependent control flow

    with pytest.raises(UnsupportedError, match="torch.export could not export Bad"):
        fp.lower_model(Bad(), (1, 3, 4, 4), importer="export")


@pytest.mark.parametrize("name", ["ecaresnet26t", "convnext_atto"])
def test_timm_eca_and_convnext_blocks_lower_as_with_fx(name):
    """timm's ECA gate (view, aten.conv1d, sigmoid, view, expand_as: one banded 1x1 conv) and ConvNeXt's
    channels-last blocks (a layer scale computed from its parameter, gamma.reshape(1, -1, 1, 1), folded
    at import) give the fx importer's stages."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    m = _randomize_bn(timm.create_model(name, pretrained=False))
    shape = (1, 3, 64, 64)
    prog = _check(m, shape)
    assert not any(s.fallback for s in prog.stages), [s.name for s in prog.stages if s.fallback]
    assert [s.pattern for s in prog.stages] == [s.pattern for s in fp.lower_model(m, shape).stages]


def test_a_node_no_rule_foresaw_is_named(monkeypatch):
    """An exception inside a rule comes out as an UnsupportedError naming the node."""
    from fusekit.pipeline import export_import

    def broken(self, node, op, a):
        raise KeyError("surprise")

    monkeypatch.setattr(export_import.ExportReader, "rule", broken)
    with pytest.raises(UnsupportedError, match=r"cannot import node conv2d \(aten.conv2d.default\).*KeyError"):
        fp.lower_model(nn.Sequential(nn.Conv2d(3, 4, 1)).eval(), (1, 3, 4, 4), importer="export")


class ShapeMask(nn.Module):
    """An additive mask built from the input's shape alone (``x.new_zeros``, a slice set, ``!= 0``,
    ``masked_fill``), as Swin builds its shifted-window attention mask."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        m = x.new_zeros((x.shape[2], x.shape[3]))
        m[: x.shape[2] // 2] = 1.0
        return self.conv(x) + m.masked_fill(m != 0, -3.0).masked_fill(m == 0, 0.5)


def test_values_made_from_an_inputs_shape_alone_fold_to_constants():
    """new_zeros and what follows from it alone fold to one constant (a bool mask never sits in a
    float activation buffer); the conv takes it as its added operand or a fallback adds it."""
    prog = _check(ShapeMask().eval(), (2, 3, 6, 6))
    assert len(prog.stages) <= 2 and not any(s.attrs.get("op") in ("ne", "masked_fill", "new_zeros") for s in prog.stages), str(prog)


class ScaledBlock(nn.Module):
    """NFNet's pattern: a weight standardized in forward, an activation times a Python scalar (its
    gamma), a branch times alpha and divided by beta before the residual add."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, 3, 3))
        self.conv = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        w = (self.w - self.w.mean((1, 2, 3), keepdim=True)) / self.w.std((1, 2, 3), keepdim=True)
        y = F.conv2d(F.silu(x) * 1.7015, w, padding=1)
        return self.conv(y) * 0.2 / 0.98 + x


def test_scalar_factors_fold_and_weights_are_computed_in_float64():
    """``x * k`` and ``x / k`` with a Python scalar are per-channel scales (folded into the conv before
    them, or one scale-shift stage); a weight computed from parameters is folded in float64, so the
    stages match float64 eager to float64 rounding."""
    torch.manual_seed(0)
    prog = _check(ScaledBlock().eval(), (2, 8, 6, 6))
    assert not any(s.fallback for s in prog.stages), [s.name for s in prog.stages if s.fallback]
    assert sum(s.kind == "conv" for s in prog.stages) == 2


class ShapePositions(nn.Module):
    """A positional encoding from the input's shape alone run through a conv with parameters (EdgeNeXt's
    PositionalEncodingFourier): a constant, folded in float64 with the conv's weights."""

    def __init__(self):
        super().__init__()
        self.proj, self.conv = nn.Conv2d(2, 3, 1), nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        n, _, h, w = x.shape
        mask = torch.zeros(n, h, w, device=x.device, dtype=torch.bool)
        ys, xs = (~mask).cumsum(1, dtype=x.dtype), (~mask).cumsum(2, dtype=x.dtype)
        return self.conv(x) + self.proj(torch.stack([ys.sin(), xs.cos()], dim=1))


def test_a_shape_only_value_through_weights_folds_in_float64():
    torch.manual_seed(0)
    prog = _check(ShapePositions().eval(), (2, 3, 5, 6))
    assert len(prog.stages) <= 2, str(prog)
