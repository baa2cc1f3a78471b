"""GPU: fusekit.nn (CuPy layers on fused graphs) against PyTorch, and training with it."""

import math

import numpy as np
import pytest
from helpers import rel  # noqa: E402

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")


def to_torch(a):
    return torch.from_dlpack(a).double()


@pytest.fixture
def ieee_float32():
    """float32 graphs on IEEE math for the test (TF32, the default for convolutions, rounds inputs
    to 10 mantissa bits: ReLU masks then differ from the float64 model's near zero), then the
    default policy again."""
    import fusekit

    fusekit.configure(allow_tf32=False)
    yield
    fusekit.configure()


def test_layers_match_torch_gradients(ieee_float32):
    import fusekit.nn as fnn

    model = fnn.Sequential(
        fnn.Conv2d(3, 8, 3, padding=1, activation="relu", seed=1),
        fnn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1, seed=2),
        fnn.ReLU(),
        fnn.Flatten(),
        fnn.Linear(4 * 16 * 16, 10, seed=3),
    )
    ref = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 16 * 16, 10),
    ).cuda().double()
    pairs = [(model[0], ref[0]), (model[1], ref[2]), (model[4], ref[5])]
    with torch.no_grad():
        for m, r in pairs:
            r.weight.copy_(to_torch(m.weight.data))
            r.bias.copy_(to_torch(m.bias.data))
    x = fusekit_nhwc_random((4, 3, 8, 8))
    labels = cp.asarray(np.random.default_rng().integers(0, 10, 4))
    loss_fn = fnn.CrossEntropyLoss()
    loss = loss_fn(model(x), labels)
    model.backward(loss_fn.backward())
    xr = to_torch(x).requires_grad_(True)
    lr_ = torch.nn.functional.cross_entropy(ref(xr), to_torch(labels).long())
    lr_.backward()
    assert abs(float(loss) - float(lr_)) / float(lr_) < 5e-3
    for m, r in pairs:
        assert rel(m.weight.grad, r.weight.grad) < 5e-3
        assert rel(m.bias.grad, r.bias.grad) < 5e-3


def test_relu6_layers_match_torch_gradients(ieee_float32):
    """Conv2d(activation="relu6") and a ReLU6 layer: loss and gradients as torch's ReLU6 model's."""
    import fusekit.nn as fnn

    model = fnn.Sequential(fnn.Conv2d(3, 8, 3, padding=1, activation="relu6", seed=4), fnn.Conv2d(8, 8, 1, seed=5), fnn.ReLU6(),
                           fnn.Flatten(), fnn.Linear(8 * 8 * 8, 10, seed=6))
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU6(), torch.nn.Conv2d(8, 8, 1), torch.nn.ReLU6(),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10)).cuda().double()
    pairs = [(model[0], ref[0]), (model[1], ref[2]), (model[4], ref[5])]
    with torch.no_grad():
        for m, r in pairs:
            m.weight.data *= 8  # activations well above 6: the clips matter
            r.weight.copy_(to_torch(m.weight.data))
            r.bias.copy_(to_torch(m.bias.data))
    x = fusekit_nhwc_random((4, 3, 8, 8))
    x *= 3
    with torch.no_grad():
        assert float((ref[:2](to_torch(x)) == 6).double().mean()) > 0.05
    labels = cp.asarray(np.random.default_rng().integers(0, 10, 4))
    loss_fn = fnn.CrossEntropyLoss()
    loss = loss_fn(model(x), labels)
    model.backward(loss_fn.backward())
    lr_ = torch.nn.functional.cross_entropy(ref(to_torch(x)), to_torch(labels).long())
    lr_.backward()
    assert abs(float(loss) - float(lr_)) / float(lr_) < 5e-3
    for m, r in pairs:
        assert rel(m.weight.grad, r.weight.grad) < 5e-3
        assert rel(m.bias.grad, r.bias.grad) < 5e-3


def fusekit_nhwc_random(shape):
    import fusekit

    n, c, h, w = shape
    return fusekit.nhwc(cp.random.standard_normal((n, h, w, c), dtype=cp.float32))


def test_cupy_autoencoder_trains():
    import fusekit.nn as fnn

    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 64), torch.linspace(0, 1, 64), indexing="ij")
    c = torch.rand(128, 4, 2, generator=g)
    wd = 0.05 + 0.15 * torch.rand(128, 4, 1, 1, generator=g)
    col = torch.rand(128, 4, 3, generator=g)
    m = torch.exp(-((xx - c[..., 0, None, None]) ** 2 + (yy - c[..., 1, None, None]) ** 2) / (2 * wd**2))
    imgs = torch.einsum("nbhw,nbc->nhwc", m, col).clamp(0, 1).float().numpy()
    data = cp.asarray(imgs)  # (N, H, W, C): channels-last
    model = fnn.Sequential(
        fnn.Conv2d(3, 16, 3, stride=2, padding=1, activation="relu", seed=0),
        fnn.ConvTranspose2d(16, 3, 3, stride=2, padding=1, output_padding=1, activation="relu", seed=1),
    )
    opt = fnn.Adam(model.parameters(), lr=3e-3)
    loss_fn = fnn.MSELoss()
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(300):
        import fusekit

        x = fusekit.nhwc(data[cp.asarray(rng.integers(0, 128, 16))])
        loss = loss_fn(model(x), x)
        opt.zero_grad()
        model.backward(loss_fn.backward())
        opt.step()
        losses.append(float(loss))
    print(f"CuPy autoencoder: {losses[0]:.4f} -> {losses[-1]:.5f}")
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] / min(losses[-10:]) >= 10


