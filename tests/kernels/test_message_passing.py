"""Triton message_passing (fused PaiNN message step): forward, fused backward, composite double backward.

Tolerances. The oracle is the torch reference (forward) and its explicit VJP
(``message_passing_backward_reference``), both evaluated in float64 on the same inputs (float32 inputs too).
Every output entry is a sum of many products; the bound follows the condition of that sum, not the entry alone:
    |out - ref| <= tol · (|ref| + S),   S = the same sum evaluated with absolute values of every factor,
with tol = 1e-12 (float64) and 2e-6 (float32; ~16 ulp of the summed magnitude). Double backward: normwise,
|g - g_ref| <= tol · max|g_ref| (tol as above). The whole StudentModel, triton vs torch in float64: energy,
forces and the parameter gradients of a force loss agree to 1e-10 relative (normwise).

The graphs are random, with receivers sorted (as our neighbour lists give them) unless a test says otherwise.
CPU runs use the Triton interpreter and small sizes; the large cases are CUDA-only. The correctness tests run
under every kernel variant of the forward and the sender backward (``variant``: "atom", one program per atom;
"block", BLOCK_A atoms per program with a one-hot tl.dot segment sum).
"""

import importlib

import pytest
import torch
from mlff_distiller.kernels import message_passing, message_passing_reference, use_backend

mp_module = importlib.import_module("mlff_distiller.kernels.message_passing")
message_passing_backward_reference = mp_module.message_passing_backward_reference

TOL = {torch.float32: 2e-6, torch.float64: 1e-12}
OPS = torch.ops.mlff_distiller


def _graph(n_atoms, n_edges, n_feat, n_rbf, dtype, device, seed=0, sort=True, isolated=0):
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


@pytest.fixture(params=["atom", "block"])
def variant(request):
    """Run the forward and the sender backward with this kernel variant (the launch configuration)."""
    # block_min_atoms=0: the test graphs are small, and the variant asked for must be the one that runs on CUDA.
    with mp_module._configured(fwd_variant=request.param, bwd_sender_variant=request.param, block_min_atoms=0):
        yield request.param


def _triton(*args, **kw):
    with use_backend("triton"):
        return message_passing(*args, **kw)


def _abs_scales(x, v, rbf, w, unit, ei, gs=None, gv=None):
    """S for the forward outputs (and, given upstream gradients, for the five gradients): the reference run on
    the absolute values of every input."""
    a = [t.detach().double().abs() for t in (x, v, rbf, w, unit)]
    fwd = message_passing_reference(*a, ei)
    if gs is None:
        return fwd
    return fwd, message_passing_backward_reference(gs.double().abs(), gv.double().abs(), *a, ei)


def _check(actual, expected, scale, tol, what):
    actual = actual.double()
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).abs()
    bound = tol * (expected.abs() + scale)
    worst = (err - bound).max().item() if err.numel() else -1.0
    assert worst <= 0, f"{what}: max error {err.max().item():.3e} exceeds the bound"


def _compare(args, dtype, row_ptr=None):
    """Forward and all five first gradients of the Triton op vs the float64 reference."""
    tol = TOL[dtype]
    x, v, rbf, w, unit, ei = args
    ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
    ds, dv = _triton(*ins, ei, row_ptr=row_ptr)
    ref64 = [t.detach().double() for t in (x, v, rbf, w, unit)]
    r_s, r_v = message_passing_reference(*ref64, ei)
    gs, gv = torch.randn_like(ds), torch.randn_like(dv)
    (s_s, s_v), s_grads = _abs_scales(x, v, rbf, w, unit, ei, gs, gv)
    _check(ds, r_s, s_s, tol, "ds")
    _check(dv, r_v, s_v, tol, "dv")
    grads = torch.autograd.grad((ds, dv), ins, (gs, gv))
    ref_grads = message_passing_backward_reference(gs.double(), gv.double(), *ref64, ei)
    for name, g, r, s in zip(("x", "v", "rbf", "filter_weight", "unit"), grads, ref_grads, s_grads, strict=True):
        _check(g, r, s, tol, f"grad {name}")
    return ds, dv, grads


