"""Fast CPU checks of the kernel-side probes in benchmarks/ (the GEMM, SASS, message-passing, memory and launch-option
probes): each runs on a small case (the Triton interpreter where a kernel runs), reports what it measured and restores
what it patched. Split from test_probes_smoke.py at stop 85 (size)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from mlff_distiller import kernels  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_bench_gemm_floor_is_the_larger_of_bytes_and_products():
    """bench_gemm.py's floor column: bytes at the copy bandwidth or three TF32 passes at the TF32 rate."""
    import bench_gemm

    # 7,200 x 128 -> 384: 14.9 MB, 0.708 GFLOP
    assert bench_gemm._bytes("linear", 7200, 128, 384) == 4 * (7200 * 128 + 128 * 384 + 7200 * 384)
    mem = bench_gemm.floor_us("linear", 7200, 128, 384, bw_gbs=1000.0, tf32_tflops=1e6)
    assert mem == pytest.approx(14.942208, rel=1e-9)  # bytes / (1 TB/s), the products free
    tc = bench_gemm.floor_us("linear", 7200, 128, 384, bw_gbs=1e9, tf32_tflops=100.0)
    assert tc == pytest.approx(3 * 2 * 7200 * 128 * 384 / 1e8, rel=1e-9)  # 21.2 µs at 100 TFLOP/s
    # the SiLU' prologue reads P [M, K] too, an accumulation reads C
    assert bench_gemm._bytes("silu'(p)*g@W", 10, 4, 3) - bench_gemm._bytes("g@W", 10, 4, 3) == 4 * 10 * 4
    assert bench_gemm._bytes("+= g@W", 10, 4, 3) - bench_gemm._bytes("g@W", 10, 4, 3) == 4 * 10 * 3


def test_probe_kernel_order_names_our_frames(capsys):
    """``probe_kernel_order.py``: an operator's source line in this package is found among its profiler ancestors
    (the Python calls with_stack records as events); without CUDA the probe says so and stops."""
    import probe_kernel_order
    from torch.profiler import ProfilerActivity, profile

    x, v = torch.randn(5, 12), torch.zeros(5, 3, 4)
    rbf, w, unit = torch.randn(8, 6), torch.randn(12, 6), torch.randn(8, 3)
    edge_index = torch.tensor([[0, 0, 1, 1, 2, 3, 4, 4], [1, 2, 0, 3, 4, 1, 0, 2]])
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        kernels.message_passing_reference(x, v, rbf, w, unit, edge_index)
    if not any(".py(" in e.name or getattr(e, "stack", None) for e in prof.events()):
        # torch 2.11's CUDA build on a machine without a GPU records no Python events at all (stop 80)
        pytest.skip("this torch's profiler recorded no Python frames here")
    ops = [e for e in prof.events() if e.name == "aten::index_select"]
    assert ops and "message_passing.py(" in probe_kernel_order._frames(ops[0])
    assert "message_passing_reference" in probe_kernel_order._frames(ops[0])
    if not torch.cuda.is_available():
        probe_kernel_order.main([])
        assert "needs CUDA" in capsys.readouterr().out


def test_sender_reuse_counts_on_a_hand_graph_and_a_small_box(tmp_path):
    """probe_sender_reuse.py: its block counts on a graph small enough to count by hand, then a smoke run."""
    import probe_sender_reuse

    # 4 atoms, blocks of 2 receivers: block 0 (atoms 0, 1) has edges 0<-1, 0<-2, 1<-0, 1<-2 (senders {0, 1, 2}),
    # block 1 (atoms 2, 3) has 2<-0, 3<-0 (sender {0}).
    i = np.array([0, 0, 1, 1, 2, 3])
    j = np.array([1, 2, 0, 2, 0, 0])
    st = probe_sender_reuse.block_stats(i, j, n_atoms=4, ba=2, bs=2)
    assert st["edges"] == 3 and st["senders"] == 2  # (4 + 2) / 2 blocks, (3 + 1) / 2
    assert st["reuse"] == pytest.approx(6 / 4) and st["density"] == pytest.approx(6 / (2 * 4))
    assert st["tiles"] == pytest.approx(1.5) and st["tile_density"] == pytest.approx(6 / (2 * 2 * 3))
    probe_sender_reuse.main(["--out", str(tmp_path), "--name", "t", "--sizes", "96", "--blocks", "8"])
    rows = [r for r in (tmp_path / "t.md").read_text().splitlines() if r.startswith("| 96 ")]
    assert len(rows) == 2 and all(float(r.split("|")[6]) >= 1.0 for r in rows)  # reuse >= 1 in both orders


