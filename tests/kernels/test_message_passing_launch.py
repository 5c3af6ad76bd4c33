"""Triton message_passing: its launch forms on large graphs and their switches (GPU-only sizes, torch.compile and
the op registrations; the edge backward's tiles, feature slices and chained slices; the folded x_b ⊙ v; the v = 0
promise and v's residual alias; rows past the CSR; ∂u's orders and NaN guard), each against the float64 reference
or the shipped form's bits. Tolerances and graphs as in test_message_passing.py (mp_helpers.py)."""

import importlib

import pytest
import torch
from mlff_distiller.kernels import message_passing, message_passing_reference, use_backend
from mp_helpers import (
    OPS,
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


# ------------------------------------------------------------------------------------------------------------
# GPU only: large graphs, torch.compile and the op registrations


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_water_like_graph(dtype, variant):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, per_atom = 3000, 55
    x, v, rbf, w, unit, _ = graph(n, n * per_atom, 128, 20, dtype, torch.device("cuda"), seed=11)
    recv = torch.arange(n, device="cuda").repeat_interleave(per_atom)
    send = (recv + torch.randint(-200, 201, recv.shape, device="cuda")) % n  # local senders, as in a real box
    compare((x, v, rbf, w, unit, torch.stack([recv, send])), dtype)


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
        compare(graph(3000, 3000 * 40, 128, 20, torch.float32, torch.device("cuda"), seed=21), torch.float32)


@pytest.mark.parametrize("split", [1, 2, 4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_edge_kernel_feature_split(triton_device, split, dtype, monkeypatch):
    """The edge backward with its feature loop split over 1, 2 or 4 programs per edge tile (partial ∂rbf / ∂u rows
    summed on the host) matches the reference; a split that does not divide the feature chunks (3) runs one slice."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)  # 4 feature chunks of F = 64 under the interpreter
    e = 100 if triton_device.type == "cpu" else 300  # (a few edge tiles under the interpreter: 11 s a case at 300)
    args = graph(20 if triton_device.type == "cpu" else 40, e, 64, 20, dtype, triton_device, seed=31)
    with mp_module._configured(bwd_edge_split=split, bwd_sender_variant="atom"):
        c, _, _ = mp_module._launch_config(args[0], "bwd_edge", 64, 20, n_edges=e)
        chunks = 64 // c["BLOCK_F"]
        used = mp_module._edge_split(args[0], e // c["BLOCK_E"] + 1, 64, c["BLOCK_F"])
        assert used == (split if chunks % split == 0 else 1)
        compare(args, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sender_fold_half_matches_reference(triton_device, dtype):
    """``sender_fold_half``: the atom sender backward's five sums kept as half-tiles (each edge tile's two row halves
    added in the loop, the rows summed after it) match the float64 reference on a graph whose senders take several
    edge tiles (and one with none), and equal the per-tile sums to rounding."""
    n, e = (16, 1500) if triton_device.type == "cpu" else (64, 6000)
    args = graph(n, e, 32, 20, dtype, triton_device, seed=81, isolated=1)
    x, v, rbf, w, unit, ei = args
    grads = {}
    for half in (True, False):
        with mp_module._configured(sender_fold_half=half, bwd_sender_variant="atom", block_min_atoms=0):
            if half:
                compare(args, dtype)
            ins = [t.detach().clone().requires_grad_(True) for t in (x, v)]
            ds, dv = run_triton(ins[0], ins[1], rbf, w, unit, ei)
            grads[half] = torch.autograd.grad((ds, dv), ins, (torch.ones_like(ds), torch.ones_like(dv)))
    for a, b in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("accumulate", [False, True])
def test_edge_kernel_chained_slices_equal_the_sum_kernel(triton_device, accumulate, monkeypatch):
    """``edge_split_chain``: two slices per edge tile, the second adding the first's rows after its flag (no sum
    kernel, no partial plane when writing afresh, one when adding into given rows): the same bits as the sum
    kernel's, written afresh and added into given rows, over repeated launches (the flags start at zero each
    launch), with inert rows past the CSR."""
    if triton_device.type == "cpu":
        monkeypatch.setitem(mp_module._CPU_TILES, "block_f", 16)  # 4 feature chunks of F = 64 under the interpreter
    n, e, f = (20, 100, 64) if triton_device.type == "cpu" else (600, 24000, 64)
    x, v, rbf, w, unit, ei = graph(n, e, f, 20, torch.float32, triton_device, seed=71)
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
        cfg = dict(bwd_edge_split=2, edge_split_chain=chain, edge_chain_min_tiles=0)
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
    args = graph(n, e, 64, 20, torch.float32, triton_device, seed=73)
    fold_cfg = dict(fold_xb_min_edges=1, fold_xb_min_degree=0) if fold else dict(fold_xb_min_edges=None)
    calls = []
    monkeypatch.setattr(mp_module, "_mp_sum_split_kernel", _CountingLaunch(mp_module._mp_sum_split_kernel, calls))
    cfg = dict(bwd_edge_split=2, edge_split_chain="fold", edge_chain_min_tiles=0, bwd_sender_variant="atom")
    with mp_module._configured(**cfg, **fold_cfg):
        assert mp_module._fold_xb(args[0], e, n) == fold
        compare(args, torch.float32)
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
    args = graph(3000, 3000 * 40, f, 20, torch.float32, torch.device("cuda"), seed=23)
    cfg = dict(seg_split=True, fwd_variant="block", bwd_sender_variant="block", block_min_atoms=0)
    with mp_module._configured(**cfg):
        c, _, variant = mp_module._launch_config(args[0], "bwd_sender", f, 20, n_atoms=3000)
        assert variant == "block" and c["SEG_SPLIT"]
        compare(args, torch.float32)


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
    x, v, rbf, w, unit, _ = graph(n, n * per_atom, 128, 20, torch.float32, torch.device("cuda"), seed=23)
    recv = torch.arange(n, device="cuda").repeat_interleave(per_atom)
    send = (recv + torch.randint(-100, 101, recv.shape, device="cuda")) % n
    expected = "block" if per_atom <= mp_module._CONFIG["sender_block_max_degree"] else "atom"
    got = mp_module._launch_config(x, "bwd_sender", 128, 20, n_atoms=n, n_edges=n * per_atom)[2]
    assert got == expected
    compare((x, v, rbf, w, unit, torch.stack([recv, send])), torch.float32)


@pytest.mark.gpu
def test_compile_and_opcheck(variant):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    x, v, rbf, w, unit, ei = graph(50, 400, 32, 8, torch.float32, torch.device("cuda"), seed=12)
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
    x, _, rbf, w, unit, ei = graph(11, 90, 40, 6, dtype, triton_device, seed=41)
    v = torch.zeros((11, 3, 40), dtype=dtype, device=triton_device)
    outs = []
    for promise in (False, True):
        ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
        ds, dv = run_triton(*ins, ei, v_zero=promise)
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
    x, v, rbf, w, unit, ei = graph(10, 70, 24, 5, dtype, triton_device, seed=43)
    outs = []
    for alias in (False, True):
        ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
        if alias:
            ds, dv, v2 = run_triton(*ins, ei, v_residual=True)
            assert v2.data_ptr() == ins[1].data_ptr() and torch.equal(v2, ins[1])
        else:
            (ds, dv), v2 = run_triton(*ins, ei), ins[1]
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
        *small, ei_small = graph(4, 9, 3, 2, dtype, triton_device, seed=7)
        ins = [t.requires_grad_(True) for t in small]

        def fn(*a):
            ds, dv, v2 = run_triton(*a, ei_small, v_residual=True)
            return ds, v2 * 0.3 + dv

        def fn_xv(x, v):  # (the alias's own term is v's: rbf, w, unit held, as test_gradcheck_gradgradcheck covers)
            return fn(x, v, *ins[2:])

        kw = dict(fast_mode=True, check_undefined_grad=False)
        assert torch.autograd.gradcheck(fn, ins, **kw)
        # the second derivative over x and v only: over all five it took 20 s under the interpreter
        assert torch.autograd.gradgradcheck(fn_xv, ins[:2], **kw)


def test_v_residual_without_the_triton_path_is_v_itself():
    """The torch reference (and so every non-Triton path) returns v itself as v'."""
    x, v, rbf, w, unit, ei = graph(5, 13, 7, 5, torch.float64, "cpu", seed=3)
    with use_backend("torch"):
        ds, dv, v2 = message_passing(x, v, rbf, w, unit, ei, v_residual=True)
    assert v2 is v
    ref = message_passing_reference(x, v, rbf, w, unit, ei)
    assert torch.equal(ds, ref[0]) and torch.equal(dv, ref[1])


