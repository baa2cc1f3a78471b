"""fusekit.pipeline on the GPU: torchvision models and an ONNX CNN compiled in float16
channels-last, replayed from one CUDA graph, against PyTorch float32 eager."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def _models():
    tv = pytest.importorskip("torchvision")
    return {"resnet18": tv.models.resnet18, "resnet50": tv.models.resnet50, "mobilenet_v2": tv.models.mobilenet_v2}


_CACHE: dict = {}


def _half(model):
    import copy

    return copy.deepcopy(model).half().to(memory_format=torch.channels_last)


def _calibrate(m):
    """Random-init torchvision models can have vanishing activations (mobilenet_v2's logits are
    ~1e-9, below float16's range): set every BN's running statistics to the batch statistics of
    one forward pass on random images, so activations are O(1) as in a trained network."""
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.reset_running_stats()
            mod.momentum = None  # cumulative average: the one batch's statistics
    m.train()
    with torch.no_grad():
        m(torch.randn(16, 3, 224, 224, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)))
    return m.eval()


def _compiled(name, batch, choose=True):
    """(fp32 eager model on cuda, pipeline) for a model and batch; built once per test session."""
    import fusekit.pipeline as fp

    key = (name, batch, choose)
    if key not in _CACHE:
        if name not in _CACHE:
            torch.manual_seed(0)
            m = _models()[name](weights=None).cuda().float().eval()
            if name == "mobilenet_v2":
                m = _calibrate(m)
            _CACHE[name] = m
        m = _CACHE[name]
        pipe = fp.compile(m, torch.zeros(batch, 3, 224, 224), dtype="float16", choose=choose)
        _CACHE[key] = pipe
    return _CACHE[name], _CACHE[key]


def _check_logits(got, want, batch, half=None):
    """fp16 pipeline vs fp32 eager: relative error within 4x that of PyTorch's own float16
    channels-last run ``half`` on the same input, or < 5e-3 (float16 rounding through a deep net;
    a race between stages showed as 1e-2 to 3e-2 while PyTorch's float16 run was 4.5e-4);
    top-1 classes equal, except where the reference's top two logits are near-tied (at most one
    input more than PyTorch's own float16 run flips: random-weight MobileNetV2 has many near-ties)."""
    got, want = got.float(), want.float()
    rel = float((got - want).norm() / want.norm())
    fp16_rel = 0.0 if half is None else float((half.float() - want).norm() / want.norm())
    assert rel < max(5e-3, 4 * fp16_rel), (rel, fp16_rel)
    top_got, top_want = got.argmax(1), want.argmax(1)
    bad = (top_got != top_want).nonzero().flatten().tolist()
    if batch == 1:
        assert not bad, (top_got, top_want)
    else:
        torch_flips = 0 if half is None else int((half.float().argmax(1) != top_want).sum())
        assert len(bad) <= torch_flips + 1, (bad, torch_flips)
        for i in bad:  # allowed only when the reference's top two logits are near-tied
            top2 = torch.topk(want[i], 2).values
            assert float(top2[0] - top2[1]) < max(5e-3, 4 * fp16_rel) * float(want[i].abs().max()), (i, top2)


@pytest.mark.parametrize("name,batch,choose", [
    (name, batch, True) for name in ("resnet18", "resnet50", "mobilenet_v2") for batch in (1, 8)
] + [("resnet18", 8, False), ("mobilenet_v2", 8, False)])
@pytest.mark.heavy
def test_torchvision_model(name, batch, choose):
    """fp16 pipeline vs fp32 eager; with choose=False every fused stage runs its cuDNN graph (and
    every pooling stage fusekit's CuPy kernel), else PyTorch's kernel where it measured faster."""
    model, pipe = _compiled(name, batch, choose)
    fused = [i for i, s in enumerate(pipe.stages) if s.pattern not in ("torch", "reshape")]
    if choose:
        assert len(pipe.choices) == sum("(faster" in pipe.engines[i] for i in fused), pipe.choices
    else:
        assert not pipe.choices and not any("(faster" in pipe.engines[i] for i in fused), pipe.engines
    assert pipe.graph_captured, pipe.capture_error
    gen = torch.Generator(device="cuda").manual_seed(batch)
    outs = []
    for _ in range(2):  # two replays with different inputs: input copied in, outputs differ and are right
        x = torch.randn(batch, 3, 224, 224, device="cuda", generator=gen)
        y = pipe(x)
        assert y.dtype == torch.float16 and tuple(y.shape) == (batch, 1000)
        with torch.no_grad():
            want = model(x)
            half = _CACHE.setdefault((name, "half"), _half(model))
            h = half(x.half().contiguous(memory_format=torch.channels_last)).float()
        print(f"{name} b{batch}: pipeline rel {float((y.float() - want).norm() / want.norm()):.3e}, "
              f"torch fp16 rel {float((h - want).norm() / want.norm()):.3e}")
        _check_logits(y, want, batch, h)
        outs.append(y)
    assert not torch.equal(outs[0], outs[1])
    print(f"{name} b{batch}: build fallbacks {pipe.build_fallbacks}")
    rows = pipe.check(torch.randn(batch, 3, 224, 224, device="cuda", generator=gen))
    worst = max(rows, key=lambda r: r["rel_err"])
    print(f"{name} b{batch}: worst stage {worst}")
    assert len(rows) >= sum(s.pattern.startswith(("conv", "linear")) for s in pipe.stages)
    assert worst["rel_err"] < 1e-2, sorted(rows, key=lambda r: -r["rel_err"])[:5]
    if name.startswith("resnet"):
        pats = {s.pattern for s in pipe.stages}
        assert {"conv_bias_relu", "conv_bias_add_relu", "max_pool2d", "avg_pool2d", "linear_bias"} <= pats
        assert not pipe.program.fallbacks, pipe.program.fallbacks
        assert not any(s.kind == "bn" for s in pipe.stages)
    else:  # MobileNetV2: ReLU6 and linear residual tails fused, depthwise convs too (or PyTorch's kernel where faster)
        assert not pipe.program.fallbacks, pipe.program.fallbacks
        assert {"conv_bias_relu6", "conv_bias_add"} <= {s.pattern for s in pipe.stages}
        assert any(int(s.attrs.get("groups", 1)) > 1 and s.pattern.startswith("conv") for s in pipe.stages)
        print(f"{name}: build fallbacks {pipe.build_fallbacks}; measured choices {pipe.choices}")


@pytest.mark.parametrize("name", ["resnet18"])
def test_report_mentions_every_stage(name):
    _, pipe = _compiled(name, 1)
    r = pipe.report()
    rows = [line for line in r.splitlines() if line.startswith("│")]
    for i, s in enumerate(pipe.stages):
        assert any(row.split("│")[1].strip() == str(i) and s.pattern in row for row in rows), (i, s.pattern)
    assert "captured" in r and "MiB" in r
    assert all(t is not None and t >= 0 for t in pipe.times_ms)
    eng = [e for e, s in zip(pipe.engines, pipe.stages) if s.pattern.startswith(("conv", "linear"))]
    assert all(e not in ("-", "") for e in eng), eng
    print(r)


def test_static_output_and_clone():
    _, pipe = _compiled("resnet18", 1)
    x = torch.randn(1, 3, 224, 224, device="cuda")
    a = pipe.run(x, clone=False)
    assert a.data_ptr() == pipe.output_buffer.data_ptr()
    b = pipe(x)
    assert b.data_ptr() != a.data_ptr() and torch.equal(a, b)
    # input on the host, float32, NCHW: cast and relayout on the copy
    c = pipe(x.cpu())
    assert torch.equal(b, c)


def _small_onnx(tmp_path):
    onnx = pytest.importorskip("onnx")
    nn = torch.nn

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                nn.Linear(64, 10),
            )

        def forward(self, x):
            return torch.softmax(self.f(x), dim=1)

    torch.manual_seed(3)
    m = CNN().eval()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
    path = tmp_path / "cnn.onnx"
    try:
        torch.onnx.export(m, torch.zeros(4, 3, 32, 32), str(path), dynamo=False, opset_version=17)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch.onnx.export unavailable ({type(e).__name__}: {e})")
    onnx.checker.check_model(onnx.load(str(path)))
    return m, path


def test_onnx_cnn(tmp_path):
    import fusekit.pipeline as fp

    m, path = _small_onnx(tmp_path)
    pipe = fp.compile(str(path), (4, 3, 32, 32), dtype="float16")
    assert pipe.graph_captured, pipe.capture_error
    x = torch.randn(4, 3, 32, 32, device="cuda")
    y = pipe(x).float()
    want = m.cuda()(x)
    assert float((y - want).norm() / want.norm()) < 2e-2
    ref = torch.from_numpy(pipe.reference(x.cpu().double().numpy())).cuda().float()
    assert float((y - ref).norm() / ref.norm()) < 2e-2
    assert "softmax" in [s.pattern for s in pipe.stages]


def test_autotune_path_small():
    import fusekit.pipeline as fp

    nn = torch.nn
    torch.manual_seed(4)
    m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 8)).eval().cuda()
    seen = []
    # choose=False: each stage stays on its tuned plan (with choose, PyTorch may time faster on shapes
    # this small and take all three stages: seen on an H100)
    pipe = fp.compile(m, torch.zeros(2, 16, 16, 16), dtype="float16", autotune=True, choose=False, progress=lambda *a: seen.append(a))
    assert pipe.autotuned
    assert seen[0][:2] == (0, 3) and seen[-1][:2] == (3, 3), seen  # two convs and the linear, then done
    x = torch.randn(2, 16, 16, 16, device="cuda")
    y = pipe(x).float()
    want = m(x)
    assert float((y - want).norm() / want.norm()) < 2e-2
    srcs = [src for src, s in zip(pipe.sources, pipe.stages) if s.pattern.startswith(("conv", "linear"))]
    assert srcs == ["tuned"] * 3, srcs


