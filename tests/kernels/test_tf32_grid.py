"""Weights on the TF32 grid: two TF32 MMAs for every weight dot under tf32x3 (``_frozen.tf32_exact``, "tf32x2w").

With every entry of W a TF32 value, tf32x3's product ``A_hi W_lo`` is an exact zero, so ``A_hi W + A_lo W`` (two
MMAs, A split in registers) gives the float32-accurate sums of its three. The Triton interpreter multiplies in
float32 whatever the dot's precision, so here a dropped part (``A_lo W``) shows as a 2^-11 relative error, and the
path taken is checked by spying on the dots' mode; CUDA compares the two forms' results on the tensor cores.
"""

import importlib

import pytest
import torch
from mlff_distiller.kernels import message_passing, message_passing_reference, use_backend
from mlff_distiller.kernels._frozen import round_tf32_, split_tf32, tf32_exact
from mlff_distiller.kernels._triton_utils import HAS_TRITON, dot_fin, dot_w, round_tf32, tf32_hi, tl, triton
from mlff_distiller.kernels.linear import gemm

lin = importlib.import_module("mlff_distiller.kernels.linear")
gemm_kernels = importlib.import_module("mlff_distiller.kernels._gemm_kernels")
mp_module = importlib.import_module("mlff_distiller.kernels.message_passing")
mp_config = importlib.import_module("mlff_distiller.kernels._mp_config")


def _rand(*shape, seed=0, scale=1.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=torch.float32)


