"""CPU: the pipeline's lowering rules on small models built from the forms modern CNNs use
(functional batch norm, every activation, squeeze-excitation, chunk / split, stochastic depth,
mean over H and W), each checked against the model's float64 eager output."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import fusekit.pipeline as fp  # noqa: E402
from fusekit.errors import UnsupportedError  # noqa: E402


def _randomize_bn(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(torch.rand(mod.num_features, generator=g) - 0.5)
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
            mod.weight.data.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
            mod.bias.data.copy_(torch.rand(mod.num_features, generator=g) - 0.5)
    return m.eval()


def _check(m, shape, seed=1, importer="fx"):
    """Lower m, compare the float64 reference with float64 eager; returns the program."""
    x = np.random.default_rng(seed).standard_normal(shape) * 2
    prog = fp.lower_model(m, shape, importer=importer)
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    m.float()
    got = fp.Pipeline(prog).reference(x)
    assert np.abs(got - want).max() <= 1e-12 * max(np.abs(want).max(), 1.0), str(prog)
    return prog


class BNAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d form: F.batch_norm called functionally, then an activation."""

    def __init__(self, c, act):
        super().__init__(c)
        self.act = act

    def forward(self, x):
        return self.act(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.1, self.eps))


@pytest.mark.parametrize("act", [nn.SiLU(), nn.Hardswish(), nn.GELU(), nn.GELU(approximate="tanh"), nn.Sigmoid(), nn.Tanh(),
                                 nn.Hardsigmoid(), nn.LeakyReLU(0.2), nn.ELU(0.5), nn.ReLU6(), nn.ReLU()], ids=str)
def test_functional_batch_norm_folds_and_every_activation_fuses(act):
    m = _randomize_bn(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), BNAct(8, act)))
    prog = _check(m, (2, 3, 6, 6))
    assert len(prog.stages) == 1 and prog.stages[0].pattern.startswith("conv_bias"), str(prog)
    assert prog.stages[0].pattern in ("conv_bias_act", "conv_bias_relu", "conv_bias_relu6", "conv_bias_hardswish")
    if isinstance(act, nn.Hardsigmoid):  # its constants folded into the conv: a clip at 1
        assert tuple(prog.stages[0].attrs["act"]) == ("clip", 1.0)


@pytest.mark.parametrize("fn", [F.silu, torch.sigmoid, F.hardswish, F.gelu, lambda t: F.leaky_relu(t, 0.3), lambda t: F.elu(t, 2.0),
                                lambda t: F.hardtanh(t, 0.0, 4.0), torch.tanh, lambda t: t.sigmoid()], ids=range(9))
def test_functional_activations_fuse_into_the_conv(fn):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return fn(self.c(x))

    prog = _check(M().eval(), (2, 3, 5, 5))
    assert [s.pattern for s in prog.stages] in (["conv_bias_act"], ["conv_bias_hardswish"]) and prog.fallbacks == []


class SE(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // r, 1), nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(s))))


def test_squeeze_excitation_is_fused_graphs_and_a_gate():
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.SiLU(), SE(16)).eval()
    prog = _check(m, (2, 3, 7, 7))
    assert [s.pattern for s in prog.stages] == ["conv_bias_act", "avg_pool2d", "conv_bias_act", "conv_bias_act", "channel_gate"], str(prog)
    assert [s.attrs.get("act") for s in prog.stages[2:4]] == [("silu", 0.0), ("sigmoid", 0.0)]
    gate = prog.stages[4]
    assert gate.in_shapes == [(2, 16, 7, 7), (2, 16, 1, 1)]  # image first, whichever side of the * it was on


def test_unfolded_batch_norm_act_add_and_mean_forms():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.conv = nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)
            self.drop = nn.Dropout2d(0.5)

        def forward(self, x):
            y = F.relu(self.bn(x))  # pre-activation (DenseNet): scale-shift-act graph
            z = F.silu(y + self.drop(x))  # add without a conv operand, then an activation
            z = self.conv(z)
            return z.mean(3).mean(2) + 0 * z.mean(dim=-1).mean(-1) + z.mean((2, 3))  # int dims, negative dims, a tuple

    prog = _check(_randomize_bn(M()), (2, 4, 5, 5))
    pats = [s.pattern for s in prog.stages]
    assert pats[:3] == ["channel_scale_shift_act", "add_act", "conv_bias"], str(prog)
    assert "avg_pool2d" in pats and "reshape" in pats  # mean((2, 3)) without keepdim: pool then flatten
    assert prog.stages[1].attrs["act"] == ("silu", 0.0)


def test_stochastic_depth_and_drop_path_are_removed():
    tv_ops = pytest.importorskip("torchvision.ops")

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.sd = nn.Conv2d(3, 3, 1), tv_ops.StochasticDepth(0.5, "row")

        def forward(self, x):
            return self.sd(self.c(x)) + x

    prog = _check(M().eval(), (2, 3, 4, 4))
    assert [s.pattern for s in prog.stages] == ["conv_bias_add"], str(prog)