def test_ceil_mode_pools_run_on_fusekit_kernels():
    """nn.MaxPool2d / AvgPool2d with ceil_mode (GoogLeNet, SqueezeNet) lower to fusekit's pooling
    kernels (choose=False: no PyTorch stand-in), with PyTorch's output sizes and values."""
    import fusekit.pipeline as fp

    nn = torch.nn
    torch.manual_seed(5)
    m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True),  # 14 -> 7 (floor: 6)
                      nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False),  # 7 -> 4
                      nn.Flatten(), nn.Linear(32 * 4 * 4, 8)).eval().cuda()
    pipe = fp.compile(m, torch.zeros(2, 16, 14, 14), dtype="float16", choose=False)
    pools = [(s.pattern, e) for s, e in zip(pipe.stages, pipe.engines) if "pool" in s.pattern]
    assert pools == [("max_pool2d", "cupy kernel"), ("avg_pool2d", "cupy kernel")], pools
    x = torch.randn(2, 16, 14, 14, device="cuda")
    y, want = pipe(x).float(), m(x)
    assert float((y - want).norm() / want.norm()) < 2e-2


def test_dilated_and_divisor_override_pools_run_on_fusekit_kernels():
    import fusekit.pipeline as fp

    nn = torch.nn
    torch.manual_seed(6)
    m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 1, 1, dilation=2),  # 14 -> 12
                      nn.AvgPool2d(3, 2, 1, divisor_override=4),  # 12 -> 6
                      nn.Flatten(), nn.Linear(32 * 6 * 6, 8)).eval().cuda()
    pipe = fp.compile(m, torch.zeros(2, 16, 14, 14), dtype="float16", choose=False)
    pools = [(s.pattern, e) for s, e in zip(pipe.stages, pipe.engines) if "pool" in s.pattern]
    assert pools == [("max_pool2d", "cupy kernel"), ("avg_pool2d", "cupy kernel")], pools
    x = torch.randn(2, 16, 14, 14, device="cuda")
    y, want = pipe(x).float(), m(x)
    assert float((y - want).norm() / want.norm()) < 2e-2


