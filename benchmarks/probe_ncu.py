"""What limits the energy + forces step on large graphs: launch-option sweeps and a hardware-counter run.

Two modes, both GPU only:

* ``--mode sweep``: the step alone (``peers.StepImpl``, a CUDA-graph replay unless ``--step-mode eager``) timed
  with ``triton.testing.do_bench`` under launch options (``--variants``: message-passing tiles and ``num_stages``,
  the Triton GEMM's large-M tile), each against the shipped configuration measured in the same run. Writes
  ``probe_ncu_sweep.md``.
* ``--mode ncu``: one step per system between ``cudaProfilerStart`` and ``cudaProfilerStop`` (and in an NVTX
  range ``measure_<system>``), for Nsight Compute to profile (``scripts/gpu_session.sh ncu`` runs it under
  ``ncu --profile-from-start off``).

* ``--mode summary REPORT...``: a table of Nsight Compute's text reports (``ncu --log-file``), one row per kernel.

Systems: ``water<N>`` (bench_large's boxes, e.g. ``water192``, ``water3000``, ``water24000``), ``g2x<N>`` (N ASE g2
molecules) and ``benzene`` (one, with the g2 student).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import re
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch
from bench_engine import make_student as make_g2_student
from bench_large import box
from harness import STUDENT_WEIGHTS, write_lines
from peers import StepImpl, make_student

from mlff_distiller.buckets import BucketLadder
from mlff_distiller.model import StudentModel

# The modules (the package re-exports functions under the same names).
linear = importlib.import_module("mlff_distiller.kernels.linear")
edge_features = importlib.import_module("mlff_distiller.kernels.edge_features")
mp = importlib.import_module("mlff_distiller.kernels.message_passing")
update = importlib.import_module("mlff_distiller.kernels.painn_update")
moments = importlib.import_module("mlff_distiller.kernels.species_moments")
engine_mod = importlib.import_module("mlff_distiller.engine")

SYSTEMS = ("water3000", "water24000", "g2x4096")


def structures(name: str, hidden: int | None = None, layers: int | None = None):
    """The system's structures and its student; ``hidden`` / ``layers`` change the student's width / depth (the
    same species, basis and cutoff, seeded random weights)."""
    if name == "benzene":
        from ase.build import molecule

        atoms, model = [molecule("C6H6")], make_g2_student()
    elif name.startswith("water"):
        atoms, model = [box(int(name[5:]))], make_student()
    else:
        atoms, model = g2_batch(int(name.split("x")[1])), make_g2_student()
    if hidden or layers:
        c = model.config
        model = make_student(
            species=list(c.species),
            hidden=hidden or c.hidden,
            layers=layers or c.layers,
            n_rbf=c.n_rbf,
            cutoff=c.cutoff,
        )
    return atoms, model


@contextlib.contextmanager
def patched_config(config: dict, **changes):
    """``config`` (a kernel module's launch ``_CONFIG``) with ``changes`` inside, restored after."""
    old = dict(config)
    config.update(changes)
    try:
        yield
    finally:
        config.clear()
        config.update(old)


DEFAULT_VARIANTS = "gemm:large=128x64x8,large_block_k=32;" + ";".join(
    f"mp:{k}_stages={s}" for k in ("fwd", "bwd_sender", "bwd_edge") for s in (1, 2, 4)
)


@contextlib.contextmanager
def class_attrs(cls, **changes):
    """``cls`` (a class or a module) with attributes ``changes``, restored after."""
    old = {k: getattr(cls, k) for k in changes}
    for k, v in changes.items():
        setattr(cls, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(cls, k, v)


@contextlib.contextmanager
def ladder_config(**changes):
    """The engine's default bucket ladder with ``changes`` (``BucketLadder`` fields, e.g. ``growth``)."""
    old = engine_mod.BucketLadder
    engine_mod.BucketLadder = functools.partial(old, **changes)
    try:
        yield
    finally:
        engine_mod.BucketLadder = old


def _value(text: str):
    if "x" in text and all(p.isdigit() for p in text.split("x")):
        return tuple(int(p) for p in text.split("x"))
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


# Variant prefixes that patch one module's switch dict (ladder:, model:, seed: and mp: are handled apart).
_CONFIGS = {
    "gemm": lambda: linear._CONFIG,
    "update": lambda: update._CONFIG,
    "moments": lambda: moments._CONFIG,
    "edge": lambda: edge_features._OPTIONS,
}


def variants(spec: str = DEFAULT_VARIANTS):
    """(label, context factory) pairs from ``spec``: ``;``-separated ``mp:key=value,key=value`` (message-passing
    launch keys, ``_configured``), ``gemm:key=value`` (the Triton GEMM's ``_CONFIG``; ``AxBxC`` is a tuple),
    ``update:key=value`` (the update block's elementwise kernels, ``painn_update._CONFIG``) or
    ``ladder:key=value`` (the engine's default ``BucketLadder``, e.g. ``ladder:growth=1.125``) or
    ``model:species_table=0`` (``StudentModel``'s class switches: the first layer's φ from the MLP on every atom)
    or ``model:v_residual_alias=0`` (v itself, not the message block's alias, into the update: one add kernel
    per layer after the first) or ``model:species_inputs_fused=0`` (the species index, embedding, v = 0 and first
    φ rows as four torch launches, not kernels.species_inputs) or ``model:last_update_scalars_only=0`` (the last
    layer's update makes v' and a_vv too, as before stop 56) or ``moments:key=value``
    (``species_moments._CONFIG``, e.g. ``moments:model_min_edges=1000000000``: the first layer on the message
    kernel, ``moments:into_sink=0``) or ``edge:zero_in_forward=0`` (``edge_features._OPTIONS``) or ``seed:old=1``
    (the padded step's vector-Jacobian product through ``engine_padded._Seeded``, as before stop 45). Items joined
    by ``+`` are one variant with all their changes (e.g. ``edge:zero_in_forward=0+moments:into_sink=0``). The
    ``wall:`` and ``engine:`` prefixes and the readout's wall under ``gemm:`` went with their switches at stop 49,
    which measured no gain on the GPU (results/stop49_gpu/wall_packed_pdl_dropped.diff)."""
    out = []
    for item in filter(None, (v.strip() for v in spec.split(";"))):
        if "+" in item:
            parts = [ctx for _, ctx in variants(";".join(item.split("+")))]
            out.append((item, lambda parts=parts: _all_of(parts)))
            continue
        where, _, body = item.partition(":")
        changes = {k: _value(v) for k, v in (kv.split("=") for kv in body.split(","))}
        if where == "mp":
            unknown = set(changes) - set(mp._CONFIG)
            ctx = lambda c=changes: mp._configured(**c)  # noqa: E731
        elif where in _CONFIGS:  # a module's switch dict, patched for the variant's run
            config = _CONFIGS[where]()
            unknown = set(changes) - set(config)
            ctx = lambda c=changes, config=config: patched_config(config, **c)  # noqa: E731
        elif where == "model":
            unknown = set(changes) - {
                "species_table",
                "v_residual_alias",
                "species_inputs_fused",
                "last_update_scalars_only",
            }
            ctx = lambda c=changes: class_attrs(StudentModel, **{k: bool(v) for k, v in c.items()})  # noqa: E731
        elif where == "seed":  # seed:old=1: the padded step's VJP through _Seeded (one fill kernel more)
            unknown = set(changes) - {"old"}
            ctx = lambda c=changes: class_attrs(  # noqa: E731
                importlib.import_module("mlff_distiller.engine_padded"),
                **({"_engine_run_backward": None} if c.get("old") else {}),
            )
        elif where == "ladder":
            unknown = set(changes) - {f.name for f in dataclasses.fields(BucketLadder)}
            ctx = lambda c=changes: ladder_config(**c)  # noqa: E731
        else:
            raise ValueError(
                f"variant {item!r}: want mp:, gemm:, update:, moments:, edge:, model:, seed: or ladder:..."
            )
        if unknown:
            raise ValueError(f"variant {item!r}: unknown keys {sorted(unknown)}")
        out.append((item, ctx))
    return out


@contextlib.contextmanager
def _all_of(factories):
    """Every context of ``factories`` at once (a ``+``-joined variant)."""
    with contextlib.ExitStack() as stack:
        for factory in factories:
            stack.enter_context(factory())
        yield


def step(name: str, atoms, model, device, mode: str, precision: str = "fp32"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = StepImpl(f"ours {mode}", "ours", model, device, mode=mode, precision=precision)
    if not impl.available:
        raise RuntimeError(impl.why_unavailable)
    return impl.prepare(atoms, True)


def sweep(args, device) -> list[str]:
    import triton

    lines = [
        "# probe_ncu.py --mode sweep: launch options of the step's kernels (H100 session)",
        "",
        f"{torch.cuda.get_device_name(device)} · torch {torch.__version__} · triton {triton.__version__} · "
        f"student weights {STUDENT_WEIGHTS}",
        "",
        f"Student: width {args.hidden or 'as shipped'}, layers {args.layers or 'as shipped'}. "
        f"Step alone ({args.step_mode}, precision {args.precision}), median of triton.testing.do_bench (ms). Each "
        "variant is timed right after a fresh shipped run of the same system; ratio = shipped / variant (> 1: the "
        "variant is faster).",
        "",
        "| system | variant | shipped ms | variant ms | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    t_end = time.perf_counter() + args.budget_s
    for name in args.systems:
        atoms, model = structures(name, args.hidden, args.layers)
        model = model.to(device)
        base_run = step(name, atoms, model, device, args.step_mode, args.precision)
        base_run()
        for label, ctx in variants(args.variants):
            if time.perf_counter() > t_end:
                lines.append(f"| {name} | {label} | skipped: budget | | |")
                continue
            try:
                t_base = triton.testing.do_bench(base_run, warmup=50, rep=300, return_mode="median")
                with ctx():
                    eager = args.step_mode == "eager"
                    run = base_run if eager else step(name, atoms, model, device, args.step_mode, args.precision)
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
        atoms, model = structures(name, args.hidden, args.layers)
        run = step(name, atoms, model.to(device), device, args.step_mode, args.precision)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        # Profiled between cudaProfilerStart/Stop (ncu --profile-from-start off): NVTX ranges are per thread, and
        # the backward's kernels are launched from autograd's device thread.
        torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push(f"measure_{name}")
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        torch.cuda.profiler.stop()
        print(f"measured {name}", flush=True)


_NCU_KEYS = {
    "Duration": "µs",
    "Registers Per Thread": "regs",
    "Theoretical Occupancy": "theor. occ. %",
    "Achieved Occupancy": "occ. %",
    "Issue Slots Busy": "issue %",
    "Eligible Warps Per Scheduler": "eligible warps",
    "L1/TEX Cache Throughput": "L1 %",
    "L2 Cache Throughput": "L2 %",
    "DRAM Throughput": "DRAM %",
    "Dynamic Shared Memory Per Block": "smem KB",
}


def ncu_summary(paths: list[Path]) -> list[str]:
    """One table row per profiled kernel of Nsight Compute's text reports (``--log-file``): time, registers,
    occupancy, issue-slot use, eligible warps, cache and DRAM throughput, and the three largest stall reasons
    (cycles per issued instruction)."""
    lines = [
        "| report | kernel | grid | " + " | ".join(_NCU_KEYS.values()) + " | top stalls (cycles / issue) |",
        "|---|---|---|" + "---:|" * len(_NCU_KEYS) + "---|",
    ]
    for path in paths:
        blocks = re.split(r"\n  (?=[_a-zA-Z]\w* \(\d+, \d+, \d+\)x\()", path.read_text())
        for block in blocks[1:]:
            head = block.split("\n")[0]
            name, grid = head.split(" (")[0], "(" + head.split(" (")[1].split(")")[0] + ")"
            vals = []
            for key in _NCU_KEYS:
                m = re.search(r"\n\s+" + re.escape(key) + r"\s+(?:\S+\s+)?([\d.,]+)\n", block)
                unit = re.search(r"\n\s+" + re.escape(key) + r"\s+(\S+)\s+[\d.,]+\n", block)
                v = m.group(1).replace(",", "") if m else ""
                if key == "Duration" and unit and unit.group(1) == "ms" and v:
                    v = f"{float(v) * 1e3:.1f}"
                vals.append(v)
            stalls = {
                m.group(1): float(m.group(2))
                for m in re.finditer(r"issue_stalled_(\w+)_per_issue_active\.ratio\s+inst\s+([\d.]+)", block)
            }
            top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:3])
            lines.append(f"| {path.name} | {name} | {grid} | " + " | ".join(vals) + f" | {top} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("sweep", "ncu", "summary"), default="sweep")
    p.add_argument("reports", nargs="*", type=Path, help="--mode summary: Nsight Compute text reports")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="see variants()")
    p.add_argument("--step-mode", default="cudagraph", choices=("cudagraph", "eager"))
    p.add_argument("--precision", default="fp32", help="the engine's precision (fp32, tf32, bf16, ...)")
    p.add_argument("--hidden", type=int, default=None, help="student width (default: the system's student, 128)")
    p.add_argument("--layers", type=int, default=None, help="student depth (default: 3)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = {s for s in args.systems if s not in SYSTEMS and not re.fullmatch(r"(water|g2x)\d+|benzene", s)}
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; known: {SYSTEMS}, waterN / g2xN, or benzene")
    if args.mode == "summary":
        print("\n".join(ncu_summary(args.reports)))
        return 0
    if not torch.cuda.is_available():
        print("probe_ncu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    if args.mode == "ncu":
        ncu(args, device)
        return 0
    lines = sweep(args, device)
    path = write_lines(lines, args.out, "probe_ncu_sweep")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