def test_cluster_edge_probe_kernel_equals_the_reference_backward():
    """probe_cluster_edge.py's cluster-pair edge kernel (Triton interpreter, float64): ∂rbf and ∂u equal
    ``message_passing_backward_reference`` for several block and sender-tile sizes, every edge in exactly one
    (block, tile); a graph with a repeated (receiver, sender) pair is refused."""
    import importlib

    import probe_cluster_edge

    mp = importlib.import_module("mlff_distiller.kernels.message_passing")
    gen = torch.Generator().manual_seed(0)
    n, e, f, r = 21, 150, 32, 5
    key = torch.randperm(n * n, generator=gen)[:e]
    ei = torch.stack([key // n, key % n])
    ei = ei[:, torch.argsort(ei[0], stable=True)]

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, v, rbf, w = rand(n, 3 * f), rand(n, 3, f), rand(e, r), rand(3 * f, r)
    unit = torch.nn.functional.normalize(rand(e, 3), dim=1)
    gs, gv = rand(n, f), rand(n, 3, f)
    ref = mp.message_passing_backward_reference(gs, gv, x, v, rbf, w, unit, ei)
    for ba, bs in ((4, 4), (8, 2), (2, 8)):
        pairs = probe_cluster_edge.cluster_pairs(ei, n, ba, bs)
        placed = pairs["pair_edge"][pairs["pair_edge"] >= 0]
        assert torch.equal(torch.sort(placed.long()).values, torch.arange(e))  # each edge exactly once
        g_rbf, g_unit = probe_cluster_edge.cluster_edge_grads(gs, gv, x, v, rbf, w, unit, pairs, block_f=16)
        torch.testing.assert_close(g_rbf, ref[2], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g_unit, ref[4], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="twice"):
        probe_cluster_edge.cluster_pairs(torch.tensor([[0, 0], [1, 1]]), 2, 2, 2)


def test_memory_peak_replay_and_sites():
    """probe_memory_peak.py: the trace replay finds the peak and the blocks live at it (a block freed before the
    peak is not counted; one freed after is), and attributes each block to the innermost frame in our code."""
    import probe_memory_peak as pm

    ours = {"filename": "/x/src/mlff_distiller/engine.py", "line": 7, "name": "compute"}
    kern = {"filename": "/x/kernels/message_passing.py", "line": 3, "name": "bwd"}
    torch_fr = {"filename": "/usr/lib/torch/autograd/__init__.py", "line": 1, "name": "grad"}
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [torch_fr, ours]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [kern, ours]},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 120, "frames": [kern, ours]},  # peak: 2 + 3 = 170
        {"action": "free_completed", "addr": 3, "size": 120},
        {"action": "alloc", "addr": 4, "size": 60, "frames": [torch_fr]},
    ]
    peak, blocks = pm.peak_of_trace(events)
    assert peak == 170 and sorted(b["addr"] for b in blocks) == [2, 3]
    sites = pm.by_site(blocks)
    assert sites == [("kernels/message_passing.py:3 bwd", 170, 2, 120)]
    assert pm.site_of([torch_fr, ours]) == "engine.py:7 compute"
    assert pm.site_of([torch_fr]) == "(outside our code)"
    # free_requested stands in only for a trace without any free_completed
    peak2, _ = pm.peak_of_trace([*[e for e in events if e["action"] != "free_completed"][:3], events[4]])
    assert peak2 == 170
    assert pm.main(["--atoms", "24"]) == 0  # without CUDA: one line, no error