def test_input_bound_when_it_is_the_input_buffer():
    _, pipe = _compiled("resnet18", 1)
    x = torch.randn(1, 3, 224, 224, device="cuda")
    want = pipe(x)
    pipe.input_buffer.copy_(x)
    got = pipe(pipe.input_buffer)  # the bound buffer itself: no copy, same result
    assert torch.equal(got, want)


def test_fusekit_nn_sequential_compiles_with_cupy_in_and_out():
    cp = pytest.importorskip("cupy")
    import fusekit
    import fusekit.nn as fnn
    import fusekit.pipeline as fp

    bn = fnn.BatchNorm2d(16, relu=True)
    rs = cp.random.RandomState(5)
    bn.running_mean = rs.uniform(-0.2, 0.2, 16).astype(cp.float32)
    bn.running_var = rs.uniform(0.5, 1.5, 16).astype(cp.float32)
    bn.weight.data = rs.uniform(0.5, 1.5, 16).astype(cp.float32)
    seq = fnn.Sequential(
        fnn.Conv2d(3, 16, 3, padding=1, seed=0), bn, fnn.MaxPool2d(2),
        fnn.Conv2d(16, 32, 3, stride=2, padding=1, activation="relu", seed=1), fnn.Flatten(), fnn.Linear(32 * 4 * 4, 10, seed=2),
    ).eval()
    x = fusekit.nhwc(rs.standard_normal((4, 16, 16, 3)).astype(cp.float32))
    want = cp.asnumpy(seq(x)).astype(np.float64)
    pipe = fp.compile(seq, x, dtype="float16")
    assert pipe.graph_captured, pipe.capture_error
    assert [s.pattern for s in pipe.stages] == ["conv_bias_relu", "max_pool2d", "conv_bias_relu", "reshape", "linear_bias"]
    y = pipe(x)
    assert isinstance(y, cp.ndarray) and y.shape == (4, 10) and y.dtype == cp.float16
    got = cp.asnumpy(y).astype(np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    host = pipe(cp.asnumpy(x))  # NumPy in, NumPy out
    assert isinstance(host, np.ndarray) and np.array_equal(host, cp.asnumpy(y))


def test_batch_sizes_share_weights_and_pad_smaller_batches():
    """compile(batch_sizes=[1, 4]): one CUDA graph per size, one copy of the weights; a batch of 3 runs
    the batch-4 graph padded and matches float32 eager row for row; 5 rows are refused by name."""
    import fusekit.pipeline as fp
    from fusekit.errors import OperandError

    m, _ = _compiled("resnet18", 1)
    pipes = fp.compile(m, torch.zeros(1, 3, 224, 224), batch_sizes=[4, 1])
    assert isinstance(pipes, fp.BatchedPipelines) and pipes.batch_sizes == [1, 4]
    p1, p4 = pipes.pipelines[1], pipes.pipelines[4]
    assert p1.graph_captured and p4.graph_captured
    ptrs = {t.data_ptr() for w in p1._stage_weights for t in w.values()}
    assert ptrs and all(t.data_ptr() in ptrs for w in p4._stage_weights for t in w.values())
    assert pipes.weight_bytes == p1.weight_bytes
    assert p4.input_buffer.data_ptr() != p1.input_buffer.data_ptr()
    x = torch.randn(3, 3, 224, 224, device="cuda")
    assert pipes.pipeline_for(3) is p4 and pipes.pipeline_for(1) is p1
    got = pipes(x)
    assert got.shape == (3, 1000)
    with torch.no_grad():
        want = m(x)
        half = _half(m)(x.half().contiguous(memory_format=torch.channels_last))
    _check_logits(got, want, 3, half)
    one = pipes(x[:1])  # the batch-1 graph: same logits as row 0 of the padded batch-4 run, within float16
    _check_logits(one, want[:1], 1, half[:1])
    with pytest.raises(OperandError, match="at most 4 rows"):
        pipes(torch.randn(5, 3, 224, 224, device="cuda"))
    with pytest.raises(OperandError, match="expected shape"):
        pipes(torch.randn(2, 3, 112, 112, device="cuda"))


def test_global_average_pools_run_as_a_reduction():
    """AdaptiveAvgPool2d(1), mean over (H, W) and an AvgPool2d whose window is the whole plane run as
    a reduction (fusekit's two-pass mean or PyTorch's, whichever times faster; not a pooling window
    per output), matching eager."""
    import fusekit.pipeline as fp

    nn = torch.nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(16, 32, 3, padding=1)
            self.gap, self.whole = nn.AdaptiveAvgPool2d(1), nn.AvgPool2d(28)
            self.fc = nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.conv(x))
            g = torch.sigmoid(self.gap(y))
            return self.fc((self.whole(y * g) + y.mean((2, 3), keepdim=True)).flatten(1))

    torch.manual_seed(7)
    m = Net().eval().cuda()
    pipe = fp.compile(m, torch.zeros(4, 16, 28, 28), dtype="float16")
    pools = [e for s, e in zip(pipe.stages, pipe.engines) if s.pattern == "avg_pool2d"]
    # fusekit's two-pass mean, or PyTorch's where it timed faster: never a one-thread-per-output pool
    assert len(pools) == 3 and all(e.startswith(("cupy kernel (global mean)", "torch (faster")) for e in pools), pools
    x = torch.randn(4, 16, 28, 28, device="cuda")
    y, want = pipe(x).double(), m.double()(x.double())
    assert float((y - want).norm() / want.norm()) < 1e-2