# (N, E, F, R): empty graph, one edge, a prime number of edges, F not a power of two, F larger than one block.
SHAPES = [(3, 0, 8, 4), (2, 1, 8, 4), (5, 13, 7, 5), (9, 41, 20, 6), (6, 37, 40, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{n}-E{e}-F{f}-R{r}" for n, e, f, r in SHAPES])
def test_matches_reference(triton_device, variant, dtype, shape):
    n, e, f, r = shape
    _compare(_graph(n, e, f, r, dtype, triton_device, seed=e), dtype)


def test_isolated_atoms_and_no_edges(triton_device, variant, poison):
    """Atoms that receive or send nothing get exact zeros (poisoned allocator: a missed store shows as NaN)."""
    args = _graph(12, 30, 8, 4, torch.float64, triton_device, isolated=5)
    poison(12 * 3 * 8 * 4, torch.float64, triton_device)
    ds, dv, grads = _compare(args, torch.float64)
    assert torch.equal(ds[-5:], torch.zeros_like(ds[-5:])) and torch.equal(dv[-5:], torch.zeros_like(dv[-5:]))
    assert torch.equal(grads[0][-5:], torch.zeros_like(grads[0][-5:]))
    assert torch.equal(grads[1][-5:], torch.zeros_like(grads[1][-5:]))


def test_hubs(triton_device, variant):
    """One receiver with 1,200 neighbours and one sender with 1,100 (the transposed CSR), many tiles each."""
    n, f, r = 40, 6, 4
    gen = torch.Generator().manual_seed(3)
    recv = torch.cat([torch.zeros(1200, dtype=torch.long), torch.randint(1, n, (1100,), generator=gen)])
    send = torch.cat([torch.randint(1, n, (1200,), generator=gen), torch.ones(1100, dtype=torch.long)])
    order = torch.argsort(recv, stable=True)
    ei = torch.stack([recv[order], send[order]]).to(triton_device)
    x, v, rbf, w, unit, _ = _graph(n, ei.shape[1], f, r, torch.float64, triton_device, seed=4)
    _compare((x, v, rbf, w, unit, ei), torch.float64)


def test_block_boundaries(triton_device, variant):
    """Atoms without edges inside and at the edges of the 16-atom blocks, a prime atom count (a partial last
    block), one receiver and one sender whose edges run over two blocks of tiles, F not a power of two."""
    n, f, r = 37, 20, 6
    gen = torch.Generator().manual_seed(9)
    empty = torch.tensor([0, 15, 16, 17, 31, 36])
    live = torch.tensor([k for k in range(n) if k not in set(empty.tolist())])
    recv = torch.cat([live[torch.randint(0, len(live), (150,), generator=gen)], torch.full((70,), 14)])
    send = torch.cat([live[torch.randint(0, len(live), (150,), generator=gen)], torch.full((70,), 18)])
    order = torch.argsort(recv, stable=True)
    ei = torch.stack([recv[order], send[order]]).to(triton_device)
    x, v, rbf, w, unit, _ = _graph(n, ei.shape[1], f, r, torch.float32, triton_device, seed=10)
    ds, dv, grads = _compare((x, v, rbf, w, unit, ei), torch.float32)
    idx = empty.to(triton_device)
    assert torch.equal(ds[idx], torch.zeros_like(ds[idx])) and torch.equal(dv[idx], torch.zeros_like(dv[idx]))
    assert torch.equal(grads[0][idx], torch.zeros_like(grads[0][idx]))


def test_feature_chunks_and_small_tiles(triton_device, variant, monkeypatch):
    """Several feature chunks per row (F = 40 in chunks of 16: the last one masked) and blocks of 32 atoms over
    16-edge tiles, as on the GPU (the interpreter otherwise takes whole rows); CUDA runs its own tiles."""
    monkeypatch.setitem(mp_module._CPU_TILES, "block_a", 32)
    monkeypatch.setitem(mp_module._CPU_TILES, "block_e_block", 16)
    monkeypatch.setitem(mp_module._CPU_TILES, "block_e", 16)
    monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)
    _compare(_graph(45, 160, 40, 7, torch.float64, triton_device, seed=14, isolated=4), torch.float64)


def test_launch_configuration():
    """Variant and dot precision come from the launch configuration, per kernel; float64 and the interpreter
    always get "ieee"; unknown keys and values are errors."""
    cfg = mp_module._launch_config_for
    prec = {f"dot_{k}": p for k, p in zip(mp_module._KERNELS, ("tf32x3", "tf32", "ieee", "tf32x3"), strict=True)}
    with mp_module._configured(fwd_variant="block", fwd_block_a=64, **prec):
        for kernel, p in zip(mp_module._KERNELS, ("tf32x3", "tf32", "ieee", "tf32x3"), strict=True):
            assert cfg("cuda", torch.float32, kernel, 128, 20)[0]["DOT_PRECISION"] == p
            assert cfg("cuda", torch.float64, kernel, 128, 20)[0]["DOT_PRECISION"] == "ieee"
            assert cfg("cpu", torch.float32, kernel, 128, 20)[0]["DOT_PRECISION"] == "ieee"
        c, _, which = cfg("cuda", torch.float32, "fwd", 128, 20)
        assert which == "block" and c["BLOCK_A"] == 64
        assert cfg("cuda", torch.float32, "bwd_sender", 128, 20)[2] == "atom"
        assert cfg("cuda", torch.float64, "fwd", 128, 20)[0]["BLOCK_F"] == 32
    with mp_module._configured(bwd_sender_variant="fused"), pytest.raises(ValueError, match="variant"):
        cfg("cuda", torch.float32, "bwd_sender", 64, 20)  # removed at stop 21 (slower where it ran)
    # Small graphs run the atom variants on the GPU (too few block programs), large ones the configured one.
    with mp_module._configured(fwd_variant="block", bwd_sender_variant="block", block_min_atoms=4096):
        for kernel in ("fwd", "bwd_sender"):
            assert cfg("cuda", torch.float32, kernel, 128, 20, n_atoms=216)[2] == "atom"
            assert cfg("cuda", torch.float32, kernel, 128, 20, n_atoms=24000)[2] == "block"
            assert cfg("cpu", torch.float32, kernel, 128, 20, n_atoms=216)[2] == "block"  # the interpreter: as asked
    with mp_module._configured(bwd_edge_block_e=64, bwd_edge_block_f=32, bwd_edge_warps=8):
        c, warps, _ = cfg("cuda", torch.float32, "bwd_edge", 128, 20)
        assert (c["BLOCK_E"], c["BLOCK_F"], warps) == (64, 32, 8)
        assert cfg("cuda", torch.float32, "bwd_filter", 128, 20)[0]["BLOCK_F"] == 128  # its own keys
    # shipped defaults: the H100 sweep's fastest float32-accurate choices (benchmarks/results/tune_mp_h100.md)
    assert mp_module._CONFIG["fwd_variant"] == "block" and mp_module._CONFIG["dot_fwd"] == "tf32x3"
    # the two-MMA segment sum (probe_ncu_sweep_h100_run3.md) only where the block kernels run tf32x3
    with mp_module._configured(fwd_variant="block", block_min_atoms=0):
        assert cfg("cuda", torch.float32, "fwd", 128, 20)[0]["SEG_SPLIT"] is True
        assert cfg("cuda", torch.float64, "fwd", 128, 20)[0]["SEG_SPLIT"] is False
        assert cfg("cpu", torch.float32, "fwd", 128, 20)[0]["SEG_SPLIT"] is False
        with mp_module._configured(dot_fwd="ieee"):
            assert cfg("cuda", torch.float32, "fwd", 128, 20)[0]["SEG_SPLIT"] is False
    # the sender backward's "auto" variant: block for large graphs with few edges per atom, atom otherwise
    assert mp_module._CONFIG["bwd_sender_variant"] == "auto"
    sender = [
        cfg("cuda", torch.float32, "bwd_sender", 128, 20, n_atoms=a, n_edges=e)[2]
        for a, e in ((6850, 51444), (24000, 1305160), (216, 1000), (6850, None))
    ]
    assert sender == ["block", "atom", "atom", "atom"]
    assert cfg("cpu", torch.float32, "bwd_sender", 128, 20, n_atoms=6850, n_edges=51444)[2] == "atom"
    with mp_module._configured(bwd_sender_variant="atom"):  # an explicit variant is kept
        assert cfg("cuda", torch.float32, "bwd_sender", 128, 20, n_atoms=6850, n_edges=51444)[2] == "atom"
    # the edge kernel: tf32x3 on 64 x 64 tiles (stop55_gpu/c/), 64 x 32 below edge_wide_min_edges (a 192-atom box:
    # ~17,000 edges); float64 keeps tiles of <= 32 x 32
    for n_edges, block_f in ((None, 64), (1305160, 64), (40000, 64), (17000, 32), (12, 32)):
        c, warps, _ = cfg("cuda", torch.float32, "bwd_edge", 128, 20, n_edges=n_edges)
        assert (c["BLOCK_E"], c["BLOCK_F"], warps, c["DOT_PRECISION"], c["DU_DOT"]) == (64, block_f, 4, "tf32x3", True)
    assert cfg("cpu", torch.float32, "bwd_edge", 128, 20, n_edges=12)[0]["BLOCK_F"] == mp_module._CPU_TILES["block_f"]
    c, _, _ = cfg("cuda", torch.float64, "bwd_edge", 128, 20)
    assert (c["BLOCK_E"], c["BLOCK_F"], c["DOT_PRECISION"]) == (32, 32, "ieee")
    # the forward at 2 pipeline stages on the GPU (stop 45, stop45_gpu/probe_ncu_sweep_stages*.md), both variants;
    # the other kernels keep Triton's default; the interpreter takes no launch options
    for n_atoms in (216, 24000):
        assert cfg("cuda", torch.float32, "fwd", 128, 20, n_atoms=n_atoms)[0]["num_stages"] == 2
        assert "num_stages" not in cfg("cpu", torch.float32, "fwd", 128, 20, n_atoms=n_atoms)[0]
    assert all("num_stages" not in cfg("cuda", torch.float32, k, 128, 20)[0] for k in ("bwd_sender", "bwd_edge"))
    with pytest.raises(KeyError, match="unknown"), mp_module._configured(dot_everything="ieee"):
        pass
    for bad in (dict(fwd_variant="warp"), dict(dot_bwd_edge="tf32x6")):
        with mp_module._configured(**bad), pytest.raises(ValueError, match="variant"):
            cfg("cuda", torch.float32, "fwd" if "fwd_variant" in bad else "bwd_edge", 128, 20)


def test_partial_gradients(triton_device, variant):
    """Only ∂rbf/∂u wanted (the edge kernel alone) or only ∂x/∂v (the sender kernel alone): each matches the
    reference."""
    args = _graph(20, 90, 12, 5, torch.float32, triton_device, seed=13)
    x, v, rbf, w, unit, ei = args
    for wrt in ((rbf, unit), (x, v)):
        ins = [t.detach().clone().requires_grad_(any(t is u for u in wrt)) for t in (x, v, rbf, w, unit)]
        ds, dv = _triton(*ins, ei)
        got = torch.autograd.grad((ds.sum() + dv.sum()), [t for t in ins if t.requires_grad])
        ref = message_passing_backward_reference(
            torch.ones_like(ds).double(), torch.ones_like(dv).double(), *(t.double() for t in args[:-1]), ei
        )
        want = [ref[k] for k, t in zip((0, 1, 2, 4), (x, v, rbf, unit), strict=True) if any(t is u for u in wrt)]
        for g, r in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-5)


