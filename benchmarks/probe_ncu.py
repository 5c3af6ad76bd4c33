"""What limits the energy + forces step on large graphs: launch-option sweeps and a hardware-counter run.

Two modes, both GPU only:

* ``--mode sweep``: the step alone (``peers.StepImpl``: eager for the water boxes, a CUDA-graph replay for the g2
  batch, the modes a user gets) timed with ``triton.testing.do_bench`` under launch options of the
  message-passing kernels (``num_stages`` per kernel) and of the Triton GEMM (its large-M tile), each against the
  shipped configuration measured in the same run. Writes ``probe_ncu_sweep.md``.
* ``--mode ncu``: one step per system inside an NVTX range ``measure_<system>``, for Nsight Compute to profile
  (``scripts/gpu_session.sh ncu`` runs it under ``ncu --nvtx --nvtx-include measure_<system>/``).

Systems: ``water3000``, ``water24000`` (bench_large's boxes) and ``g2x4096`` (4,096 ASE g2 molecules).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch
from bench_engine import make_student as make_g2_student
from bench_large import box
from harness import write_lines
from peers import StepImpl, make_student

# The modules (the package re-exports functions under the same names).
linear = importlib.import_module("mlff_distiller.kernels.linear")
mp = importlib.import_module("mlff_distiller.kernels.message_passing")

SYSTEMS = ("water3000", "water24000", "g2x4096")


def structures(name: str):
    if name.startswith("water"):
        return [box(int(name[5:]))], make_student()
    return g2_batch(int(name.split("x")[1])), make_g2_student()


@contextlib.contextmanager
def gemm_config(**changes):
    old = dict(linear._CONFIG)
    linear._CONFIG.update(changes)
    try:
        yield
    finally:
        linear._CONFIG.clear()
        linear._CONFIG.update(old)


def variants():
    """(label, context factory) pairs: the shipped configuration first."""
    out = [("shipped", contextlib.nullcontext)]
    out.append(("GEMM large tile 128x64/8 warps, BK 32", lambda: gemm_config(large=(128, 64, 8), large_block_k=32)))
    for kernel in ("fwd", "bwd_sender", "bwd_edge"):
        for stages in (1, 2, 4):
            ctx = lambda k=kernel, s=stages: mp._configured(**{f"{k}_stages": s})  # noqa: E731
            out.append((f"{kernel} num_stages={stages}", ctx))
    return out


def step(name: str, atoms, model, device):
    mode = "cudagraph" if name.startswith("g2") else "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = StepImpl(f"ours {mode}", "ours", model, device, mode=mode)
    if not impl.available:
        raise RuntimeError(impl.why_unavailable)
    return impl.prepare(atoms, True)


def sweep(args, device) -> list[str]:
    import triton

    lines = [
        "# probe_ncu.py --mode sweep: launch options of the step's kernels (H100 session)",
        "",
        f"{torch.cuda.get_device_name(device)} · torch {torch.__version__} · triton {triton.__version__}",
        "",
        "Step alone (eager for water, CUDA-graph replay for g2), median of triton.testing.do_bench (ms). Each "
        "variant is timed right after a fresh shipped run of the same system; ratio = shipped / variant (> 1: the "
        "variant is faster).",
        "",
        "| system | variant | shipped ms | variant ms | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    t_end = time.perf_counter() + args.budget_s
    for name in args.systems:
        atoms, model = structures(name)
        model = model.to(device)
        base_run = step(name, atoms, model, device)
        base_run()
        for label, ctx in variants()[1:]:
            if time.perf_counter() > t_end:
                lines.append(f"| {name} | {label} | skipped: budget | | |")
                continue
            try:
                t_base = triton.testing.do_bench(base_run, warmup=50, rep=300, return_mode="median")
                with ctx():
                    run = step(name, atoms, model, device) if name.startswith("g2") else base_run
                    run()
                    t_var = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
                lines.append(f"| {name} | {label} | {t_base:.3f} | {t_var:.3f} | {t_base / t_var:.3f} |")
            except Exception as exc:  # a launch option a kernel cannot take (shared memory): report, go on
                lines.append(f"| {name} | {label} | failed: {type(exc).__name__}: {str(exc)[:80]} | | |")
            print(lines[-1], flush=True)
        del base_run
        torch.cuda.empty_cache()
    return lines


def ncu(args, device) -> None:
    for name in args.systems:
        atoms, model = structures(name)
        run = step(name, atoms, model.to(device), device)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"measure_{name}")
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"measured {name}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("sweep", "ncu"), default="sweep")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; known: {SYSTEMS}")
    if not torch.cuda.is_available():
        print("probe_ncu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    if args.mode == "ncu":
        ncu(args, device)
        return 0
    lines = sweep(args, device)
    path = write_lines(lines, args.out, "probe_ncu_sweep.md")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
