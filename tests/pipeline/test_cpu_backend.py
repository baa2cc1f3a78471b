"""CPU: fusekit as a torch.compile backend. Dynamo's graph (parameters and buffers as inputs) is
bound, imported and lowered by the pipeline's own rules; the lowered stages match the graph in
float64; what fusekit does not run goes to Inductor with the reason; the entry point registers it."""

import copy
import importlib.metadata

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusekit.pipeline as fp  # noqa: E402
from fusekit.errors import OperandError  # noqa: E402
from fusekit import backend as fk_backend  # noqa: E402
from fusekit.pipeline import backend as fb  # noqa: E402
from helpers import with_fallback  # noqa: E402


def dynamo_graph(model, x, grad=False):
    """(the FX graph dynamo hands a backend for ``model(*x)`` (x a tensor or a tuple), its example inputs)."""
    got = {}
    x = x if isinstance(x, tuple) else (x,)

    def capture(gm, example_inputs):
        got["gm"], got["ex"] = gm, example_inputs
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=capture)(*x)
    return got["gm"], got["ex"]


def _tv():
    return pytest.importorskip("torchvision")


@pytest.mark.parametrize("name", ["efficientnet_b0", "resnet18", "mobilenet_v3_small"])
def test_dynamo_graphs_lower_with_the_pipeline_rules_and_match_in_float64(name):
    tv = _tv()
    torch.manual_seed(0)
    model = tv.models.get_model(name, weights=None).eval()
    x = torch.randn(2, 3, 64, 64)
    gm, ex = dynamo_graph(model, x)
    with torch.no_grad():  # inference: what dynamo traces under no_grad
        compiled = fk_backend.backend(gm, ex)
    assert isinstance(compiled, fb.FusekitGraph)
    prog = compiled.program
    assert not prog.fallbacks and prog.fused_fraction == 1.0, prog.fallbacks
    want = copy.deepcopy(model).double()(x.double()).detach().numpy()
    got = fp.Pipeline(prog).reference(x.double().numpy())
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-12
    out = compiled(*ex)  # CPU tensors: not the pipeline's; the captured graph runs
    assert isinstance(out, tuple) and torch.allclose(out[0], model(x), atol=1e-5)


def test_bound_graph_holds_the_parameters_as_constants():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    gm, ex = dynamo_graph(model, torch.randn(1, 3, 8, 8))
    bound, inputs = fb.bind_constants_of(gm, ex)
    assert inputs == [i for i, t in enumerate(ex) if not isinstance(t, torch.nn.Parameter) and t.dim() == 4]
    assert [n.op for n in bound.graph.nodes].count("placeholder") == 1
    assert len(list(bound.buffers())) == len(ex) - 1


def test_what_fusekit_does_not_run_goes_to_inductor_with_the_reason(monkeypatch):
    tv = _tv()
    sent = []
    monkeypatch.setattr(fb, "inductor", lambda gm, ex, why, mode=None: sent.append(why) or gm.forward)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh()).train()
    gm, ex = dynamo_graph(model, torch.randn(2, 8), grad=True)
    with torch.enable_grad():
        fk_backend.backend(gm, ex)
    assert sent and "without a convolution or training batch norm" in sent[-1]

    class TwoOut(torch.nn.Module):
        def forward(self, x):
            return x.relu(), x.sigmoid()

    gm, ex = dynamo_graph(TwoOut(), torch.randn(1, 4, 2, 2))
    with torch.no_grad():
        fk_backend.backend(gm, ex)
    assert "several outputs" in sent[-1]
    gm, ex = dynamo_graph(tv.models.resnet18().eval(), torch.randn(1, 3, 32, 32))
    with torch.no_grad():
        assert isinstance(fk_backend.backend(gm, ex, options={"min_fused": 1.0}), fb.FusekitGraph)  # resnet18 lowers fully
    assert len(sent) == 2


@pytest.mark.parametrize("options, words", [
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"autotune": "yes"}, "autotune must be True or False"),
    ({"min_fused": 2}, "min_fused must be a number in [0, 1]"),
    ({"mode": "fast"}, "unknown option(s) ['mode']"),
])
def test_bad_options_are_named(options, words):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    gm, ex = dynamo_graph(model, torch.randn(1, 3, 8, 8))
    with pytest.raises(OperandError, match="options") as e, torch.no_grad():
        fk_backend.backend(gm, ex, options=options)
    assert words in str(e.value)


