"""CPU: the batch-norm family's oracle (against naive loops and finite differences), its cuDNN
graph structure, and its errors."""

import numpy as np
import pytest

import fusekit
from fusekit.engine import lower
from fusekit.engine import oracle
from fusekit.tensors import TensorSpec


def naive_bn(x, gamma, beta, eps):
    n, c, h, w = x.shape
    y = np.empty_like(x)
    means, invs = np.empty(c), np.empty(c)
    for k in range(c):
        vals = [x[i, k, a, b] for i in range(n) for a in range(h) for b in range(w)]
        m = sum(vals) / len(vals)
        v = sum((t - m) ** 2 for t in vals) / len(vals)
        inv = 1.0 / np.sqrt(v + eps)
        means[k], invs[k] = m, inv
        for i in range(n):
            for a in range(h):
                for b in range(w):
                    y[i, k, a, b] = (x[i, k, a, b] - m) * inv * gamma[k] + beta[k]
    return y, means, invs


@pytest.mark.parametrize("c", [1, 3, 5])
def test_batchnorm_oracle_matches_naive_loops(c, rng):
    x = rng.standard_normal((3, c, 4, 5))
    g, b = rng.random(c) + 0.5, rng.standard_normal(c)
    rm, rv = rng.standard_normal(c), rng.random(c) + 0.5
    y, mean, inv, nrm, nrv = oracle.evaluate("batchnorm", x, g, b, rm, rv, epsilon=1e-3, momentum=0.25)
    yn, mn, invn = naive_bn(x, g, b, 1e-3)
    assert np.allclose(y, yn) and np.allclose(mean, mn) and np.allclose(inv, invn)
    count = 3 * 4 * 5
    var_unbiased = x.var(axis=(0, 2, 3)) * count / (count - 1)
    assert np.allclose(nrm, 0.75 * rm + 0.25 * mn) and np.allclose(nrv, 0.75 * rv + 0.25 * var_unbiased)
    (yr,) = oracle.evaluate("batchnorm_inference_relu", x, rm, 1 / np.sqrt(rv + 1e-5), g, b)
    assert np.allclose(yr, np.maximum(((x - rm[:, None, None]) / np.sqrt(rv[:, None, None] + 1e-5)) * g[:, None, None] + b[:, None, None], 0))