def test_sequential_fuses_normalize_scale_shift_relu_with_identical_results():
    """normalize -> scale/shift -> ReLU written as three layers runs as one graph, same numbers."""
    import fusekit.nn as fnn

    def build(fuse):
        bn = fnn.BatchNorm2d(64, affine=False)
        ss = fnn.ChannelScaleShift(64)
        ss.weight.data[...] = cp.linspace(0.5, 1.5, 64, dtype=cp.float32)
        ss.bias.data[...] = cp.linspace(-1, 1, 64, dtype=cp.float32)
        return fnn.Sequential(bn, ss, fnn.ReLU(), fuse=fuse)

    fused, plain = build(True), build(False)
    assert len(fused._steps()) == 1 and len(plain._steps()) == 3
    x = fusekit_nhwc_random((8, 64, 12, 12))
    y1, y2 = fused(x), plain(x)
    assert float(cp.abs(y1 - y2).max()) < 1e-4
    dy = fusekit_nhwc_random((8, 64, 12, 12))
    dx1, dx2 = fused.backward(dy), plain.backward(dy)
    assert float(cp.linalg.norm(dx1 - dx2) / cp.linalg.norm(dx2)) < 1e-4
    for p1, p2 in zip(fused.parameters(), plain.parameters()):
        assert float(cp.linalg.norm(p1.grad - p2.grad) / cp.linalg.norm(p2.grad)) < 1e-4
    for a, b in ((fused[0].running_mean, plain[0].running_mean), (fused[0].running_var, plain[0].running_var)):
        assert float(cp.abs(a - b).max()) < 1e-5
    fused.eval(), plain.eval()
    assert float(cp.abs(fused(x) - plain(x)).max()) < 1e-4


def test_batchnorm2d_matches_torch_train_and_eval():
    import fusekit.nn as fnn

    bn = fnn.BatchNorm2d(3, momentum=0.2)
    ref = torch.nn.BatchNorm2d(3, momentum=0.2).cuda().double()
    for _ in range(3):
        x = fusekit_nhwc_random((4, 3, 9, 9))
        y = bn(x)
        yr = ref(to_torch(x))
        assert rel(y, yr) < 1e-4
    assert rel(bn.running_mean, ref.running_mean) < 1e-5 and rel(bn.running_var, ref.running_var) < 1e-5
    bn.eval(), ref.eval()
    x = fusekit_nhwc_random((4, 3, 9, 9))
    assert rel(bn(x), ref(to_torch(x))) < 1e-4


def test_small_cnn_trains():
    """conv-BN-ReLU-pool x2, linear, log-softmax on a synthetic 4-class task (which quadrant holds the blob)."""
    import fusekit
    import fusekit.nn as fnn

    rng = np.random.default_rng(0)

    def batch(n):
        labels = rng.integers(0, 4, n)
        imgs = rng.normal(0, 0.3, (n, 16, 16, 3)).astype(np.float32)
        for i, q in enumerate(labels):
            r0, c0 = (q // 2) * 8 + rng.integers(1, 5), (q % 2) * 8 + rng.integers(1, 5)
            imgs[i, r0:r0 + 3, c0:c0 + 3, :] += 2.0
        return fusekit.nhwc(cp.asarray(imgs)), cp.asarray(labels)

    model = fnn.Sequential(
        fnn.Conv2d(3, 8, 3, padding=1, seed=0), fnn.BatchNorm2d(8), fnn.ReLU(), fnn.MaxPool2d(2),
        fnn.Conv2d(8, 16, 3, padding=1, seed=1), fnn.BatchNorm2d(16), fnn.ReLU(), fnn.MaxPool2d(2),
        fnn.Flatten(), fnn.Linear(16 * 4 * 4, 4, seed=2), fnn.Softmax(log=True),
    )
    assert sum(type(s).__name__ == "_FusedNorm" for s in model._steps()) == 2  # BN -> ReLU fused twice
    opt, loss_fn = fnn.Adam(model.parameters(), lr=3e-3), fnn.NLLLoss()
    losses = []
    for _ in range(150):
        x, labels = batch(32)
        loss = loss_fn(model(x), labels)
        opt.zero_grad()
        model.backward(loss_fn.backward())
        opt.step()
        losses.append(float(loss))
    model.eval()
    x, labels = batch(256)
    acc = float((model(x).argmax(axis=1) == labels).mean())
    print(f"small CNN: loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}, eval accuracy {acc:.1%}")
    assert np.mean(losses[-10:]) < losses[0] / 4 and acc > 0.9