def test_probe_ncu_variants_patch_each_switch_and_restore_it():
    """probe_ncu's variant specs: each prefix patches its module's switch inside the context and restores it, and
    ``+`` joins several into one variant; an unknown key or prefix is an error."""
    import importlib

    import probe_ncu

    k = "mlff_distiller.kernels."
    switches = {
        "edge:zero_in_forward=0": (importlib.import_module(k + "edge_features")._OPTIONS, "zero_in_forward"),
        "moments:into_sink=0": (importlib.import_module(k + "species_moments")._CONFIG, "into_sink"),
        "gemm:readout_zero_in_gemm=0": (importlib.import_module(k + "linear")._CONFIG, "readout_zero_in_gemm"),
    }
    got = probe_ncu.variants(";".join(switches))
    assert [label for label, _ in got] == list(switches)
    for (label, ctx), (config, key) in zip(got, switches.values(), strict=True):
        before = config[key]
        with ctx():
            assert before and not config[key], label  # each ships on; the variant turns it off
        assert config[key] == before
    ((label, ctx),) = probe_ncu.variants("edge:zero_in_forward=0+moments:into_sink=0")
    joined = [switches["edge:zero_in_forward=0"], switches["moments:into_sink=0"]]
    with ctx():
        assert not any(config[key] for config, key in joined), label
    assert all(config[key] for config, key in joined)
    with pytest.raises(ValueError, match="unknown keys"):
        probe_ncu.variants("edge:nope=1")
    with pytest.raises(ValueError, match="want mp:"):
        probe_ncu.variants("nowhere:x=1")


def test_probe_gemm_persistent_kernel_on_the_interpreter(capsys):
    """probe_gemm_persistent.py (stop 53): its persistent kernel gives act(x Wᵀ + b) for every tiling it times, on
    the Triton interpreter (odd row counts, K 128 and 256, both epilogues); on a CPU its main says it needs CUDA."""
    import probe_gemm_persistent as probe

    if not probe.HAS_TRITON:
        pytest.skip("needs triton")
    from torch.nn import functional as nnf

    gen = torch.Generator().manual_seed(0)
    for m, k, n, act in ((77, 128, 384, "none"), (45, 256, 128, "silu")):
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen) * k**-0.5
        b = torch.randn(n, generator=gen)
        want = nnf.linear(x, w, b)
        want = nnf.silu(want) if act == "silu" else want
        for label, kw in probe.VARIANTS.items():
            got = probe.persistent_gemm(x, w, b, act, **kw)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=label)
    assert probe.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


def test_probe_gemm_tma_kernel_on_the_interpreter(capsys):
    """probe_gemm_tma.py (stop 60): its descriptor GEMM gives act(x Wᵀ + b) for every one-program-per-tile tiling
    it times and for the three launches of its --launches section (host descriptors on 1-D and 2-D grids,
    descriptors made in the kernel), on the Triton interpreter (rows and columns that leave the last tiles partial,
    K 128 and 256, both epilogues; the persistent tilings ask the GPU for its multiprocessor count); on a CPU its
    main says it needs CUDA."""
    import probe_gemm_tma as probe

    if not probe.HAS_TRITON:
        pytest.skip("needs triton")
    from mlff_distiller.kernels._frozen import round_tf32_
    from torch.nn import functional as nnf

    gen = torch.Generator().manual_seed(1)
    for m, k, n, act in ((77, 128, 384, "none"), (45, 256, 128, "silu")):
        x = torch.randn(m, k, generator=gen)
        w = round_tf32_(torch.randn(n, k, generator=gen) * k**-0.5)
        b = torch.randn(n, generator=gen)
        want = nnf.linear(x.double(), w.double(), b.double())
        want = nnf.silu(want) if act == "silu" else want
        for tile in probe.TILES:
            if tile[-1]:
                continue
            got, pre = probe.gemm_tma(x, w, b, act, tile)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=str(tile))
            if act == "silu":
                lin = nnf.linear(x.double(), w.double(), b.double())
                torch.testing.assert_close(pre.double(), lin, rtol=1e-5, atol=1e-5, msg=str(tile))
        for how in ("host", "host-2d", "device"):  # the --launches section's three launches of one tile
            got, _ = probe.gemm_variant(x, w, b, act, how, tile=(64, 32, 32, 4, 3, 0))
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=how)
    assert probe.main([]) == 0
    assert probe.main(["--launches"]) == 0
    assert "needs CUDA" in capsys.readouterr().out