@pytest.mark.parametrize("split", ["chunk", "split", "unbind"])
def test_several_outputs_become_one_stage_per_item(split):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            if split == "chunk":
                a, b = x.chunk(2, dim=1)
            elif split == "split":
                a, b = torch.split(x, [1, 3], dim=1)
                a = a.expand(-1, 3, -1, -1)
            else:
                a, b = x[:, :2].unbind(1)[0:2]
                a, b = a.unsqueeze(1), b.unsqueeze(1)
            return torch.cat([F.relu(a), b], 1) * 2

    prog = _check(M().eval(), (2, 4, 3, 3))
    assert any("[0]" in s.attrs.get("op", "") for s in prog.stages), str(prog)


def test_shufflenet_convnext_and_vit_lower_and_match():
    tv = pytest.importorskip("torchvision")
    for name, shape in (("shufflenet_v2_x0_5", (1, 3, 64, 64)), ("convnext_tiny", (1, 3, 32, 32))):
        torch.manual_seed(0)
        prog = _check(_randomize_bn(tv.models.get_model(name, weights=None)), shape)
        pats = [s.pattern for s in prog.stages]
        if name == "convnext_tiny":  # every LayerNorm over channels (stem, 18 blocks, 3 downsamplings, head) is a layer-norm graph
            assert pats.count("layernorm") == 23 and not prog.fallbacks, prog.fallbacks
        else:  # chunks are channel slices, concatenations planned in place, shuffles fusekit's kernel
            assert pats.count("channel_shuffle") == 16 and not prog.fallbacks, prog.fallbacks
    torch.manual_seed(0)
    vit = tv.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    _check(vit, (1, 3, 32, 32))  # MultiheadAttention returns (output, weights): its first item is a stage


def test_a_node_that_cannot_import_is_named():
    class M(nn.Module):
        def forward(self, x):
            return x.chunk(2, 1)  # returns several tensors: the model must return one

    with pytest.raises(UnsupportedError, match="one tensor"):
        fp.lower_model(M(), (1, 4, 2, 2))

    class N(nn.Module):
        def forward(self, x):
            parts = x.chunk(2, 1)
            return torch.stack(parts).sum(0)  # reads the several tensors whole

    with pytest.raises(UnsupportedError, match="several tensors"):
        fp.lower_model(N(), (1, 4, 2, 2))


def test_rules_are_a_table_of_small_rules():
    import inspect

    assert len(fp.RULES) >= 6 and all(isinstance(r, fp.Rule) for r in fp.RULES)
    for r in fp.RULES:
        for f in (r.match, r.rewrite):
            assert len(inspect.getsource(f).splitlines()) <= 80, (r.name, f.__name__)


@pytest.mark.parametrize("sizes", [[], [0, 4], [-1], ["8"], [1.5], [True], None.__class__])
def test_batch_sizes_are_checked_before_any_work(sizes):
    from fusekit.errors import OperandError

    m = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    with pytest.raises(OperandError, match="batch_sizes"):
        fp.compile(m, (1, 3, 8, 8), batch_sizes=sizes)


def test_batch_sizes_need_the_batch_as_the_outputs_first_dimension():
    from fusekit.errors import OperandError

    class Flat(nn.Module):
        def forward(self, x):
            return torch.flatten(x)

    with pytest.raises(OperandError, match="first dimension is the batch"):
        fp.compile(Flat(), (1, 3, 8, 8), batch_sizes=[1, 2])


class _LayerNorm2d(nn.LayerNorm):
    """torchvision's / timm's LayerNorm2d: a LayerNorm over channels through two permutes."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class _CNBlock(nn.Module):
    """ConvNeXt's block: depthwise 7x7, then per position LayerNorm -> Linear -> GELU -> Linear on the
    (N, H, W, C) permute, a layer scale, the residual."""

    def __init__(self, c, scale_shape):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.fc1, self.act, self.fc2 = nn.LayerNorm(c, eps=1e-6), nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c)
        self.layer_scale = nn.Parameter(torch.rand(*scale_shape) + 0.5)
        self.timm = len(scale_shape) == 1

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(self.act(self.fc1(self.norm(y))))
        if self.timm:  # timm: the scale on the (N, H, W, C) value
            return x + (y * self.layer_scale).permute(0, 3, 1, 2)
        return x + self.layer_scale * y.permute(0, 3, 1, 2)  # torchvision: (C, 1, 1) on the image


@pytest.mark.parametrize("scale_shape", [(16, 1, 1), (16,)])
def test_convnext_block_lowers_to_channel_ops_without_permutes(scale_shape):
    """The permuted region becomes channel ops on the image: the Linears 1x1 convolutions (GELU and the
    layer scale fused into them, the residual added in the second), LayerNorm over channels the one
    PyTorch stage, no permute left."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), _LayerNorm2d(16), _CNBlock(16, scale_shape), _CNBlock(16, scale_shape)).eval()
    prog = _check(m, (2, 3, 32, 32))
    pats = [s.pattern for s in prog.stages]
    assert pats == ["conv_bias", "layernorm"] + ["conv_bias", "layernorm", "conv_bias_act", "conv_bias_add"] * 2, pats
    assert [s.attrs["act"][0] for s in prog.stages if s.pattern == "conv_bias_act"] == ["gelu", "gelu"]
    assert not prog.fallbacks


