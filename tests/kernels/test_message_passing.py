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
from mp_helpers import (
    SHAPES,
    TOL,
    abs_scales,
    check,
    compare,
    graph,
    message_passing_backward_reference,
    run_triton,
    symmetric_graph,
)

mp_module = importlib.import_module("mlff_distiller.kernels.message_passing")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{n}-E{e}-F{f}-R{r}" for n, e, f, r in SHAPES])
def test_matches_reference(triton_device, variant, dtype, shape):
    n, e, f, r = shape
    compare(graph(n, e, f, r, dtype, triton_device, seed=e), dtype)


def test_isolated_atoms_and_no_edges(triton_device, variant, poison):
    """Atoms that receive or send nothing get exact zeros (poisoned allocator: a missed store shows as NaN)."""
    args = graph(12, 30, 8, 4, torch.float64, triton_device, isolated=5)
    poison(12 * 3 * 8 * 4, torch.float64, triton_device)
    ds, dv, grads = compare(args, torch.float64)
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
    x, v, rbf, w, unit, _ = graph(n, ei.shape[1], f, r, torch.float64, triton_device, seed=4)
    compare((x, v, rbf, w, unit, ei), torch.float64)


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
    x, v, rbf, w, unit, _ = graph(n, ei.shape[1], f, r, torch.float32, triton_device, seed=10)
    ds, dv, grads = compare((x, v, rbf, w, unit, ei), torch.float32)
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
    compare(graph(45, 160, 40, 7, torch.float64, triton_device, seed=14, isolated=4), torch.float64)


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
    args = graph(20, 90, 12, 5, torch.float32, triton_device, seed=13)
    x, v, rbf, w, unit, ei = args
    for wrt in ((rbf, unit), (x, v)):
        ins = [t.detach().clone().requires_grad_(any(t is u for u in wrt)) for t in (x, v, rbf, w, unit)]
        ds, dv = run_triton(*ins, ei)
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
    x, v, rbf, w, unit, ei = graph(10, 60, 8, 4, torch.float64, triton_device, seed=5)
    row_ptr = torch.searchsorted(ei[0], torch.arange(11, device=triton_device))
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(0)).to(triton_device)
    sorted_out = compare((x, v, rbf, w, unit, ei), torch.float64)
    compare((x, v, rbf[perm], w, unit[perm], ei[:, perm]), torch.float64)
    with_ptr = run_triton(x, v, rbf, w, unit, ei, row_ptr=row_ptr.to(torch.int32))
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
    x, v, rbf, w, unit, ei = graph(10, 60, 8, 4, torch.float64, triton_device, seed=5)
    row_ptr = torch.searchsorted(ei[0], torch.arange(11, device=triton_device))
    csr = _sender_csr(ei, 10)

    def grads(sender_csr, edges=ei, r=rbf, u=unit, ptr=row_ptr):
        ins = [t.detach().clone().requires_grad_(True) for t in (x, v, r, w, u)]
        ds, dv = run_triton(*ins, edges, row_ptr=ptr, sender_csr=sender_csr)
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
        run_triton(x, v, rbf, w, unit, ei, row_ptr=row_ptr, sender_csr=(csr[0][:-1], csr[1]))
    with pytest.raises(ValueError, match="sender_csr col_ptr"):
        run_triton(x, v, rbf, w, unit, ei, row_ptr=row_ptr, sender_csr=(csr[0], csr[1][:-1]))
    with pytest.raises(ValueError, match="pair"):
        run_triton(x, v, rbf, w, unit, ei, row_ptr=row_ptr, sender_csr=csr[0])


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
    x, v, rbf, w, unit, ei, row_ptr = symmetric_graph(n, pairs, f, r, dtype, triton_device, seed=pairs)
    ins0 = (x, v, rbf, w, unit)

    def run(symmetric, ptr=row_ptr, second_order=True):
        ins = [t.detach().clone().requires_grad_(True) for t in ins0]
        ds, dv = run_triton(*ins, ei, row_ptr=ptr, symmetric=symmetric)
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
    _, s_grads = abs_scales(*ins0, ei, gs, gv)
    ref_grads = message_passing_backward_reference(gs.double(), gv.double(), *ref64, ei)
    for k, name in enumerate(("x", "v", "rbf", "filter_weight", "unit")):
        check(sym[2 + k], ref_grads[k], s_grads[k], TOL[dtype], f"grad {name}")
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(sym, plain, strict=True):
        torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=0)
    for a, b in zip(run(True, ptr=None, second_order=False)[0], sym, strict=False):  # row_ptr built here
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_symmetric_promise_is_what_the_sender_gradients_use(triton_device, variant):
    """The promise is trusted: on a list that is not symmetric (one partner's unit vector not flipped) the
    gradient wrt x differs from the reference; the edge-side gradients (rbf, u) do not use it."""
    x, v, rbf, w, unit, ei, row_ptr = symmetric_graph(9, 30, 8, 4, torch.float64, triton_device, seed=4)
    bad_unit = unit.clone()
    bad_unit[0] = -bad_unit[0]  # its partner keeps the old direction
    ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, bad_unit)]
    ds, dv = run_triton(*ins, ei, row_ptr=row_ptr, symmetric=True)
    gs, gv = torch.ones_like(ds), torch.ones_like(dv)
    got = torch.autograd.grad((ds, dv), ins, (gs, gv))
    ref = message_passing_backward_reference(gs, gv, *[t.detach() for t in ins], ei)
    assert not torch.allclose(got[0], ref[0], atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], atol=1e-12, rtol=0)
    torch.testing.assert_close(got[4], ref[4], atol=1e-12, rtol=0)


def test_bad_inputs_are_value_errors(triton_device):
    x, v, rbf, w, unit, ei = graph(5, 10, 4, 3, torch.float64, triton_device)
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
        run_triton(x, v, rbf, w, unit, out_of_range)
    with pytest.raises(ValueError, match="row_ptr"):
        run_triton(x, v, rbf, w, unit, ei, row_ptr=torch.zeros(3, dtype=torch.long, device=triton_device))


@pytest.mark.parametrize("variant", ["atom", "block"], indirect=True)
def test_gradcheck_gradgradcheck(triton_device, variant):
    """float64, small: first and second derivatives of the fused op (second: the composite of fused ops)."""
    x, v, rbf, w, unit, ei = graph(4, 9, 3, 2, torch.float64, triton_device, seed=7)
    ins = [t.clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]

    def fn(*a):
        return run_triton(*a, ei)

    kw = dict(fast_mode=True, check_undefined_grad=False)
    assert torch.autograd.gradcheck(fn, ins, **kw)
    assert torch.autograd.gradgradcheck(fn, ins, **kw)


def test_double_backward_matches_reference(triton_device, variant):
    """Force-training style: first gradients with create_graph, a loss on all of them, second gradients."""
    args = graph(7, 31, 12, 5, torch.float64, triton_device, seed=8)
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
    got = second(run_triton)
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
