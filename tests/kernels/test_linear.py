"""Triton GEMMs of the atom-wise layers (kernels/linear.py): gemm's epilogue/prologue/accumulate options and the
frozen-weight MLP vs torch, and the dispatch rules.

Tolerances: the oracle is torch in float64 on the same inputs. Normwise relative error ≤ 1e-12 (float64) and
1e-5 (float32: tf32x3 dots on the GPU, ieee under the interpreter).
"""

import pytest
import torch
from mlff_distiller.kernels import gemm, gemm_fusable, mlp, mlp_reference, use_backend
from mlff_distiller.kernels._frozen import tf32_exact
from mlff_distiller.kernels.linear import readout, readout_reference, structure_sums
from torch.nn import functional as nnf
from torch.utils._python_dispatch import TorchDispatchMode

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _rand(*shape, gen, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def _close(actual, expected, tol, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).norm().item()
    assert err <= tol * max(expected.double().norm().item(), 1e-30), f"{what}: normwise error {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "m, k, n", [(0, 8, 16), (1, 20, 384), (17, 128, 128), (200, 256, 128), (3000, 128, 64), (2500, 384, 96)]
)
@pytest.mark.parametrize("act", ["none", "silu"])
def test_gemm_forward(triton_device, poison, dtype, m, k, n, act):
    gen = torch.Generator().manual_seed(m + k + n)
    a = _rand(m, k, gen=gen, dtype=dtype, device=triton_device)
    w = _rand(n, k, gen=gen, dtype=dtype, device=triton_device, scale=k**-0.5)
    b = _rand(n, gen=gen, dtype=dtype, device=triton_device)
    poison(4 * m * n + 64, dtype, triton_device)
    c, pre = gemm(a, w, b, act=act)
    want_pre = nnf.linear(a.double(), w.double(), b.double())
    _close(c, nnf.silu(want_pre) if act == "silu" else want_pre, TOL[dtype], "C")
    if act == "silu":
        _close(pre, want_pre, TOL[dtype], "pre-activation")
    else:
        assert pre is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m, k, n", [(1, 16, 8), (33, 384, 128), (200, 128, 256)])