class _DenseBlock(torch.nn.Module):
    """DenseNet's pattern: each layer reads the concatenation of all earlier features (BN, ReLU,
    conv) and its output joins it; the block returns the whole concatenation."""

    def __init__(self, c: int, growth: int, layers: int) -> None:
        super().__init__()
        nn = torch.nn
        self.layers = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(c + k * growth), nn.ReLU(), nn.Conv2d(c + k * growth, growth, 3, padding=1))
                                    for k in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [x]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        return torch.cat(feats, 1)


def test_concatenations_are_written_in_place():
    """The parts of channel concatenations are written by their producers straight into slices of
    the concatenation's buffer (cuDNN convolutions write channel slices); the concatenations copy
    nothing, and the output matches eager."""
    import fusekit.pipeline as fp

    nn = torch.nn
    torch.manual_seed(8)
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.MaxPool2d(2), _DenseBlock(16, 8, 4), nn.Conv2d(48, 16, 1),
                      nn.AvgPool2d(2), _DenseBlock(16, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(40, 10)).eval().cuda()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-1, 1)
                mod.running_var.uniform_(0.5, 2)
    pipe = fp.compile(m, torch.zeros(4, 8, 32, 32), dtype="float16", choose=False)  # cuDNN runs every fused stage
    cats = [e for s, e in zip(pipe.stages, pipe.engines) if s.attrs.get("op") == "cat"]
    assert cats and all(e == "in place (no copy)" for e in cats), cats
    assert pipe.memory_plan.alias and pipe.memory_plan.conflicts() == []
    convs = [e for s, e in zip(pipe.stages, pipe.engines) if s.pattern.startswith("conv") and s.output in pipe.memory_plan.alias]
    assert convs and not any(e.startswith("torch") for e in convs), convs  # cuDNN wrote the slices (none refused)
    x = torch.randn(4, 8, 32, 32, device="cuda")
    for _ in range(2):  # replays reuse the buffers
        y, want = pipe(x).double(), m.double()(x.double())
        m.float()
        assert float((y - want).norm() / want.norm()) < 1e-2
        x = torch.randn(4, 8, 32, 32, device="cuda")


