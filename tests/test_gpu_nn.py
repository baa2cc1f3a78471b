"""GPU: fusekit.nn (CuPy layers on fused graphs) against PyTorch, and training with it."""

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")


def to_torch(a):
    return torch.from_dlpack(a).double()


def rel(a, ref):
    a = to_torch(a) if not isinstance(a, torch.Tensor) else a.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def test_layers_match_torch_gradients():
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