def test_probe_sass_compiles_for_hopper_without_a_gpu():
    """probe_sass.py (stop 60) compiles a kernel for sm_90 with Triton's own ptxas on this machine and reads its
    registers, stack and instruction mix (a separate process: the interpreter this session runs under cannot
    compile); its --set changes a constexpr, and the GEMM's two-MMA tiles are warpgroup MMAs (HGMMA)."""
    import os
    import subprocess

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_sass.py"
    run = subprocess.run(
        [sys.executable, str(script), "--kernels", "gemm", "--set", "BN=32"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if run.returncode != 0 and "ptxas" in run.stderr:
        pytest.skip(f"no ptxas for sm_90 here: {run.stderr[-200:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| gemm |")]
    assert len(rows) == 1 and "BN=32" in rows[0], run.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    reg, stack, hgmma = int(cells[4]), int(cells[5]), int(cells[6])
    assert 32 <= reg <= 255 and stack >= 0 and hgmma > 0, rows[0]
    interp = subprocess.run(
        [sys.executable, str(script), "--kernels", "gemm"],
        capture_output=True, text=True, env={**env, "TRITON_INTERPRET": "1"}, timeout=600,
    )  # fmt: skip
    assert interp.returncode == 2 and "unset TRITON_INTERPRET" in interp.stdout


def test_probe_sass_constexprs_take_defaults_and_refuse_a_missing_one():
    """probe_sass.constexprs: a kernel's constexprs not given take their defaults (the sender's FOLD_HALF
    False when the probe does not set it, its SYM as given), and one without a default is an error, not a
    runtime argument compiling both branches."""
    pytest.importorskip("triton")
    import probe_sass
    from mlff_distiller.kernels import _mp_kernels

    const = dict(probe_sass.KERNELS["sender"][2])
    assert const.pop("FOLD_HALF") is True  # the shipped launch (sender_fold_half)
    got = probe_sass.constexprs(_mp_kernels._mp_bwd_sender_kernel, const)
    assert got["FOLD_HALF"] is False and got["SYM"] is True and got["BLOCK_E"] == 16
    del const["BLOCK_F"]
    with pytest.raises(ValueError, match="BLOCK_F"):
        probe_sass.constexprs(_mp_kernels._mp_bwd_sender_kernel, const)


def test_probe_cta_exchange_model_and_cpu_guard(capsys):
    """probe_cta_exchange.py: its float64 model of the rounds keeps the mean at 1 (bounded over any number of
    rounds) and rotates the vector; on a machine without CUDA its main says it needs CUDA (the interpreter would
    hang on programs that wait for each other)."""
    import probe_cta_exchange

    x = torch.arange(8.0).reshape(2, 4)
    one = probe_cta_exchange.reference(x, 1)
    assert torch.allclose(one[0], torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64) - 1.5 + 1.0)
    many = probe_cta_exchange.reference(torch.randn(3, 128, generator=torch.Generator().manual_seed(0)), 64)
    assert torch.allclose(many.mean(dim=1), torch.ones(3, dtype=torch.float64)) and many.abs().max() < 50
    if not torch.cuda.is_available():
        assert probe_cta_exchange.main([]) == []
        assert "needs CUDA" in capsys.readouterr().out