def test_unsorted_edges_and_row_ptr(triton_device, variant):
    """Shuffled edges are sorted internally (same results, gradients back in the caller's order); an explicit
    row_ptr (as NeighborList provides) gives the same as the one built from edge_index."""
    x, v, rbf, w, unit, ei = _graph(10, 60, 8, 4, torch.float64, triton_device, seed=5)
    row_ptr = torch.searchsorted(ei[0], torch.arange(11, device=triton_device))
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(0)).to(triton_device)
    sorted_out = _compare((x, v, rbf, w, unit, ei), torch.float64)
    _compare((x, v, rbf[perm], w, unit[perm], ei[:, perm]), torch.float64)
    with_ptr = _triton(x, v, rbf, w, unit, ei, row_ptr=row_ptr.to(torch.int32))
    for a, b in zip(with_ptr, sorted_out[:2], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _sender_csr(ei, n):
    """The sender CSR as PaddedGraph.refresh_csr builds it: stable sort of the senders, offsets of each run."""
    keys, perm = torch.sort(ei[1], stable=True)
    return perm, torch.searchsorted(keys, torch.arange(n + 1, device=ei.device))


def test_precomputed_sender_csr_is_used_as_given(triton_device):
    """A sender CSR given to message_passing (as the engine's padded buckets do) gives bit-identical outputs,
    first and second derivatives to the one the backward builds itself; it is trusted, not recomputed (a wrong
    one changes the sender gradients), and edges message_passing has to sort ignore it."""
    x, v, rbf, w, unit, ei = _graph(10, 60, 8, 4, torch.float64, triton_device, seed=5)
    row_ptr = torch.searchsorted(ei[0], torch.arange(11, device=triton_device))
    csr = _sender_csr(ei, 10)

    def grads(sender_csr, edges=ei, r=rbf, u=unit, ptr=row_ptr):
        ins = [t.detach().clone().requires_grad_(True) for t in (x, v, r, w, u)]
        ds, dv = _triton(*ins, edges, row_ptr=ptr, sender_csr=sender_csr)
        gen = torch.Generator().manual_seed(2)
        gs = torch.randn(ds.shape, generator=gen, dtype=ds.dtype).to(ds.device)
        gv = torch.randn(dv.shape, generator=gen, dtype=dv.dtype).to(dv.device)
        first = torch.autograd.grad((ds, dv), ins, (gs, gv), create_graph=True)
        second = torch.autograd.grad(sum((g * g).sum() for g in first), ins)
        return [ds, dv, *first, *second]

    built, given = grads(None), grads(csr)
    for a, b in zip(built, given, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    stale = (csr[0].flip(0), csr[1])  # the wrong order: the sender sums gather other edges
    wrong = grads(stale)
    assert not torch.equal(wrong[2], built[2])  # grad x comes from the sender kernel
    # unsorted edges are sorted inside, where the caller's sender CSR no longer applies: it is ignored
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(0)).to(triton_device)
    shuffled = grads(stale, edges=ei[:, perm], r=rbf[perm], u=unit[perm], ptr=None)
    for a, b in zip(shuffled[:4], built[:4], strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="sender_csr perm"):
        _triton(x, v, rbf, w, unit, ei, row_ptr=row_ptr, sender_csr=(csr[0][:-1], csr[1]))
    with pytest.raises(ValueError, match="sender_csr col_ptr"):
        _triton(x, v, rbf, w, unit, ei, row_ptr=row_ptr, sender_csr=(csr[0], csr[1][:-1]))
    with pytest.raises(ValueError, match="pair"):
        _triton(x, v, rbf, w, unit, ei, row_ptr=row_ptr, sender_csr=csr[0])


def _symmetric_graph(n_atoms, n_pairs, n_feat, n_rbf, dtype, device, seed=0, self_images=2):
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


# (N, pairs, F, R) and dtype: one pair; a small graph in both dtypes; several atom blocks and feature chunks.
SYM_CASES = [
    ((2, 1, 8, 4), torch.float64),
    ((9, 30, 20, 6), torch.float32),
    ((9, 30, 20, 6), torch.float64),
    ((23, 90, 40, 20), torch.float64),
]


@pytest.mark.parametrize("shape, dtype", SYM_CASES, ids=["tiny-f64", "small-f32", "small-f64", "wide-f64"])
def test_symmetric_edges_walk_the_receiver_rows(triton_device, variant, dtype, shape):
    """symmetric=True: the sender backward walks each atom's receiver row for the partners of the edges it sends.
    Forward, first and second derivatives match the reference (float64 oracle) and the sender-sorted path, with
    a given row_ptr and without (the switch ``sender_symmetric`` is the engine's to read, tests/test_buckets.py)."""
    n, pairs, f, r = shape
    x, v, rbf, w, unit, ei, row_ptr = _symmetric_graph(n, pairs, f, r, dtype, triton_device, seed=pairs)
    ins0 = (x, v, rbf, w, unit)

    def run(symmetric, ptr=row_ptr, second_order=True):
        ins = [t.detach().clone().requires_grad_(True) for t in ins0]
        ds, dv = _triton(*ins, ei, row_ptr=ptr, symmetric=symmetric)
        gen = torch.Generator().manual_seed(3)
        gs = torch.randn(ds.shape, generator=gen, dtype=torch.float64).to(ds)
        gv = torch.randn(dv.shape, generator=gen, dtype=torch.float64).to(dv)
        first = torch.autograd.grad((ds, dv), ins, (gs, gv), create_graph=second_order)
        if not second_order:
            return [ds, dv, *first], (gs, gv)
        second = torch.autograd.grad(sum((g * g).sum() for g in first), ins)
        return [ds, dv, *first, *second], (gs, gv)

    plain, (gs, gv) = run(False)
    sym, _ = run(True)
    ref64 = [t.double() for t in ins0]
    _, s_grads = _abs_scales(*ins0, ei, gs, gv)
    ref_grads = message_passing_backward_reference(gs.double(), gv.double(), *ref64, ei)
    for k, name in enumerate(("x", "v", "rbf", "filter_weight", "unit")):
        _check(sym[2 + k], ref_grads[k], s_grads[k], TOL[dtype], f"grad {name}")
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(sym, plain, strict=True):
        torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=0)
    for a, b in zip(run(True, ptr=None, second_order=False)[0], sym, strict=False):  # row_ptr built here
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_symmetric_promise_is_what_the_sender_gradients_use(triton_device, variant):
    """The promise is trusted: on a list that is not symmetric (one partner's unit vector not flipped) the
    gradient wrt x differs from the reference; the edge-side gradients (rbf, u) do not use it."""
    x, v, rbf, w, unit, ei, row_ptr = _symmetric_graph(9, 30, 8, 4, torch.float64, triton_device, seed=4)
    bad_unit = unit.clone()
    bad_unit[0] = -bad_unit[0]  # its partner keeps the old direction
    ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, bad_unit)]
    ds, dv = _triton(*ins, ei, row_ptr=row_ptr, symmetric=True)
    gs, gv = torch.ones_like(ds), torch.ones_like(dv)
    got = torch.autograd.grad((ds, dv), ins, (gs, gv))
    ref = message_passing_backward_reference(gs, gv, *[t.detach() for t in ins], ei)
    assert not torch.allclose(got[0], ref[0], atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], atol=1e-12, rtol=0)
    torch.testing.assert_close(got[4], ref[4], atol=1e-12, rtol=0)


def test_bad_inputs_are_value_errors(triton_device):
    x, v, rbf, w, unit, ei = _graph(5, 10, 4, 3, torch.float64, triton_device)
    bad = [
        ((x[:, :-1], v, rbf, w, unit, ei), "x must be"),
        ((x, v[:, :2], rbf, w, unit, ei), "v must be"),
        ((x, v, rbf[:-1], w, unit, ei), "rbf must be"),
        ((x, v, rbf, w[:, :-1], unit, ei), "filter_weight must be"),
        ((x, v, rbf, w, unit[:, :2], ei), "unit must be"),
        ((x, v, rbf, w, unit, ei.double()), "integer"),
        ((x, v, rbf.float(), w, unit, ei), "one dtype"),
    ]
    for args, match in bad:
        for backend in ("torch", "triton"):
            with use_backend(backend), pytest.raises(ValueError, match=match):
                message_passing(*args)
    out_of_range = ei.clone()
    out_of_range[1, 3] = 5
    with pytest.raises(ValueError, match="outside"):
        _triton(x, v, rbf, w, unit, out_of_range)
    with pytest.raises(ValueError, match="row_ptr"):
        _triton(x, v, rbf, w, unit, ei, row_ptr=torch.zeros(3, dtype=torch.long, device=triton_device))