def test_mode_is_checked_and_reaches_inductor(monkeypatch):
    """torch.compile's ``mode`` arrives as the backend's keyword: checked, and Inductor compiles the
    graphs fusekit does not run with that mode's options (reduce-overhead: its CUDA graphs)."""
    import torch._inductor.compile_fx as cfx

    got = []
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, ex, config_patches=None: got.append(config_patches) or gm.forward)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).train()
    gm, ex = dynamo_graph(model, torch.randn(1, 3, 8, 8), grad=True)
    with torch.enable_grad():
        fk_backend.backend(gm, ex, mode="reduce-overhead")
        fk_backend.backend(gm, ex)
    assert got[0].get("triton.cudagraphs") is True and got[1] == {}
    with pytest.raises(OperandError, match="mode") as e:
        fk_backend.backend(gm, ex, mode="fastest")
    assert "reduce-overhead" in str(e.value)


def test_a_graph_dynamo_makes_dynamic_stays_on_fusekit():
    """After a second batch size dynamo hands over a graph with the batch as an int input: its sizes
    are read from the input's dims, so the backend still returns fusekit's graph (a pipeline per
    shape), and calls give eager's output."""
    made = []
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, 4)).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, ex, **kw: made.append((gm, ex, fk_backend.backend(gm, ex, **kw))) or made[-1][2])
    with torch.no_grad():
        for batch in (2, 5, 3):
            x = torch.randn(batch, 3, 8, 8)
            assert torch.allclose(compiled(x), model(x), atol=1e-6)
    assert len(made) == 2 and any(not isinstance(e, torch.Tensor) for e in made[1][1])  # the second: dynamic
    assert all(isinstance(g, fb.FusekitGraph) for _, _, g in made)
    dyn = made[1][2]
    assert [n.op for n in dyn.bound.graph.nodes].count("placeholder") == 1
    assert dyn.out_shape(torch.empty(7, 3, 8, 8)) == (7, 4)


def test_the_backend_is_registered_by_entry_point_and_compiles_end_to_end():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(ep.name == "fusekit" and ep.value == "fusekit.backend:backend" for ep in eps), list(eps)
    assert "fusekit" in torch._dynamo.list_backends()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(model, backend="fusekit")(x)
    assert torch.allclose(y, model(x), atol=1e-6)