def test_edges_past_the_csr_get_zero_gradients(triton_device, poison):
    """Edges at or past row_ptr[N] (a padded bucket's inert tail: in neither CSR, last in the sender order too) get
    ∂rbf = ∂u = 0 exactly; the live edges and ∂x match the reference of the live edges alone."""
    n, live, tail, f, r = 20, 90, 14, 32, 6
    x, v, rbf, w, unit, ei = graph(n, live + tail, f, r, torch.float64, triton_device, seed=41)
    ei = torch.cat([ei[:, :live], torch.arange(tail, device=triton_device).repeat(2, 1) % n], 1)
    row_ptr = torch.searchsorted(ei[0, :live].contiguous(), torch.arange(n + 1, device=triton_device))
    order_live = torch.argsort(ei[1, :live], stable=True)
    perm = torch.cat([order_live, torch.arange(live, live + tail, device=triton_device)])
    col_ptr = torch.searchsorted(ei[1, :live][order_live].contiguous(), torch.arange(n + 1, device=triton_device))
    ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
    poison(4 * (live + tail) * r, torch.float64, triton_device)
    ds, dv = run_triton(*ins, ei, row_ptr=row_ptr, sender_csr=(perm, col_ptr))
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
            compare(graph(*shape, dtype, triton_device, seed=51), dtype)
        finally:
            mp_module._fold_xb = real
    assert len(folds) == (2 if variant == "block" else 1) and all(e == shape[1] for e in folds)