def test_channels_last_value_read_by_an_op_without_a_rule_is_made_real():
    """An (N, H, W, C) permute read by something else (a sum over channels) is materialized once, as PyTorch has it."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 8)

        def forward(self, x):
            y = self.conv(x).permute(0, 2, 3, 1)
            return self.fc(y).permute(0, 3, 1, 2) + y.sum(-1, keepdim=True).permute(0, 3, 1, 2)

    prog = _check(M().eval(), (2, 3, 10, 10))
    assert sum(s.attrs.get("op") == "permute" for s in prog.stages) == 1


def test_pytorch_stages_write_into_the_planned_buffer_as_they_compute_without_it():
    """run_torch_stage(..., out=buffer) (what a built pipeline's PyTorch stages do: no temporary and copy
    for elementwise stages) gives what it returns without ``out``, into a channels-last view, for every
    kind of stage a modern CNN lowers to."""
    from fusekit.pipeline.ir import run_torch_stage
    from fusekit.pipeline.reference import evaluate

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.dw, self.se1, self.se2 = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
            self.bn2 = nn.BatchNorm2d(8)

        def forward(self, x):
            y = F.hardswish(self.bn1(self.c1(x)))
            z = F.silu(self.dw(y))
            z = z * torch.sigmoid(self.se2(F.relu(self.se1(z.mean((2, 3), keepdim=True)))))
            z = F.elu(self.bn2(F.max_pool2d(z + y, 2)), 0.7)
            return torch.cat([F.mish(z), z], 1)

    m = Net().eval()
    _randomize_bn(m, 3)
    prog = fp.lower_model(m, (2, 3, 12, 12))
    x = np.random.default_rng(4).standard_normal((2, 3, 12, 12))
    env = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in evaluate(prog, x, keep=True).items()}
    kinds = set()
    for s in prog.stages:
        w = {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in s.weights.items()}
        fn = s.fn.double() if isinstance(s.fn, nn.Module) else s.fn
        want = run_torch_stage(s, env, fn, w, dtype=torch.float64)
        buf = torch.full(want.shape, float("nan"), dtype=torch.float64)
        out = buf.contiguous(memory_format=torch.channels_last) if buf.dim() == 4 else buf
        got = run_torch_stage(s, env, fn, w, dtype=torch.float64, out=out)
        assert got is out and torch.allclose(out, want, rtol=1e-12, atol=1e-12), s.describe()
        kinds.add(s.kind)
    assert {"conv", "bn", "add", "mul", "gap", "torch"} <= kinds, kinds
    assert any(s.attrs.get("op") == "cat" for s in prog.stages)  # torch.cat(..., out=buffer)


@pytest.mark.parametrize("out_format", ["channels_last", "contiguous_format"])
@pytest.mark.parametrize("in_format", ["channels_last", "contiguous_format"])
def test_every_activation_written_into_a_buffer_of_either_layout(in_format, out_format):
    from fusekit.engine.patterns import ACTIVATIONS
    from fusekit.pipeline.ir import torch_act

    x = (torch.randn(2, 8, 5, 5, generator=torch.Generator().manual_seed(5)) * 3).contiguous(memory_format=getattr(torch, in_format))
    for act in ACTIVATIONS:
        a = (act, {"clip": 6.0, "leaky_relu": 0.1, "elu": 0.7}.get(act, 0.0))
        out = torch.full((2, 8, 5, 5), float("nan")).contiguous(memory_format=getattr(torch, out_format))
        assert torch_act(x, a, out) is out and torch.allclose(out, torch_act(x, a), atol=1e-6), act


def test_a_submodule_fx_cannot_trace_is_exported_or_else_one_fallback_stage():
    """Python control flow on the input's shape inside a submodule (timm's Conv2dSame, VGG's ConvMlp):
    that submodule is read through torch.export for the fixed size and its stages spliced in (its pad
    folded into the conv); one with control flow on values (export cannot read it) stays whole, one
    PyTorch stage. An nn.Conv2d subclass with its own forward is not mistaken for a plain convolution."""

    class SamePad(nn.Conv2d):
        def forward(self, x):
            if x.shape[-1] % 2:  # control flow on the input's shape: fx cannot trace it, export specializes it
                x = F.pad(x, (0, 1, 0, 1))
            return super().forward(x)

    class Gate(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # on values: neither fx nor export

    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), SamePad(8, 8, 2, stride=2), Gate(),
                      nn.Conv2d(8, 4, 1), nn.SiLU()).eval()
    _randomize_bn(m, 4)
    prog = _check(m, (2, 3, 9, 9))
    assert [s.pattern for s in prog.stages] == ["conv_bias_relu", "conv_bias_act", "torch", "conv_bias_act"], str(prog)
    assert prog.stages[1].attrs["extra_padding"] == (1, 1) and prog.stages[1].name.startswith("_3.")
    assert [s.attrs["op"] for s in prog.stages if s.fallback] == ["Gate"]


@pytest.mark.parametrize("contiguous,back", [(True, "view"), (False, "reshape"), (True, "flatten")])
def test_channel_shuffle_is_one_stage(contiguous, back):
    """ShuffleNet's x.view(n, g, c // g, h, w).transpose(1, 2)[.contiguous()].view(n, c, h, w): one
    channel_shuffle stage (fusekit's kernel, one pass) instead of three copies."""

    class Shuffle(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 12, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            n, c, h, w = y.size()
            y = y.view(n, 3, c // 3, h, w).transpose(1, 2)
            if contiguous:
                y = y.contiguous()
            y = torch.flatten(y, 1, 2) if back == "flatten" else getattr(y, back)(n, c, h, w)
            return torch.relu(y)

    prog = _check(Shuffle().eval(), (2, 3, 6, 6))
    assert [s.pattern for s in prog.stages] == ["conv_bias", "channel_shuffle", "act"] and not prog.fallbacks, str(prog)
    assert prog.stages[1].attrs["groups"] == 3


def test_channel_layer_norm_stage_matches_pytorch_and_its_rows_view():
    """A cln stage: PyTorch's run (what the pipeline checks cuDNN's against) and the float64 oracle on
    the image read as rows of channels both give F.layer_norm over the channels."""
    from fusekit.engine import oracle
    from fusekit.pipeline.ir import Stage, channel_rows, from_pixel_rows, fused_operands, run_torch_stage

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 3, 4))
    g, b = rng.uniform(0.5, 1.5, 5), rng.uniform(-0.5, 0.5, 5)
    s = Stage("cln", ["x"], "y", pattern="layernorm", weights={"gamma": g, "beta": b}, attrs={"eps": 1e-6}, out_shape=x.shape)
    want = torch.nn.functional.layer_norm(torch.from_numpy(x).permute(0, 2, 3, 1), (5,), torch.from_numpy(g), torch.from_numpy(b), 1e-6)
    want = want.permute(0, 3, 1, 2).numpy()
    got = run_torch_stage(s, {"x": torch.from_numpy(x)}, None, {"gamma": torch.from_numpy(g), "beta": torch.from_numpy(b)}).numpy()
    assert np.abs(got - want).max() < 1e-12
    ops, attrs = fused_operands(s, {"x": x}, s.weights)
    assert ops[0].shape == (2 * 3 * 4, 5, 1, 1) and attrs == {"epsilon": 1e-6}
    rows = oracle.evaluate("layernorm", *ops, **attrs)[0]
    assert np.abs(from_pixel_rows(rows, x.shape) - want).max() < 1e-12
    assert np.array_equal(from_pixel_rows(channel_rows(x), x.shape), x)


class _Eca(nn.Module):
    """ECA channel attention as timm writes it: a Conv1d across the pooled channels, a sigmoid, and an
    expand_as before the multiply."""

    def __init__(self, k: int = 5, dilation: int = 1, bias: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 1, k, padding=dilation * (k - 1) // 2, dilation=dilation, bias=bias)

    def forward(self, x):
        y = self.conv(x.mean((2, 3)).view(x.shape[0], 1, -1))
        return x * torch.sigmoid(y).view(x.shape[0], -1, 1, 1).expand_as(x)


@pytest.mark.parametrize(("k", "dilation", "bias"), [(3, 1, False), (5, 1, True), (3, 2, False)])
def test_eca_conv1d_lowers_to_a_1x1_convolution_and_a_channel_gate(k, dilation, bias):
    """The Conv1d over the pooled channels is a 1x1 convolution with a banded weight (its sigmoid fused),
    the expand_as is dropped and the multiply is the channel gate, folded into the 1x1 projection after
    it: no PyTorch stage; float64 as eager."""
    torch.manual_seed(k + dilation)
    m = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), _Eca(k, dilation, bias), nn.Conv2d(12, 4, 1)).eval()
    prog = fp.lower_model(m, (2, 3, 6, 6))
    assert [s.pattern for s in prog.stages] == ["conv_bias", "avg_pool2d", "conv_bias_act", "batched_matmul_bias"], str(prog)
    assert prog.stages[2].attrs["act"] == ("sigmoid", 0.0) and not prog.fallbacks
    x = np.random.default_rng(k).standard_normal((2, 3, 6, 6))
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() / np.abs(want).max() < 1e-12


