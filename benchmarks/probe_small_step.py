"""Probe (GPU): the one-kernel step (``kernels.small_step``) against the engine's captured step, in one run.

Issue 5's benzene row (energy + forces ≤ 0.05 ms) is measured on the engine's captured step: ~60 kernels replayed
as a CUDA graph. ``kernels.small_step`` computes a molecule of at most 16 atoms in one program. Rows, per student:

* check: the kernel's fp32 energy and forces against the model's own forward and autograd in float64 (CPU), for
  benzene and for every g2 molecule of the run's batch (the g2 student), and against the engine's fp32 step;
* benzene: the kernel alone captured in a CUDA graph (replay median, as the engine's row is timed), its eager
  launch (host included), and the engine's captured step (``peers.StepImpl``), for each product mode and warp count;
* g2 x B (a student with the g2 species, random weights on the TF32 grid): µs per structure, the kernel (one
  program per molecule) against the engine's captured step on the same molecules.

    python benchmarks/probe_small_step.py --out benchmarks/results --name probe_small_step_h200
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
from harness import time_fn, time_graph, write_lines
from mlff_distiller.kernels import small_step as ss
from peers import StepImpl, make_student

from mlff_distiller import load_model, predict_forces

G2_SPECIES = (1, 3, 4, 5, 6, 7, 8, 9, 11, 13, 14, 15, 16, 17)


def _frozen(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def padded(model, structures, device, dtype=torch.float32):
    zi = {z: k for k, z in enumerate(model.config.species)}
    pos = torch.zeros((len(structures), ss.MAX_ATOMS, 3), dtype=dtype)
    idx = torch.full((len(structures), ss.MAX_ATOMS), -1, dtype=torch.int32)
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


def _engine_step(model, structures):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = StepImpl("probe", "ours", model, "cuda", mode="cudagraph")  # as probe_student_size's rows
        return impl, impl.prepare(structures, forces=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_small_step")
    ap.add_argument("--students", default="builtin:chno-gfn2-small,builtin:chno-gfn2")
    ap.add_argument("--warps", default="16")
    ap.add_argument("--dots", default="2", help="product modes: 2 tf32x2 (weights on the TF32 grid), 1 tf32x3")
    ap.add_argument("--g2", default="1024,4096")
    ap.add_argument("--g2-hidden", default="64,128")
    ap.add_argument("--random-hidden", default="64,128", help="benzene rows of random students without a wall")
    args = ap.parse_args()
    import triton

    dev = torch.device("cuda")
    from ase.build import molecule

    benzene = molecule("C6H6")
    lines = [
        f"# {args.name}",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}. Medians "
        "(triton.testing.do_bench); graph = the call captured in a CUDA graph and replayed.",
        "",
        "## Benzene: the one-kernel step against the engine's captured step",
        "",
        "| student | mode | warps | compile s | max dE eV | max dF eV/Å | kernel graph µs | kernel eager µs | "
        "engine step µs | engine / kernel |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    students = [(n, lambda n=n: load_model(n)) for n in args.students.split(",") if n]
    students += [(f"random {h} x 3, no wall", lambda h=h: make_student(hidden=h)) for h in _ints(args.random_hidden)]
    for name, make in students:
        model = _frozen(make().to(dev))
        ref = _frozen(make().double())
        pos, idx = padded(model, [benzene], dev)
        er, _, fr = ss.small_step_reference(ref, pos.double().cpu(), idx.cpu())
        impl, run = _engine_step(model, [benzene])
        t_engine = time_fn(run, dev, rep_ms=300).median_us
        eng = impl.engine
        print(f"{name}: engine mode {eng.mode}, captured buckets {len(getattr(eng, '_runners', {}))}", flush=True)
        for dot in [int(x) for x in args.dots.split(",")]:
            for warps in [int(x) for x in args.warps.split(",")]:
                out = (
                    torch.empty(1, dtype=torch.float64, device=dev),
                    torch.empty((1, ss.MAX_ATOMS), device=dev),
                    torch.empty((1, ss.MAX_ATOMS, 3), device=dev),
                )

                t0 = time.perf_counter()
                try:
                    step = ss.SmallStep(model, torch.float32, dev, dot=dot, num_warps=warps)

                    def call(step=step, out=out, p=pos, i=idx):
                        return step(p, i, out)

                    with torch.no_grad():
                        call()
                    torch.cuda.synchronize()
                except Exception as exc:  # a configuration that does not compile: reported, the rest go on
                    lines.append(f"| {name} | {dot} | {warps} | failed: {type(exc).__name__}: {str(exc)[:150]} |")
                    continue
                compile_s = time.perf_counter() - t0
                de, df = _errors(out[0], out[2], er, fr, idx)
                with torch.no_grad():
                    tg = time_graph(call, dev, rep_ms=300)
                    te = time_fn(call, dev, rep_ms=300).median_us
                tg = tg.median_us if tg is not None else float("nan")
                lines.append(
                    f"| {name} | {dot} | {warps} | {compile_s:.1f} | {de:.2e} | {df:.2e} | {tg:.1f} | {te:.1f} | "
                    f"{t_engine:.1f} | {t_engine / tg:.2f} |"
                )
                print(lines[-1], flush=True)
        del impl, run
    lines += [
        "",
        "## g2 molecules (≤ 16 atoms), a student with the g2 species (random weights on the TF32 grid)",
        "",
        "| hidden | B | warps | max dF vs fp64 eV/Å | max dF vs engine eV/Å | kernel µs/structure | "
        "engine µs/structure | engine / kernel |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for hidden in [int(x) for x in args.g2_hidden.split(",")]:
        model = _frozen(make_student(hidden=hidden, species=list(G2_SPECIES)).to(dev))
        ref = _frozen(make_student(hidden=hidden, species=list(G2_SPECIES)).double())
        for b in [int(x) for x in args.g2.split(",")]:
            mols = [m for m in g2_batch(b) if len(m) <= ss.MAX_ATOMS]
            pos, idx = padded(model, mols, dev)
            impl, run = _engine_step(model, mols)
            t_engine = time_fn(run, dev, rep_ms=300).median_us / len(mols)
            k = min(64, len(mols))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                f_engine = [r["forces"] for r in predict_forces(model, mols[:k], device="cuda")]
            for warps in [int(x) for x in args.warps.split(",")]:
                try:
                    step = ss.SmallStep(model, torch.float32, dev, num_warps=warps)

                    def call(step=step, p=pos, i=idx):
                        return step(p, i)

                    with torch.no_grad():
                        e, _, f = call()
                except Exception as exc:
                    lines.append(
                        f"| {hidden} | {len(mols)} | {warps} | failed: {type(exc).__name__}: {str(exc)[:150]} |"
                    )
                    continue
                er, _, fr = ss.small_step_reference(ref, pos[:k].double().cpu(), idx[:k].cpu())
                _, df = _errors(e[:k], f[:k], er, fr, idx[:k])
                dfe = max(
                    float(abs(f[m, : len(fe)].double().cpu().numpy() - fe).max()) for m, fe in enumerate(f_engine)
                )
                with torch.no_grad():
                    tk = time_fn(call, dev, rep_ms=300).median_us / len(mols)
                lines.append(
                    f"| {hidden} | {len(mols)} | {warps} | {df:.2e} | {dfe:.2e} | {tk:.3f} | {t_engine:.3f} | "
                    f"{t_engine / tk:.2f} |"
                )
                print(lines[-1], flush=True)
            del impl, run
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
