"""GPU: torch.compile(model, backend="fusekit") (here the backend itself: the device runs fusekit from
its source tree, without the package's entry point; tests/pipeline/test_cpu_backend.py checks that) runs a fusekit pipeline per input shape, within
PyTorch float16's own error of float32 eager; a new batch size builds another pipeline; calls that
want gradients run the captured graph."""

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
tv = pytest.importorskip("torchvision")

from fusekit import backend as fk_backend  # noqa: E402
from fusekit.pipeline import backend as fb  # noqa: E402
from helpers import with_fallback  # noqa: E402


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["efficientnet_b0", "resnet50"])
def test_compiled_model_runs_fusekit_pipelines_and_matches_float32_eager(name, monkeypatch):
    torch.manual_seed(0)
    model = tv.models.get_model(name, weights=None).eval().cuda()
    with torch.no_grad():  # BN statistics of random images, so the activations keep a sensible scale
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    half = tv.models.get_model(name, weights=None).eval().cuda()
    half.load_state_dict(model.state_dict())
    half = half.half().to(memory_format=torch.channels_last)
    made = []  # the FusekitGraphs the backend returns
    init = fb.FusekitGraph.__init__
    monkeypatch.setattr(fb.FusekitGraph, "__init__", lambda self, *a, **k: (init(self, *a, **k), made.append(self))[0])
    torch._dynamo.reset()
    compiled = torch.compile(half, backend=fk_backend.backend, dynamic=False)
    for batch in (8, 8, 4):
        x = torch.randn(batch, 3, 128, 128, device="cuda")
        with torch.no_grad():
            y = compiled(x.half().contiguous(memory_format=torch.channels_last))
            want, fp16 = model(x), half(x.half().contiguous(memory_format=torch.channels_last))
        assert y.dtype == torch.float16 and y.shape == want.shape
        assert _rel(y, want) < max(5e-3, 4 * _rel(fp16, want)), (batch, _rel(y, want), _rel(fp16, want))
    pipes = {key[0]: p for g in made for key, p in g.pipelines.items()}
    assert set(pipes) == {(8, 3, 128, 128), (4, 3, 128, 128)}, set(pipes)  # one pipeline per batch size, each built once
    assert all(p.graph_captured for p in pipes.values())