@pytest.mark.parametrize("blas", [False, True], ids=["below-threshold", "above-threshold"])
def test_gemm_backward_forms(triton_device, monkeypatch, dtype, m, k, n, blas):
    """B = W untransposed, SiLU' folded into the A operand, and accumulation into the output; also above
    untransposed_max_rows, where CUDA runs them on W's kept transpose (made once) and the interpreter through
    torch's product."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    monkeypatch.setitem(lin._CONFIG, "untransposed_max_rows", 0 if blas else 10**9)
    calls = []
    real = lin._torch_gemm
    monkeypatch.setattr(lin, "_torch_gemm", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(m * k + n)
    g = _rand(m, k, gen=gen, dtype=dtype, device=triton_device)
    p = _rand(m, k, gen=gen, dtype=dtype, device=triton_device, scale=2.0)
    w = _rand(k, n, gen=gen, dtype=dtype, device=triton_device, scale=k**-0.5)
    out = _rand(m, n, gen=gen, dtype=dtype, device=triton_device)
    before = out.clone()
    res, _ = gemm(g, w, transpose_w=False, prologue_silu_of=p, out=out, accumulate=True)
    assert res is out
    sg = torch.sigmoid(p.double())
    want = before.double() + (g.double() * sg * (1 + p.double() * (1 - sg))) @ w.double()
    _close(out, want, TOL[dtype], "accumulated prologue GEMM")
    plain, _ = gemm(g, w, transpose_w=False)
    _close(plain, g.double() @ w.double(), TOL[dtype], "plain GEMM with W as [K, N]")
    on_cuda = triton_device.type == "cuda"
    assert len(calls) == (2 if blas and not on_cuda else 0)
    if blas and on_cuda:
        from mlff_distiller.kernels._frozen import _CACHE

        kept = [entry[3] for key, entry in _CACHE.items() if key[0] == "t" and entry[0][0]() is w]
        assert len(kept) == 1 and torch.equal(kept[0], w.t())  # one transpose for both calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m, k, n", [(0, 8, 16), (1, 16, 8), (33, 128, 256), (200, 128, 128)])
@pytest.mark.parametrize("blas", [False, True], ids=["below-threshold", "above-threshold"])
def test_gemm_residual_prologue_and_addend(triton_device, monkeypatch, dtype, m, k, n, blas):
    """``prologue_add=Q`` multiplies A + Q (the same rounded sum as a torch add: bit for bit the GEMM of the
    stored sum) and ``addend=D`` adds D in the epilogue (bit for bit the GEMM's output + D); also for the
    untransposed form above untransposed_max_rows (CUDA: W's kept transpose; the interpreter: torch's product)."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    monkeypatch.setitem(lin._CONFIG, "untransposed_max_rows", 0 if blas else 10**9)
    gen = torch.Generator().manual_seed(m + k + n)
    a, q = (_rand(m, k, gen=gen, dtype=dtype, device=triton_device) for _ in range(2))
    w = _rand(n, k, gen=gen, dtype=dtype, device=triton_device, scale=k**-0.5)
    b = _rand(n, gen=gen, dtype=dtype, device=triton_device)
    d = _rand(m, n, gen=gen, dtype=dtype, device=triton_device)
    got, _ = gemm(a, w, b, prologue_add=q)
    assert torch.equal(got, gemm(a + q, w, b)[0])
    _close(got, nnf.linear(a.double() + q.double(), w.double(), b.double()), TOL[dtype], "A + Q GEMM")
    wt = w.t().contiguous()  # [K, N]: the backward form (the fallback's)
    for tw, ww in ((True, w), (False, wt)):
        got, _ = gemm(a, ww, transpose_w=tw, addend=d)
        assert torch.equal(got, gemm(a, ww, transpose_w=tw)[0] + d)
        got, _ = gemm(a, ww, transpose_w=tw, prologue_add=q, addend=d)
        assert torch.equal(got, gemm(a + q, ww, transpose_w=tw)[0] + d)
    with pytest.raises(ValueError, match="one prologue"):
        gemm(a, w, prologue_add=q, prologue_silu_of=q)
    with pytest.raises(ValueError, match="addend"):
        gemm(a, w, addend=d, act="silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, f, h, o", [(0, 16, 16, 48), (7, 20, 20, 60), (65, 128, 64, 1)])
def test_mlp_matches_reference(triton_device, dtype, n, f, h, o):
    gen = torch.Generator().manual_seed(n + f + o)
    x = _rand(n, f, gen=gen, dtype=dtype, device=triton_device).requires_grad_(True)
    ws = [
        _rand(h, f, gen=gen, dtype=dtype, device=triton_device, scale=f**-0.5),
        _rand(h, gen=gen, dtype=dtype, device=triton_device),
        _rand(o, h, gen=gen, dtype=dtype, device=triton_device, scale=h**-0.5),
        _rand(o, gen=gen, dtype=dtype, device=triton_device),
    ]
    with use_backend("triton"):
        assert gemm_fusable(x, *ws) == (triton_device.type == "cpu" or dtype == torch.float32)
        y = mlp(x, *ws)
    x64 = x.detach().double().requires_grad_(True)
    y_ref = mlp_reference(x64, *(w.double() for w in ws))
    _close(y, y_ref.detach(), TOL[dtype], "MLP output")
    if n:
        up = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64).to(triton_device)
        (g,) = torch.autograd.grad(y, x, up.to(dtype))
        (g_ref,) = torch.autograd.grad(y_ref, x64, up)
        _close(g, g_ref, TOL[dtype], "MLP gradient wrt x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 33])
def test_mlp_residual_alias(triton_device, dtype, n):
    """mlp(x, ..., residual=True) returns (MLP(x), x'): x' equals x, and the gradient wrt x of a loss using both is
    bit for bit what autograd gives when x is used twice (its two gradients summed), here added in the MLP's
    last backward GEMM."""
    gen = torch.Generator().manual_seed(n + 7)
    x = _rand(n, 20, gen=gen, dtype=dtype, device=triton_device).requires_grad_(True)
    ws = [_rand(*s, gen=gen, dtype=dtype, device=triton_device, scale=0.3) for s in ((24, 20), (24,), (60, 24), (60,))]
    up_y = _rand(n, 60, gen=gen, dtype=dtype, device=triton_device)
    up_x = _rand(n, 20, gen=gen, dtype=dtype, device=triton_device)
    with use_backend("triton"):
        y, alias = mlp(x, *ws, residual=True)
        (got,) = torch.autograd.grad((y, alias), x, (up_y, up_x))
        y2 = mlp(x, *ws)
        (want,) = torch.autograd.grad((y2, x.view_as(x)), x, (up_y, up_x))
        (only_alias,) = torch.autograd.grad(mlp(x, *ws, residual=True)[1], x, up_x)
    assert torch.equal(alias, x) and torch.equal(y, y2)
    assert torch.equal(got, want)
    assert torch.equal(only_alias, up_x)
    with use_backend("torch"):
        y_t, alias_t = mlp(x, *ws, residual=True)
    assert alias_t is x
    _close(y_t, y.double(), TOL[dtype], "residual MLP, torch vs triton")


def _readout_inputs(n, b, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = _rand(n, 16, gen=gen, dtype=dtype, device=device).requires_grad_(True)
    ws = [_rand(*s, gen=gen, dtype=dtype, device=device, scale=0.3) for s in ((8, 16), (8,), (1, 8), (1,))]
    scale, shift = (_rand(3, gen=gen, dtype=dtype, device=device) for _ in range(2))
    species = torch.randint(0, 3, (n,), generator=gen).to(device)
    batch = torch.sort(torch.randint(0, b, (n,), generator=gen)).values.to(device)
    return x, ws, scale, shift, species, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, b", [(0, 1), (1, 1), (7, 3), (150, 4)])
@pytest.mark.parametrize("grads", ["energy", "atomic", "both"])
def test_readout_matches_reference(triton_device, monkeypatch, poison, dtype, n, b, grads):
    """The fused readout (scale, shift and the per-structure sum in the GEMM epilogue, their backward in the
    prologue) is bit for bit the Triton MLP + torch ops it replaces, under the interpreter (on the GPU the sums'
    atomics run in another order, as index_add's did); two GEMM launches each way and no other op but E's zeros;
    the torch reference within the MLP tolerance."""
    x, ws, scale, shift, species, batch = _readout_inputs(n, b, dtype, triton_device, seed=n + b)
    poison(4 * b + 64, dtype, triton_device)  # E's entries are NaN unless the first GEMM zeroes them
    gen = torch.Generator().manual_seed(3)
    g_e = _rand(b, gen=gen, dtype=dtype, device=triton_device).double()  # E is float64 (as the engine's seed)
    g_a = _rand(n, gen=gen, dtype=dtype, device=triton_device)
    pick = {"energy": (0,), "atomic": (1,), "both": (0, 1)}[grads]
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    gemms, real = [], lin.gemm
    monkeypatch.setattr(lin, "gemm", lambda *a, **k: gemms.append(1) or real(*a, **k))

    def unfused(*args):
        """What the model ran before: the Triton MLP, then the torch ops (the sums in float64, kept so)."""
        atomic = mlp(*args[:5]).squeeze(-1) * scale[species] + shift[species]
        return structure_sums(atomic, batch, b, keep_wide=True), atomic

    def run(backend, fn=readout):
        with use_backend(backend), _Ops() as ops:
            out = fn(x, *ws, scale, shift, species, batch, b)
            (g,) = torch.autograd.grad([out[i] for i in pick], x, [(g_e, g_a)[i] for i in pick])
        return out, g, ops.names

    with use_backend("triton"):
        fused = gemm_fusable(x, *ws, scale, shift)  # (not float64 on the GPU: cuBLAS there)
    for w in ws:  # whether each weight is on the TF32 grid: looked at once per weight (a few ops), not per call
        tf32_exact(w)
    (e, a), g, ops = run("triton")
    assert len(gemms) == (4 if fused else 0)
    _, g_r, _ = run("torch")
    if triton_device.type == "cpu":
        (e_u, a_u), g_u, _ = run("triton", unfused)
        assert torch.equal(e, e_u) and torch.equal(a, a_u) and torch.equal(g, g_u)
    if fused and n and grads != "atomic":  # (only ε differentiated: a zero gather source, a rare path)
        # E's zeros in the first GEMM; no fill, gather, mul, add, index_add; E's float64 sums returned as they
        # are (no rounding to float32: stop 53), and their float64 gradient rounded inside the first GEMM's load
        assert ops == [], ops
        assert e.dtype == torch.float64, e.dtype
    x64 = x.detach().double()
    e64, a64 = readout_reference(x64, *(w.double() for w in ws), scale.double(), shift.double(), species, batch, b)
    _close(e, e64, TOL[dtype], "energy")
    _close(a, a64, TOL[dtype], "atomic energies")
    _close(g, g_r.double(), TOL[dtype], "gradient wrt x")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_readout_sums_many_atoms_to_float32_accuracy(triton_device, backend):
    """A structure of many atoms (a 6,000-atom box's -15,000 eV): its float32 energy is within one rounding of the
    exact sum of its atomic energies (the sums accumulate in float64, ``_CONFIG["energy_sum_f64"]``); float32
    sums, switched on here to show the test can fail, are off by several roundings (~7e-4 relative at
    200,001 water atoms on an H200's atomics)."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    n = 6000
    x, ws, scale, shift, species, batch = _readout_inputs(n, 1, torch.float32, triton_device, seed=5)
    shift = torch.tensor([-4.5, -1.0, -2.0], device=triton_device)  # eV per atom, as a trained student's
    scale = scale * 0.1
    batch = torch.zeros(n, dtype=torch.long, device=triton_device)
    errors = {True: 0.0, False: 0.0}
    # The float32 control sums with atomics on a GPU, whose order (and so its error) changes from run to run: one
    # run under load (stop 77, six test processes on one H200) gave 1.61 eps. Its worst of three runs is taken.
    for wide in (True, False, False, False):
        with use_backend(backend), torch.no_grad(), pytest.MonkeyPatch.context() as mp:
            mp.setitem(lin._CONFIG, "energy_sum_f64", wide)
            # the control sums row by row (a tile's own sum first, the shipped form, is more accurate in float32)
            mp.setitem(lin._CONFIG, "segsum_tile", wide)
            e, a = readout(x, *ws, scale, shift, species, batch, 1)
        exact = a.double().sum()
        err = abs(e.double().item() - exact.item()) / (torch.finfo(torch.float32).eps * abs(exact.item()))
        errors[wide] = max(errors[wide], err)
    assert e.dtype == torch.float32
    assert errors[True] <= 0.5, errors  # correctly rounded (in units of float32's eps relative to the sum)
    # float32 accumulation: the check would see it (more than twice its bound). Not asked of torch's CUDA index_add,
    # whose float32 sum of these 6,000 atoms landed within 0.58 eps on an H200 (stop 57,
    # benchmarks/results/stop57_gpu/f/): that shows no more than one order of atomics; the engine's own paths are the
    # other three cases.
    if not (triton_device.type == "cuda" and backend == "torch"):
        assert errors[False] > 1.0, errors


@pytest.mark.parametrize("sizes", [(6000,), (2500, 3500), (3, 700, 1, 4000, 37)])
def test_readout_tile_sums_equal_row_sums(triton_device, sizes):
    """The readout's per-structure sums with a tile's rows of one structure added as one sum per column
    (``_CONFIG["segsum_tile"]``) against one atomic per row: in float64 (the shipped sums of float32 terms) the
    same energies bit for bit, for one large structure, two, and a mix of tiles within one structure and spanning
    several; with float32 sums the tile form is the more accurate one (so the tile path ran)."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    n = sum(sizes)
    x, ws, scale, shift, species, _ = _readout_inputs(n, 1, torch.float32, triton_device, seed=11)
    shift = torch.tensor([-4.5, -1.0, -2.0], device=triton_device)
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(triton_device)
    out, err32 = {}, {}
    for tile in (True, False):
        for wide in (True, False):
            with use_backend("triton"), torch.no_grad(), pytest.MonkeyPatch.context() as mp:
                mp.setitem(lin._CONFIG, "segsum_tile", tile)
                mp.setitem(lin._CONFIG, "energy_sum_f64", wide)
                e, a = readout(x, *ws, scale, shift, species, batch, len(sizes))
            exact = torch.zeros(len(sizes), dtype=torch.float64, device=a.device).index_add_(0, batch, a.double())
            if wide:
                out[tile] = e
                assert e.dtype == torch.float64
                assert torch.allclose(e, exact, rtol=1e-15, atol=0)
            else:
                err32[tile] = ((e.double() - exact).abs() / exact.abs()).max().item()
    assert torch.equal(out[True], out[False])
    if sizes == (6000,):
        assert err32[True] < err32[False], err32


class _Ops(TorchDispatchMode):
    """Names of the aten ops that compute (not views or allocations; set_/copy_ are the interpreter's plumbing)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not view and not name.startswith(("empty", "new_empty", "set_", "copy_", "detach")):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_readout_first_order_only(triton_device):
    # float32: the Triton readout's dtype on the GPU too (float64 there keeps the torch ops, twice differentiable)
    x, ws, scale, shift, species, batch = _readout_inputs(9, 2, torch.float32, triton_device)
    with use_backend("triton"):
        energy, _ = readout(x, *ws, scale, shift, species, batch, 2)
    (g,) = torch.autograd.grad(energy.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(g.sum(), x)


def test_mlp_first_order_only(triton_device):
    gen = torch.Generator().manual_seed(1)
    x = _rand(9, 16, gen=gen, dtype=torch.float32, device=triton_device).requires_grad_(True)
    ws = [_rand(*s, gen=gen, dtype=torch.float32, device=triton_device) for s in ((16, 16), (16,), (4, 16), (4,))]
    with use_backend("triton"):
        y = mlp(x, *ws)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(g.sum(), x)


def test_mlp_dispatch_rules(triton_device, monkeypatch):
    """Torch backend, or a weight requiring grad (training), or mixed dtypes: the torch reference runs."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    calls = []
    real = lin.gemm
    monkeypatch.setattr(lin, "gemm", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    gen = torch.Generator().manual_seed(2)
    dtype = torch.float32
    x = _rand(5, 8, gen=gen, dtype=dtype, device=triton_device)
    ws = [_rand(*s, gen=gen, dtype=dtype, device=triton_device) for s in ((8, 8), (8,), (3, 8), (3,))]
    with use_backend("torch"):
        mlp(x, *ws)
    with use_backend("triton"):
        mlp(x, ws[0].clone().requires_grad_(True), *ws[1:])
        assert not gemm_fusable(x, ws[0].double(), *ws[1:])
        if triton_device.type == "cuda":
            assert not gemm_fusable(x.double(), *(w.double() for w in ws))  # float64 on the GPU: cuBLAS
    assert not calls
    with use_backend("triton"):
        mlp(x, *ws)
    assert calls  # the positive control: the Triton GEMMs do run here


def test_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="does not chain"):
        mlp(x, torch.randn(6, 7), torch.randn(6), torch.randn(2, 6), torch.randn(2))
    with pytest.raises(ValueError, match="gemm: A is"):
        gemm(x, torch.randn(3, 5))
    with pytest.raises(ValueError, match="accumulate needs out"):
        gemm(x, torch.randn(3, 8), accumulate=True)


def test_split_tf32_parts():
    """W's two parts for tf32x3 (made once per frozen weight): W_hi is W rounded to the nearest TF32 value (ties
    away from zero: 13 low mantissa bits cleared, |W - W_hi| at most half a TF32 step), W_hi + W_lo == W exactly."""
    from mlff_distiller.kernels._frozen import split_tf32

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 48, generator=gen) * torch.logspace(-20, 20, 48)
    w[0, :4] = torch.tensor([0.0, -0.0, 1.0 + 2.0**-11, -(1.0 + 2.0**-11)])  # ties: away from zero
    hi, lo = split_tf32(w)
    assert torch.equal(hi + lo, w)
    assert ((hi.view(torch.int32) & 0x1FFF) == 0).all()
    assert (lo.abs() <= hi.abs() * 2.0**-11 + 1e-45).all()
    assert hi[0, 2].item() == 1.0 + 2.0**-10 and hi[0, 3].item() == -(1.0 + 2.0**-10)
    # Rounding to nearest: the TF32 neighbour on the other side is never closer.
    step = hi.abs() * 2.0**-10
    assert (lo.abs() <= step / 2 * (1 + 2.0**-10) + 1e-45).all()


@pytest.mark.parametrize("split", [None, 0], ids=["triton-split", "w-split-once"])
@pytest.mark.parametrize("form", ["linear", "backward", "silu-prologue", "addend"])
def test_gemm_tf32x3_float32_accuracy(triton_device, monkeypatch, split, form):
    """float32 with dot="tf32x3", W split by Triton in every tile or once (``w_split_min_rows``): within 5e-7
    normwise of float64 at K = 384. On the GPU this bounds what the MMAs accumulate (the small products added to
    the running sum inside the MMAs measured 3e-6 here); the interpreter multiplies in float32 (ieee), where a part
    lost or doubled (W_lo's pointer, A's split) shows as ~2e-4."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    monkeypatch.setitem(lin._CONFIG, "w_split_min_rows", split)
    gen = torch.Generator().manual_seed(11)
    m, k, n = 300, 384, 96
    dev, f32 = triton_device, torch.float32
    a = _rand(m, k, gen=gen, dtype=f32, device=dev)
    if form == "linear":
        w, b = _rand(n, k, gen=gen, dtype=f32, device=dev, scale=k**-0.5), _rand(n, gen=gen, dtype=f32, device=dev)
        got, want = gemm(a, w, b, dot="tf32x3")[0], nnf.linear(a.double(), w.double(), b.double())
    else:
        w = _rand(k, n, gen=gen, dtype=f32, device=dev, scale=k**-0.5)
        p = _rand(m, k, gen=gen, dtype=f32, device=dev)
        d = _rand(m, n, gen=gen, dtype=f32, device=dev)
        if form == "backward":
            got, want = gemm(a, w, transpose_w=False, dot="tf32x3")[0], a.double() @ w.double()
        elif form == "silu-prologue":
            got = gemm(a, w, transpose_w=False, prologue_silu_of=p, dot="tf32x3")[0]
            want = torch.ops.aten.silu_backward(a.double(), p.double()) @ w.double()
        else:
            got = gemm(a, w, transpose_w=False, addend=d, dot="tf32x3")[0]
            want = a.double() @ w.double() + d.double()
    _close(got, want, 5e-7, f"{form}, w_split_min_rows={split}")


def test_gemm_w_split_made_once(triton_device, monkeypatch):
    """W's parts come from the frozen-weight cache: one split per weight across calls, a new one after an edit."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    monkeypatch.setitem(lin._CONFIG, "w_split_min_rows", 0)
    made = []
    frozen = importlib.import_module("mlff_distiller.kernels._frozen")
    real = frozen.split_tf32
    monkeypatch.setattr(frozen, "split_tf32", lambda w: (made.append(1), real(w))[1])
    gen = torch.Generator().manual_seed(3)
    a = _rand(40, 32, gen=gen, dtype=torch.float32, device=triton_device)
    w = _rand(16, 32, gen=gen, dtype=torch.float32, device=triton_device)
    first = gemm(a, w, dot="tf32x3")[0].clone()
    gemm(a, w, dot="tf32x3")
    assert len(made) == 1
    with torch.no_grad():
        w.mul_(2.0)
    again = gemm(a, w, dot="tf32x3")[0]
    assert len(made) == 2
    _close(again, 2.0 * first, 1e-6, "after the weight's edit")
    monkeypatch.setitem(lin._CONFIG, "w_split_min_rows", 41)  # below the threshold: Triton's own split
    gemm(a, w, dot="tf32x3")
    assert len(made) == 2


@pytest.mark.parametrize("m, numel", [(1, 1), (37, 37), (37, 5), (100, 64), (3000, 1000), (0, 0)])
def test_gemm_zeroes_a_tensor_on_the_side(triton_device, m, numel):
    """gemm's ``zero``: its entries (at most M, any M against the row tiles) all set to 0 by the kernel, the product
    unchanged; more entries than rows, or a non-contiguous tensor, are refused."""
    gen = torch.Generator().manual_seed(m + numel)
    a = _rand(m, 32, gen=gen, dtype=torch.float32, device=triton_device)
    w = _rand(48, 32, gen=gen, dtype=torch.float32, device=triton_device)
    z = torch.full((numel,), float("nan"), device=triton_device)
    c, _ = gemm(a, w, zero=z)
    assert not z.any() and not torch.isnan(z).any()
    _close(c, nnf.linear(a.double(), w.double()), TOL[torch.float32], "C")
    with pytest.raises(ValueError, match="zero"):
        gemm(a, w, zero=torch.zeros(m + 1, device=triton_device))
    with pytest.raises(ValueError, match="zero"):
        gemm(a, w, zero=torch.zeros(2 * m + 2, device=triton_device)[::2])


@pytest.mark.parametrize("m, k, n", [(300, 64, 200), (5, 32, 384), (1000, 128, 130)])
def test_gemm_grid_orders_agree(triton_device, monkeypatch, m, k, n):
    """The 1-D grid with a row tile's column tiles side by side (``_CONFIG["col_fast"]``, shipped) computes what the
    2-D grid does, bit for bit, with several row and column tiles: the forward form with SiLU and the side zeroing
    (column tile 0's programs), and a backward form accumulating into its output."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    gen = torch.Generator().manual_seed(m + k + n)
    a = _rand(m, k, gen=gen, dtype=torch.float32, device=triton_device)
    w = _rand(n, k, gen=gen, dtype=torch.float32, device=triton_device)
    b = _rand(n, gen=gen, dtype=torch.float32, device=triton_device)
    g = _rand(m, n, gen=gen, dtype=torch.float32, device=triton_device)
    base = _rand(m, k, gen=gen, dtype=torch.float32, device=triton_device)
    res = {}
    for col_fast in (True, False):
        monkeypatch.setitem(lin._CONFIG, "col_fast", col_fast)
        z = torch.full((m,), float("nan"), device=triton_device)
        c, pre = gemm(a, w, b, act="silu", zero=z)
        assert not z.any() and not torch.isnan(z).any()
        acc = base.clone()
        gemm(g, w, transpose_w=False, out=acc, accumulate=True)
        res[col_fast] = (c, pre, acc)
    for x, y in zip(res[True], res[False], strict=True):
        assert torch.equal(x, y)
    _close(res[True][0], nnf.silu(nnf.linear(a.double(), w.double(), b.double())), TOL[torch.float32], "C")
    _close(res[True][2], base.double() + g.double() @ w.double(), TOL[torch.float32], "acc")


_TMA_FORMS = ["linear", "silu", "pro_silu", "pro_add", "addend", "accumulate", "zero"]


def _tma_case(form, m, k, n, device, gen, grid_w):
    """(kwargs of gemm, W, A) of one form with W as nn.Linear [N, K] (the large-M launches' layout)."""
    from mlff_distiller.kernels._frozen import round_tf32_

    a = _rand(m, k, gen=gen, dtype=torch.float32, device=device)
    w = _rand(n, k, gen=gen, dtype=torch.float32, device=device, scale=k**-0.5)
    if grid_w:
        round_tf32_(w)
    kw = {"bias": _rand(n, gen=gen, dtype=torch.float32, device=device)}
    if form == "silu":
        kw["act"] = "silu"
    elif form == "pro_silu":
        kw = {"prologue_silu_of": _rand(m, k, gen=gen, dtype=torch.float32, device=device)}
    elif form == "pro_add":
        kw["prologue_add"] = _rand(m, k, gen=gen, dtype=torch.float32, device=device)
    elif form == "addend":
        kw = {"addend": _rand(m, n, gen=gen, dtype=torch.float32, device=device)}
    elif form == "accumulate":
        kw = {"out": _rand(m, n, gen=gen, dtype=torch.float32, device=device), "accumulate": True}
    elif form == "zero":
        kw["zero"] = torch.full((m // 2 + 1,), float("nan"), device=device)
    return kw, w, a


def _tma_reference(form, a, w, kw):
    x = a.double()
    if form == "pro_silu":
        p = kw["prologue_silu_of"].double()
        x = x * torch.sigmoid(p) * (1 + p * (1 - torch.sigmoid(p)))
    elif form == "pro_add":
        x = x + kw["prologue_add"].double()
    c = x @ w.double().T
    if "bias" in kw:
        c = c + kw["bias"].double()
    if form == "silu":
        c = nnf.silu(c)
    if form == "addend":
        c = c + kw["addend"].double()
    return c


@pytest.mark.parametrize("form", _TMA_FORMS)
def test_gemm_tma_kernel_on_the_interpreter(triton_device, form):
    """The large-M launch through tensor descriptors (``_gemm_tma_kernel``, CUDA only in the engine) run by the
    interpreter on CPU tensors: every form it takes (bias, SiLU with its pre-activation, the SiLU' and add
    prologues, an addend, accumulating into the output, the side zeroing) against float64, with rows and columns
    that do not fill the last tiles (the descriptors' zero fill and clipped stores)."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's case; on CUDA test_gemm_tma_equals_pointer_path_on_cuda runs the kernel")
    if lin._TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    m, k, n = 150, 64, 96
    gen = torch.Generator().manual_seed(7)
    kw, w, a = _tma_case(form, m, k, n, torch.device("cpu"), gen, grid_w=False)
    before = kw["out"].clone() if form == "accumulate" else None
    out = kw.get("out", torch.empty(m, n))
    pre = torch.empty(m, n) if form == "silu" else None
    aux = kw.get("prologue_silu_of", kw.get("prologue_add"))
    pro = 1 if form == "pro_silu" else (2 if form == "pro_add" else 0)
    addend = kw.get("addend", out if form == "accumulate" else None)
    c, p = lin._launch_tma(
        a, w, w, kw.get("bias"), aux, out, pre, addend, kw.get("zero"), m, n, k, kw.get("act", "none"), pro,
        64, 32, 32, 4, "ieee",
    )  # fmt: skip
    expect = _tma_reference(form, a, w, kw)
    if form == "accumulate":
        expect = expect + before.double()
    _close(c, expect, 1e-6, form)
    if form == "silu":
        _close(p, _tma_reference("linear", a, w, kw), 1e-6, "pre")
    if form == "zero":
        assert not kw["zero"].any() and not torch.isnan(kw["zero"]).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", _TMA_FORMS)
@pytest.mark.parametrize("m, grid_w", [(3001, True), (5003, False), (2049, True)])
def test_gemm_tma_equals_pointer_path_on_cuda(monkeypatch, form, m, grid_w):
    """On a Hopper GPU the large-M launches take the tensor-descriptor kernel (a spy counts it), with the same
    bits as the element-wise kernel (``_CONFIG["tma"]`` off) for every form, with W on the TF32 grid (two MMAs) and
    off it (tf32x3 with W's parts made once), both within float32 accuracy of float64."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9 or lin._TensorDescriptor is None:
        pytest.skip("the descriptor path needs sm90+ and Triton's host-side descriptors")
    k, n = 128, 384
    res, calls = {}, []
    real = lin._launch_tma
    monkeypatch.setattr(lin, "_launch_tma", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 0)  # eager calls here: the descriptors at any size
    for tma in (True, False):
        monkeypatch.setitem(lin._CONFIG, "tma", tma)
        calls.clear()
        kw, w, a = _tma_case(form, m, k, n, dev, torch.Generator().manual_seed(m + len(form)), grid_w)
        before = kw["out"].clone() if form == "accumulate" else None
        c, pre = gemm(a, w, dot="tf32x3", **kw)
        assert len(calls) == (1 if tma else 0)
        res[tma] = (c.clone(), None if pre is None else pre.clone())
        expect = _tma_reference(form, a, w, kw) + (before.double() if form == "accumulate" else 0)
        _close(c, expect, 1e-6, f"{form} tma={tma}")
        if form == "zero":
            assert not kw["zero"].any() and not torch.isnan(kw["zero"]).any()
    assert torch.equal(res[True][0], res[False][0])
    if res[True][1] is not None:
        assert torch.equal(res[True][1], res[False][1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gemm_tma_declines_unaligned_operands():
    """An operand the copy engine cannot take (rows not 16-byte aligned: K = 130) keeps the element-wise kernel,
    with the right product."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    a = _rand(3000, 130, gen=gen, dtype=torch.float32, device=dev)
    w = _rand(64, 130, gen=gen, dtype=torch.float32, device=dev)
    assert not lin._tma_ok(a, w)
    c, _ = gemm(a, w)
    _close(c, a.double() @ w.double().T, 1e-6, "C")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gemm_tma_eager_only_from_its_row_threshold(monkeypatch):
    """Eager calls take the descriptor launch only from ``tma_eager_min_rows`` rows on (their host cost per call);
    inside a CUDA-graph capture every large-M launch takes it, and the replay equals the eager result."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9 or lin._TensorDescriptor is None:
        pytest.skip("the descriptor path needs sm90+ and Triton's host-side descriptors")
    calls = []
    real = lin._launch_tma
    monkeypatch.setattr(lin, "_launch_tma", lambda *args, **kw: calls.append(args[9]) or real(*args, **kw))
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 4000)
    gen = torch.Generator().manual_seed(5)
    w = _rand(256, 128, gen=gen, dtype=torch.float32, device=dev)
    small, large = (_rand(m, 128, gen=gen, dtype=torch.float32, device=dev) for m in (3001, 4001))
    eager_small = gemm(small, w, act="silu")[0].clone()
    gemm(large, w)
    assert calls == [4001]
    out = torch.empty(3001, 256, device=dev)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm(small, w, act="silu", out=out)  # warm-up outside the capture (eager: no descriptors)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(small, w, act="silu", out=out)
    assert calls == [4001, 3001]
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_small)


def _same_bits_under_switch(monkeypatch, form, m, tma, key, dot, kernel_dots, tol):
    """gemm on CUDA with ``linear._CONFIG[key]`` True and False: the launch's kernel dot (a spy on both launches)
    is ``kernel_dots[value]``, the results have the same bits, and each is within ``tol`` of float64."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    dev = torch.device("cuda")
    monkeypatch.setitem(lin._CONFIG, "tma", tma)
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 0)
    dots = []
    real_kernel, real_tma = lin._gemm_kernel, lin._launch_tma

    class _Spy:  # records the element-wise launch's DOT
        def __getitem__(self, grid):
            return lambda *args, **kw: dots.append(kw["DOT"]) or real_kernel[grid](*args, **kw)

    monkeypatch.setattr(lin, "_gemm_kernel", _Spy())
    monkeypatch.setattr(lin, "_launch_tma", lambda *args, **kw: dots.append(args[-1]) or real_tma(*args, **kw))
    res = {}
    for value in (True, False):
        monkeypatch.setitem(lin._CONFIG, key, value)
        dots.clear()
        kw, w, a = _tma_case(form, m, 128, 384, dev, torch.Generator().manual_seed(m + len(form)), True)
        before = kw["out"].clone() if form == "accumulate" else None
        c, pre = gemm(a, w, dot=dot, **kw)
        assert dots == [kernel_dots[value]]
        res[value] = (c.clone(), None if pre is None else pre.clone())
        expect = _tma_reference(form, a, w, kw) + (before.double() if form == "accumulate" else 0)
        _close(c, expect, tol, f"{form} {key}={value}")
    assert torch.equal(res[True][0], res[False][0])
    if res[True][1] is not None:
        assert torch.equal(res[True][1], res[False][1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", _TMA_FORMS)
@pytest.mark.parametrize("m", [40, 3001])
@pytest.mark.parametrize("tma", [True, False])
def test_gemm_nan_guard_changes_no_bits_on_cuda(monkeypatch, form, m, tma):
    """``nan_guard`` False: the two-MMA launches (W on the TF32 grid) take dot_fin, without dot_w's NaN guard (the
    kernel dot "tf32x2f"); the same bits as with the guard for every form, small and large M, element-wise and
    descriptor launches, within float32 accuracy of float64."""
    _same_bits_under_switch(monkeypatch, form, m, tma, "nan_guard", "tf32x3", {True: "tf32x2w", False: "tf32x2f"}, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", _TMA_FORMS)
@pytest.mark.parametrize("m", [40, 3001])
@pytest.mark.parametrize("tma", [True, False])
def test_gemm_tf32_with_w_on_the_grid_rounds_a_alone_on_cuda(monkeypatch, form, m, tma):
    """``w_exact_tf32``: a "tf32" launch (the engine's tf32 precision) with W on the TF32 grid takes "tf32w" (A
    alone rounded to nearest); the same bits as "tf32", which rounds W too and leaves it unchanged, within TF32's
    accuracy of float64."""
    _same_bits_under_switch(monkeypatch, form, m, tma, "w_exact_tf32", "tf32", {True: "tf32w", False: "tf32"}, 2e-3)


def _norm_case(m, f, n, dtype, device, gen, with_d):
    """S, D (or None), U [3M, 2F] and a weight [N, 2F], bias: the update block's first mixing GEMM."""
    s = _rand(m, f, gen=gen, dtype=dtype, device=device)
    d = _rand(m, f, gen=gen, dtype=dtype, device=device) if with_d else None
    u = _rand(3 * m, 2 * f, gen=gen, dtype=dtype, device=device)
    w = _rand(n, 2 * f, gen=gen, dtype=dtype, device=device, scale=(2 * f) ** -0.5)
    b = _rand(n, gen=gen, dtype=dtype, device=device)
    return s, d, u, w, b


def _norm_reference(s, d, u, w, b):
    m, f = s.shape
    vv = u.double().view(m, 3, 2 * f)[:, :, f:]
    x = s.double() if d is None else s.double() + d.double()
    x = torch.cat([x, torch.sqrt((vv * vv).sum(dim=1) + 1e-8)], dim=1)
    return x @ w.double().T + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_d", [False, True], ids=["s", "s+ds"])
@pytest.mark.parametrize("m, f, n", [(1, 8, 16), (37, 20, 24), (130, 64, 128)])
def test_gemm_norm_prologue(triton_device, dtype, with_d, m, f, n):
    """``prologue_norm = (S, D, U)``: A = [S + D | sqrt(Σ_k vv_k² + 1e-8)] made in the load from the update block's
    [uv | vv] rows (F not a power of two, a K step across both halves under the interpreter), with SiLU and its
    pre-activation, against float64."""
    gen = torch.Generator().manual_seed(m + f + with_d)
    s, d, u, w, b = _norm_case(m, f, n, dtype, triton_device, gen, with_d)
    with use_backend("triton"):
        if not gemm_fusable(s, w, b):
            pytest.skip("float64 on the GPU: no Triton GEMM")
        h, pre = gemm(None, w, b, act="silu", prologue_norm=(s, d, u))
    ref = _norm_reference(s, d, u, w, b)
    _close(pre, ref, TOL[dtype], "pre")
    _close(h, nnf.silu(ref), TOL[dtype], "silu")


def test_gemm_norm_prologue_rejects_bad_operands():
    """A given with the norm prologue, U of the wrong shape, D not S's shape, or another prologue beside it."""
    gen = torch.Generator().manual_seed(3)
    s, d, u, w, b = _norm_case(6, 8, 16, torch.float32, torch.device("cpu"), gen, True)
    with pytest.raises(ValueError, match="pass A as None"):
        gemm(s, w, b, prologue_norm=(s, d, u))
    with pytest.raises(ValueError, match="prologue_norm wants"):
        gemm(None, w, b, prologue_norm=(s, d, u[:-3]))
    with pytest.raises(ValueError, match="D must be"):
        gemm(None, w, b, prologue_norm=(s, d[:-1], u))
    with pytest.raises(ValueError, match="one prologue"):
        gemm(None, w, b, prologue_norm=(s, d, u), prologue_add=s)


@pytest.mark.parametrize("with_d", [False, True], ids=["s", "s+ds"])
def test_gemm_tma_norm_prologue_on_the_interpreter(triton_device, with_d):
    """The descriptor kernel's norm prologue (S, D through their descriptors, the vv halves through U viewed
    [M, 6F]) on the interpreter, with rows that leave the last tile partial, against float64."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's case; on CUDA test_gemm_norm_prologue_equals_the_norm_kernel_on_cuda")
    if lin._TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    m, f, n = 150, 64, 96
    gen = torch.Generator().manual_seed(17 + with_d)
    s, d, u, w, b = _norm_case(m, f, n, torch.float32, torch.device("cpu"), gen, with_d)
    out, pre = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))
    c, p = lin._launch_tma(
        s, w, w, b, d if with_d else s, out, pre, None, None, m, n, 2 * f, "silu", lin._PRO_NORM, 64, 32, 32, 4,
        "ieee", u=u, norm_d=with_d,
    )  # fmt: skip
    ref = _norm_reference(s, d, u, w, b)
    _close(p, ref, 1e-6, "pre")
    _close(c, nnf.silu(ref), 1e-6, "silu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [700, 3001, 22000])
@pytest.mark.parametrize("with_d", [False, True], ids=["s", "s+ds"])
def test_gemm_norm_prologue_equals_the_norm_kernel_on_cuda(monkeypatch, m, with_d):
    """On the GPU (small tiles at 700 rows, the descriptors above) the norm prologue gives the bits of the update
    block's norm kernel followed by the plain GEMM, with the weight on the TF32 grid (two MMAs)."""
    import importlib

    from mlff_distiller.kernels._frozen import round_tf32_

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    pu = importlib.import_module("mlff_distiller.kernels.painn_update")
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 0)
    dev = torch.device("cuda")
    f, n = 128, 128
    gen = torch.Generator().manual_seed(m + with_d)
    s, d, u, w, b = _norm_case(m, f, n, torch.float32, dev, gen, with_d)
    round_tf32_(w)
    h, pre = gemm(None, w, b, act="silu", prologue_norm=(s, d, u), dot="tf32x3")
    x = torch.empty(m, 2 * f, device=dev)
    pu._launch(pu._painn_update_norm_kernel, s, m, f, s, d if with_d else s, u, x, HAS_DS=with_d)
    h_ref, pre_ref = gemm(x, w, b, act="silu", dot="tf32x3")
    assert torch.equal(pre, pre_ref)
    assert torch.equal(h, h_ref)
    _close(pre, _norm_reference(s, d, u, w, b), 1e-6, "pre")
