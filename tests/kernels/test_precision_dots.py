"""The reduced-precision dots of the kernels (kernels/_precision.py) and the engine's bf16 / fp16 on them.

The Triton GEMMs under a 16-bit type must multiply exactly the 16-bit roundings of their float32 operands with
float32 accumulation (checked against torch on rounded operands); the autograd Functions must run their backward
with the forward's choice; the engine's bf16 / fp16 keep the fused Triton path (no 16-bit copies of the model) and
stay within the documented tolerance of fp64. On the CPU these run under the Triton interpreter, where bfloat16 is
emulated by rounding in float32 (the interpreter's own bfloat16 dot is wrong).
"""

import contextlib

import pytest
import torch
from ase.build import molecule
from helpers import assert_close_to, make_model
from mlff_distiller.kernels import gemm, mlp, painn_update, use_backend
from mlff_distiller.kernels._precision import dot_mode, float32_dot, matmul_dtype, reduced_matmul_dtype
from mlff_distiller.kernels.linear import readout

from mlff_distiller import AtomsBatch, ForceEngine
from mlff_distiller.precision import _ReducedLinear

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _rounded(x: torch.Tensor, dot: str) -> torch.Tensor:
    return x.to(LOW[dot]).float() if dot in LOW else x


@pytest.fixture(autouse=True)
def _tf32_off():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_dot_choice_follows_the_switches():
    assert float32_dot() == "tf32x3" and float32_dot("ieee") == "ieee"
    with matmul_dtype(torch.bfloat16):
        assert reduced_matmul_dtype() is torch.bfloat16
        assert float32_dot(gemm=True) == "bf16" and float32_dot() == "tf32" and float32_dot("ieee") == "ieee"
        with matmul_dtype(torch.float16):
            assert float32_dot(gemm=True) == "fp16"
        assert float32_dot(gemm=True) == "bf16"  # restored on exit
        # On the CPU (interpreter) only the GEMMs of float32 take it; float64 never does.
        assert dot_mode(torch.zeros(1), gemm=True) == "bf16" and dot_mode(torch.zeros(1)) == "ieee"
        assert dot_mode(torch.zeros(1, dtype=torch.float64), gemm=True) == "ieee"
    assert reduced_matmul_dtype() is None and dot_mode(torch.zeros(1), gemm=True) == "ieee"
    torch.backends.cuda.matmul.allow_tf32 = True
    assert float32_dot() == "tf32" and float32_dot(gemm=True) == "tf32"
    with pytest.raises(ValueError, match="16-bit"), matmul_dtype(torch.float32):
        pass