def _rel(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def test_tf32_exact_answers_per_version():
    """Random float32 weights are not on the grid; rounded ones are (W_lo of split_tf32 is zero); an in-place edit
    is seen (the version counter), so is a new tensor's data; a weight that requires grad, a float64 one and an
    inference tensor get False without a look; a view of an exact weight is exact."""
    w = _rand(64, 32, seed=1)
    assert not tf32_exact(w)
    round_tf32_(w)
    assert tf32_exact(w) and torch.equal(split_tf32(w)[1], torch.zeros_like(w))
    assert tf32_exact(w[3:9]) and tf32_exact(w.t())
    with torch.no_grad():
        w[0, 0] += 1e-3
    assert not tf32_exact(w)
    round_tf32_(w)
    assert tf32_exact(w)
    assert not tf32_exact(w.clone().requires_grad_(True))
    assert not tf32_exact(w.double())
    with torch.inference_mode():
        inf = round_tf32_(_rand(8, 8, seed=2))
    assert not tf32_exact(inf)
    zero = torch.zeros(4, 4)
    assert tf32_exact(zero)


def test_round_tf32_is_split_tf32s_high_part():
    """``round_tf32_`` in place equals W_hi of split_tf32 (nearest TF32, ties away from zero), is idempotent, and
    leaves other dtypes alone."""
    w = _rand(50, 70, seed=3, scale=10.0)
    hi = split_tf32(w)[0]
    assert torch.equal(round_tf32_(w.clone()), hi)
    assert torch.equal(round_tf32_(hi.clone()), hi)
    d = w.double()
    assert torch.equal(round_tf32_(d.clone()), d)


def _grid_graph(n, per_atom, device, seed, f=128, r=20):
    """x, v, rbf, a filter weight on the TF32 grid, unit vectors and a receiver-sorted edge index of ``n`` atoms with
    ``per_atom`` random edges each, float32 on ``device`` (drawn in float64 from one seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    e = n * per_atom

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=torch.float32)

    x, v, rbf = rand(n, 3 * f), rand(n, 3, f), rand(e, r)
    w = round_tf32_(rand(3 * f, r) / r**0.5)
    unit = torch.nn.functional.normalize(rand(e, 3), dim=-1)
    ei = torch.randint(0, n, (2, e), generator=gen).to(device)
    return x, v, rbf, w, unit, ei[:, torch.argsort(ei[0], stable=True)]


@pytest.fixture
def dot_modes(monkeypatch):
    """The ``DOT`` of every ``dot_w`` the GEMM kernel calls (the interpreter runs it as Python, with the globals of
    the module that defines it)."""
    seen = []
    real = gemm_kernels.dot_w

    def spy(a, b, b_lo, DOT):
        seen.append(str(DOT))
        return real(a, b, b_lo, DOT)

    monkeypatch.setattr(gemm_kernels, "dot_w", spy)
    return seen


# (rows, form): Triton's own split below w_split_min_rows, W split once above (the untransposed forms of more than
# untransposed_max_rows rows run torch's product off the GPU)
CASES = [(40, "linear"), (3000, "linear"), (40, "backward"), (40, "silu-prologue")]


@pytest.mark.parametrize("m, form", CASES)
def test_gemm_on_the_grid_takes_two_mmas_at_float32_accuracy(dot_modes, m, form):
    """gemm(dot="tf32x3") with W on the grid: the kernel's dots are "tf32x2w" and the result is within 5e-7 of
    float64 (a lost A_lo W shows as ~2e-4); off the grid, or with the switch off, the three-MMA forms run."""
    k, n = 128, 96
    a = _rand(m, k, seed=m)
    if form == "linear":
        w = round_tf32_(_rand(n, k, seed=5, scale=k**-0.5))
        got, want = gemm(a, w, dot="tf32x3")[0], a.double() @ w.double().t()
    else:
        w = round_tf32_(_rand(k, n, seed=6, scale=k**-0.5))
        if form == "backward":
            got, want = gemm(a, w, transpose_w=False, dot="tf32x3")[0], a.double() @ w.double()
        else:
            p = _rand(m, k, seed=7)
            got = gemm(a, w, transpose_w=False, prologue_silu_of=p, dot="tf32x3")[0]
            want = torch.ops.aten.silu_backward(a.double(), p.double()) @ w.double()
    assert dot_modes and set(dot_modes) == {"tf32x2w"}
    assert _rel(got, want) < 5e-7
    dot_modes.clear()
    with torch.no_grad():
        w.add_(1e-4)  # off the grid (an edit: the version moves)
    gemm(a, w, dot="tf32x3") if form == "linear" else gemm(a, w, transpose_w=False, dot="tf32x3")
    assert "tf32x2w" not in dot_modes
    dot_modes.clear()
    round_tf32_(w)
    lin._CONFIG["w_exact_two_mmas"], saved = False, lin._CONFIG["w_exact_two_mmas"]
    try:
        gemm(a, w, dot="tf32x3") if form == "linear" else gemm(a, w, transpose_w=False, dot="tf32x3")
    finally:
        lin._CONFIG["w_exact_two_mmas"] = saved
    assert "tf32x2w" not in dot_modes


def test_gemm_other_dots_ignore_the_grid(dot_modes):
    """Only tf32x3 turns into two MMAs: "ieee" (the interpreter's default) stays as it is (so do the reduced
    modes, whose roundings the interpreter cannot run)."""
    a, w = _rand(64, 64, seed=8), round_tf32_(_rand(32, 64, seed=9))
    gemm(a, w)
    assert "tf32x2w" not in dot_modes  # (its dots go through dot_rn: none is recorded unless the grid's form ran)


@pytest.fixture
def tf32x3_on_cpu(monkeypatch):
    """The message-passing kernels launched with tf32x3 dots under the interpreter (the CPU's config is "ieee"),
    and the DOT_PRECISION of each launch recorded."""
    real = mp_config._launch_config_for

    def as_cuda(device_type, dtype, kernel, *rest):
        c, warps, variant = real(device_type, dtype, kernel, *rest)
        if dtype == torch.float32:  # (SEG_SPLIT stays off, as the CPU's config has it)
            c = {**c, "DOT_PRECISION": "tf32x3"}
        return c, warps, variant

    monkeypatch.setattr(mp_config, "_launch_config_for", as_cuda)
    return _spy_dot_precisions(monkeypatch)


def _spy_dot_precisions(monkeypatch) -> dict:
    """``{kernel: {DOT_PRECISION, ...}}`` of every message-passing launch configured from here on."""
    seen = {}
    real_cfg = mp_module._launch_config

    def spy(ref, kernel, *args, **kw):
        out = real_cfg(ref, kernel, *args, **kw)
        seen.setdefault(kernel, set()).add(out[0]["DOT_PRECISION"])
        return out

    monkeypatch.setattr(mp_module, "_launch_config", spy)
    return seen


@pytest.mark.parametrize("variant", ["atom", "block"])
@pytest.mark.parametrize("on_grid", [True, False])
def test_message_passing_on_the_grid_takes_two_mmas(tf32x3_on_cpu, variant, on_grid):
    """A frozen filter weight on the grid: the forward, sender and edge kernels run "tf32x2w" (the filter-gradient
    kernel, whose dots multiply by rbf, keeps tf32x3), and ds, dv and the gradients wrt x, v, rbf and the unit
    vectors are within float32's bound of float64 (a lost A_lo W shows as ~1e-4); off the grid, tf32x3."""
    gen = torch.Generator().manual_seed(21)
    n, e, f, r = 40, 400, 32, 20

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float()

    x, v, rbf = rand(n, 3 * f), rand(n, 3, f), rand(e, r)
    w = rand(3 * f, r) / r**0.5
    if on_grid:
        round_tf32_(w)
    unit = torch.nn.functional.normalize(rand(e, 3), dim=-1)
    ei = torch.randint(0, n, (2, e), generator=gen)
    ei = ei[:, torch.argsort(ei[0], stable=True)]
    ins = [t.clone().requires_grad_(True) for t in (x, v, rbf, unit)]
    with mp_module._configured(fwd_variant=variant, bwd_sender_variant=variant, block_min_atoms=0):
        with use_backend("triton"):
            ds, dv = message_passing(ins[0], ins[1], ins[2], w, ins[3], ei)
        gs, gv = torch.randn(ds.shape, generator=gen).float(), torch.randn(dv.shape, generator=gen).float()
        grads = torch.autograd.grad((ds, dv), ins, (gs, gv))
    want = "tf32x2w" if on_grid else "tf32x3"
    assert tf32x3_on_cpu["fwd"] == {want} and tf32x3_on_cpu["bwd_sender"] == {want}
    assert tf32x3_on_cpu["bwd_edge"] == {want}
    ref = [t.double() for t in (x, v, rbf, w, unit)]
    r_s, r_v = message_passing_reference(*ref, ei)
    assert _rel(ds, r_s) < 1e-6 and _rel(dv, r_v) < 1e-6
    ins64 = [t.clone().requires_grad_(True) for t in (ref[0], ref[1], ref[2], ref[4])]
    s64, v64 = message_passing_reference(ins64[0], ins64[1], ins64[2], ref[3], ins64[3], ei)
    want_grads = torch.autograd.grad((s64, v64), ins64, (gs.double(), gv.double()))
    for name, g, g64 in zip(("x", "v", "rbf", "unit"), grads, want_grads, strict=True):
        assert _rel(g, g64) < 1e-6, name


def test_launch_config_refuses_a_weight_for_the_filter_gradient_kernel():
    """Only the kernels whose DOT_PRECISION dots all multiply by the weight take one (the filter-gradient kernel
    multiplies by rbf: "tf32x2w" there would drop a real product)."""
    x = torch.zeros(4, 24)
    with pytest.raises(ValueError, match="bwd_filter"):
        mp_module._launch_config(x, "bwd_filter", 8, 4, weight=torch.zeros(24, 4))


@pytest.mark.gpu
def test_two_mmas_equal_three_on_cuda():
    """On the tensor cores (which drop each operand's low 13 bits): with W on the grid the GEMM's and the message
    passing's two-MMA results equal the three-MMA ones to float32 rounding (the dropped product is exactly zero);
    the same switch on a weight off the grid would miss by ~1e-4, which is why it needs the check."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    a = _rand(5000, 128, seed=30, device=dev)
    w = round_tf32_(_rand(384, 128, seed=31, scale=128**-0.5, device=dev))
    want = a.double() @ w.double().t()
    two = gemm(a, w)[0]
    with_three = dict(lin._CONFIG)
    lin._CONFIG["w_exact_two_mmas"] = False
    try:
        three = gemm(a, w)[0]
    finally:
        lin._CONFIG.update(with_three)
    assert _rel(two, want) < 5e-7 and _rel(three, want) < 5e-7
    assert _rel(two, three) < 2e-7
    x, v, rbf, w, unit, ei = _grid_graph(3000, 40, dev, seed=32)
    outs = []
    for two_mmas in (True, False):
        with mp_module._configured(w_exact_two_mmas=two_mmas):
            ins = [t.clone().requires_grad_(True) for t in (x, v, rbf, unit)]
            with use_backend("triton"):
                ds, dv = message_passing(ins[0], ins[1], ins[2], w, ins[3], ei)
            gs = torch.ones_like(ds)
            gv = torch.ones_like(dv)
            outs.append([ds, dv, *torch.autograd.grad((ds, dv), ins, (gs, gv))])
    ref = message_passing_reference(*(t.double() for t in (x, v, rbf, w, unit)), ei)
    for got, want in zip(outs[0][:2], ref, strict=True):
        assert _rel(got, want) < 1e-6
    for two, three in zip(*outs, strict=True):
        assert _rel(two, three) < 1e-6


if HAS_TRITON:

    @triton.jit
    def _dot_forms_kernel(a_ptr, b_ptr, fin_ptr, guarded_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        out = rm[:, None] * N + rn[None, :]
        tl.store(fin_ptr + out, dot_fin(a, b, "tf32x2w"))
        tl.store(guarded_ptr + out, dot_w(a, b, b, "tf32x2w"))

    @triton.jit
    def _tf32_hi_forms_kernel(x_ptr, int_ptr, asm_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n)
        tl.store(int_ptr + i, tf32_hi(x), mask=i < n)
        if ASM:
            tl.store(asm_ptr + i, round_tf32(x), mask=i < n)


def _dot_forms(device):
    a = _rand(32, 32, seed=40, scale=1e3, device=device)
    a[0, :8] = torch.tensor([1e-30, -1e-38, 3.4e38, -3.4e38, 0.0, -0.0, 1.5, -2.75], device=device)
    b = round_tf32_(_rand(32, 32, seed=41, scale=1e-3, device=device))
    fin, guarded = torch.empty(32, 32, device=device), torch.empty(32, 32, device=device)
    _dot_forms_kernel[(1,)](a, b, fin, guarded, M=32, N=32, K=32)
    return a, b, fin, guarded


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_dot_fin_is_the_guarded_two_mma_dot_for_finite_operands(triton_device):
    """``dot_fin`` (the message kernels' weight dots since stop 61) is ``dot_w``'s "tf32x2w" without the NaN
    guard: the same bits for finite A (large, tiny, signed zeros among them), within float32's bound of float64."""
    a, b, fin, guarded = _dot_forms(triton_device)
    assert torch.equal(fin, guarded)
    want = a.double() @ b.double()
    assert torch.isfinite(fin).all() and _rel(fin[1:], want[1:]) < 1e-6


@pytest.mark.gpu
def test_tf32_hi_has_the_bits_of_cvt_rna_on_cuda():
    """The segment sums' high part in integer ops (``tf32_hi``, stop 61) equals ``cvt.rna.tf32.f32``
    (``round_tf32``) bit for bit: random magnitudes, ties, the largest finite values (which round to inf),
    denormals, signed zeros and infinities."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    x = torch.cat(
        [
            _rand(100_000, seed=42, scale=1e4),
            torch.tensor([3.4028235e38, -3.4028235e38, 1e-40, -1e-40, 0.0, -0.0, float("inf"), -float("inf")]),
            (torch.arange(-4096, 4096, dtype=torch.int32) * 4096 + 0x3F801000).view(torch.float32),  # ties
        ]
    ).to(dev)
    got_int, got_asm = torch.empty_like(x), torch.empty_like(x)
    _tf32_hi_forms_kernel[(triton.cdiv(x.numel(), 1024),)](x, got_int, got_asm, x.numel(), BLOCK=1024, ASM=True)
    assert torch.equal(got_int.view(torch.int32), got_asm.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["atom", "block"])
def test_message_passing_tf32_with_w_on_the_grid_rounds_rbf_alone_on_cuda(monkeypatch, variant):
    """``w_exact_tf32``: under TF32 dots (the engine's tf32 precision) a filter weight on the grid takes "tf32w" in the
    forward, sender and edge kernels (only the other operand rounded); ds, dv and the gradients wrt x, v, rbf and the
    unit vectors have the same bits as with "tf32", which rounds the weight too and leaves it unchanged."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    x, v, rbf, w, unit, ei = _grid_graph(2000, 30, dev, seed=33)
    seen = _spy_dot_precisions(monkeypatch)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    outs = {}
    for exact in (True, False):
        seen.clear()
        with mp_module._configured(
            w_exact_tf32=exact, fwd_variant=variant, bwd_sender_variant=variant, block_min_atoms=0
        ):
            ins = [t.clone().requires_grad_(True) for t in (x, v, rbf, unit)]
            with use_backend("triton"):
                ds, dv = message_passing(ins[0], ins[1], ins[2], w, ins[3], ei)
            gs = torch.ones_like(ds)
            gv = torch.ones_like(dv)
            outs[exact] = [ds, dv, *torch.autograd.grad((ds, dv), ins, (gs, gv))]
        want = "tf32w" if exact else "tf32"
        assert seen["fwd"] == {want} and seen["bwd_sender"] == {want} and seen["bwd_edge"] == {want}
    ref = message_passing_reference(*(t.double() for t in (x, v, rbf, w, unit)), ei)
    for got, want in zip(outs[True][:2], ref, strict=True):
        assert _rel(got, want) < 2e-3
    for a, b in zip(outs[True], outs[False], strict=True):
        assert torch.equal(a, b)