@pytest.mark.skipif(not kernels.triton_available("cpu"), reason="needs Triton (the interpreter on a CPU)")
def test_probe_split_dense_layer_matches_its_float64_model():
    """probe_split_dense.py: the layer equals the float64 torch model of it to float32 rounding, unsplit (S = 1, one
    launch: the exchanges are no-ops) and split over S = 2 programs an atom in its four-launch form (the exchanges as
    launch boundaries: the column blocks and the all-reduced row sums checked here; the spinning one-launch form runs
    on the GPU only, where the probe checks it against the same model). A wrong weight slice (M2's columns swapped)
    is caught; so was, by hand at stop 84, a kernel whose W1 all-reduce read one program's part only (0.70 at S = 2,
    while S = 1 still passed)."""
    import probe_split_dense as psd

    if torch.cuda.is_available():
        pytest.skip("the probe's GPU rows run on the device; this checks the interpreter's")
    lines = psd.main(["--features", "32", "--splits", "1,2", "--phased"])
    rows = [line for line in lines if line.startswith("| 32 |")]
    assert [r.split("|")[2:4] for r in rows] == [[" 1 ", " one launch "], [" 1 ", " four launches "],
                                                 [" 2 ", " four launches "]]  # fmt: skip
    assert all(float(r.split("|")[6]) < 1e-5 for r in rows), rows
    t = psd.make_inputs(12, 32, torch.device("cpu"))
    want = psd.reference(t, 12, 32)
    *got, scratch = psd.run_layer(t, 12, 32, 1)
    assert psd.max_error(got, want) < 1e-5
    *got, scratch = psd.run_layer(t, 12, 32, 1, launches=3, scratch=scratch)  # (the timed form)
    assert scratch["flags"].shape[0] == 3 and psd.max_error(got, want) < 1e-5
    *got, _ = psd.run_layer(t, 12, 32, 2, phased=True)
    assert psd.max_error(got, want) < 1e-5
    swapped = dict(t, m2=torch.cat([t["m2"][:, 32:64], t["m2"][:, :32], t["m2"][:, 64:]], 1).contiguous())
    *got, _ = psd.run_layer(swapped, 12, 32, 1)
    assert psd.max_error(got, want) > 1e-3


def test_probe_sass_dense_rows_compile_every_launch_of_the_plan(monkeypatch):
    """probe_sass --dense: one row per launch of the student's dense step (DenseStep.plan: three forwards, three
    backwards for three layers) at the warps asked for, with the engine's argument types (int64 numbers, float64
    energies). The compile itself (~1 min a launch at 128 features) is stubbed here: the GEMM's compile above checks
    compile_counts on this machine."""
    pytest.importorskip("triton")
    import probe_sass

    seen = []

    def stub(kernel, const, warps, stages, types=None):
        seen.append((kernel.fn.__name__, const["LAYER"], warps, types))
        return {"REG": 128, "STACK": 0, **dict.fromkeys(probe_sass._COUNTS, 0)}

    monkeypatch.setattr(probe_sass, "compile_counts", stub)
    rows = probe_sass.dense_rows("builtin:chno-gfn2-small", 4)
    assert len(rows) == 6 and all(r.startswith("| _dense_") for r in rows)
    fwd, bwd = "_dense_fwd_kernel", "_dense_bwd_kernel"
    assert [s[:2] for s in seen] == [(fwd, 0), (fwd, 1), (fwd, 2), (bwd, 2), (bwd, 1), (bwd, 0)]
    assert all(s[2] == 4 and s[3]["idx_ptr"] == "*i64" and s[3]["energy_ptr"] == "*fp64" for s in seen)
