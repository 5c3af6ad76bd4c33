"""Shared cases of the message-passing kernel tests (test_message_passing.py, test_message_passing_launch.py).

Tolerances. The oracle is the torch reference (forward) and its explicit VJP
(``message_passing_backward_reference``), both evaluated in float64 on the same inputs (float32 inputs too).
Every output entry is a sum of many products; the bound follows the condition of that sum, not the entry alone:
    |out - ref| <= tol · (|ref| + S),   S = the same sum evaluated with absolute values of every factor,
with tol = 1e-12 (float64) and 2e-6 (float32; ~16 ulp of the summed magnitude) (:func:`check`, :func:`compare`).
The graphs are random, with receivers sorted (as our neighbour lists give them) unless a test says otherwise.
"""

import importlib

import torch
from mlff_distiller.kernels import message_passing, message_passing_reference, use_backend

mp_module = importlib.import_module("mlff_distiller.kernels.message_passing")
message_passing_backward_reference = mp_module.message_passing_backward_reference

TOL = {torch.float32: 2e-6, torch.float64: 1e-12}
OPS = torch.ops.mlff_distiller


def graph(n_atoms, n_edges, n_feat, n_rbf, dtype, device, seed=0, sort=True, isolated=0):
    """x, v, rbf, filter_weight, unit, edge_index; the last ``isolated`` atoms have no edges at all."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    x, v = rand(n_atoms, 3 * n_feat), rand(n_atoms, 3, n_feat)
    rbf, w = rand(n_edges, n_rbf), rand(3 * n_feat, n_rbf) / n_rbf**0.5
    unit = torch.nn.functional.normalize(rand(n_edges, 3), dim=-1)
    active = max(1, n_atoms - isolated)
    ei = torch.randint(0, active, (2, n_edges), generator=gen).to(device)
    if sort:
        ei = ei[:, torch.argsort(ei[0], stable=True)]
    return x, v, rbf, w, unit, ei


def run_triton(*args, **kw):
    with use_backend("triton"):
        return message_passing(*args, **kw)


def abs_scales(x, v, rbf, w, unit, ei, gs=None, gv=None):
    """S for the forward outputs (and, given upstream gradients, for the five gradients): the reference run on
    the absolute values of every input."""
    a = [t.detach().double().abs() for t in (x, v, rbf, w, unit)]
    fwd = message_passing_reference(*a, ei)
    if gs is None:
        return fwd
    return fwd, message_passing_backward_reference(gs.double().abs(), gv.double().abs(), *a, ei)


def check(actual, expected, scale, tol, what):
    actual = actual.double()
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).abs()
    bound = tol * (expected.abs() + scale)
    worst = (err - bound).max().item() if err.numel() else -1.0
    assert worst <= 0, f"{what}: max error {err.max().item():.3e} exceeds the bound"


def compare(args, dtype, row_ptr=None):
    """Forward and all five first gradients of the Triton op vs the float64 reference."""
    tol = TOL[dtype]
    x, v, rbf, w, unit, ei = args
    ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
    ds, dv = run_triton(*ins, ei, row_ptr=row_ptr)
    ref64 = [t.detach().double() for t in (x, v, rbf, w, unit)]
    r_s, r_v = message_passing_reference(*ref64, ei)
    gs, gv = torch.randn_like(ds), torch.randn_like(dv)
    (s_s, s_v), s_grads = abs_scales(x, v, rbf, w, unit, ei, gs, gv)
    check(ds, r_s, s_s, tol, "ds")
    check(dv, r_v, s_v, tol, "dv")
    grads = torch.autograd.grad((ds, dv), ins, (gs, gv))
    ref_grads = message_passing_backward_reference(gs.double(), gv.double(), *ref64, ei)
    for name, g, r, s in zip(("x", "v", "rbf", "filter_weight", "unit"), grads, ref_grads, s_grads, strict=True):
        check(g, r, s, tol, f"grad {name}")
    return ds, dv, grads


# (N, E, F, R): empty graph, one edge, a prime number of edges, F not a power of two, F larger than one block.
SHAPES = [(3, 0, 8, 4), (2, 1, 8, 4), (5, 13, 7, 5), (9, 41, 20, 6), (6, 37, 40, 20)]


def symmetric_graph(n_atoms, n_pairs, n_feat, n_rbf, dtype, device, seed=0, self_images=2):
    """A random *symmetric* graph, as a full neighbour list is: n_pairs pairs (i, j) in both directions with one
    rbf row and opposite unit vectors, plus ``self_images`` periodic self-images (i ← i with u and with -u);
    receiver-sorted. Returns x, v, rbf, w, unit, edge_index, row_ptr."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, v = rand(n_atoms, 3 * n_feat), rand(n_atoms, 3, n_feat)
    w = rand(3 * n_feat, n_rbf) / n_rbf**0.5
    i = torch.randint(0, n_atoms, (n_pairs,), generator=gen)
    j = torch.randint(0, n_atoms, (n_pairs,), generator=gen)
    keep = i != j
    i, j = i[keep], j[keep]
    s = torch.randint(0, n_atoms, (self_images,), generator=gen)
    rbf_p, unit_p = rand(i.shape[0], n_rbf), torch.nn.functional.normalize(rand(i.shape[0], 3), dim=-1)
    rbf_s, unit_s = rand(self_images, n_rbf), torch.nn.functional.normalize(rand(self_images, 3), dim=-1)
    recv = torch.cat([i, j, s, s])
    send = torch.cat([j, i, s, s])
    rbf = torch.cat([rbf_p, rbf_p, rbf_s, rbf_s])
    unit = torch.cat([unit_p, -unit_p, unit_s, -unit_s])
    order = torch.argsort(recv, stable=True)
    ei = torch.stack([recv[order], send[order]])
    row_ptr = torch.searchsorted(ei[0], torch.arange(n_atoms + 1))
    out = [x, v, rbf[order], w, unit[order]]
    return (*(t.to(device=device, dtype=dtype) for t in out), ei.to(device), row_ptr.to(device))
