"""Probe (GPU): the dense step (``kernels.dense_step``: six launches, one program per atom) against the engine's
captured step, in one run.

Issue 5's benzene row (energy + forces ≤ 0.05 ms) is timed on the engine's captured step (~60 kernels replayed as a
CUDA graph; ``peers.StepImpl`` in mode "cudagraph", as ``probe_student_size.py``). Rows:

* check: the dense step's fp32 energy and forces against the model's own forward and autograd in float64 (CPU), and
  its float64 launch on the GPU against the same oracle;
* molecules (H2, H2O, CH4, benzene): the dense step captured in a CUDA graph (replay median, L2 flushed between
  repetitions, as the engine's row), for each launch variant, beside the engine's captured step;
* g2 x B (molecules ≤ MAX_ATOMS atoms, a student with the g2 species): µs per structure against the engine.

    python benchmarks/probe_dense_step.py --out benchmarks/results --name probe_dense_step_h200
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch
from harness import back_to_back_us, capture_graph, time_fn, time_graph, write_lines
from mlff_distiller.kernels import dense_step as ds
from mlff_distiller.kernels._triton_utils import pdl_enabled
from peers import StepImpl, make_student
from probe_kernel_order import replay_kernels

from mlff_distiller import load_model

G2_SPECIES = (1, 3, 4, 5, 6, 7, 8, 9, 11, 13, 14, 15, 16, 17)
VARIANTS = {  # name: (DenseStep keywords, PDL on); "shipped": the defaults at the run's commit (stop 71: pdl,
    # early, fan forward and the kept geometry on; stop 71's runs "a" to "c" had them off until each was timed); the
    # stop-69 ones without rows
    "shipped": ({}, True),  # (PDL off before stop 71's run "e": its run "d" timed "shipped" without PDL)
    "default": ({"rows": False, "prefetch": False, "split": False, "pdl": True}, True),
    "pdl off": ({"rows": False, "prefetch": False, "split": False}, False),
    "pdl off + L2 prefetch": ({"rows": False, "split": False}, False),
    "tf32x3 filters": ({"rows": False, "dot": 1, "prefetch": False, "split": False, "pdl": True}, True),
    "2 warps": ({"rows": False, "num_warps": 2, "prefetch": False, "split": False, "pdl": True}, True),
    "8 warps": ({"rows": False, "num_warps": 8, "prefetch": False, "split": False, "pdl": True}, True),
    "prefetch, 8 warps": ({"rows": False, "num_warps": 8, "split": False}, False),
    "prefetch, split": (
        {
            "rows": False,
        },
        False,
    ),
    "prefetch, split, 8 warps": ({"rows": False, "num_warps": 8}, False),
    "prefetch, split, 16 warps": ({"rows": False, "num_warps": 16}, False),
    "stop 69": ({"rows": False}, False),
    "rows, 4 warps": ({"num_warps": 4}, False),
    "rows, forward": ({"rows": (True, False)}, False),
    "rows, backward": ({"rows": (False, True)}, False),
    "rows, 8 warps": ({"num_warps": 8}, False),
    "rows, 16 warps": ({"num_warps": 16}, False),
    "rows, 16 / 8 warps": ({"num_warps": (16, 8)}, False),
    "rows, 8 / 16 warps": ({"num_warps": (8, 16)}, False),
    "geometry kept": ({"geometry": True}, False),
    "pdl": ({"pdl": True, "early": False}, True),  # (stop 71's early on: its "pdl" row had it off)
    "geometry kept, pdl": ({"geometry": True, "pdl": True}, True),
    "no geometry": ({"geometry": False}, False),
    "fan": ({"fan": True}, False),
    "fan forward": ({"fan": (True, False)}, False),
    "fan backward": ({"fan": (False, True)}, False),
    "early": ({"pdl": True, "early": True}, True),
    "early, fan both": ({"pdl": True, "early": True, "fan": True}, True),
    "early, no geometry": ({"pdl": True, "early": True, "geometry": False}, True),
    "no fan": ({"fan": False}, True),
    "stop 70 launch": ({"geometry": False, "fan": False, "early": False, "pdl": False}, False),
    # timing instruments (wrong results): a split backward's feature or geometry programs left out
    "ablate features": ({"ablate": 1}, True),
    "ablate geometry": ({"ablate": 2}, True),
    # stop 72's run "b" also timed "l1" and "l1, fan both": an L1 prefetch of the weight tiles of the products after
    # each launch's wait, before it (DenseStep(l1=True) at ceba0df; no faster, removed)
    "fan both": ({"fan": True}, True),
    # stop 84: warps a program with the shipped launch (PDL, early loads), for the 128-wide student, whose dense step
    # stop 73 timed only with its default 16 warps (probe_split_dense.py's unsplit 128-wide layer: 4 warps 21.1 µs
    # against 8 warps' 33.8)
    "4 warps, pdl": ({"num_warps": 4}, True),
    "8 warps, pdl": ({"num_warps": 8}, True),
    "4 / 8 warps, pdl": ({"num_warps": (4, 8)}, True),
    "8 / 16 warps, pdl": ({"num_warps": (8, 16)}, True),
    "16 / 8 warps, pdl": ({"num_warps": (16, 8)}, True),
}


def _frozen(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def padded(model, structures, device, dtype=torch.float32, np_=None):
    zi = {z: k for k, z in enumerate(model.config.species)}
    np_ = np_ or ds.padded_atoms(max(len(a) for a in structures))
    pos = torch.zeros((len(structures), np_, 3), dtype=dtype)
    idx = torch.full((len(structures), np_), -1, dtype=torch.int32)
    for b, at in enumerate(structures):
        n = len(at)
        pos[b, :n] = torch.as_tensor(at.positions, dtype=dtype)
        idx[b, :n] = torch.tensor([zi[int(z)] for z in at.numbers], dtype=torch.int32)
    return pos.to(device), idx.to(device)


def _errors(e, f, er, fr, idx) -> tuple[float, float]:
    real = (idx >= 0).cpu()
    de = (e.double().cpu() - er.cpu()).abs().max().item()
    df = (f.double().cpu() - fr.double().cpu())[real].abs().max().item()
    return de, df


def warm_us(fn, calls: int = 300) -> float:
    """µs per call of ``fn`` (a graph replay) called back to back with the L2 cache kept warm, as an MD loop keeps
    the weights there (:func:`harness.back_to_back_us`: the host's ~10 µs a launch hides behind the device's
    work)."""
    return back_to_back_us(fn, calls)


def _engine_step(model, structures, dense_small=False):
    """The engine's captured step (``dense_small=False``: the model's forward and autograd, as before stop 69;
    None: the engine's own choice, the dense step where it applies)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = StepImpl("probe", "ours", model, "cuda", mode="cudagraph", dense_small=dense_small)
        return impl, impl.prepare(structures, forces=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_dense_step")
    ap.add_argument("--students", default="builtin:chno-gfn2-small,builtin:chno-gfn2")
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names of VARIANTS, separated by ';'")
    ap.add_argument("--molecules", default="H2,H2O,CH4,C6H6")
    ap.add_argument("--g2", default="1024,4096")
    ap.add_argument("--g2-hidden", default="64")
    ap.add_argument(
        "--md-steps",
        type=int,
        default=0,
        help="ASE velocity Verlet on benzene through StudentCalculator, the dense step on and off, two rounds each "
        "(0: not run)",
    )
    ap.add_argument(
        "--loop",
        type=int,
        default=0,
        help="only call the first student's step on benzene this often "
        "(prefetch on, PDL off: a target for Nsight Compute)",
    )
    ap.add_argument(
        "--dense-max-hidden",
        type=int,
        default=0,
        help="set the engine's DENSE_MAX_HIDDEN (the widest student its dense step takes by default) for this run",
    )
    ap.add_argument(
        "--dense-zero",
        choices=("off", "on", "both"),
        default="off",
        help="the engine's rows with DENSE_ZERO_IN_KERNEL off (its default), on, or both in turn",
    )
    args = ap.parse_args()
    from mlff_distiller import engine_padded

    if args.dense_max_hidden:
        engine_padded.DENSE_MAX_HIDDEN = args.dense_max_hidden
    if args.loop:
        from ase.build import molecule

        model = _frozen(load_model(args.students.split(",")[0]).cuda())
        pos, idx = padded(model, [molecule("C6H6")], torch.device("cuda"))
        with pdl_enabled(False):
            step = ds.DenseStep(model, torch.float32, "cuda", split=False)
            for _ in range(args.loop):
                step(pos, idx)
        torch.cuda.synchronize()
        return
    import triton
    from ase.build import molecule

    dev = torch.device("cuda")
    lines = [
        f"# {args.name}",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}. Medians "
        "(triton.testing.do_bench, L2 flushed between repetitions); graph = the call captured in a CUDA graph and "
        "replayed. The engine's step: peers.StepImpl, mode cudagraph (probe_student_size's row).",
        "",
        "## Molecules: the dense step against the engine's captured step",
        "",
        "| student | molecule | variant | first call s | max dE eV (fp32 / fp64; first call, after replays) | "
        "max dF eV/Å (fp32 / fp64; the same) | "
        "dense graph µs | engine step µs | engine / dense | dense warm µs | engine warm µs |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    tables: list[str] = []
    auto_rows = [
        "",
        "## Through the engine (peers.StepImpl, mode cudagraph): its own choice against dense_small=False",
        "",
        "| student | molecule | step taken | engine µs | engine warm µs | engine, dense_small=False µs | ratio |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name in [n for n in args.students.split(",") if n]:
        model = _frozen(load_model(name).to(dev))
        ref = _frozen(load_model(name).double())
        dense64 = ds.DenseStep(ref, torch.float64, dev)
        for mol in [m for m in args.molecules.split(",") if m]:
            atoms = molecule(mol)
            pos, idx = padded(model, [atoms], dev)
            er, _, fr = ds.dense_step_reference(ref, pos.double().cpu(), idx.cpu())
            e64, _, f64 = dense64(pos.double(), idx)
            de64, df64 = _errors(e64, f64, er, fr, idx)
            impl, run = _engine_step(model, [atoms])
            t_engine = time_fn(run, dev, rep_ms=300).median_us
            t_engine_warm = warm_us(run)
            for zero in dict(off=[False], on=[True], both=[False, True])[args.dense_zero]:
                engine_padded.DENSE_ZERO_IN_KERNEL = zero
                impl_d, run_d = _engine_step(model, [atoms], dense_small=None)
                t_auto = time_fn(run_d, dev, rep_ms=300).median_us
                eng = impl_d.engine
                taken = "dense" if any(eng._dense_runners.values()) else "graph"
                auto_rows.append(
                    f"| {name} | {mol} | {taken}{', zeroed in its first launch' if zero else ''} | {t_auto:.1f} | "
                    f"{warm_us(run_d):.1f} | {t_engine:.1f} | {t_engine / t_auto:.2f} |"
                )
                print(auto_rows[-1], flush=True)
                del impl_d, run_d
            engine_padded.DENSE_ZERO_IN_KERNEL = False
            for var in variants:
                kw, pdl = VARIANTS[var]
                with pdl_enabled(pdl):
                    step = ds.DenseStep(model, torch.float32, dev, **kw)
                    out = (
                        torch.empty(1, dtype=torch.float64, device=dev),
                        torch.empty((1, pos.shape[1]), device=dev),
                        torch.empty((1, pos.shape[1], 3), device=dev),
                    )

                    def call(step=step, out=out, p=pos, i=idx):
                        return step(p, i, out)

                    t0 = time.perf_counter()
                    call()
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    de, df = _errors(out[0], out[2], er, fr, idx)
                    tg = time_graph(call, dev, rep_ms=300)
                    graph = capture_graph(call)
                    tw = warm_us(graph.replay)
                    torch.cuda.synchronize()
                    # the outputs of the last of the back-to-back replays (launches that overlap under PDL), checked
                    # again: a race between a launch and its predecessor would show here
                    de2, df2 = _errors(out[0], out[2], er, fr, idx)
                    de, df = max(de, de2), max(df, df2)
                    if mol == "C6H6":
                        tables += ["", f"{name}, {mol}, dense step ({var}):", "", *replay_kernels(graph.replay)]
                    del graph
                tg = tg.median_us if tg is not None else float("nan")
                lines.append(
                    f"| {name} | {mol} | {var} | {first:.1f} | {de:.1e} / {de64:.1e} | {df:.1e} / {df64:.1e} | "
                    f"{tg:.1f} | {t_engine:.1f} | {t_engine / tg:.2f} | {tw:.1f} | {t_engine_warm:.1f} |"
                )
                print(lines[-1], flush=True)
            del impl, run
    lines += auto_rows
    if args.md_steps:
        from probe_md_step import _md_us

        from mlff_distiller import StudentCalculator

        lines += [
            "",
            f"## ASE MD step, benzene (velocity Verlet 0.5 fs, {args.md_steps} steps after 100, median wall µs/step)",
            "",
            "| student | round | dense step | median µs | p20 µs | launches ahead taken | MD runners dense |",
            "|---|---:|---|---:|---:|---:|---|",
        ]
        for name in [n for n in args.students.split(",") if n]:
            for rnd in (1, 2):
                for dense in (True, False) if rnd == 1 else (False, True):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        calc = StudentCalculator(load_model(name), device="cuda")
                    calc.engine.dense_small = None if dense else False
                    med, p20 = _md_us(molecule("C6H6"), calc, args.md_steps)
                    e = calc.engine
                    md_dense = [md.dense for md in e._md_runners.values()]
                    lines.append(
                        f"| {name} | {rnd} | {'on' if dense else 'off'} | {med:.1f} | {p20:.1f} | {e.n_ahead_taken} | "
                        f"{md_dense} |"
                    )
                    print(lines[-1], flush=True)
                    del calc, e
    lines += ["", "## Device time per kernel (one benzene step, each variant)", *tables]
    write_lines(lines, args.out, args.name)
    lines += [
        "",
        f"## g2 molecules (≤ {ds.MAX_ATOMS} atoms), a student with the g2 species (random weights)",
        "",
        "| hidden | B | NP | max dF vs fp64 eV/Å (first 32) | dense µs/structure | engine µs/structure | "
        "engine / dense |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for hidden in [int(x) for x in args.g2_hidden.split(",") if x]:
        model = _frozen(make_student(hidden=hidden, species=list(G2_SPECIES)).to(dev))
        ref = _frozen(make_student(hidden=hidden, species=list(G2_SPECIES)).double())
        for b in [int(x) for x in args.g2.split(",") if x]:
            mols = [m for m in g2_batch(b) if len(m) <= 16]
            pos, idx = padded(model, mols, dev, np_=16)
            impl, run = _engine_step(model, mols)
            t_engine = time_fn(run, dev, rep_ms=300).median_us / len(mols)
            step = ds.DenseStep(model, torch.float32, dev)

            def call(step=step, p=pos, i=idx):
                return step(p, i)

            e, _, f = call()
            k = 32
            er, _, fr = ds.dense_step_reference(ref, pos[:k].double().cpu(), idx[:k].cpu())
            _, df = _errors(e[:k], f[:k], er, fr, idx[:k])
            tg = time_graph(call, dev, rep_ms=300)
            tk = (tg.median_us if tg is not None else float("nan")) / len(mols)
            lines.append(
                f"| {hidden} | {len(mols)} | 16 | {df:.1e} | {tk:.3f} | {t_engine:.3f} | {t_engine / tk:.2f} |"
            )
            print(lines[-1], flush=True)
            del impl, run
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
