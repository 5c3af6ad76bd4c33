"""``kernels.compile_ahead``: a dry run that compiles a step's Triton kernels in parallel before its first real run
(a cold process compiled them one after another: 15-18 s to the first benzene result on the H100 host)."""

import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from mlff_distiller.kernels import _compile_ahead
from mlff_distiller.kernels._triton_utils import HAS_TRITON

from mlff_distiller import kernels

needs_compiled_triton = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available() and _compile_ahead.compile_ahead_supported()),
    reason="needs a CUDA device and a Triton with AsyncCompileMode",
)


def test_off_under_the_interpreter_and_by_the_switch(monkeypatch):
    """Where the dry run is not supported the block runs as it is: launches included, ``precompile`` a no-op."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _compile_ahead.compile_ahead_supported()
    with kernels.compile_ahead() as on:
        assert on is False and not kernels.dry_run_active()
    calls = []
    assert kernels.precompile(calls.append, 1) is False and calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("MLFF_DISTILLER_COMPILE_AHEAD", "0")
    assert not _compile_ahead.compile_ahead_supported()


def test_edge_compact_gives_valid_indices_under_a_dry_run(monkeypatch):
    """Under a dry run no compaction kernel runs; the outputs the torch ops after it index with are zeros, not
    whatever the allocator held (the stress step's virial indexes atoms with them)."""
    if not HAS_TRITON:
        pytest.skip("needs Triton")
    ec = importlib.import_module("mlff_distiller.kernels.edge_compact")  # the package attribute is the function

    monkeypatch.setattr(ec, "dry_run_active", lambda: True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (conftest)
    n, c = 5, 12
    pos = torch.randn(n, 3, dtype=torch.float64, device=dev)
    ei = torch.randint(0, n, (2, c), device=dev)
    ei = ei[:, torch.argsort(ei[0], stable=True)].contiguous()
    row_ptr = torch.searchsorted(ei[0], torch.arange(n + 1, device=dev))
    perm = torch.argsort(ei[1], stable=True)
    sptr = torch.searchsorted(ei[1][perm], torch.arange(n + 1, device=dev))
    shifts = torch.zeros(c, 3, dtype=torch.float64, device=dev)
    with kernels.use_backend("triton"):
        out = ec._edge_compact_triton(pos, ei, shifts, row_ptr, perm, sptr, 2.0, 100.0)
    for t in out:
        assert torch.count_nonzero(t) == 0


def _keep_launch(n: int, c: int, block: int):
    """A launch of one of the package's kernels (the compaction's keep flags) on fresh CUDA data, and its output,
    filled with -7 so that a launch shows. Sizes no other test uses give a specialisation not compiled yet."""
    from mlff_distiller.kernels.edge_compact import _keep_kernel

    dev = torch.device("cuda")
    pos = torch.randn(n, 3, device=dev)
    ei = torch.randint(0, n, (2, c), device=dev)
    keep = torch.full((2, c), -7, dtype=torch.int32, device=dev)
    cnt = torch.full((2, 1), -7, dtype=torch.int32, device=dev)
    args = (pos, ei, torch.zeros(c, 3, device=dev), torch.arange(c, device=dev), torch.tensor([c], device=dev))

    def launch():
        _keep_kernel[(1,)](*args, keep, cnt, c, ei.stride(0), 1, 4.0, BLOCK=block, PDL=False)

    return launch, keep


@needs_compiled_triton
@pytest.mark.gpu
def test_a_dry_run_launches_nothing_then_the_kernel_is_compiled():
    from triton.runtime.jit import JITFunction

    compiles = []
    do_compile = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiles.append((self.fn.__name__, kernels.dry_run_active()))
        return do_compile(self, *args, **kwargs)

    JITFunction._do_compile = counting
    try:
        launch, keep = _keep_launch(7, 33, 64)
        with kernels.compile_ahead() as on:
            assert on and kernels.dry_run_active()
            launch()
        torch.cuda.synchronize()
        assert not kernels.dry_run_active()
        assert (keep == -7).all()  # not launched
        assert compiles == [("_keep_kernel", True)]
        launch()
        torch.cuda.synchronize()
        assert compiles == [("_keep_kernel", True)]  # compiled by the dry run: none now
        assert (keep != -7).any()  # launched
    finally:
        JITFunction._do_compile = do_compile


@needs_compiled_triton
@pytest.mark.gpu
def test_other_threads_launch_during_a_dry_run():
    """The dry run's mark is its own stream: a kernel launched from another thread meanwhile runs."""
    launch, keep = _keep_launch(6, 21, 32)
    seen = []

    def other():
        seen.append(kernels.dry_run_active())
        launch()
        torch.cuda.synchronize()

    with kernels.compile_ahead() as on:
        assert on
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == [False]
    assert (keep != -7).any()  # launched


_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from ase.build import molecule
    from triton.runtime.jit import JITFunction
    from mlff_distiller import ForceEngine, load_model, kernels
    from mlff_distiller.batch import AtomsBatch

    compiles = []
    do_compile = JITFunction._do_compile
    import threading
    def counting(self, *args, **kwargs):
        thread = threading.current_thread().name
        compiles.append([self.fn.__name__, kernels.dry_run_active(), thread, self.fn.__module__])
        return do_compile(self, *args, **kwargs)
    JITFunction._do_compile = counting

    from mlff_distiller.kernels import _compile_ahead
    model = load_model("builtin:chno-gfn2")
    if sys.argv[1] == "benzene":
        atoms = molecule("C6H6")
        atoms.rattle(0.05, seed=1)
        batch = AtomsBatch.from_atoms([atoms])
        t0 = time.perf_counter()
        fast = ForceEngine(model, device="cuda", mode="cudagraph").compute(batch, forces=True)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        n_fast, dry_fast, total_fast = len(compiles), dict(_compile_ahead.LAST), dict(_compile_ahead.TOTAL)
        ref = ForceEngine(model, device="cuda", mode="eager").compute(batch, forces=True)
        out = {"energy": [fast["energy"].item(), ref["energy"].item()], "forces": [fast["forces"], ref["forces"]]}
    elif sys.argv[1] == "warmup":  # three buckets warmed at once, then a benzene call in the first
        engine = ForceEngine(model, device="cuda", mode="cudagraph")
        t0 = time.perf_counter()
        engine.warmup(buckets=[(12, 132), (300, 6000), (2000, 60000)])
        first = time.perf_counter() - t0
        atoms = molecule("C6H6")
        batch = AtomsBatch.from_atoms([atoms])
        fast = engine.compute(batch, forces=True)
        n_fast, dry_fast, total_fast = len(compiles), dict(_compile_ahead.LAST), dict(_compile_ahead.TOTAL)
        ref = ForceEngine(model, device="cuda", mode="eager").compute(batch, forces=True)
        out = {"energy": [fast["energy"].item(), ref["energy"].item()], "forces": [fast["forces"], ref["forces"]]}
        out["captured"] = len(engine.captured_buckets)
    elif sys.argv[1] == "train":  # a few CUDA-graph training steps of a small student on EMT labels
        from ase.calculators.emt import EMT
        from ase.calculators.singlepoint import SinglePointCalculator
        from mlff_distiller.distill import TrainConfig, train
        frames = []
        for k in range(24):
            a = molecule("CH3CH2OH")
            a.rattle(0.08, seed=k)
            a.calc = EMT()
            e, f = a.get_potential_energy(), a.get_forces()
            a.calc = SinglePointCalculator(a, energy=e, forces=f)
            frames.append(a)
        cfg = TrainConfig(
            model=dict(hidden=32, layers=2, n_rbf=8, cutoff=4.0), batch_size=8, lr=3e-3, warmup_steps=2,
            eval_every=3, max_steps=6, ema_decay=0.9, device="cuda", train_step="cudagraph", patience=0, seed=0,
        )
        t0 = time.perf_counter()
        result = train(frames[:18], frames[18:], cfg, log=lambda m: None)
        first = time.perf_counter() - t0
        n_fast, dry_fast, total_fast = len(compiles), dict(_compile_ahead.LAST), dict(_compile_ahead.TOTAL)
        out = {
            "losses": [h["train_loss"] for h in result.history],
            "capture_seconds": result.capture_seconds,
            "energy": [0.0, 0.0],
            "forces": [torch.zeros(1), torch.zeros(1)],
        }
    elif sys.argv[1] == "eager":  # the eager path (batches beyond the largest bucket): forces and stress
        sys.path.insert(0, "benchmarks")
        from systems import water_box
        atoms = water_box(3000, seed=4)
        batch = AtomsBatch.from_atoms([atoms])
        engine = ForceEngine(model, device="cuda", mode="eager")
        t0 = time.perf_counter()
        fast = engine.compute(batch, forces=True, stress=True)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        n_fast, dry_fast, total_fast = len(compiles), dict(_compile_ahead.LAST), dict(_compile_ahead.TOTAL)
        with kernels.use_backend("torch"):
            ref = ForceEngine(model, device="cuda", mode="eager").compute(batch, forces=True, stress=True)
        out = {
            "energy": [fast["energy"].item(), ref["energy"].item()],
            "forces": [fast["forces"], ref["forces"]],
            "stress_err": (fast["stress"] - ref["stress"]).abs().max().item(),
            "stress_max": ref["stress"].abs().max().item(),
        }
    else:  # a periodic water box through the calculator: Verlet list, in-step compaction, the stress step
        sys.path.insert(0, "benchmarks")
        from systems import water_box
        from mlff_distiller import StudentCalculator
        atoms = water_box(96, seed=3)
        atoms.calc = StudentCalculator(model, device="cuda", skin=1.0)
        t0 = time.perf_counter()
        f_fast, s_fast, e_fast = atoms.get_forces(), atoms.get_stress(), atoms.get_potential_energy()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        n_fast, dry_fast, total_fast = len(compiles), dict(_compile_ahead.LAST), dict(_compile_ahead.TOTAL)
        eng = ForceEngine(model, device="cuda", mode="eager")
        ref = eng.compute(AtomsBatch.from_atoms([atoms]), forces=True, stress=True)
        out = {
            "mode": atoms.calc.engine.mode,
            "captured": [str(b) for b in atoms.calc.engine.captured_buckets],
            "energy": [e_fast, ref["energy"].item()],
            "forces": [torch.as_tensor(f_fast), ref["forces"].cpu()],
            "stress_err": float(abs(s_fast - ref["stress"].cpu().numpy().reshape(-1)).max()),
            "stress_max": float(abs(s_fast).max()),
        }
    f, g = (t.detach().cpu().double() for t in out.pop("forces"))
    print(json.dumps({
        "first_s": first,
        "dry_run": dry_fast,  # the last dry run of the fast path's first call (the reference engines make their own)
        "total": total_fast,
        "n_compiles": [n_fast, len(compiles)],
        "compiles": compiles[:n_fast],
        "force_err": (f - g).abs().max().item(),
        "force_max": g.abs().max().item(),
        **out,
    }))
    """
)


def _cold_child(tmp_path, ahead: bool, system: str = "benzene") -> dict:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(tmp_path / f"cache_{system}_{'on' if ahead else 'off'}")
    env["MLFF_DISTILLER_COMPILE_AHEAD"] = "1" if ahead else "0"
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, str(script), system], env=env, capture_output=True, text=True, timeout=600, cwd=root
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_compiled_triton
@pytest.mark.gpu
@pytest.mark.slow  # fresh processes on empty caches, ~20-50 s each
def test_a_cold_capture_compiles_in_the_dry_run_and_gives_the_eager_results(tmp_path):
    """A fresh process on an empty Triton cache: the captured benzene step's kernels are all compiled by the dry run
    (none later, in the capture), and its result equals the eager engine's."""
    on = _cold_child(tmp_path, ahead=True)
    print(json.dumps(on))
    late = [(name, thread) for name, dry, thread, _ in on["compiles"] if not dry]
    assert on["dry_run"]["error"] is None and on["dry_run"]["compiled"] >= 10, on
    assert late == [], f"compiled after the dry run: {late}; {on['dry_run']}"  # all in it: none in the capture
    e_fast, e_ref = on["energy"]
    assert abs(e_fast - e_ref) <= 1e-4 * max(1.0, abs(e_ref))
    assert on["force_err"] <= 1e-3 * max(1.0, on["force_max"])
    off = _cold_child(tmp_path, ahead=False)
    assert not any(dry for _, dry, _, _ in off["compiles"])
    # The same kernels, each compiled once either way (Triton 3.6 asks again for every launch of a kernel still
    # compiling, which its async mode answers with the same compile).
    assert on["dry_run"]["compiled"] == on["dry_run"]["submitted"] == len(off["compiles"])
    assert sorted({n for n, _, _, _ in on["compiles"]}) == sorted({n for n, _, _, _ in off["compiles"]})
    print(f"cold first result: {on['first_s']:.2f} s with the dry run, {off['first_s']:.2f} s without")


@needs_compiled_triton
@pytest.mark.gpu
@pytest.mark.slow  # fresh processes on empty caches, ~20-50 s each
def test_a_cold_periodic_md_call_with_the_stress_gives_the_eager_results(tmp_path):
    """The riskier step: a periodic box through the calculator (a Verlet list, so the in-step edge compaction, whose
    output the stress step's virial indexes with) and the stress, from an empty Triton cache."""
    on = _cold_child(tmp_path, ahead=True, system="water")
    print(json.dumps({k: v for k, v in on.items() if k != "compiles"}))
    late = [(name, thread) for name, dry, thread, module in on["compiles"] if not dry and ".neighbors." not in module]
    assert on["total"]["compiled"] >= 10 and on["dry_run"]["error"] is None, on["total"]
    assert late == [], late
    e_fast, e_ref = on["energy"]
    assert abs(e_fast - e_ref) <= 1e-4 * max(1.0, abs(e_ref))
    assert on["force_err"] <= 1e-3 * max(1.0, on["force_max"])
    assert on["stress_err"] <= 1e-3 * max(1e-3, on["stress_max"])


@needs_compiled_triton
@pytest.mark.gpu
@pytest.mark.slow  # fresh processes on empty caches, ~20-50 s each
def test_warming_several_buckets_compiles_them_in_one_dry_run(tmp_path):
    on = _cold_child(tmp_path, ahead=True, system="warmup")
    late = [(name, thread) for name, dry, thread, _ in on["compiles"] if not dry]
    assert on["captured"] == 3 and late == [], (on["dry_run"], late)
    assert on["total"]["compiled"] >= 10, on["total"]
    e_fast, e_ref = on["energy"]
    assert abs(e_fast - e_ref) <= 1e-4 * max(1.0, abs(e_ref))
    assert on["force_err"] <= 1e-3 * max(1.0, on["force_max"])
    off = _cold_child(tmp_path, ahead=False, system="warmup")
    print(f"cold warm-up of 3 buckets: {on['first_s']:.2f} s with the dry run, {off['first_s']:.2f} s without")


@needs_compiled_triton
@pytest.mark.gpu
@pytest.mark.slow  # fresh processes on empty caches, ~20-50 s each
def test_a_cold_eager_call_compiles_in_its_dry_run_and_matches_the_torch_path(tmp_path):
    """The eager path (3,000 periodic atoms, forces and stress) from an empty cache: its step's kernels compile in
    the dry run before it (the neighbour list's before that, one by one), and the results equal the torch path's."""
    on = _cold_child(tmp_path, ahead=True, system="eager")
    late = [(name, thread) for name, dry, thread, module in on["compiles"] if not dry and ".neighbors." not in module]
    assert late == [], late
    assert on["dry_run"]["error"] is None and on["dry_run"]["compiled"] >= 10, on["dry_run"]
    e_fast, e_ref = on["energy"]
    assert abs(e_fast - e_ref) <= 1e-4 * max(1.0, abs(e_ref))
    assert on["force_err"] <= 1e-3 * max(1.0, on["force_max"])
    assert on["stress_err"] <= 1e-3 * max(1e-3, on["stress_max"])
    off = _cold_child(tmp_path, ahead=False, system="eager")
    print(
        f"cold eager first result, 3,000 atoms: {on['first_s']:.2f} s with the dry run, {off['first_s']:.2f} s without"
    )


@needs_compiled_triton
@pytest.mark.gpu
@pytest.mark.slow  # fresh processes on empty caches, ~20-50 s each
def test_a_cold_cuda_graph_training_run_compiles_in_dry_runs_and_learns_the_same(tmp_path):
    """The training step's first run of a capacity dry-runs its loss and backward (the optimiser step is left out:
    it would apply the dry run's garbage gradients). The run's losses equal those of a run without it."""
    on = _cold_child(tmp_path, ahead=True, system="train")
    off = _cold_child(tmp_path, ahead=False, system="train")
    assert on["total"]["compiled"] >= 10, on["total"]
    assert len(on["losses"]) == len(off["losses"]) > 0
    for a, b in zip(on["losses"], off["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    t_on, t_off = on["capture_seconds"], off["capture_seconds"]
    print(f"cold training, warm-ups and captures: {t_on:.2f} s with the dry run, {t_off:.2f} s without")


# Kernels whose count arguments (and size-dependent pointers) Triton must not specialise: a batch of a new size then
# needs no new compile (_triton_utils.unspecialized).
UNSPECIALIZED = {
    "_mp_kernels": {
        "_mp_fwd_kernel": ({"ei_stride"}, set()),
        "_mp_fwd_block_kernel": ({"n_atoms", "ei_stride"}, set()),
        "_mp_bwd_sender_kernel": ({"ei_stride"}, set()),
        "_mp_bwd_sender_block_kernel": ({"n_atoms", "ei_stride"}, set()),
    },
    "_mp_edge_kernels": {
        "_mp_bwd_edge_kernel": ({"E", "ei_stride"}, {"live_ptr"}),
        "_mp_sum_split_kernel": ({"E"}, set()),
        "_mp_bwd_filter_kernel": ({"E", "ei_stride", "EDGES_PER_PROG"}, set()),
    },
    "_edge_kernels": {k: ({"E", "ei_stride"}, set()) for k in ("_edge_fwd_kernel", "_edge_bwd_kernel")},
    "rbf_cutoff": {k: ({"E"}, set()) for k in ("_rbf_cutoff_fwd_kernel", "_rbf_cutoff_bwd_kernel")},
    "painn_update": {k: ({"n_atoms"}, set()) for k in ("_painn_update_norm_kernel", "_painn_update_out_bwd_kernel")},
    "repulsion": {
        "_pair_repulsion_fwd_kernel": ({"n_edges"}, {"energy"}),
        "_pair_repulsion_bwd_kernel": ({"n_edges"}, {"g_atomic", "g_energy"}),
    },
}


def test_unspecialized_keywords_and_their_switch(monkeypatch):
    from mlff_distiller.kernels import _triton_utils as tu

    if not HAS_TRITON:
        pytest.skip("needs Triton")
    monkeypatch.setattr(tu, "_JIT_HAS_ALIGNMENT_SWITCH", True)
    assert tu.unspecialized("E", "ei_stride", aligned=("live_ptr",)) == {
        "do_not_specialize": ["E", "ei_stride"],
        "do_not_specialize_on_alignment": ["live_ptr"],
    }
    assert tu.unspecialized("n") == {"do_not_specialize": ["n"]}
    monkeypatch.setattr(tu, "_JIT_HAS_ALIGNMENT_SWITCH", False)  # an older Triton: the counts only
    assert tu.unspecialized("E", aligned=("p",)) == {"do_not_specialize": ["E"]}
    monkeypatch.setattr(tu, "SPECIALIZE_COUNTS", True)  # MLFF_DISTILLER_SPECIALIZE_COUNTS=1: Triton's default
    assert tu.unspecialized("E", aligned=("p",)) == {}


@pytest.mark.parametrize("switch", ["0", "1"])
def test_compiled_kernels_take_counts_unspecialised(switch):
    """The compiled (not interpreted) kernels as Triton defines them, in a fresh process: each listed count and
    pointer is unspecialised; ``MLFF_DISTILLER_SPECIALIZE_COUNTS=1`` gives Triton's default back. Needs no GPU."""
    if not HAS_TRITON:
        pytest.skip("needs Triton")
    code = textwrap.dedent(
        f"""
        import importlib, json
        out = {{}}
        for mod, names in {json.dumps({m: list(ks) for m, ks in UNSPECIALIZED.items()})}.items():
            m = importlib.import_module("mlff_distiller.kernels." + mod)
            for name in names:
                params = getattr(m, name).params
                out[name] = (
                    sorted(p.name for p in params if p.do_not_specialize),
                    sorted(p.name for p in params if p.do_not_specialize_on_alignment),
                )
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "MLFF_DISTILLER_SPECIALIZE_COUNTS": switch}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    from mlff_distiller.kernels._triton_utils import _jit_takes

    alignment = _jit_takes("do_not_specialize_on_alignment")
    for names in UNSPECIALIZED.values():
        for name, (counts, aligned) in names.items():
            if switch == "1":
                assert got[name] == [[], []], name
            else:
                assert set(got[name][0]) == counts, name
                assert set(got[name][1]) == (aligned if alignment else set()), name


@needs_compiled_triton
@pytest.mark.gpu
def test_a_new_edge_count_compiles_nothing_new():
    """The split edge sums' kernel at edge counts of every divisibility class (and one aligned, one not): one
    compile, where Triton's default compiled per class."""
    from mlff_distiller.kernels._mp_edge_kernels import _mp_sum_split_kernel
    from triton.runtime.jit import JITFunction

    compiles = []
    do_compile = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiles.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    JITFunction._do_compile = counting
    try:
        dev = torch.device("cuda")
        for e in (48, 1, 37, 64, 1000, 1003):
            part_rbf, part_unit = torch.randn(2, e, 20, device=dev), torch.randn(2, e, 3, device=dev)
            g_rbf, g_unit = torch.empty(e, 20, device=dev), torch.empty(e, 3, device=dev)
            # R_PAD 32 and BLOCK_E 128 as the shipped launch; SPLIT 2 with a BLOCK_E no other test uses
            _mp_sum_split_kernel[(-(-e // 64),)](
                part_rbf, part_unit, g_rbf, g_unit, e, N_RBF=20, R_PAD=32, SPLIT=2, BLOCK_E=64, PDL=False
            )
            torch.testing.assert_close(g_rbf, part_rbf.sum(0))
            torch.testing.assert_close(g_unit, part_unit.sum(0))
        assert compiles.count("_mp_sum_split_kernel") == 1, compiles
    finally:
        JITFunction._do_compile = do_compile


def test_a_dry_run_stands_in_for_a_capture_only_in_its_second_pass():
    """``precompile(..., for_capture=True)``: ``dry_run_for_capture()`` is False outside every dry run, and a call
    that makes no dry run (no CUDA device) runs nothing and leaves it False (the GEMM asks it to pick the capture's
    kernel)."""
    assert not kernels.dry_run_for_capture()
    seen = []
    assert not kernels.precompile(lambda: seen.append(kernels.dry_run_for_capture()), device="cpu", for_capture=True)
    assert seen == [] and not kernels.dry_run_for_capture() and _compile_ahead._FOR_CAPTURE == [False]


@needs_compiled_triton
@pytest.mark.gpu
def test_a_dry_run_for_a_capture_makes_both_passes():
    """The capture's warm-up launches the pointer kernels and the capture the descriptor kernels: a dry run for a
    capture runs its function twice, the second time as the capture (and only the dry run's stream sees it)."""
    seen = []

    def fn(x):
        seen.append((kernels.dry_run_active(), kernels.dry_run_for_capture()))
        return x * 2

    x = torch.ones(4, device="cuda")
    assert kernels.precompile(fn, x, for_capture=True)
    assert seen == [(True, False), (True, True)]
    seen.clear()
    assert kernels.precompile(fn, x)
    assert seen == [(True, False)] and not kernels.dry_run_for_capture()