def test_compiled_graphs_run_through_a_registered_custom_op_with_a_fake_implementation(fresh_session):
    """torch.ops.fusekit.run_segment(xs, key, variant, segment) is registered; its fake implementation
    gives each output's shape (channels-last images) in the variant's dtype, so that shape
    propagation and tracing need no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 5)).eval()
    gm, ex = dynamo_graph(model, torch.randn(2, 3, 8, 8))
    with torch.no_grad():
        compiled = fk_backend.backend(gm, ex)
    assert isinstance(compiled, fb.FusekitGraph) and fresh_session.table("compiled_graphs")[compiled.key] is compiled
    schema = str(torch.ops.fusekit.run_segment.default._schema)
    assert "fusekit::run_segment(Tensor[] xs, int key, int variant, int segment) -> Tensor[]" in schema, schema
    for batch, dtype in ((2, torch.float16), (7, torch.float32)):
        x = torch.empty(batch, 3, 8, 8, dtype=dtype)
        v = compiled.variant(x)  # (lowered for its shape on first use)
        with FakeTensorMode() as mode:
            (y,) = torch.ops.fusekit.run_segment([mode.from_tensor(x)], compiled.key, v, 0)
        assert tuple(y.shape) == (batch, 5) and y.dtype == dtype
    assert [tuple(v.program.input_shape) for v in compiled.variants] == [(2, 3, 8, 8), (7, 3, 8, 8)]


def _fallback_graph(batch=2):
    torch.manual_seed(4)
    model = with_fallback(3, 8, 4).eval()
    with torch.no_grad():
        model.b1.running_mean.uniform_(-0.2, 0.2)
        model.b1.running_var.uniform_(0.5, 1.5)
    x = torch.randn(batch, 3, 8, 8)
    gm, ex = dynamo_graph(model, x)
    with torch.no_grad():
        compiled = fk_backend.backend(gm, ex)
    return model, x, compiled


def test_a_program_splits_into_fused_segments_and_the_fallbacks_between():
    """split(): maximal runs of fused and of fallback stages; each segment's inputs are the values it
    reads from before it, its outputs the values read after it (a skip connection crossing the
    fallback goes out of the first segment and into the last)."""
    from fusekit.pipeline import partition

    _, _, compiled = _fallback_graph()
    prog = compiled.program
    segs = partition.split(prog)
    assert [s.fused for s in segs] == [True, False, True]
    assert segs[0].lo == 0 and segs[-1].hi == len(prog.stages) and all(a.hi == b.lo for a, b in zip(segs, segs[1:]))
    assert all(prog.stages[i].fallback != s.fused for s in segs for i in range(s.lo, s.hi))
    first, mid, last = segs
    assert first.inputs == [prog.input] and mid.inputs == first.outputs
    assert len(first.outputs) == 1 and set(last.inputs) == {first.outputs[0], mid.outputs[0]}, (first, mid, last)
    assert last.outputs == [prog.output]
    whole = fp.lower_model(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval(), (1, 3, 8, 8))
    (only,) = partition.split(whole)
    assert only.fused and only.inputs == [whole.input] and only.outputs == [whole.output]


def test_partitioned_graph_matches_float64_eager_and_compiles_with_inductor(fresh_session):
    """The partitioned FX graph (fused segments as fusekit::run_segment, whose CPU implementation is
    the float64 reference; fallback stages as modules) gives the model's float64 output, directly
    and compiled by Inductor (the op's fake implementation standing in during compilation)."""
    from torch._inductor.compile_fx import compile_fx

    from fusekit.pipeline import partition

    model, x, compiled = _fallback_graph()
    assert isinstance(compiled, fb.FusekitGraph)
    x64 = x.double()
    v = compiled.variant(x64)
    var = compiled.variants[v]
    mod = partition.partitioned_module(var.program, var.segments, compiled.key, v, x.device, torch.float64, torch.float64)
    targets = [n.target for n in mod.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fusekit.run_segment.default) == 2
    assert [n.op for n in mod.graph.nodes].count("call_module") == var.segments[1].hi - var.segments[1].lo
    want = copy.deepcopy(model).double()(x64)
    (got,) = mod(x64)
    assert float((got - want).norm() / want.norm()) < 1e-12
    (again,) = compile_fx(mod, [x64])(x64)
    assert float((again - want).norm() / want.norm()) < 1e-12
    ran = compiled.run(x64)  # the graph's own route: the variant's partition compiled by Inductor, then called
    assert var.call is not None and float((ran - want).norm() / want.norm()) < 1e-12
    for k, seg in enumerate(var.segments):  # the fake implementation agrees with the op on shapes, dtypes and strides
        if seg.fused:
            ins = [torch.randn(var.program.shapes()[n], dtype=torch.float64).contiguous(memory_format=torch.channels_last) for n in seg.inputs]
            torch.library.opcheck(torch.ops.fusekit.run_segment.default, (ins, compiled.key, v, k), test_utils=("test_schema", "test_faketensor"))


def _train_net():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4),
        torch.nn.BatchNorm2d(8), torch.nn.ReLU6(), torch.nn.Conv2d(8, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())


class _Block(torch.nn.Module):
    """A residual block as torchvision writes it: the shortcut computed after the last batch norm,
    added in place, then a ReLU module."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = torch.nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(c_out)
        self.relu = torch.nn.ReLU(inplace=True)
        self.down = None if stride == 1 and c_in == c_out else torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                                                                   torch.nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        identity = x if self.down is None else self.down(x)
        out += identity
        return self.relu(out)


def _res_net():
    return torch.nn.Sequential(_Block(3, 8, 1), _Block(8, 8, 1), _Block(8, 16, 2), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())


def test_training_graph_puts_fusekit_ops_in_place_of_conv_batch_norm_and_relu():
    """A dynamo training graph: every conv2d, training batch norm and the ReLU / ReLU6 right after
    either become fusekit's fused ops; nothing else changes."""
    from fusekit.torch import training

    gm, ex = dynamo_graph(_train_net().train(), torch.randn(2, 3, 8, 8), grad=True)
    gm, fused = training.training_graph(gm)
    assert fused == [f for f in fused if f.split(": ")[1] in ("conv2d", "conv2d + relu", "batch_norm + relu", "batch_norm + relu6", "batch_norm")]
    kinds = sorted(f.split(": ")[1] for f in fused)
    assert kinds == ["batch_norm", "batch_norm + relu", "batch_norm + relu6", "conv2d", "conv2d", "conv2d", "conv2d + relu"], kinds
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.conv2d not in targets and torch.nn.functional.conv2d not in targets and torch.nn.functional.batch_norm not in targets
    assert not any(getattr(n.target, "__name__", "") in ("relu", "relu6", "relu_") for n in gm.graph.nodes)
    gm, ex = dynamo_graph(_res_net().train(), torch.randn(2, 3, 8, 8), grad=True)
    gm, fused = training.training_graph(gm)
    kinds = [f.split(": ")[1] for f in fused]
    assert (kinds.count("batch_norm + residual + relu"), kinds.count("batch_norm + relu"), kinds.count("batch_norm"), kinds.count("conv2d")) == (3, 3, 2, 8), kinds
    assert not any(getattr(n.target, "__name__", "") in ("relu", "iadd", "add") for n in gm.graph.nodes), gm.graph