def _fd(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f(x)
        x[i] = old - eps
        fm = f(x)
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


@pytest.mark.parametrize("relu", [False, True])
def test_batchnorm_backward_oracle_matches_finite_differences(relu, rng):
    c = 3
    x = rng.standard_normal((2, c, 3, 3))
    g, b = rng.random(c) + 0.5, rng.standard_normal(c)
    dy = rng.standard_normal(x.shape)
    name = "batchnorm_relu" if relu else "batchnorm"
    rm, rv = np.zeros(c), np.ones(c)

    def loss(xx, gg=g, bb=b):
        return float((oracle.evaluate(name, xx, gg, bb, rm, rv)[0] * dy).sum())

    y, mean, inv, _, _ = oracle.evaluate(name, x, g, b, rm, rv)
    if relu:
        dx, dg, db = oracle.evaluate("batchnorm_relu_backward", dy, y, x, g, mean, inv)
    else:
        dx, dg, db = oracle.evaluate("batchnorm_backward", dy, x, g, mean, inv)
    assert np.allclose(dx, _fd(loss, x.copy()), atol=1e-5)
    assert np.allclose(dg, _fd(lambda gg: loss(x, gg, b), g.copy()), atol=1e-5)
    assert np.allclose(db, _fd(lambda bb: loss(x, g, bb), b.copy()), atol=1e-5)


def test_batchnorm_add_relu_oracle_matches_finite_differences(rng):
    """relu(bn(x) + z) and its one-graph backward: dx, dgamma, dbeta and the residual's gradient dz."""
    c = 3
    x, z = rng.standard_normal((2, c, 3, 3)), rng.standard_normal((2, c, 3, 3))
    g, b = rng.random(c) + 0.5, rng.standard_normal(c)
    dy = rng.standard_normal(x.shape)
    rm, rv = np.zeros(c), np.ones(c)

    def loss(xx, gg=g, bb=b, zz=z):
        return float((oracle.evaluate("batchnorm_add_relu", xx, gg, bb, rm, rv, zz)[0] * dy).sum())

    y, mean, inv, _, _ = oracle.evaluate("batchnorm_add_relu", x, g, b, rm, rv, z)
    bn = oracle.evaluate("batchnorm", x, g, b, rm, rv)[0]
    assert np.array_equal(y, np.maximum(bn + z, 0))
    dx, dz, dg, db = oracle.evaluate("batchnorm_add_relu_backward", dy, y, x, g, mean, inv)
    assert np.array_equal(dz, dy * (y > 0))
    assert np.allclose(dx, _fd(loss, x.copy()), atol=1e-5)
    assert np.allclose(dz, _fd(lambda zz: loss(x, g, b, zz), z.copy()), atol=1e-5)
    assert np.allclose(dg, _fd(lambda gg: loss(x, gg, b), g.copy()), atol=1e-5)
    assert np.allclose(db, _fd(lambda bb: loss(x, g, bb), b.copy()), atol=1e-5)


def test_scale_shift_and_genstats_oracle(rng):
    x = rng.standard_normal((2, 4, 3, 3))
    g, b = rng.standard_normal(4), rng.standard_normal(4)
    (y,) = oracle.evaluate("channel_scale_shift_relu", x, g, b)
    assert np.allclose(y, np.maximum(x * g[:, None, None] + b[:, None, None], 0))
    (dg,) = oracle.evaluate("scale_grad", y, x)
    assert np.allclose(dg, (y * x).sum(axis=(0, 2, 3)))
    w = rng.standard_normal((5, 4, 3, 3))
    yc, s, sq = oracle.evaluate("conv_genstats", x, w, padding=1)
    assert np.allclose(s, yc.sum(axis=(0, 2, 3))) and np.allclose(sq, (yc**2).sum(axis=(0, 2, 3)))


def _specs(pat, shapes, dtype="float16"):
    specs = {}
    for o in pat.operands:
        shp = shapes[o.name]
        specs[o.name] = TensorSpec.build(shp, o.dtype or dtype, 0, "NHWC" if o.kind == "image" else "NCHW", view=(shp[1],) if o.kind == "channel" else None)
    return specs


def test_batchnorm_relu_graph_structure():
    pat = fusekit.get_pattern("batchnorm_relu")
    c = 8
    specs = _specs(pat, {"x": (2, c, 5, 5), **{n: (1, c, 1, 1) for n in ("gamma", "beta", "running_mean", "running_var")}})
    norm = dict(pat.normalize_attrs({"epsilon": 1e-3, "momentum": 0.2}))
    from fusekit.engine.keys import output_specs

    specs.update(output_specs(pat, specs, tuple(norm.items())))
    low = lower.lower(pat, specs, norm)
    info = low.graph.inspect()
    assert [n["type"] for n in info["nodes"]] == ["BATCHNORM", "POINTWISE"]
    t = info["tensors"]
    assert t["y"]["dtype"] == "data_type.HALF" and not t["y"]["is_virtual"] and t["y"]["stride"] == [200, 1, 40, 8]
    assert t["mean"]["dtype"] == "data_type.FLOAT" and t["new_running_var"]["dim"] == [1, c, 1, 1]
    relu_in = info["nodes"][1]["inputs"]["IN_0"]
    assert info["nodes"][0]["outputs"]["Y"] == relu_in and t[relu_in]["is_virtual"]  # BN's y feeds the ReLU inside the graph
    # epsilon and momentum are pass-by-value scalars the graph carries (nothing to bind at execute)
    scalars = {name: t for name, t in low.graph.tensors.items() if t.is_pass_by_value}
    assert sorted(v.pass_by_value for v in scalars.values()) == [1e-3, 0.2]
    # the backend takes a scalar_type (compile-time constant vs runtime parameter), not a data_type
    import cudnn

    assert all(v.scalar_type == cudnn.scalar_type.RUNTIME_PARAM for v in scalars.values())
    assert len(low.uids) == len(low.names)


def test_norm_errors():
    x = np.zeros((2, 4, 3, 3))
    with pytest.raises(fusekit.OperandError, match="'gamma'.*one value per channel"):
        oracle.evaluate("batchnorm", x, np.ones(3), np.zeros(4), np.zeros(4), np.ones(4))
    with pytest.raises(fusekit.OperandError, match="attribute 'epsilon'.*positive"):
        oracle.evaluate("batchnorm", x, np.ones(4), np.zeros(4), np.zeros(4), np.ones(4), epsilon=0.0)
    with pytest.raises(fusekit.OperandError, match="attribute 'momentum'.*\\[0, 1\\]"):
        oracle.evaluate("batchnorm", x, np.ones(4), np.zeros(4), np.zeros(4), np.ones(4), momentum=-0.1)
    with pytest.raises(fusekit.OperandError, match="'beta'.*needs both"):
        fusekit.ops.channel_scale_shift(x, np.ones(4), None, relu=True)
    with pytest.raises(fusekit.OperandError, match="'gamma'.*give gamma, beta or both"):
        fusekit.ops.channel_scale_shift(x)
    # a residual is added in front of a plain ReLU only; its backward needs that ReLU's output
    c = np.ones(4)
    for kw in ({}, {"relu": True, "upper_clip": 6.0}):
        with pytest.raises(fusekit.OperandError, match="argument 'residual'.*relu=True"):
            fusekit.ops.batchnorm(x, c, c, c, c, residual=x, **kw)
    with pytest.raises(fusekit.OperandError, match="'y'.*residual=True needs y"):
        fusekit.ops.batchnorm_backward(x, x, c, c, c, residual=True)


@pytest.mark.parametrize("relu", [False, True])
def test_batchnorm_from_reductions_matches_the_node(monkeypatch, relu):
    """The split batch norm (for keys cuDNN's node refuses, e.g. C not a multiple of its vector
    width) gives the node's forward and backward: ops' own code, with each graph evaluated by the oracle."""
    from fusekit.ops import common, norm

    def call(name, *a, out=None, **kw):  # the oracle in place of the GPU; channel outputs as (C,) like fusekit's
        res = tuple(r.reshape(-1) if r.ndim == 4 and r.shape[0] == 1 and r.shape[2:] == (1, 1) else r for r in oracle.evaluate(name, *a, **kw))
        return res[0] if len(res) == 1 else res

    monkeypatch.setattr(norm, "call", call)
    monkeypatch.setattr(common, "call", call)
    for mod in (norm, common):  # no GPU timing of fused against split
        monkeypatch.setattr(mod, "fused_or_split", lambda tag, fused, split, like=None: fused())
    rng = np.random.default_rng(3)
    c = 3
    x = rng.standard_normal((4, c, 5, 6)) * 2 + 0.5
    g, b, rm, rv = rng.random(c) + 0.5, rng.standard_normal(c), rng.standard_normal(c), rng.random(c) + 0.5
    got = norm.bn_split_forward(x, g, b, rm, rv, relu, 1e-3, 0.25)
    want = oracle.evaluate("batchnorm_relu" if relu else "batchnorm", x, g, b, rm, rv, epsilon=1e-3, momentum=0.25)
    for a, w in zip(got, want):
        np.testing.assert_allclose(np.reshape(a, np.shape(w)), w, rtol=1e-12, atol=1e-12)
    y, mean, inv = got[:3]
    dy = rng.standard_normal(x.shape)
    dz = dy * (y > 0) if relu else dy
    got_b = norm.bn_split_backward(dz, x, g, mean, inv)
    want_b = oracle.evaluate("batchnorm_backward", dz, x, g, np.reshape(mean, (c,)), np.reshape(inv, (c,)))
    for a, w in zip(got_b, want_b):
        np.testing.assert_allclose(np.reshape(a, np.shape(w)), w, rtol=1e-10, atol=1e-12)
