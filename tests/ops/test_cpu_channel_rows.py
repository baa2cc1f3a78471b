"""CPU: per-channel sums over few channels (bias gradients, ReLU backward + bias gradient) run on
the channels-last memory read as rows of several pixels; each graph evaluated by the oracle."""

import numpy as np
import pytest

import fusekit
from fusekit.engine import oracle
from fusekit.ops import common


@pytest.mark.parametrize("c, rows", [(1, (4, 32)), (3, (8, 48)), (16, (64, 32)), (31, (64, 62)), (32, None)])
def test_few_channel_sums_run_on_rows_of_pixels(monkeypatch, c, rows):
    """ReLU backward + bias gradient and the bias gradient alone on fewer than 32 channels run on
    the channels-last memory read as (N*H*W / k, k*C, 1, 1) and fold the k*C sums: the same dz
    (channels-last, shape of dy) and db as the direct graph, each graph evaluated by the oracle."""
    torch = pytest.importorskip("torch")

    seen = []

    def call(name, *a, out=None, **kw):
        seen.append((name, tuple(tuple(x.shape) for x in a)))
        res = oracle.evaluate(name, *(x.contiguous().numpy() for x in a), **kw)
        res = tuple(torch.from_numpy(np.ascontiguousarray(r.reshape(-1) if r.shape[0] == 1 and r.shape[2:] == (1, 1) else r)) for r in res)
        return res[0] if len(res) == 1 else res

    monkeypatch.setattr(common, "call", call)
    monkeypatch.setattr(common, "fused_or_split", lambda tag, fused, split, like=None: fused())  # no GPU timing
    g = torch.Generator().manual_seed(c)
    dy = torch.randn(2, c, 8, 8, generator=g, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    y = torch.randn(2, c, 8, 8, generator=g, dtype=torch.float64).relu().contiguous(memory_format=torch.channels_last)
    dz, db = common.relu_bias_grad(dy, y, True)
    want = dy * (y > 0)
    assert dz.shape == dy.shape and (rows is None or dz.is_contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(dz, want, rtol=0, atol=0)
    torch.testing.assert_close(db, want.sum((0, 2, 3)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(common.bias_grad(dy), dy.sum((0, 2, 3)), rtol=1e-12, atol=1e-12)
    expect = (2, c, 8, 8) if rows is None else (*rows, 1, 1)
    assert [s[1][0] for s in seen] == [expect, expect]
    # NCHW memory (for one channel: H and W swapped), or an odd pixel count, is reduced as it is
    seen.clear()
    common.bias_grad(dy.contiguous() if c > 1 else dy.transpose(2, 3))
    odd = torch.randn(1, c, 3, 3, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    common.bias_grad(odd)
    assert [s[1][0] for s in seen] == [(2, c, 8, 8), (1, c, 3, 3)]
    assert common.pixels_per_row(torch.empty(0, c, 8, 8).contiguous(memory_format=torch.channels_last)) == 1  # empty
    if c > 1:  # operands in different layouts: as they are
        assert common.pixels_per_row(dy, y.contiguous()) == 1


def test_few_channel_sums_of_host_tensors_name_the_operand():
    """A host (CPU) channels-last tensor with 3 channels goes through the row views to dispatch, which
    refuses it naming the pattern's operand, before anything reaches cuDNN."""
    torch = pytest.importorskip("torch")
    x = torch.ones(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    assert common.pixels_per_row(x, x) == 16
    with pytest.raises(fusekit.OperandError, match=r"bias_grad: operand 'dy': expected a CUDA device array"):
        common.bias_grad(x)
    with pytest.raises(fusekit.OperandError, match=r"relu_bias_grad: operand 'dy': expected a CUDA device array"):
        common.relu_bias_grad(x, x, True)