def test_training_graph_leaves_what_it_does_not_fuse():
    """Eval-mode batch norm (running statistics), a ReLU whose input has a second user, 1-D and 3-D
    convolutions stay PyTorch's."""
    from fusekit.torch import training

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c3 = torch.nn.Conv1d(3, 4, 3), torch.nn.Conv3d(1, 2, 3)
            self.c, self.bn = torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4).eval()

        def forward(self, x, v):
            y = self.c(self.c1(x).unsqueeze(-1))
            return self.bn(torch.relu(y)) + y, self.c3(v)

    gm, ex = dynamo_graph(Net(), (torch.randn(2, 3, 8), torch.randn(1, 1, 4, 4, 4)), grad=True)
    gm, fused = training.training_graph(gm)
    assert [f.split(": ")[1] for f in fused] == ["conv2d"], fused


def test_fused_ops_pass_torch_library_checks():
    """The custom ops' schemas, fake implementations (shapes, dtypes, strides) and autograd
    registrations, checked by torch.library.opcheck on CPU tensors."""
    pytest.importorskip("fusekit.torch.training")  # registers the ops

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 6, 6, generator=g, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    w = torch.randn(6, 2, 3, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    b = torch.randn(6, generator=g, dtype=torch.float64).requires_grad_(True)
    for act in ("", "relu", "relu6"):
        torch.library.opcheck(torch.ops.fusekit.conv_act.default, (x, w, b, [1, 1], [2, 1], [1, 1], 2, act))
        torch.library.opcheck(torch.ops.fusekit.conv_act.default, (x, w, None, [0, 1], [1, 1], [1, 2], 2, act))
    y = torch.ops.fusekit.conv_act(x, w, None, [1, 1], [1, 1], [1, 1], 2, "relu").detach()
    for needs in ([False, True, False], [True, False, True], [True, True, True]):  # the first conv of a net: no dx
        for has_bias in (False, True):
            torch.library.opcheck(torch.ops.fusekit.conv_act_backward.default,
                                  (torch.randn_like(y), x.detach(), w.detach(), y, [1, 1], [1, 1], [1, 1], 2, "relu", has_bias, needs))
    gamma, beta = torch.rand(4, dtype=torch.float64).requires_grad_(True), torch.randn(4, dtype=torch.float64).requires_grad_(True)
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    for act in ("", "relu", "relu6"):
        torch.library.opcheck(torch.ops.fusekit.batch_norm_act.default, (x, gamma, beta, rm, rv, None, 0.1, 1e-5, act))
        y, mean, inv, _, _ = torch.ops.fusekit.batch_norm_act(x, gamma, beta, rm, rv, None, 0.1, 1e-5, act)
        torch.library.opcheck(torch.ops.fusekit.batch_norm_act_backward.default,
                              (torch.randn_like(y), x.detach(), gamma.detach(), mean, inv, y.detach(), 1e-5, act, False))
    z = torch.randn_like(x).requires_grad_(True)
    torch.library.opcheck(torch.ops.fusekit.batch_norm_act.default, (x, gamma, beta, rm, rv, z, 0.1, 1e-5, "relu"))


@pytest.mark.parametrize("net", [_train_net, _res_net], ids=["plain", "residual"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["NCHW", "NHWC"])
def test_training_through_the_backend_matches_eager_in_float64(memory_format, net):
    """torch.compile(backend=fusekit) in training (AOTAutograd + Inductor around fusekit's ops; on the
    CPU the ops run PyTorch's kernels): output, input gradient, every parameter's gradient and the
    running statistics as eager's, in float64, over three steps (the third at another batch size:
    dynamo's recompile with a symbolic batch goes through the ops' fake implementations)."""
    import copy

    torch.manual_seed(5)
    model = net().double().to(memory_format=memory_format).train()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    made = []
    compiled = torch.compile(model, backend=lambda gm, ex, **kw: made.append(fk_backend.backend(gm, ex, **kw)) or made[-1])
    for step, batch in enumerate((3, 3, 5)):
        x = torch.randn(batch, 3, 10, 10, dtype=torch.float64).contiguous(memory_format=memory_format)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y, want = compiled(xa), ref(xb)
        g = torch.randn_like(want)
        (y * g).sum().backward()
        (want * g).sum().backward()
        assert float((y - want).abs().max()) < 1e-12 and float((xa.grad - xb.grad).abs().max()) < 1e-12, step
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert float((p.grad - q.grad).abs().max()) < 1e-10, n
    for (n, p), (_, q) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(p, q) or float((p - q).abs().max()) < 1e-12, n
    assert len(made) == 2  # the first batch size's graph, then one with a symbolic batch


def test_torchvision_mobilenet_v2_trains_through_the_backend_as_eager(monkeypatch):
    """MobileNetV2 (depthwise convolutions, ReLU6 as hardtanh, inverted-residual adds; dropout off, whose
    random mask compiled code draws differently) through the backend in training: output and every
    parameter's gradient equal eager's in float64, and the rewrite took all 52 convolutions."""
    import copy

    from fusekit.torch import training

    tv = _tv()
    torch.manual_seed(6)
    model = tv.models.mobilenet_v2(num_classes=10, dropout=0.0).double().train()
    ref = copy.deepcopy(model)
    fused = []
    rewrite = training.training_graph
    monkeypatch.setattr(training, "training_graph", lambda gm: (lambda r: (fused.extend(r[1]), r)[1])(rewrite(gm)))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fk_backend.backend)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    y, want = compiled(x), ref(x)
    y.sum().backward()
    want.sum().backward()
    assert float((y - want).abs().max()) < 1e-12
    assert max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters())) < 1e-10
    assert sum(f.split(": ")[1] == "conv2d" for f in fused) == 52 and sum("relu6" in f for f in fused) == 35, fused


