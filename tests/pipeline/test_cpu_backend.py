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
from fusekit.pipeline import backend as fb  # noqa: E402


def dynamo_graph(model, x, grad=False):
    """(the FX graph dynamo hands a backend for ``model(x)``, its example inputs)."""
    got = {}

    def capture(gm, example_inputs):
        got["gm"], got["ex"] = gm, example_inputs
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=capture)(x)
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
        compiled = fb.backend(gm, ex)
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
    model = tv.models.resnet18().train()
    gm, ex = dynamo_graph(model, torch.randn(2, 3, 32, 32), grad=True)
    with torch.enable_grad():
        fb.backend(gm, ex)
    assert sent and "training" in sent[-1]

    class TwoOut(torch.nn.Module):
        def forward(self, x):
            return x.relu(), x.sigmoid()

    gm, ex = dynamo_graph(TwoOut(), torch.randn(1, 4, 2, 2))
    with torch.no_grad():
        fb.backend(gm, ex)
    assert "several outputs" in sent[-1]
    gm, ex = dynamo_graph(tv.models.resnet18().eval(), torch.randn(1, 3, 32, 32))
    with torch.no_grad():
        assert isinstance(fb.backend(gm, ex, options={"min_fused": 1.0}), fb.FusekitGraph)  # resnet18 lowers fully
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
        fb.backend(gm, ex, options=options)
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
        fb.backend(gm, ex, mode="reduce-overhead")
        fb.backend(gm, ex)
    assert got[0].get("triton.cudagraphs") is True and got[1] == {}
    with pytest.raises(OperandError, match="mode") as e:
        fb.backend(gm, ex, mode="fastest")
    assert "reduce-overhead" in str(e.value)


def test_a_graph_dynamo_makes_dynamic_stays_on_fusekit():
    """After a second batch size dynamo hands over a graph with the batch as an int input: its sizes
    are read from the input's dims, so the backend still returns fusekit's graph (a pipeline per
    shape), and calls give eager's output."""
    made = []
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(8, 4)).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, ex, **kw: made.append((gm, ex, fb.backend(gm, ex, **kw))) or made[-1][2])
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
    assert any(ep.name == "fusekit" and ep.value == "fusekit.pipeline.backend:backend" for ep in eps), list(eps)
    assert "fusekit" in torch._dynamo.list_backends()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(model, backend="fusekit")(x)
    assert torch.allclose(y, model(x), atol=1e-6)


def test_compiled_graphs_run_through_a_registered_custom_op_with_a_fake_implementation(fresh_session):
    """torch.ops.fusekit.run_pipeline(x, key) is registered (schema (Tensor x, int key) -> Tensor); its
    fake implementation gives the output's shape for any batch and x's dtype, so that shape
    propagation and tracing need no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 5)).eval()
    gm, ex = dynamo_graph(model, torch.randn(2, 3, 8, 8))
    with torch.no_grad():
        compiled = fb.backend(gm, ex)
    assert isinstance(compiled, fb.FusekitGraph) and fresh_session.table("compiled_graphs")[compiled.key] is compiled
    assert "fusekit::run_pipeline(Tensor x, int key) -> Tensor" in str(torch.ops.fusekit.run_pipeline.default._schema)
    with FakeTensorMode() as mode:
        for batch, dtype in ((2, torch.float16), (7, torch.float32)):
            y = torch.ops.fusekit.run_pipeline(mode.from_tensor(torch.empty(batch, 3, 8, 8, dtype=dtype)), compiled.key)
            assert tuple(y.shape) == (batch, 5) and y.dtype == dtype