def test_chunk_items_are_views():
    """ShuffleNetV2's split unit: x.chunk(2, 1) items are channel slices of x (no copy) that cuDNN
    convolutions read in place; the result matches eager."""
    import fusekit.pipeline as fp

    nn = torch.nn

    class Unit(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.branch = nn.Sequential(nn.Conv2d(c // 2, c // 2, 1), nn.BatchNorm2d(c // 2), nn.ReLU(),
                                        nn.Conv2d(c // 2, c // 2, 3, padding=1, groups=c // 2), nn.Conv2d(c // 2, c // 2, 1), nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, dim=1)
            return nn.functional.channel_shuffle(torch.cat((x1, self.branch(x2)), 1), 2)

    torch.manual_seed(9)
    m = nn.Sequential(nn.Conv2d(8, 32, 3, padding=1), Unit(32), Unit(32), nn.Conv2d(32, 8, 1)).eval().cuda()
    pipe = fp.compile(m, torch.zeros(4, 8, 16, 16), dtype="float16")
    views = [e for s, e in zip(pipe.stages, pipe.engines) if "channel_slice" in s.attrs]
    assert views.count("view (no copy)") >= 2, list(zip([s.name for s in pipe.stages], pipe.engines))
    x = torch.randn(4, 8, 16, 16, device="cuda")
    y, want = pipe(x).double(), m.double()(x.double())
    assert float((y - want).norm() / want.norm()) < 1e-2


@pytest.mark.heavy
def test_channel_layer_norms_run_as_cudnn_layer_norm_graphs():
    """ConvNeXt's LayerNorm over channels (permute, LayerNorm, permute) runs as cuDNN's layer norm
    over the image read as rows of channels (no copy), within float16's error of eager."""
    import fusekit.pipeline as fp

    nn = torch.nn

    class LN2d(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    torch.manual_seed(10)
    m = nn.Sequential(nn.Conv2d(3, 96, 4, stride=4), LN2d(96), nn.Conv2d(96, 96, 7, padding=3, groups=96), LN2d(96),
                      nn.Conv2d(96, 192, 1), nn.GELU(), nn.Conv2d(192, 96, 1)).eval().cuda()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
    pipe = fp.compile(m, torch.zeros(8, 3, 64, 64), dtype="float16", choose=False)
    lns = [e for s, e in zip(pipe.stages, pipe.engines) if s.pattern == "layernorm"]
    assert len(lns) == 2 and not any(e.startswith(("torch", "cupy")) for e in lns), (lns, pipe.fallbacks)
    # with the choice, each runs the fastest of the cuDNN graph, fusekit's CuPy kernel and PyTorch's
    chosen = fp.compile(m, torch.zeros(8, 3, 64, 64), dtype="float16")
    engines = [e for s, e in zip(chosen.stages, chosen.engines) if s.pattern == "layernorm"]
    assert len(engines) == 2 and all("(faster" not in e or e.startswith(("cupy kernel (faster", "torch (faster")) for e in engines), engines
    assert all(r["rel_err"] < 1e-2 for r in chosen.check()), chosen.check()
    x = torch.randn(8, 3, 64, 64, device="cuda")
    want = m.double()(x.double())
    for p in (pipe, chosen):
        y = p(x).double()
        assert float((y - want).norm() / want.norm()) < 1e-2