@pytest.mark.heavy
def test_calls_wanting_gradients_run_the_captured_graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).cuda().eval()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend=fk_backend.backend, dynamic=False)
        compiled(torch.randn(2, 3, 16, 16, device="cuda"))
    x = torch.randn(2, 3, 16, 16, device="cuda", requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    assert x.grad is not None and torch.allclose(y, model(x), atol=1e-4)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_a_mode_keeps_inference_on_fusekit_and_training_graphs_compile_in_it(mode):
    """Under torch.compile's modes an inference graph still runs as a fusekit pipeline (its own CUDA
    graph), and a training graph goes to Inductor compiled in that mode; both match eager."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 8, 1)).cuda().half().to(memory_format=torch.channels_last).eval()
    x = torch.randn(4, 8, 16, 16, device="cuda").half().contiguous(memory_format=torch.channels_last)
    torch._dynamo.reset()
    made = []
    compiled = torch.compile(model, backend=lambda gm, ex, **kw: made.append(fk_backend.backend(gm, ex, **kw)) or made[-1], mode=mode)
    with torch.no_grad():
        y, want = compiled(x), model(x)
    assert isinstance(made[-1], fb.FusekitGraph) and _rel(y, want) < 5e-3
    model.train()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, ex, **kw: made.append(fk_backend.backend(gm, ex, **kw)) or made[-1], mode=mode)
    xt = x.clone().requires_grad_(True)
    y = compiled(xt)
    y.float().sum().backward()
    assert not isinstance(made[-1], fb.FusekitGraph)  # Inductor's
    assert xt.grad is not None and _rel(y, model(x)) < 5e-3


def test_dynamic_batch_graphs_run_fusekit_pipelines():
    """With torch.compile's default dynamic=None, dynamo hands over a graph with a symbolic batch after
    the second batch size: it still runs as fusekit pipelines (one per batch size), within float16's error."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(16, 10)).cuda().half().eval()
    torch._dynamo.reset()
    made = []
    compiled = torch.compile(model, backend=lambda gm, ex, **kw: made.append(fk_backend.backend(gm, ex, **kw)) or made[-1])
    for batch in (4, 6, 3, 6):
        x = torch.randn(batch, 8, 12, 12, device="cuda").half().contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            y, want = compiled(x), model(x)
        assert y.shape == want.shape and _rel(y, want) < 5e-3
    assert len(made) == 2 and all(isinstance(g, fb.FusekitGraph) for g in made)
    assert {k[0][0] for k in made[1].pipelines} == {6, 3}  # the dynamic graph's pipelines, one per batch size


@pytest.mark.heavy
@pytest.mark.parametrize("precision", ["amp-fp16", "fp32"])
def test_training_runs_fusekit_fused_ops_and_matches_float64(precision, monkeypatch):
    """ResNet-18 training steps through torch.compile(backend=fusekit): its convolutions, batch norms
    and ReLUs on fusekit's fused ops (AOTAutograd + Inductor around them), under fp16 autocast or in
    float32; the output, input gradient and every parameter's gradient within 3x PyTorch eager's own
    error against float64 (or a floor), the running statistics as eager's."""
    import copy

    from fusekit.torch import training

    fused = []
    rewrite = training.training_graph
    monkeypatch.setattr(training, "training_graph", lambda gm: (lambda r: (fused.append(r[1]), r)[1])(rewrite(gm)))
    torch.manual_seed(7)
    model = tv.models.resnet18(num_classes=10).cuda().to(memory_format=torch.channels_last).train()
    base, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fk_backend.backend)
    amp = precision == "amp-fp16"
    floor = 2e-2 if amp else 3e-3
    for step in range(2):
        x = torch.randn(8, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
        g = torch.randn(8, 10, device="cuda", dtype=torch.float64)
        outs = {}
        for name, m in (("fusekit", compiled), ("torch", base), ("float64", ref64)):
            xi = (x.double() if name == "float64" else x.clone()).requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp and name != "float64"):
                y = m(xi)
            (y.double() * g).sum().backward()
            outs[name] = (y.double(), xi.grad.double())
        for i, what in enumerate(("output", "input gradient")):
            e_fk, e_t = _rel(outs["fusekit"][i], outs["float64"][i]), _rel(outs["torch"][i], outs["float64"][i])
            assert e_fk < max(3 * e_t, floor), (step, what, e_fk, e_t)
    kinds = [f.split(": ")[1] for f in fused[0]]  # the first graph dynamo compiled: the whole model
    assert sum(k.startswith("conv2d") for k in kinds) == 20 and sum(k.startswith("batch_norm") for k in kinds) == 20, kinds
    assert kinds.count("batch_norm + residual + relu") == 8, kinds  # every BasicBlock's end
    for (n, p), (_, q), (_, r) in zip(model.named_parameters(), base.named_parameters(), ref64.named_parameters()):
        assert _rel(p.grad, r.grad) < max(3 * _rel(q.grad, r.grad), 5e-2), n
    for (n, p), (_, q) in zip(model.named_buffers(), base.named_buffers()):
        if p.is_floating_point():
            assert _rel(p, q) < 1e-2, n


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_graphs_with_fallbacks_run_fusekit_segments_and_inductor_between(mode):
    """A graph with a stage fusekit cannot run is cut into fused segments (the custom op
    fusekit::run_segment, each segment its own CUDA graph) and the fallback between them, which
    Inductor compiles (in reduce-overhead, all of it inside PyTorch's CUDA graphs); a new batch
    size lowers and compiles another variant; outputs within float16's error of float32 eager."""
    torch.manual_seed(3)
    model = with_fallback(8, 16, 8).cuda().eval()
    with torch.no_grad():
        model.b1.running_var.uniform_(0.5, 1.5)
    half = with_fallback(8, 16, 8).cuda().eval()
    half.load_state_dict(model.state_dict())
    half = half.half().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    made = []
    compiled = torch.compile(half, backend=lambda gm, ex, **kw: made.append(fk_backend.backend(gm, ex, **kw)) or made[-1],
                             mode=mode, dynamic=False)
    for batch in (4, 4, 4, 2):
        x = torch.randn(batch, 8, 16, 16, device="cuda")
        xh = x.half().contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            y, want, fp16 = compiled(xh), model(x), half(xh)
        assert y.dtype == torch.float16 and y.shape == want.shape
        assert _rel(y, want) < max(5e-3, 4 * _rel(fp16, want)), (batch, _rel(y, want), _rel(fp16, want))
    graphs = [g for g in made if isinstance(g, fb.FusekitGraph)]
    assert graphs and all(len(v.segments) == 3 and [s.fused for s in v.segments] == [True, False, True] for g in graphs for v in g.variants)
    shapes = {k[0] for g in graphs for k in g.pipelines}
    assert shapes == {(4, 8, 16, 16), (2, 8, 16, 16)}, shapes
    assert all(p.graph_captured for g in graphs for p in g.pipelines.values())
