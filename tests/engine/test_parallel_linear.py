"""The projections' `plus` path (engine/parallel.py): a prefill step's LoRA delta handed to the base GEMM,
which adds it (and the bias) as it writes the output. One rank, on the CPU: the sum equals linear(x) +
delta, with and without a bias."""

import pytest
import torch

from engine.parallel import ColumnParallelLinear, RowParallelLinear


def _filled(layer, generator):
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_plus_adds_the_delta_and_the_bias(kind, bias):
    g = torch.Generator().manual_seed(3)
    if kind == "column":
        layer = _filled(ColumnParallelLinear(24, (16, 8, 8), bias=bias), g)
    else:
        layer = _filled(RowParallelLinear(24, 32, bias=bias), g)
    x = torch.randn(5, 24, generator=g)
    delta = torch.randn(5, 32, generator=g)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias) + delta
    plain = layer(x)
    got = layer(x, plus=delta.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain)  # the delta went in
    torch.testing.assert_close(layer(x, plus=torch.zeros(5, 32)), plain, rtol=1e-5, atol=1e-5)