@pytest.mark.parametrize("dot", ["bf16", "fp16"])
@pytest.mark.parametrize("rows", [37, 1500])  # 1,500 > untransposed_max_rows: the interpreter's torch product
def test_gemm_16bit_is_the_product_of_rounded_operands(triton_device, dot, rows):
    g = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 64, generator=g).to(triton_device)
    w = torch.randn(48, 64, generator=g).to(triton_device)
    b = torch.randn(48, generator=g).to(triton_device)
    exact = torch.nn.functional.linear(a.double(), w.double(), b.double())
    ref = torch.nn.functional.linear(_rounded(a, dot).double(), _rounded(w, dot).double(), b.double())
    out, _ = gemm(a, w, b, dot=dot)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (out.double() - exact).abs().max() >= 1e-4 * exact.abs().max()  # it did round
    # The backward form (B = W as stored), from the engine's switch instead of the argument.
    gy = torch.randn(rows, 48, generator=g).to(triton_device)
    with matmul_dtype(LOW[dot]):
        gx, _ = gemm(gy, w, transpose_w=False)
    ref = _rounded(gy, dot).double() @ _rounded(w, dot).double()
    assert (gx.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_gemm_rejects_16bit_dots_on_float64(triton_device):
    x = torch.randn(4, 8, dtype=torch.float64, device=triton_device)
    with pytest.raises(ValueError, match="float32 operands"):
        gemm(x, torch.randn(8, 8, dtype=torch.float64, device=triton_device), dot="bf16")
    with pytest.raises(ValueError, match="not one of"):
        gemm(x, torch.randn(8, 8, dtype=torch.float64, device=triton_device), dot="int8")


def _grads_inside_and_outside(fn, *inputs):
    """Gradients of fn(*inputs) with the backward inside and outside the bf16 block (forward always inside)."""
    out = []
    for inside in (True, False):
        xs = [x.detach().clone().requires_grad_(True) for x in inputs]
        with matmul_dtype(torch.bfloat16):
            y = fn(*xs)
            if inside:
                grads = torch.autograd.grad(y, xs)
        if not inside:
            grads = torch.autograd.grad(y, xs)
        out.append((y.detach(), grads))
    return out


def test_functions_keep_the_forwards_dot_for_their_backward(triton_device):
    """The backward of the Triton MLP, readout and update multiply as their forward did, wherever they run."""
    torch.manual_seed(0)
    dev, n, f = triton_device, 40, 32
    lin = [torch.randn(o, i, device=dev) / i**0.5 for o, i in ((f, f), (3 * f, f))]
    b1, b2 = torch.randn(f, device=dev), torch.randn(3 * f, device=dev)
    x, v = torch.randn(n, f, device=dev), torch.randn(n, 3, f, device=dev)
    uw, vw = torch.randn(f, f, device=dev) / f**0.5, torch.randn(f, f, device=dev) / f**0.5
    m1, m2 = torch.randn(f, 2 * f, device=dev) / (2 * f) ** 0.5, torch.randn(3 * f, f, device=dev) / f**0.5
    r1, r2 = torch.randn(f // 2, f, device=dev) / f**0.5, torch.randn(1, f // 2, device=dev)
    species, batch = torch.arange(n, device=dev) % 3, torch.arange(n, device=dev) // 10
    scale, shift = torch.rand(3, device=dev) + 0.5, torch.randn(3, device=dev)
    cases = {
        "mlp": (lambda s: mlp(s, lin[0], b1, lin[1], b2).square().sum(), (x,)),
        "readout": (
            lambda s: readout(s, r1, b1[: f // 2], r2, b2[:1], scale, shift, species, batch, 4)[0].square().sum(),
            (x,),
        ),
        "update": (
            lambda s, vv: sum(t.square().sum() for t in painn_update(s, vv, uw, vw, m1, b1, m2, b2)),
            (x, v),
        ),
    }
    with use_backend("triton"):
        for name, (fn, inputs) in cases.items():
            (y_in, g_in), (y_out, g_out) = _grads_inside_and_outside(fn, *inputs)
            assert torch.equal(y_in, y_out), name
            for a, b in zip(g_in, g_out, strict=True):
                assert torch.equal(a, b), name
            # ... and bf16 did change the result against float32 (the switch reached the GEMMs).
            xs = [t.detach().clone().requires_grad_(True) for t in inputs]
            y32 = fn(*xs)
            assert not torch.allclose(y32.detach(), y_in, rtol=1e-5, atol=0), name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_16bit_keeps_the_triton_path(triton_device, precision):
    """The engine's bf16 / fp16 run the fused kernels with 16-bit GEMMs (on the CPU under the interpreter; on the
    GPU in the default mode, CUDA graphs): no 16-bit copy of the model, within the documented tolerance of fp64,
    and not the float32 result."""
    model = make_model(seed=3)
    batch = AtomsBatch.from_atoms([molecule("CH4"), molecule("H2O"), molecule("C2H6")])
    ref = ForceEngine(model, device=triton_device, precision="fp64").compute(batch)
    with use_backend("triton"):
        engine = ForceEngine(model, device=triton_device, precision=precision)
        assert engine.kernel_matmul_dtype is LOW[precision]
        assert not any(isinstance(m, _ReducedLinear) for m in engine.model.modules())
        out = engine.compute(batch)
        fp32 = ForceEngine(model, device=triton_device, precision="fp32").compute(batch)
    assert_close_to(out, ref, precision, 3)
    assert not torch.allclose(out["forces"], fp32["forces"], rtol=1e-5, atol=1e-6)
    # The torch kernels have no 16-bit GEMMs: the engine falls back to the 16-bit copies of the MLP layers.
    with use_backend("torch"):
        engine = ForceEngine(model, device=triton_device, precision=precision)
        assert engine.kernel_matmul_dtype is None
        assert any(isinstance(m, _ReducedLinear) for m in engine.model.modules())
        assert_close_to(engine.compute(batch), ref, precision, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the interpreter runs every dot ieee)")
@pytest.mark.parametrize("variant", ["atom", "block"])
def test_message_passing_dots_under_reduced_precision_gpu(variant):
    """Under TF32 or a 16-bit GEMM type the message passing runs one TF32 pass per dot (forward and both backward
    kernels): a result apart from strict float32 by about TF32's rounding, and equal to it with reduced_dots off."""
    import importlib

    from mlff_distiller.kernels import message_passing_reference

    mp = importlib.import_module("mlff_distiller.kernels.message_passing")

    gen = torch.Generator().manual_seed(7)
    n, e, f, r = 300, 4000, 64, 20
    x, v = torch.randn(n, 3 * f, generator=gen), torch.randn(n, 3, f, generator=gen)
    rbf, w = torch.rand(e, r, generator=gen), torch.randn(3 * f, r, generator=gen) / r**0.5
    unit = torch.nn.functional.normalize(torch.randn(e, 3, generator=gen), dim=-1)
    ei = torch.randint(0, n, (2, e), generator=gen)
    ei = ei[:, torch.argsort(ei[0], stable=True)]
    inputs = [t.cuda() for t in (x, v, rbf, w, unit)]
    exact = [o.double() for o in message_passing_reference(*[t.double() for t in inputs], ei.cuda())]

    def run(switch):
        xs = [t.clone().requires_grad_(True) for t in inputs[:2]] + [inputs[2], inputs[3], inputs[4]]
        with use_backend("triton"), mp._configured(fwd_variant=variant, bwd_sender_variant=variant), switch:
            out = mp.message_passing(*xs, ei.cuda())
            grads = torch.autograd.grad(sum(o.square().sum() for o in out), xs[:2])
        return [o.detach().double() for o in out], [g.double() for g in grads]

    def rel(a, b):
        return max(float((p - q).abs().max() / q.abs().max()) for p, q in zip(a, b, strict=True))

    strict = run(contextlib.nullcontext())
    assert rel(strict[0], exact) < 1e-5
    for switch in (_tf32(), matmul_dtype(torch.bfloat16)):
        out, grads = run(switch)
        assert 1e-5 < rel(out, exact) < 1e-2 and 1e-5 < rel(grads, strict[1]) < 1e-2
    with mp._configured(reduced_dots=False):
        out, grads = run(_tf32())
    assert rel(out, strict[0]) < 1e-6 and rel(grads, strict[1]) < 1e-6


@contextlib.contextmanager
def _tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _round_tf32_reference(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to the nearest TF32 value, ties away from zero (PTX cvt.rna.tf32.f32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (TF32 MMAs)")
def test_tf32_dots_round_to_nearest_gpu():
    """One TF32 pass rounds its operands to nearest first: no bias in a sum of positive products. The TF32 MMA alone
    truncates (~-5e-4 relative on such sums), which cost the shipped student 9 meV/atom in energy."""
    import importlib

    from mlff_distiller.kernels import message_passing_reference

    mp = importlib.import_module("mlff_distiller.kernels.message_passing")
    gen = torch.Generator().manual_seed(3)
    a, w = torch.rand(512, 256, generator=gen).cuda(), torch.rand(96, 256, generator=gen).cuda()
    exact = a.double() @ w.double().t()
    for rows in (300, 512):  # the small- and large-row tiles
        out, _ = gemm(a[:rows], w, dot="tf32")
        bias = float(((out.double() - exact[:rows]) / exact[:rows]).mean())
        assert abs(bias) < 5e-5, bias
        ref = _round_tf32_reference(a[:rows]).double() @ _round_tf32_reference(w).double().t()
        assert float(((out.double() - ref) / ref).abs().max()) < 1e-5
    # The message passing under TF32 (forward and the sender backward), on positive inputs.
    n, e, f, r = 256, 6000, 64, 20
    x, v = torch.rand(n, 3 * f, generator=gen), torch.rand(n, 3, f, generator=gen)
    rbf, fw = torch.rand(e, r, generator=gen), torch.rand(3 * f, r, generator=gen)
    unit = torch.rand(e, 3, generator=gen) + 0.1
    ei = torch.randint(0, n, (2, e), generator=gen)
    ei = ei[:, torch.argsort(ei[0], stable=True)].cuda()
    inputs = [t.cuda() for t in (x, v, rbf, fw, unit)]
    exact = message_passing_reference(*[t.double() for t in inputs], ei)
    for variant in ("atom", "block"):
        xs = [t.clone().requires_grad_(True) for t in inputs[:2]] + inputs[2:]
        with use_backend("triton"), mp._configured(fwd_variant=variant, bwd_sender_variant=variant), _tf32():
            out = mp.message_passing(*xs, ei)
            gx = torch.autograd.grad(out[0].sum() + out[1].sum(), xs[0])[0]
        for o, ex in zip(out, exact, strict=True):
            bias = float(((o.double() - ex) / ex.abs().clamp_min(1e-3)).mean())
            assert abs(bias) < 5e-5, (variant, bias)
        xs64 = [t.double().requires_grad_(True) for t in inputs[:2]] + [t.double() for t in inputs[2:]]
        out64 = message_passing_reference(*xs64, ei)
        gx64 = torch.autograd.grad(out64[0].sum() + out64[1].sum(), xs64[0])[0]
        bias = float(((gx.double() - gx64) / gx64.abs().clamp_min(1e-3)).mean())
        assert abs(bias) < 5e-5, (variant, "sender backward", bias)


def test_engine_restores_the_switches_after_each_call(triton_device):
    """The 16-bit type and the TF32 flag hold only inside the engine's calls: process-wide state, restored."""
    model = make_model(seed=5)
    batch = AtomsBatch.from_atoms([molecule("CH4")])
    torch.backends.cuda.matmul.allow_tf32 = False
    with use_backend("triton"):
        for precision in ("bf16", "fp16", "tf32"):
            ForceEngine(model, device=triton_device, precision=precision, mode="eager").compute(batch)
            assert reduced_matmul_dtype() is None and torch.backends.cuda.matmul.allow_tf32 is False, precision