@pytest.mark.parametrize("variant", ["atom", "block"], indirect=True)
def test_gradcheck_gradgradcheck(triton_device, variant):
    """float64, small: first and second derivatives of the fused op (second: the composite of fused ops)."""
    x, v, rbf, w, unit, ei = _graph(4, 9, 3, 2, torch.float64, triton_device, seed=7)
    ins = [t.clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]

    def fn(*a):
        return _triton(*a, ei)

    kw = dict(fast_mode=True, check_undefined_grad=False)
    assert torch.autograd.gradcheck(fn, ins, **kw)
    assert torch.autograd.gradgradcheck(fn, ins, **kw)


def test_double_backward_matches_reference(triton_device, variant):
    """Force-training style: first gradients with create_graph, a loss on all of them, second gradients."""
    args = _graph(7, 31, 12, 5, torch.float64, triton_device, seed=8)
    ei = args[-1]
    gen = torch.Generator().manual_seed(1)

    def second(fn):
        ins = [t.detach().clone().requires_grad_(True) for t in args[:-1]]
        ds, dv = fn(*ins, ei)
        gs = torch.randn(ds.shape, generator=gen, dtype=ds.dtype).to(ds.device).requires_grad_(True)
        gv = torch.randn(dv.shape, generator=gen, dtype=dv.dtype).to(dv.device).requires_grad_(True)
        grads = torch.autograd.grad((ds, dv), ins, (gs, gv), create_graph=True)
        weights = [torch.randn(g.shape, generator=gen, dtype=g.dtype).to(g.device) for g in grads]
        loss = sum((g * wt).sum() for g, wt in zip(grads, weights, strict=True))
        return torch.autograd.grad(loss, [*ins, gs, gv])

    gen.manual_seed(1)
    got = second(_triton)
    gen.manual_seed(1)
    ref = second(message_passing_reference)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12 * r.abs().max().item(), rtol=0)


# ------------------------------------------------------------------------------------------------------------
# The whole model: backend triton vs torch


def _water_like(n_mol, device, seed=0):
    """Random water-ish cluster (O-H 0.96 Å), no periodicity; edges within 4 Å, sorted by receiver."""
    gen = torch.Generator().manual_seed(seed)
    box = (n_mol * 30.0) ** (1 / 3)
    o = torch.rand(n_mol, 3, generator=gen, dtype=torch.float64) * box
    h1 = o + 0.96 * torch.nn.functional.normalize(torch.randn(n_mol, 3, generator=gen, dtype=torch.float64), dim=-1)
    h2 = o + 0.96 * torch.nn.functional.normalize(torch.randn(n_mol, 3, generator=gen, dtype=torch.float64), dim=-1)
    pos = torch.cat([o, h1, h2]).to(device)
    numbers = torch.tensor([8] * n_mol + [1] * 2 * n_mol, device=device)
    d = torch.cdist(pos, pos)
    i, j = torch.nonzero((d < 4.0) & (d > 0), as_tuple=True)  # row-major: sorted by receiver
    return numbers, pos, torch.stack([i, j])


def test_student_model_triton_vs_torch(triton_device):
    """StudentModel in float64 (edge_basis + message passing on the kernels): energy, forces and the parameter
    gradients of a force loss (the double backward), triton vs torch, within 1e-10 relative."""
    from mlff_distiller import StudentModel

    torch.manual_seed(0)
    n_mol = 4 if triton_device.type == "cpu" else 200
    model = StudentModel(species=[1, 8], hidden=16, layers=2, n_rbf=6, cutoff=4.0).double().to(triton_device)
    numbers, pos, ei = _water_like(n_mol, triton_device)
    shifts = torch.zeros(ei.shape[1], 3, dtype=torch.float64, device=triton_device)
    batch = torch.zeros(len(numbers), dtype=torch.long, device=triton_device)
    target = torch.randn(len(numbers), 3, dtype=torch.float64, device=triton_device)

    def run(backend):
        model.zero_grad()
        p = pos.clone().requires_grad_(True)
        with use_backend(backend):
            energy = model(numbers, p, ei, shifts, batch, 1)["energy"]
            forces = -torch.autograd.grad(energy.sum(), p, create_graph=True)[0]
            ((forces - target) ** 2).sum().backward()
        return [energy.detach(), forces.detach()] + [
            torch.zeros_like(q) if q.grad is None else q.grad.clone() for q in model.parameters()
        ]

    got, ref = run("triton"), run("torch")
    assert len(got) == len(ref)
    for k, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, atol=1e-10 * r.abs().max().item(), rtol=0, msg=f"output {k}")


# ------------------------------------------------------------------------------------------------------------
# GPU only: large graphs, torch.compile and the op registrations


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_water_like_graph(dtype, variant):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, per_atom = 3000, 55
    x, v, rbf, w, unit, _ = _graph(n, n * per_atom, 128, 20, dtype, torch.device("cuda"), seed=11)
    recv = torch.arange(n, device="cuda").repeat_interleave(per_atom)
    send = (recv + torch.randint(-200, 201, recv.shape, device="cuda")) % n  # local senders, as in a real box
    _compare((x, v, rbf, w, unit, torch.stack([recv, send])), dtype)