def test_fold_xb_second_derivative(triton_device, variant):
    """Training differentiates the backward again (a composite of the same ops): with the fold on, the second
    derivative of a force-like loss equals the unfolded one (float64, to rounding)."""
    x, v, rbf, w, unit, ei = graph(9, 41, 20, 6, torch.float64, triton_device, seed=53)
    outs = []
    for least in (None, 1):
        with mp_module._configured(fold_xb_min_edges=least, fold_xb_min_degree=0):
            ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
            ds, dv = run_triton(*ins, ei)
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
        compare(graph(3000, 3000 * 40, 128, 20, torch.float32, torch.device("cuda"), seed=57), torch.float32)


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
    x, v, rbf, w, unit, ei = graph(n, e, f, 20, torch.float64, triton_device, seed=61)
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
    x, v, rbf, w, unit, ei = graph(n, e, f, r, torch.float64, triton_device, seed=71)
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
    x, v, rbf, w, unit, ei = graph(n, e, f, r, torch.float64, triton_device, seed=73)
    ins = [t.clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
    gen = torch.Generator().manual_seed(74)
    gs = torch.randn(n, f, generator=gen, dtype=torch.float64).to(triton_device)
    gv = torch.randn(n, 3, f, generator=gen, dtype=torch.float64).to(triton_device)
    grads = {}
    for order in (first, not first):
        cfg = dict(bwd_edge_split=2, bwd_sender_variant="atom", edge_grads_first=order)
        with mp_module._configured(**cfg):
            ds, dv = run_triton(*ins, ei)
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
        args = graph(6, 37, 40, 20, dtype, triton_device, seed=61)
        c = mp_module._launch_config(args[0], "bwd_edge", 40, 20, n_edges=37)[0]
        assert c["DU_DOT"] is (du == "dot") and c["BLOCK_F"] == 16
        compare(args, dtype)
        x, v, rbf, w, unit, ei, row_ptr = symmetric_graph(9, 30, 20, 6, dtype, triton_device, seed=62)
        ins = [t.detach().clone().requires_grad_(True) for t in (x, v, rbf, w, unit)]
        ds, dv = run_triton(*ins, ei, row_ptr=row_ptr, symmetric=True)
        gs, gv = torch.ones_like(ds), torch.linspace(-1, 1, dv.numel(), dtype=dtype, device=dv.device).view_as(dv)
        got = torch.autograd.grad((ds, dv), ins, (gs, gv))
    ref = message_passing_backward_reference(gs.double(), gv.double(), *[t.detach().double() for t in ins], ei)
    _, scales = abs_scales(*[t.detach() for t in ins], ei, gs, gv)
    for name, g, r, s in zip(("x", "v", "rbf", "filter_weight", "unit"), got, ref, scales, strict=True):
        check(g, r, s, TOL[dtype], f"symmetric grad {name}")


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
        compare(graph(3000, 3000 * 40, 128, 20, torch.float32, torch.device("cuda"), seed=63), torch.float32)


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
    x, v, rbf, w, unit, ei = graph(n, n * per_atom, 128, 20, torch.float32, torch.device("cuda"), seed=29)
    round_tf32_(w)
    assert mp_module._fold_xb(x, n * per_atom, n) == (per_atom == 40)
    gs, gv = None, None
    grads = {}
    for guard in (True, False):
        with mp_module._configured(edge_nan_guard=guard):
            ins = [t.clone().requires_grad_(True) for t in (rbf, unit)]
            ds, dv = run_triton(x, v, ins[0], w, ins[1], ei)
            if gs is None:
                gen = torch.Generator(device="cuda").manual_seed(30)
                gs = torch.randn(ds.shape, device="cuda", generator=gen)
                gv = torch.randn(dv.shape, device="cuda", generator=gen)
            grads[guard] = torch.autograd.grad((ds, dv), ins, (gs, gv))
    for a, b in zip(grads[True], grads[False], strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    with mp_module._configured(edge_nan_guard=False):
        compare((x, v, rbf, w, unit, ei), torch.float32)
