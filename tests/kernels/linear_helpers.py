"""What the GEMM tests (test_linear.py, test_linear_tma.py) share: random operands and the normwise check against
torch in float64 (TOL: ≤ 1e-12 relative in float64, 1e-5 in float32)."""

import torch

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _rand(*shape, gen, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def _close(actual, expected, tol, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).norm().item()
    assert err <= tol * max(expected.double().norm().item(), 1e-30), f"{what}: normwise error {err:.3e}"