# (block_e, block_f, warps) x dot precision of the edge backward: the tensor-core (tf32x3) tilings that
# benchmarks/tune_small.py sweeps, and the former ieee default.
EDGE_TILES = [(64, 32, 4, "tf32x3"), (128, 32, 8, "tf32x3"), (32, 128, 4, "tf32x3"), (32, 128, 4, "ieee")]


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", EDGE_TILES, ids=[f"{e}x{f}w{w}-{p}" for e, f, w, p in EDGE_TILES])
def test_edge_kernel_tiles_float32(tiles):
    """The edge backward (∂rbf, ∂u) at each tiling x dot precision stays within the float32 bound of the float64
    reference on a 3,000-atom graph with F = 128, R = 20 (several feature chunks, a masked radial pad)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    be, bf, warps, prec = tiles
    cfg = dict(bwd_edge_block_e=be, bwd_edge_block_f=bf, bwd_edge_warps=warps, dot_bwd_edge=prec)
    with mp_module._configured(**cfg):
        _compare(_graph(3000, 3000 * 40, 128, 20, torch.float32, torch.device("cuda"), seed=21), torch.float32)


@pytest.mark.parametrize("split", [1, 2, 4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_kernel_feature_split(triton_device, split, dtype, monkeypatch):
    """The edge backward with its feature loop split over 1, 2 or 4 programs per edge tile (partial ∂rbf / ∂u rows
    summed on the host) matches the reference; a split that does not divide the feature chunks (3) runs one slice."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)  # 4 feature chunks of F = 64 under the interpreter
    e = 100 if triton_device.type == "cpu" else 300  # (a few edge tiles under the interpreter: 11 s a case at 300)
    args = _graph(20 if triton_device.type == "cpu" else 40, e, 64, 20, dtype, triton_device, seed=31)
    with mp_module._configured(bwd_edge_split=split, bwd_sender_variant="atom"):
        c, _, _ = mp_module._launch_config(args[0], "bwd_edge", 64, 20, n_edges=e)
        chunks = 64 // c["BLOCK_F"]
        used = mp_module._edge_split(args[0], e // c["BLOCK_E"] + 1, 64, c["BLOCK_F"])
        assert used == (split if chunks % split == 0 else 1)
        _compare(args, dtype)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_kernel_term_split(triton_device, dtype, fold, monkeypatch):
    """``edge_split_terms``: an edge kernel split in two programs per tile gives one the a- and c-terms and the other
    the b-term, each over all features (TERMS); ∂rbf, ∂u and the other gradients match the reference, with v_j and
    with the folded p = x_b ⊙ v, and the rows equal the feature split's to rounding (float64)."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)  # 4 feature chunks of F = 64 under the interpreter
    e = 100 if triton_device.type == "cpu" else 3000
    n = 20 if triton_device.type == "cpu" else 200
    args = _graph(n, e, 64, 20, dtype, triton_device, seed=37)
    fold_cfg = dict(fold_xb_min_edges=1, fold_xb_min_degree=0) if fold else dict(fold_xb_min_edges=None)
    rows = {}
    for terms in (True, False):
        with mp_module._configured(bwd_edge_split=2, bwd_sender_variant="atom", edge_split_terms=terms, **fold_cfg):
            c, _, _ = mp_module._launch_config(args[0], "bwd_edge", 64, 20, n_edges=e)
            assert c["DU_DOT"] and mp_module._edge_split(args[0], e // c["BLOCK_E"] + 1, 64, c["BLOCK_F"]) == 2
            assert mp_module._fold_xb(args[0], e, n) == fold
            if terms:
                _compare(args, dtype)
            x, v, rbf, w, unit, ei = args
            gen = torch.Generator().manual_seed(38)
            gs = torch.randn(n, 64, generator=gen, dtype=torch.float64).to(triton_device, dtype)
            gv = torch.randn(n, 3, 64, generator=gen, dtype=torch.float64).to(triton_device, dtype)
            row_ptr = mp_module._offsets(ei[0].contiguous(), n)
            rows[terms] = mp_module._edge_grads(gs, gv, x, v, rbf, w, unit, ei, row_ptr, True, mp_module._bare)
    for a, b in zip(rows[True], rows[False], strict=True):
        # float32: the two splits sum a row's terms in different orders (measured on an H200: 3e-5 relative on
        # 2 of 9,000 elements, 2.6e-6 absolute), so the bound is the rows' scale, not a fixed 1e-6.
        scale = float(b.abs().max())
        tol = dict(rtol=1e-4, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12 * scale)
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sender_fold_half_matches_reference(triton_device, dtype):
    """``sender_fold_half``: the atom sender backward's five sums kept as half-tiles (each edge tile's two row halves
    added in the loop, the rows summed after it) match the float64 reference on a graph whose senders take several
    edge tiles (and one with none), and equal the per-tile sums to rounding."""
    n, e = (16, 1500) if triton_device.type == "cpu" else (64, 6000)
    args = _graph(n, e, 32, 20, dtype, triton_device, seed=81, isolated=1)
    x, v, rbf, w, unit, ei = args
    grads = {}
    for half in (True, False):
        with mp_module._configured(sender_fold_half=half, bwd_sender_variant="atom", block_min_atoms=0):
            if half:
                _compare(args, dtype)
            ins = [t.detach().clone().requires_grad_(True) for t in (x, v)]
            ds, dv = _triton(ins[0], ins[1], rbf, w, unit, ei)
            grads[half] = torch.autograd.grad((ds, dv), ins, (torch.ones_like(ds), torch.ones_like(dv)))
    for a, b in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("terms", [False, True])
def test_edge_kernel_chained_slices_equal_the_sum_kernel(triton_device, accumulate, terms, monkeypatch):
    """``edge_split_chain``: two slices per edge tile, the second adding the first's rows after its flag (no sum
    kernel, no partial plane when writing afresh, one when adding into given rows), with the feature or the term
    split: the same bits as the sum kernel's, written afresh and added into given rows, over repeated launches (the
    flags start at zero each launch), with inert rows past the CSR."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)  # 4 feature chunks of F = 64 under the interpreter
    n, e, f = (20, 100, 64) if triton_device.type == "cpu" else (600, 24000, 64)
    x, v, rbf, w, unit, ei = _graph(n, e, f, 20, torch.float32, triton_device, seed=71)
    gen = torch.Generator().manual_seed(72)
    gs = torch.randn(n, f, generator=gen, dtype=torch.float64).to(triton_device, torch.float32)
    gv = torch.randn(n, 3, f, generator=gen, dtype=torch.float64).to(triton_device, torch.float32)
    row_ptr = mp_module._offsets(ei[0].contiguous(), n).clone()
    row_ptr[-1] = e - 7  # the last 7 edges are inert (past the CSR): zero rows
    args = (gs, gv, x, v, rbf, w, unit, ei, row_ptr, True, mp_module._bare)
    old = (torch.randn_like(rbf), torch.randn_like(unit))
    got = {}
    calls = []
    real = mp_module._mp_sum_split_kernel
    for chain in (False, True):
        cfg = dict(bwd_edge_split=2, edge_split_chain=chain, edge_chain_min_tiles=0, edge_split_terms=terms)
        with mp_module._configured(**cfg):
            out = (old[0].clone(), old[1].clone())
            monkeypatch.setattr(mp_module, "_mp_sum_split_kernel", _CountingLaunch(real, calls))
            calls.clear()
            for _ in range(2):  # twice: a second launch finds its flags zeroed again
                res = mp_module._edge_grads(*args, out=out if accumulate else None, accumulate=accumulate)
                if accumulate:
                    out = (old[0].clone(), old[1].clone())
            res = mp_module._edge_grads(*args, out=out if accumulate else None, accumulate=accumulate)
            assert len(calls) == (0 if chain else 3)
            got[chain] = (res[0].clone(), res[1].clone())
    for a, b in zip(got[True], got[False], strict=True):
        assert torch.equal(a, b)
    if not accumulate:
        assert not got[True][0][e - 7 :].any() and not got[True][1][e - 7 :].any()
    fresh = mp_module._edge_grads(*args)
    if accumulate:
        # old + (p0 + p1) against (old + p0) + p1 in float32: rounding at the rows' scale (2.3e-6 on an H200)
        scale = float((old[0] + fresh[0]).abs().max())
        torch.testing.assert_close(got[True][0], old[0] + fresh[0], rtol=1e-5, atol=1e-6 * scale)
    assert float(got[True][0].abs().max()) > 1e-3


@pytest.mark.parametrize("fold", [False, True])
def test_edge_chain_by_fold(triton_device, fold, monkeypatch):
    """``edge_split_chain="fold"`` (shipped): the edge kernel chains its two slices where it takes the folded p
    (dense graphs) and launches the sum kernel elsewhere; both give the reference's gradients, and a value other
    than "fold", True or False is a clear error."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)
    n, e = (20, 100) if triton_device.type == "cpu" else (200, 6000)
    args = _graph(n, e, 64, 20, torch.float32, triton_device, seed=73)
    fold_cfg = dict(fold_xb_min_edges=1, fold_xb_min_degree=0) if fold else dict(fold_xb_min_edges=None)
    calls = []
    monkeypatch.setattr(mp_module, "_mp_sum_split_kernel", _CountingLaunch(mp_module._mp_sum_split_kernel, calls))
    cfg = dict(bwd_edge_split=2, edge_split_chain="fold", edge_chain_min_tiles=0, bwd_sender_variant="atom")
    with mp_module._configured(**cfg, **fold_cfg):
        assert mp_module._fold_xb(args[0], e, n) == fold
        _compare(args, torch.float32)
    assert bool(calls) != fold
    with mp_module._configured(edge_split_chain="always"), pytest.raises(ValueError, match="edge_split_chain"):
        mp_module._edge_chain(True)


class _CountingLaunch:
    """A Triton kernel stand-in that counts its launches (``kernel[grid](...)``) and runs the real one."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append(grid)
            return self.kernel[grid](*args, **kw)

        return run