def test_when_inductor_cannot_compile_the_fallbacks_the_pipeline_runs_them(fresh_session, monkeypatch):
    """If Inductor fails on the partitioned graph, the variant becomes one segment (the pipeline runs
    its fallback stages on PyTorch's kernels), said in a warning."""
    _, x, compiled = _fallback_graph()

    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(fb, "inductor", broken)
    monkeypatch.setattr(fb, "run_segment", lambda xs, key, v, k: [xs[0] * 0 + 1])  # (the GPU op: not run on the CPU)
    with pytest.warns(UserWarning, match="Inductor could not compile the stages between fusekit's segments"):
        y = compiled.run(x)
    (var,) = compiled.variants
    assert len(var.segments) == 1 and var.segments[0].hi == len(var.program.stages) and torch.equal(y, torch.ones_like(x))


@pytest.mark.parametrize("name", ["vit_b_32", "swin_t"])
def test_transformer_graphs_are_cut_into_segments_that_match_float64(name, fresh_session, monkeypatch):
    """A vision transformer's graph lowers (Swin's shape-only attention mask folded to a constant);
    with min_fused 0 it is cut into many fused segments and the attention fallbacks between them, and
    the partitioned graph gives the model's float64 output. With the default min_fused the graph,
    mostly fallbacks, goes to Inductor, saying why."""
    from fusekit.pipeline import partition

    tv = _tv()
    torch.manual_seed(0)
    model = tv.models.get_model(name).eval()
    with torch.no_grad():  # torchvision starts some heads at zero
        for p in model.parameters():
            if not p.abs().max() > 0:
                p.normal_(0, 0.02)
    x = torch.randn(1, 3, 224, 224)
    gm, ex = dynamo_graph(model, x)
    with torch.no_grad():
        compiled = fk_backend.backend(gm, ex, options={"min_fused": 0.0})
    assert isinstance(compiled, fb.FusekitGraph)
    x64 = x.double()
    v = compiled.variant(x64)
    var = compiled.variants[v]
    assert sum(s.fused for s in var.segments) > 10 and sum(not s.fused for s in var.segments) > 10
    mod = partition.partitioned_module(var.program, var.segments, compiled.key, v, x.device, torch.float64, torch.float64)
    with torch.no_grad():
        (got,) = mod(x64)
        want = copy.deepcopy(model).double()(x64)
    assert float((got - want).norm() / want.norm()) < 1e-12
    sent = []
    monkeypatch.setattr(fb, "inductor", lambda gm, ex, why, mode=None: sent.append(why) or gm.forward)
    with torch.no_grad():
        fk_backend.backend(gm, ex)
    assert sent and "of its stages lower to fusekit (min_fused 50%)" in sent[0], sent