def test_a_conv1d_that_is_not_eca_stays_pytorch():
    """A Conv1d whose padding changes the length is not a channel mixing: it stays a PyTorch stage."""

    class Odd(_Eca):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(1, 1, 3, padding=0)

        def forward(self, x):
            y = self.conv(x.mean((2, 3)).view(x.shape[0], 1, -1))
            return y.view(x.shape[0], -1)

    prog = fp.lower_model(nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), Odd()).eval(), (2, 3, 6, 6))
    assert any(s.attrs.get("op") == "Conv1d" for s in prog.stages if s.fallback), str(prog)


def test_channel_rows_of_a_dense_channels_last_image_are_a_view_and_of_a_slice_a_copy():
    """A built pipeline runs the layer-norm graph on rows of channels only where those rows are a view
    of the planned buffer (a copy taken at build would be stale at every later call)."""
    from fusekit.pipeline.ir import channel_rows
    from fusekit.pipeline.ir import is_view_of

    dense = torch.randn(2, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    assert is_view_of(channel_rows(dense), dense)
    wide = torch.randn(2, 3, 3, 16)  # an NHWC buffer of 16 channels; channels 4..11 as an (N, C, H, W) slice
    part = wide[..., 4:12].permute(0, 3, 1, 2)
    assert not is_view_of(channel_rows(part), part)
    nchw = torch.randn(2, 8, 3, 3)
    assert not is_view_of(channel_rows(nchw), nchw)  # NCHW memory: the rows are a copy


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("conv_bias", [True, False])
def test_one_batch_norm_fold_for_numpy_and_torch(affine, conv_bias):
    """engine.folding's (scale, shift) and its fold into a convolution give eval-mode BatchNorm2d of
    the convolution, on NumPy arrays and on torch tensors alike (the pipeline's and fusekit.torch's)."""
    from fusekit.engine.folding import bn_scale_shift, fold_into_conv

    torch.manual_seed(int(affine) * 2 + int(conv_bias))
    conv, bn = nn.Conv2d(3, 6, 3, bias=conv_bias).double(), nn.BatchNorm2d(6, affine=affine).double().eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    want = bn(conv(x)).detach()
    g, b = (bn.weight.detach(), bn.bias.detach()) if affine else (None, None)
    for lib in ("torch", "numpy"):
        cv = (lambda t: t) if lib == "torch" else (lambda t: None if t is None else t.detach().numpy())  # noqa: E731
        scale, shift = bn_scale_shift(cv(bn.running_mean), cv(bn.running_var), bn.eps, cv(g), cv(b))
        w, bias = fold_into_conv(cv(conv.weight.detach()), cv(conv.bias.detach()) if conv_bias else None, scale, shift)
        got = nn.functional.conv2d(x, torch.as_tensor(w), torch.as_tensor(bias))
        assert float((got - want).abs().max()) < 1e-12, lib


@pytest.mark.parametrize("importer", ["fx", "export"])
@pytest.mark.parametrize("size", [8, 9])
def test_timm_same_padding_conv_lowers_for_the_fixed_size(size, importer):
    """timm's Conv2dSame (TensorFlow "same" padding from the input size): a plain convolution where the
    padding is symmetric (odd sizes at stride 2), else its one-sided pad folded into the convolution
    as padding after the input (conv_bias_act's extra_padding); no fallback, float64 as eager."""
    conv2d_same = pytest.importorskip("timm.layers.conv2d_same")
    torch.manual_seed(size)
    m = nn.Sequential(conv2d_same.Conv2dSame(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                      conv2d_same.Conv2dSame(8, 8, 3, stride=1, groups=8)).eval()
    _randomize_bn(m)
    prog = fp.lower_model(m, (2, 3, size, size), importer=importer)
    pats = [s.pattern for s in prog.stages]
    assert pats == (["conv_bias_act", "conv_bias"] if size % 2 == 0 else ["conv_bias_relu", "conv_bias"]), str(prog)
    if size % 2 == 0:
        assert prog.stages[0].attrs["extra_padding"] == (1, 1) and tuple(prog.stages[0].attrs["padding"]) == (0, 0)
        assert tuple(prog.stages[0].attrs["act"]) == ("relu", 0.0)
    x = np.random.default_rng(size).standard_normal((2, 3, size, size))
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() / np.abs(want).max() < 1e-12


class _StringPadded(nn.Module):
    """PyTorch's padding="same" / "valid" on modules and on F.conv2d: odd and even kernels, dilation, depthwise."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 9, padding="same")
        self.b = nn.Conv2d(8, 8, 4, padding="same", groups=8)
        self.c = nn.Conv2d(8, 8, 3, padding="same", dilation=2)
        self.d = nn.Conv2d(8, 4, 2, padding="valid")

    def forward(self, x):
        x = F.gelu(self.a(x))
        x = self.b(x) + x
        x = F.conv2d(x, self.c.weight, self.c.bias, padding="same", dilation=2)
        return self.d(x)


@pytest.mark.parametrize("importer", ["fx", "export"])
def test_string_padding_lowers_to_convolutions(importer):
    """padding="same" (stride 1: d * (k - 1) in all, the odd row and column after the input, as PyTorch
    pads) and "valid" lower to conv stages, the one-sided part as extra_padding; no fallback, float64 as eager."""
    torch.manual_seed(3)
    prog = _check(_StringPadded().eval(), (2, 3, 13, 11), seed=3, importer=importer)
    assert not prog.fallbacks, str(prog)
    pads = [(tuple(s.attrs["padding"]), tuple(s.attrs.get("extra_padding", (0, 0)))) for s in prog.stages]
    assert pads == [((4, 4), (0, 0)), ((1, 1), (1, 1)), ((2, 2), (0, 0)), ((0, 0), (0, 0))], str(prog)


class _HalfSplit(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.a(x)
        c = y.shape[1]  # a traced size: the slices' bounds are fx nodes
        return torch.relu(self.b(y[:, : c // 2])) + y[:, c // 2 :]


def test_channel_slices_with_traced_bounds_are_views():
    """x[:, : c // 2] with c read from the traced shape: the bounds resolve to their values, and the
    halves are channel slices (views), not an error from the shape inference."""
    prog = _check(_HalfSplit().eval(), (2, 3, 6, 6))
    assert [s.pattern for s in prog.stages] == ["conv_bias", "channel_slice", "conv_bias_relu", "channel_slice", "add_act"], str(prog)


class _Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.a(x)
        z = 0 + self.bn(y)  # MobileOne: an empty branch's 0 plus the identity branch
        z = 1.5 - (z + self.b(y))
        return torch.relu(z - 0.25) + 2


@pytest.mark.parametrize("importer", ["fx", "export"])
def test_image_plus_or_minus_a_number_is_a_channel_shift(importer):
    """x + k, k + x, x - k and k - x with a Python number k: an identity for k = 0, else a per-channel
    scale-shift stage, consecutive ones merged (1.5 - z, then - 0.25, one stage with the ReLU fused);
    no fallback, float64 as eager."""
    torch.manual_seed(4)
    m = _Shifted().eval()
    _randomize_bn(m)
    prog = _check(m, (2, 3, 6, 6), seed=4, importer=importer)
    assert not prog.fallbacks, str(prog)
    assert [s.pattern for s in prog.stages] == ["conv_bias", "channel_scale_shift_act", "conv_bias_add", "channel_scale_shift_act",
                                                "channel_scale_shift_act"], str(prog)
    assert tuple(prog.stages[3].attrs["act"]) == ("relu", 0.0) and prog.stages[3].name.count("+") == 2, str(prog)  # two shifts and the ReLU


class _Padded(nn.Module):
    def __init__(self, pad, **kw):
        super().__init__()
        self.pad, self.kw, self.conv = pad, kw, nn.Conv2d(4, 6, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(F.pad(x, self.pad, **self.kw))


@pytest.mark.parametrize("importer", ["fx", "export"])
@pytest.mark.parametrize(("pad", "kw", "folded"), [
    ([0, 1, 0, 1], {}, True), ([1, 2, 0, 3], {}, True), ([2, 2, 1, 1], {"value": 0.0}, True),
    ([1, 0, 0, 1], {}, False), ([0, 1, 0, 1], {"value": 1.0}, False), ([1, 1, 1, 1], {"mode": "reflect"}, False)])
def test_a_zero_pad_folds_into_the_conv_after_it_and_other_pads_stay_pytorch(pad, kw, folded, importer):
    """F.pad with zeros, padding after at least as much as before, becomes the conv's padding (the
    excess after as extra_padding); a non-zero value, a reflect pad or more padding before than after
    stays a PyTorch stage. Float64 as eager either way."""
    torch.manual_seed(len(pad))
    m = _Padded(pad, **kw).eval()
    x = np.random.default_rng(3).standard_normal((2, 4, 8, 7))
    prog = fp.lower_model(m, x.shape, importer=importer)
    assert any(s.fallback for s in prog.stages) != folded, str(prog)
    if folded:
        (s,) = prog.stages
        assert tuple(s.attrs["padding"]) == (1 + pad[2], 1 + pad[0])
        assert tuple(s.attrs.get("extra_padding", (0, 0))) == (pad[3] - pad[2], pad[1] - pad[0])
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() / np.abs(want).max() < 1e-12


class _MBConvTail(nn.Module):
    """EfficientNet's block end: depthwise conv, SE gate, 1x1 projection + BN (+ the block's input)."""

    def __init__(self, c, k, residual):
        super().__init__()
        self.dw, self.se = nn.Conv2d(c, c, 3, padding=1, groups=c), SE(c)
        self.proj, self.bn, self.residual = nn.Conv2d(c, k, 1, bias=False), nn.BatchNorm2d(k), residual

    def forward(self, x):
        y = self.bn(self.proj(self.se(F.silu(self.dw(x)))))
        return y + x if self.residual else y


@pytest.mark.parametrize(("c", "k", "hw", "residual", "folded"), [
    (16, 8, 6, False, True), (16, 16, 6, True, True), (16, 36, 6, False, True), (16, 37, 6, False, False), (24, 24, 5, True, True)])
def test_gated_projection_is_a_batched_matmul_where_its_weights_are_smaller(c, k, hw, residual, folded):
    """conv1x1(x * gate) (+ BN, + residual) is one gconv stage, a batched matmul of x's pixel rows by
    the gate-scaled weights, where N*C*K <= N*H*W*C (K <= H*W); else the gate and the conv stay
    apart. Float64 as eager either way."""
    torch.manual_seed(c + k)
    prog = _check(_randomize_bn(_MBConvTail(c, k if not residual else c, residual)), (2, c, hw, hw))
    pats = [s.pattern for s in prog.stages]
    if folded:
        assert pats[-1] == ("batched_matmul_bias_add" if residual else "batched_matmul_bias") and "channel_gate" not in pats, str(prog)
        g = prog.stages[-1]
        assert g.kind == "gconv" and g.in_shapes[:2] == [(2, c, hw, hw), (2, c, 1, 1)]
        assert g.weights["wt"].shape == (c, g.out_shape[1])
    else:
        assert pats[-2:] == ["channel_gate", "conv_bias"], str(prog)


def test_gated_projection_needs_a_plain_1x1_convolution():
    """A 3x3, strided or grouped convolution after the gate, or a gate read twice, keeps the multiply."""

    class M(nn.Module):
        def __init__(self, conv, twice=False):
            super().__init__()
            self.se, self.conv, self.twice = SE(8), conv, twice

        def forward(self, x):
            g = self.se(x)
            return self.conv(g) + (g.mean() if self.twice else 0)

    for m in (M(nn.Conv2d(8, 4, 3, padding=1)), M(nn.Conv2d(8, 4, 1, stride=2)), M(nn.Conv2d(8, 4, 1, groups=2)),
              M(nn.Conv2d(8, 4, 1), twice=True)):
        prog = _check(m.eval(), (2, 8, 6, 6))
        assert not any(s.kind == "gconv" for s in prog.stages) and any(s.pattern == "channel_gate" for s in prog.stages), str(prog)


def test_pixel_rows_of_a_dense_channels_last_image_are_a_view():
    from fusekit.pipeline.ir import from_pixel_rows, gate_scaled_weights, pixel_rows
    from fusekit.pipeline.ir import is_view_of

    x = torch.randn(2, 8, 3, 5).contiguous(memory_format=torch.channels_last)
    r = pixel_rows(x)
    assert r.shape == (2, 15, 8) and is_view_of(r, x)
    assert torch.equal(from_pixel_rows(r, x.shape), x)
    assert not is_view_of(pixel_rows(x.contiguous()), x.contiguous())
    gate, w = torch.rand(2, 8, 1, 1, dtype=torch.float64), torch.randn(4, 8, 1, 1, dtype=torch.float64)
    xd = x.double()
    sw = gate_scaled_weights(gate, w.reshape(4, 8).t())
    want = F.conv2d(xd * gate, w)
    assert torch.allclose(from_pixel_rows(pixel_rows(xd) @ sw, want.shape), want, atol=1e-12)


class SplitAttention(nn.Module):
    """ResNeSt's split attention as timm writes it: radix paths as one (N, r, C, H, W) view of a grouped
    convolution's output, a gate from their sum, rSoftMax over the paths, the weighted sum."""

    def __init__(self, c=16, radix=2, cardinality=1):
        super().__init__()
        self.radix, self.card = radix, cardinality
        self.conv = nn.Conv2d(c, c * radix, 3, padding=1, groups=radix * cardinality)
        self.fc1, self.fc2 = nn.Conv2d(c, 8, 1), nn.Conv2d(8, c * radix, 1)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        b, rc, h, w = x.shape
        x = x.reshape((b, self.radix, rc // self.radix, h, w))
        gap = x.sum(dim=1).mean((2, 3), keepdim=True)
        attn = self.fc2(torch.relu(self.fc1(gap)))
        attn = attn.view(b, self.card, self.radix, -1).transpose(1, 2)
        attn = torch.softmax(attn, dim=1).reshape(b, -1).view(b, -1, 1, 1)
        return (x * attn.reshape((b, self.radix, rc // self.radix, 1, 1))).sum(dim=1)


class SelectiveKernel(nn.Module):
    """SKNet's selective kernel: two paths stacked, a gate from their sum, softmax over the paths."""

    def __init__(self, c=16):
        super().__init__()
        self.p0, self.p1 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=2, dilation=2)
        self.reduce, self.select = nn.Conv2d(c, 8, 1), nn.Conv2d(8, 2 * c, 1)

    def forward(self, x):
        x = torch.stack([torch.relu(self.p0(x)), torch.relu(self.p1(x))], dim=1)
        b, n, c, h, w = x.shape
        attn = self.select(torch.relu(self.reduce(x.sum(1).mean((2, 3), keepdim=True)))).view(b, n, c, 1, 1)
        return (x * torch.softmax(attn, dim=1)).sum(dim=1)


@pytest.mark.parametrize("importer", ["fx", "export"])
@pytest.mark.parametrize("make", [SplitAttention, lambda: SplitAttention(radix=4, cardinality=2), SelectiveKernel],
                         ids=["resnest-r2", "resnest-r4-card2", "sknet"])
def test_split_attention_and_selective_kernels_lower_to_images_only(make, importer):
    """No 5-D value is left: the sums over paths become channel slices, per-path gates and adds, and
    the softmax over the paths one radix_softmax stage (fusekit's kernel); nothing runs on PyTorch;
    float64 matches eager."""
    torch.manual_seed(0)
    block = make()
    x = np.random.default_rng(2).standard_normal((2, 16, 6, 6))
    prog = fp.lower_model(block.eval(), x.shape, importer=importer)
    assert all(len(s.out_shape) <= 4 for s in prog.stages), str(prog)
    assert not any(s.fallback for s in prog.stages) and [s.pattern for s in prog.stages].count("radix_softmax") == 1, str(prog)
    assert sum(s.pattern == "channel_slice" for s in prog.stages) >= 2 and any(s.pattern == "channel_gate" for s in prog.stages)
    want = block.double()(torch.from_numpy(x)).detach().numpy()
    block.float()
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() <= 1e-12 * np.abs(want).max()


class StdConv(nn.Conv2d):
    """timm's ScaledStdConv2d form: weights standardized in the forward, then F.conv2d."""

    def forward(self, x):
        w = nn.functional.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                                     eps=1e-6).reshape_as(self.weight)
        return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


def test_weight_standardized_convs_and_scalar_multiplies_are_fused_stages():
    """NFNets: a conv whose weights the forward computes from its parameters (a constant in eval) is a
    conv stage; ``x * 0.2`` and ``2.0 * x`` are per-channel scales (folded into the conv before where
    they can be). The trace runs in float64, so the computed weights are exact: float64 agrees to 1e-12."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = StdConv(4, 8, 3, padding=1), StdConv(8, 8, 1, groups=2)

        def forward(self, x):
            y = torch.relu(self.c1(x)) * 0.2
            return 2.0 * self.c2(y)

    torch.manual_seed(0)
    m = Block().eval()
    x = np.random.default_rng(3).standard_normal((2, 4, 6, 6))
    prog = fp.lower_model(m, x.shape)
    assert not prog.fallbacks and [s.kind for s in prog.stages].count("conv") == 2, str(prog)
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() <= 1e-12 * np.abs(want).max()


class _FunctionalHead(nn.Module):
    """Pools and a classifier called functionally (timm's Inception blocks and its Linear)."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 5)

    def forward(self, x):
        y = F.avg_pool2d(F.relu(self.conv(x)), kernel_size=3, stride=1, padding=1)
        y = F.max_pool2d(y, 3, 2, ceil_mode=True)
        y = F.avg_pool2d(y, 2, count_include_pad=False)
        return F.linear(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1), self.fc.weight, self.fc.bias)


def test_functional_pools_and_linear_lower_as_their_modules():
    prog = _check(_FunctionalHead().eval(), (2, 3, 13, 13))
    assert not any(s.fallback for s in prog.stages), str(prog)
    assert [s.kind for s in prog.stages if s.kind in ("avgpool", "maxpool", "linear")] == ["avgpool", "maxpool", "avgpool", "linear"]


class _Upsampled(nn.Module):
    """An HRNet / FPN fuse: a branch upsampled (module and functional forms) and added."""

    def __init__(self, scale, mode="nearest"):
        super().__init__()
        self.conv, self.up, self.scale, self.mode = nn.Conv2d(3, 6, 3, stride=4, padding=1), nn.Upsample(scale_factor=scale, mode=mode), scale, mode

    def forward(self, x):
        y = self.conv(x)
        return self.up(y) + F.interpolate(y, scale_factor=self.scale, mode=self.mode)


@pytest.mark.parametrize("importer", ["fx", "export"])
@pytest.mark.parametrize(("scale", "mode", "fused"), [(4, "nearest", True), ((2, 4), "nearest", True), (3, "nearest", False),
                                                      (4, "bilinear", False)])
def test_nearest_upsampling_by_powers_of_two_is_a_fusekit_kernel(scale, mode, fused, importer):
    """nn.Upsample / F.interpolate "nearest" by power-of-two factors: an ``upsample_nearest2d`` stage
    (fusekit's kernel); other factors and modes stay PyTorch. Float64 as eager either way."""
    torch.manual_seed(0)
    m = _Upsampled(scale, mode).eval()
    x = np.random.default_rng(2).standard_normal((2, 3, 16, 16))
    prog = fp.lower_model(m, x.shape, importer=importer)
    ups = [s for s in prog.stages if s.pattern == "upsample_nearest2d"]
    assert len(ups) == (2 if fused else 0) and any(s.fallback for s in prog.stages) != fused, str(prog)
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() / np.abs(want).max() < 1e-12


def test_a_constant_pad_nd_folds_as_f_pad_does():
    """aten.constant_pad_nd(x, pad, value) (no mode argument) folds into the conv after it as F.pad's
    constant zero pad does; a non-zero value does not."""
    from fusekit.pipeline.ir import Ref, Stage, torch_fallback

    def prog(value):
        pad = torch_fallback("pad", ["x"], "p", torch.constant_pad_nd, [Ref("x"), [0, 1, 0, 1], value])
        pad.attrs["op"] = "constant_pad_nd"
        conv = Stage("conv", ["p"], "y", weights={"w": np.ones((2, 3, 3, 3))},
                     attrs=dict(padding=(0, 0), stride=(2, 2), dilation=(1, 1), groups=1), name="conv")
        return fp.lower(fp.Program([pad, conv], "x", (1, 3, 6, 6), "y"))

    folded = prog(0.0)
    assert [s.pattern for s in folded.stages] == ["conv_bias_act"] and folded.stages[0].attrs["extra_padding"] == (1, 1)
    assert [s.pattern for s in prog(2.0).stages] == ["torch", "conv_bias"]


@pytest.mark.parametrize("importer", ["fx", "export"])
@pytest.mark.parametrize(("hw", "out", "kind"), [((8, 6), (4, 3), "avgpool"), ((2, 3), (4, 9), "upsample"), ((4, 4), (4, 4), None),
                                                  ((5, 5), (3, 3), "torch"), ((2, 2), (7, 7), "torch")])
def test_adaptive_average_pools_of_whole_windows_are_pools_or_upsamplings(hw, out, kind, importer):
    """AdaptiveAvgPool2d where the input size is a multiple of the output's: an average pool of whole
    windows; where the output's is a multiple of the input's (each window one pixel): a nearest
    upsampling; the same size: nothing; other sizes stay PyTorch. Float64 as eager."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 1), nn.AdaptiveAvgPool2d(out), nn.ReLU()).eval()
    x = np.random.default_rng(5).standard_normal((2, 3, *hw))
    prog = fp.lower_model(m, x.shape, importer=importer)
    kinds = [s.kind for s in prog.stages]
    assert (kind in kinds if kind else len(kinds) == 1), str(prog)
    want = m.double()(torch.from_numpy(x)).detach().numpy()
    assert np.abs(fp.Pipeline(prog).reference(x) - want).max() / np.abs(want).max() < 1e-12