@pytest.mark.gpu
@pytest.mark.parametrize("f", [128, 64])
def test_seg_split_block_kernels_float32(f):
    """The block kernels' one-hot segment sums as two TF32 MMAs (seg_split) stay within the float32 bound of the
    float64 reference on a 3,000-atom graph with F = 128 and F = 64 (one feature chunk, one edge-kernel slice)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _graph(3000, 3000 * 40, f, 20, torch.float32, torch.device("cuda"), seed=23)
    cfg = dict(seg_split=True, fwd_variant="block", bwd_sender_variant="block", block_min_atoms=0)
    with mp_module._configured(**cfg):
        c, _, variant = mp_module._launch_config(args[0], "bwd_sender", f, 20, n_atoms=3000)
        assert variant == "block" and c["SEG_SPLIT"]
        _compare(args, torch.float32)


@pytest.mark.gpu
def test_edge_split_auto_rule_on_cuda():
    """ "auto": small graphs (few edge tiles) split the feature loop up to the feature chunks, large ones in slices
    of 64 features (edge_split_feat): two for F = 128, none for F = 64."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.zeros(1, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert mp_module._edge_split(x, 3, 128, 32) == 4  # benzene: 3 edge tiles
    assert mp_module._edge_split(x, 20 * sms, 128, 32) == 2  # 24,000-atom water: ~20,000 tiles, the least split
    with mp_module._configured(edge_split_feat=128):
        assert mp_module._edge_split(x, 20 * sms, 128, 32) == 1
    assert mp_module._edge_split(x, 20 * sms, 64, 32) == 1  # a 64-wide student: one slice on large graphs
    assert mp_module._edge_split(x, 3, 64, 32) == 2  # and two for a molecule
    assert mp_module._edge_split(x, 3 * sms, 128, 32) == 2
    assert mp_module._edge_split(x, 3, 96, 32) == 1  # 3 chunks: no power-of-two slice divides them
    with mp_module._configured(bwd_edge_split=1):
        assert mp_module._edge_split(x, 3, 128, 32) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("per_atom", [6, 40])
def test_auto_sender_variant_on_cuda(per_atom):
    """The shipped configuration ("auto" sender backward: block for large graphs with few edges per atom, atom
    otherwise) against the float32 bound of the reference, on 2,000-atom graphs on both sides of the rule."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = 2000
    x, v, rbf, w, unit, _ = _graph(n, n * per_atom, 128, 20, torch.float32, torch.device("cuda"), seed=23)
    recv = torch.arange(n, device="cuda").repeat_interleave(per_atom)
    send = (recv + torch.randint(-100, 101, recv.shape, device="cuda")) % n
    expected = "block" if per_atom <= mp_module._CONFIG["sender_block_max_degree"] else "atom"
    got = mp_module._launch_config(x, "bwd_sender", 128, 20, n_atoms=n, n_edges=n * per_atom)[2]
    assert got == expected
    _compare((x, v, rbf, w, unit, torch.stack([recv, send])), torch.float32)


@pytest.mark.gpu
def test_compile_and_opcheck(variant):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    x, v, rbf, w, unit, ei = _graph(50, 400, 32, 8, torch.float32, torch.device("cuda"), seed=12)
    row_ptr = torch.searchsorted(ei[0], torch.arange(51, device="cuda"))
    ins = [t.clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]

    def fn(*a):
        return message_passing(*a, ei, row_ptr=row_ptr)

    with use_backend("triton"):
        out_c = torch.compile(fn, fullgraph=True)(*ins)
        out_e = fn(*ins)
    go = [torch.randn_like(o) for o in out_e]
    g_c = torch.autograd.grad(out_c, ins, go)
    g_e = torch.autograd.grad(out_e, ins, go)
    for a, b in zip((*out_c, *g_c), (*out_e, *g_e), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.library.opcheck(OPS.message_passing.default, (*ins, ei, row_ptr))
    gs, gv = (o.detach().requires_grad_(True) for o in go)
    torch.library.opcheck(OPS.message_passing_bwd.default, (gs, gv, *ins, ei))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_v_zero_promise_gives_the_same_results(triton_device, variant, dtype):
    """``v_zero=True`` (the first layer, v = 0): the forward and edge backward skip the v terms and give what the
    full kernels give on the zero tensor: forward, the five first gradients and a second derivative (training's
    force loss differentiates the backward again). Bitwise under the interpreter; compiled for the GPU, the two
    kernel variants may order or contract their sums differently (measured on an H100: up to 9.5e-7 absolute in
    float32, 1.8e-15 in float64, the same with and without programmatic dependent launch), so there the bound is
    the float tolerance of the rest of this file."""
    x, _, rbf, w, unit, ei = _graph(11, 90, 40, 6, dtype, triton_device, seed=41)
    v = torch.zeros((11, 3, 40), dtype=dtype, device=triton_device)
    outs = []
    for promise in (False, True):
        ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
        ds, dv = _triton(*ins, ei, v_zero=promise)
        gs = torch.linspace(-1, 1, ds.numel(), dtype=dtype, device=triton_device).view_as(ds)
        gv = torch.linspace(1, -2, dv.numel(), dtype=dtype, device=triton_device).view_as(dv)
        grads = torch.autograd.grad((ds, dv), ins, (gs, gv), create_graph=True)
        (second,) = torch.autograd.grad(grads[2].square().sum() + grads[4].sum(), ins[0])
        outs.append([ds, dv, *grads, second])
    for a, b in zip(*outs, strict=True):
        if triton_device.type == "cpu":
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=TOL[dtype], atol=TOL[dtype] * b.abs().max().item())
    ref = message_passing_reference(*(t.double() for t in (x, v, rbf, w, unit)), ei)
    scale = ref[1].abs().max().item()
    torch.testing.assert_close(outs[1][1].double(), ref[1], rtol=TOL[dtype], atol=TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_v_residual_alias_adds_its_gradient_to_dv(triton_device, variant, dtype):
    """``v_residual=True`` returns v' (an alias of v for the residual sum v + dv): the gradient reaching v' is added
    to ∂v in the sender kernel's store, and v's gradient is what autograd would sum over v and v + dv's other
    branch (the same sum; on the GPU the store may fuse it into an FMA, hence the float tolerance there). The first
    gradients, one of them again through a second derivative (training's force loss), and gradcheck /
    gradgradcheck in float64."""
    x, v, rbf, w, unit, ei = _graph(10, 70, 24, 5, dtype, triton_device, seed=43)
    outs = []
    for alias in (False, True):
        ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
        if alias:
            ds, dv, v2 = _triton(*ins, ei, v_residual=True)
            assert v2.data_ptr() == ins[1].data_ptr() and torch.equal(v2, ins[1])
        else:
            (ds, dv), v2 = _triton(*ins, ei), ins[1]
        out = v2 + 0.5 * dv  # v + dv as an update block would take it
        gs = torch.linspace(-1, 1, ds.numel(), dtype=dtype, device=triton_device).view_as(ds)
        gv = torch.linspace(1, -2, dv.numel(), dtype=dtype, device=triton_device).view_as(dv)
        grads = torch.autograd.grad((ds, out), ins, (gs, gv), create_graph=True)
        (second,) = torch.autograd.grad(grads[1].square().sum() + grads[2].sum(), ins[0])
        outs.append([ds, dv, *grads, second])
    tol = 0.0 if triton_device.type == "cpu" and dtype == torch.float64 else TOL[dtype]
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())
    if dtype == torch.float64:
        *small, ei_small = _graph(4, 9, 3, 2, dtype, triton_device, seed=7)
        ins = [t.requires_grad_(True) for t in small]

        def fn(*a):
            ds, dv, v2 = _triton(*a, ei_small, v_residual=True)
            return ds, v2 * 0.3 + dv

        def fn_xv(x, v):  # (the alias's own term is v's: rbf, w, unit held, as test_gradcheck_gradgradcheck covers)
            return fn(x, v, *ins[2:])

        kw = dict(fast_mode=True, check_undefined_grad=False)
        assert torch.autograd.gradcheck(fn, ins, **kw)
        # the second derivative over x and v only: over all five it took 20 s under the interpreter
        assert torch.autograd.gradgradcheck(fn_xv, ins[:2], **kw)


def test_v_residual_without_the_triton_path_is_v_itself():
    """The torch reference (and so every non-Triton path) returns v itself as v'."""
    x, v, rbf, w, unit, ei = _graph(5, 13, 7, 5, torch.float64, "cpu", seed=3)
    with use_backend("torch"):
        ds, dv, v2 = message_passing(x, v, rbf, w, unit, ei, v_residual=True)
    assert v2 is v
    ref = message_passing_reference(x, v, rbf, w, unit, ei)
    assert torch.equal(ds, ref[0]) and torch.equal(dv, ref[1])


def test_edges_past_the_csr_get_zero_gradients(triton_device, poison):
    """Edges at or past row_ptr[N] (a padded bucket's inert tail: in neither CSR, last in the sender order too) get
    ∂rbf = ∂u = 0 exactly; the live edges and ∂x match the reference of the live edges alone."""
    n, live, tail, f, r = 20, 90, 14, 32, 6
    x, v, rbf, w, unit, ei = _graph(n, live + tail, f, r, torch.float64, triton_device, seed=41)
    ei = torch.cat([ei[:, :live], torch.arange(tail, device=triton_device).repeat(2, 1) % n], 1)
    row_ptr = torch.searchsorted(ei[0, :live].contiguous(), torch.arange(n + 1, device=triton_device))
    order_live = torch.argsort(ei[1, :live], stable=True)
    perm = torch.cat([order_live, torch.arange(live, live + tail, device=triton_device)])
    col_ptr = torch.searchsorted(ei[1, :live][order_live].contiguous(), torch.arange(n + 1, device=triton_device))
    ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
    poison(4 * (live + tail) * r, torch.float64, triton_device)
    ds, dv = _triton(*ins, ei, row_ptr=row_ptr, sender_csr=(perm, col_ptr))
    gs, gv = torch.randn_like(ds), torch.randn_like(dv)
    g = torch.autograd.grad((ds, dv), ins, (gs, gv))
    ref = message_passing_backward_reference(gs, gv, x, v, rbf[:live], w, unit[:live], ei[:, :live])
    for k in (2, 4):  # rbf, unit
        assert torch.equal(g[k][live:], torch.zeros_like(g[k][live:]))
        torch.testing.assert_close(g[k][:live], ref[k], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g[0], ref[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=[f"N{n}-E{e}-F{f}-R{r}" for n, e, f, r in SHAPES[1:]])
def test_fold_xb_matches_reference(triton_device, variant, dtype, shape):
    """``fold_xb_min_edges``: the block forward and the edge backward gather p = x_b ⊙ v in place of v and x_b.
    Forward and the five first gradients stay within the bound of the float64 reference, and the folded launch is
    the one that ran (the edge kernel on every variant, the forward on the block variant)."""
    import mlff_distiller.kernels._mp_config as cfg_module

    folds = []
    real = cfg_module._fold_xb
    with mp_module._configured(fold_xb_min_edges=1, fold_xb_min_degree=0):
        mp_module._fold_xb = lambda ref, e, n: folds.append(e) or real(ref, e, n)
        try:
            _compare(_graph(*shape, dtype, triton_device, seed=51), dtype)
        finally:
            mp_module._fold_xb = real
    assert len(folds) == (2 if variant == "block" else 1) and all(e == shape[1] for e in folds)


def test_fold_xb_second_derivative(triton_device, variant):
    """Training differentiates the backward again (a composite of the same ops): with the fold on, the second
    derivative of a force-like loss equals the unfolded one (float64, to rounding)."""
    x, v, rbf, w, unit, ei = _graph(9, 41, 20, 6, torch.float64, triton_device, seed=53)
    outs = []
    for least in (None, 1):
        with mp_module._configured(fold_xb_min_edges=least, fold_xb_min_degree=0):
            ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
            ds, dv = _triton(*ins, ei)
            gs, gv = torch.ones_like(ds), torch.linspace(-1, 1, dv.numel(), dtype=dv.dtype, device=dv.device)
            grads = torch.autograd.grad((ds, dv), ins, (gs, gv.view_as(dv)), create_graph=True)
            second = torch.autograd.grad(grads[2].square().sum() + grads[4].sum(), ins)
            outs.append([ds, dv, *grads, *second])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * max(1.0, b.abs().max().item()))


@pytest.mark.gpu
def test_fold_xb_large_graph_float32(variant):
    """The folded kernels within the float32 bound on a 3,000-atom graph, F = 128, R = 20 (the shipped student's
    shape, tf32x3 dots)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with mp_module._configured(fold_xb_min_edges=1, fold_xb_min_degree=0):
        _compare(_graph(3000, 3000 * 40, 128, 20, torch.float32, torch.device("cuda"), seed=57), torch.float32)


def test_fold_xb_rule():
    """The shipped rule: dense graphs fold (water: ~54 edges per atom, from the 192-atom box up), sparse ones (g2
    batches: ~7.5 per atom, a molecule's bucket) do not; None turns it off."""
    ref = torch.zeros(1)
    assert mp_module._fold_xb(ref, 163_000, 3_000) and mp_module._fold_xb(ref, 1_300_000, 24_000)
    assert not mp_module._fold_xb(ref, 163_000, 21_700)  # 4,096 g2 molecules
    assert mp_module._fold_xb(ref, 10_848, 200)  # a 192-atom water box's bucket (folded since stop 46)
    assert not mp_module._fold_xb(ref, 160, 32)  # benzene's bucket: 5 edge slots per atom
    with mp_module._configured(fold_xb_min_edges=None):
        assert not mp_module._fold_xb(ref, 1_300_000, 24_000)


@pytest.mark.parametrize("split", [1, 2])
def test_edge_grads_accumulate_into_given_rows(triton_device, split, monkeypatch):
    """The edge kernel's rows added to given tensors (the sum of every layer's ∂rbf, ∂u on the second stream): in
    the sum kernel's epilogue when the feature loop is split, by an add otherwise; the rows written, not added,
    without ``accumulate``."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)  # 4 feature chunks of F = 64 under the interpreter
    n, e, f = 40, 300, 64
    x, v, rbf, w, unit, ei = _graph(n, e, f, 20, torch.float64, triton_device, seed=61)
    gen = torch.Generator().manual_seed(62)
    gs = torch.randn(n, f, generator=gen, dtype=torch.float64).to(triton_device)
    gv = torch.randn(n, 3, f, generator=gen, dtype=torch.float64).to(triton_device)
    row_ptr = mp_module._offsets(ei[0].contiguous(), n)
    args = (gs, gv, x, v, rbf, w, unit, ei, row_ptr, True, mp_module._bare)
    with mp_module._configured(bwd_edge_split=split, bwd_sender_variant="atom"):
        c, _, _ = mp_module._launch_config(x, "bwd_edge", f, 20, n_edges=e)
        assert mp_module._edge_split(x, -(-e // c["BLOCK_E"]), f, c["BLOCK_F"]) == split
        fresh = mp_module._edge_grads(*args)
        old = (torch.randn_like(rbf), torch.randn_like(unit))
        summed = (old[0].clone(), old[1].clone())
        got = mp_module._edge_grads(*args, out=summed, accumulate=True)
        written = (old[0].clone(), old[1].clone())
        mp_module._edge_grads(*args, out=written)
    assert got[0] is summed[0] and got[1] is summed[1]
    torch.testing.assert_close(summed[0], old[0] + fresh[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(summed[1], old[1] + fresh[1], rtol=0, atol=1e-12)
    assert torch.equal(written[0], fresh[0]) and torch.equal(written[1], fresh[1])
    assert float(fresh[0].abs().max()) > 1e-3


class _Allocs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records ``(op name, shape)`` of every ``empty`` / ``empty_like`` run under it, in order."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("empty", "empty_like") and isinstance(out, torch.Tensor):
            self.seen.append((name, tuple(out.shape)))
        return out


@pytest.mark.parametrize("split", [2, 4])
def test_edge_split_slice0_writes_the_outputs(triton_device, split, monkeypatch):
    """edge_split_out0: the split edge kernel's slice 0 writes ∂rbf / ∂u itself, so its partial buffers hold
    split - 1 planes, not split (the backward's peak memory); the rows equal those of the all-partials path
    (bitwise for two slices, whose sum is the same one addition) and the float64 reference."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)  # 4 feature chunks of F = 64 under the interpreter
    # F = 128 on CUDA: four feature chunks of its tiles (32 features; float64 keeps them at 32), so 4 slices run.
    n, e, f, r = 40, 300, 64 if triton_device.type == "cpu" else 128, 20
    x, v, rbf, w, unit, ei = _graph(n, e, f, r, torch.float64, triton_device, seed=71)
    gen = torch.Generator().manual_seed(72)
    gs = torch.randn(n, f, generator=gen, dtype=torch.float64).to(triton_device)
    gv = torch.randn(n, 3, f, generator=gen, dtype=torch.float64).to(triton_device)
    row_ptr = mp_module._offsets(ei[0].contiguous(), n)
    args = (gs, gv, x, v, rbf, w, unit, ei, row_ptr, True, mp_module._bare)
    rows, shapes = {}, {}
    for out0 in (True, False):
        with mp_module._configured(bwd_edge_split=split, bwd_sender_variant="atom", edge_split_out0=out0):
            c, _, _ = mp_module._launch_config(x, "bwd_edge", f, r, n_edges=e)
            assert mp_module._edge_split(x, -(-e // c["BLOCK_E"]), f, c["BLOCK_F"]) == split
            with _Allocs() as allocs:
                rows[out0] = mp_module._edge_grads(*args)
        shapes[out0] = [s for _, s in allocs.seen]
    assert (split - 1, e, r) in shapes[True] and (split, e, r) not in shapes[True]
    assert (split - 1, e, 3) in shapes[True] and (split, e, 3) not in shapes[True]
    assert (split, e, r) in shapes[False]
    if split == 2:
        assert torch.equal(rows[True][0], rows[False][0]) and torch.equal(rows[True][1], rows[False][1])
    torch.testing.assert_close(rows[True][0], rows[False][0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(rows[True][1], rows[False][1], rtol=1e-13, atol=1e-13)
    ref = message_passing_backward_reference(gs, gv, x, v, rbf, w, unit, ei)
    torch.testing.assert_close(rows[True][0], ref[2], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(rows[True][1], ref[4], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("first", [True, False])
def test_backward_runs_the_edge_kernel_before_the_sender_kernel(triton_device, first, monkeypatch):
    """edge_grads_first: the backward makes the edge kernel's partial rows before the sender kernel's g_x (so the
    two kernels' buffers never share the peak), and the five gradients do not depend on the order."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)  # 2 feature chunks of F = 32: 2 slices
    n, e, f, r = 24, 120, 32 if triton_device.type == "cpu" else 64, 20
    x, v, rbf, w, unit, ei = _graph(n, e, f, r, torch.float64, triton_device, seed=73)
    ins = [t.clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
    gen = torch.Generator().manual_seed(74)
    gs = torch.randn(n, f, generator=gen, dtype=torch.float64).to(triton_device)
    gv = torch.randn(n, 3, f, generator=gen, dtype=torch.float64).to(triton_device)
    grads = {}
    for order in (first, not first):
        cfg = dict(bwd_edge_split=2, bwd_sender_variant="atom", edge_grads_first=order)
        with mp_module._configured(**cfg):
            ds, dv = _triton(*ins, ei)
            with _Allocs() as allocs:
                grads[order] = torch.autograd.grad((ds, dv), ins, (gs, gv))
        seen = allocs.seen
        part = seen.index(("empty", (1, e, r)))
        g_x = seen.index(("empty_like", (n, 3 * f)))
        assert (part < g_x) == order, seen
    for a, b in zip(grads[True], grads[False], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("du", ["sum", "dot"])
def test_edge_du_orders(triton_device, du, dtype, monkeypatch):
    """The edge backward's ∂u (``edge_du``: per-chunk feature sums, or dots D_k = (x_c ⊙ g_v[i,k]) @ W_c) is the same
    sum in another order: the forward and the five gradients stay within the bound of the float64 reference
    (three feature chunks of 16, the last one masked; a padded radial dimension), on the permutation and the
    symmetric walk, and the choice is the launch's."""
    monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)
    with mp_module._configured(edge_du=du, bwd_edge_block_f=16, bwd_edge_small_block_f=16):
        args = _graph(6, 37, 40, 20, dtype, triton_device, seed=61)
        c = mp_module._launch_config(args[0], "bwd_edge", 40, 20, n_edges=37)[0]
        assert c["DU_DOT"] is (du == "dot") and c["BLOCK_F"] == 16
        _compare(args, dtype)
        x, v, rbf, w, unit, ei, row_ptr = _symmetric_graph(9, 30, 20, 6, dtype, triton_device, seed=62)
        ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
        ds, dv = _triton(*ins, ei, row_ptr=row_ptr, symmetric=True)
        gs, gv = torch.ones_like(ds), torch.linspace(-1, 1, dv.numel(), dtype=dtype, device=dv.device).view_as(dv)
        got = torch.autograd.grad((ds, dv), ins, (gs, gv))
    ref = message_passing_backward_reference(gs.double(), gv.double(), *[t.detach().double() for t in ins], ei)
    _, scales = _abs_scales(*[t.detach() for t in ins], ei, gs, gv)
    for name, g, r, s in zip(("x", "v", "rbf", "filter_weight", "unit"), got, ref, scales, strict=True):
        _check(g, r, s, TOL[dtype], f"symmetric grad {name}")


def test_edge_du_rejects_unknown_choices():
    with mp_module._configured(edge_du="acc2d"), pytest.raises(ValueError, match="edge_du"):
        mp_module._launch_config(torch.zeros(1), "bwd_edge", 16, 8, n_edges=8)


@pytest.mark.gpu
@pytest.mark.parametrize("du", ["sum", "dot"])
def test_edge_du_large_graph_float32(du):
    """Both orders within the float32 bound on a 3,000-atom graph, F = 128, R = 20 (the shipped student's shape,
    tf32x3 dots, the edge kernel's feature split and 64-feature chunks)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with mp_module._configured(edge_du=du):
        _compare(_graph(3000, 3000 * 40, 128, 20, torch.float32, torch.device("cuda"), seed=63), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("per_atom", [8, 40])
def test_edge_nan_guard_changes_no_bits_on_cuda(per_atom):
    """The edge backward's weight dots with and without dot_w's NaN guard (``edge_nan_guard``, GUARD) give the same
    ∂rbf and ∂u bit for bit on finite inputs, unfolded (8 edges an atom) and folded (40, p = x_b ⊙ v), with the
    filter weight on the TF32 grid ("tf32x2w", where the guard differs); both within the float32 bound."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mlff_distiller.kernels._frozen import round_tf32_

    n = 3000
    x, v, rbf, w, unit, ei = _graph(n, n * per_atom, 128, 20, torch.float32, torch.device("cuda"), seed=29)
    round_tf32_(w)
    assert mp_module._fold_xb(x, n * per_atom, n) == (per_atom == 40)
    gs, gv = None, None
    grads = {}
    for guard in (True, False):
        with mp_module._configured(edge_nan_guard=guard):
            ins = [t.clone().requires_grad_(True) for t in (rbf, unit)]
            ds, dv = _triton(x, v, ins[0], w, ins[1], ei)
            if gs is None:
                gen = torch.Generator(device="cuda").manual_seed(30)
                gs = torch.randn(ds.shape, device="cuda", generator=gen)
                gv = torch.randn(dv.shape, device="cuda", generator=gen)
            grads[guard] = torch.autograd.grad((ds, dv), ins, (gs, gv))
    for a, b in zip(grads[True], grads[False], strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    with mp_module._configured(edge_nan_guard=False):
        _compare((x, v, rbf, w, unit, ei), torch.float32)
