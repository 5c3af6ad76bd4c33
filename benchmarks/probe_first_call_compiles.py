"""Which Triton kernels a process with an empty cache compiles during its first relaxation, and where (a probe).

Stop 41 measured the first ``relax_batch`` of 16,384 g2 molecules at 27.1 s with empty Triton and Inductor caches
against 6.1 s with the kernels compiled (``results/stop41_gpu/``), of which ~8 s were inside the buckets' captures
(compiled ahead, in parallel) and ~13 s outside them. This probe names the kernels behind those ~13 s: it wraps
Triton's ``JITFunction._do_compile`` and ``ForceEngine._capture``, runs one relaxation in this fresh process with
``TRITON_CACHE_DIR`` pointing at an empty directory, and writes per kernel: compiles, seconds of synchronous
compilation (a compile ahead returns at once: its time is not counted), and where (inside a capture, inside a
compile-ahead dry run, or elsewhere).

    python benchmarks/probe_first_call_compiles.py --out benchmarks/results --name probe_first_call_compiles_h100
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batched_relax import rattled
from harness import environment, sync, write_lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_first_call_compiles_h100")
    ap.add_argument("--structures", type=int, default=4096)
    ap.add_argument("--model", default="builtin:chno-gfn2")
    args = ap.parse_args(argv)
    from unittest import mock

    # Empty caches for this run (Triton and Inductor read these when they first look a kernel up); the process's
    # own settings come back afterwards.
    empty = {
        "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton_empty_"),
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor_empty_"),
    }
    with mock.patch.dict(os.environ, empty):
        return _run(args)


def _run(args) -> list[str]:
    import triton.runtime.jit as jit
    from mlff_distiller.kernels._compile_ahead import dry_run_active

    from mlff_distiller import load_model
    from mlff_distiller.batched_relax import relax_batch
    from mlff_distiller.engine import ForceEngine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, 0.0)
    model = load_model(args.model)
    structures = rattled(args.structures)
    in_capture = [0]
    rows: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    real_compile, real_capture = jit.JITFunction._do_compile, ForceEngine._capture

    specs: dict[str, list[str]] = collections.defaultdict(list)  # kernel -> what set each compile apart

    def do_compile(self, *a, **kw):
        where = "capture" if in_capture[0] else "elsewhere"
        where = f"{where}, dry run" if dry_run_active() else where
        name = getattr(self, "__name__", None) or self.fn.__name__
        specs[name].append(f"{where}: {_specialisation(self, *a, **kw)}")
        t0 = time.perf_counter()
        try:
            return real_compile(self, *a, **kw)
        finally:
            rows[(name, where)].append(time.perf_counter() - t0)

    def capture(self, *a, **kw):
        in_capture[0] += 1
        try:
            return real_capture(self, *a, **kw)
        finally:
            in_capture[0] -= 1

    jit.JITFunction._do_compile, ForceEngine._capture = do_compile, capture
    try:
        times = []
        for _ in range(2):
            sync(device)
            t0 = time.perf_counter()
            relax_batch(model, structures, device=device)
            sync(device)
            times.append(time.perf_counter() - t0)
            print("call", len(times), f"{times[-1]:.2f} s", flush=True)
    finally:
        jit.JITFunction._do_compile, ForceEngine._capture = real_compile, real_capture
    lines = [
        "# Triton compiles of a first relaxation with empty caches (probe_first_call_compiles.py)",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · {args.model}, fp32",
        "",
        f"{args.structures} rattled g2 molecules, relax_batch twice in one fresh process: "
        f"{times[0]:.2f} s, then {times[1]:.2f} s. seconds: synchronous compilation in `_do_compile` (a compile "
        "ahead is handed to a thread pool and returns at once). where: inside a bucket's capture or elsewhere; "
        "dry run: inside a compile-ahead dry run.",
        "",
        "| kernel | where | compiles | seconds |",
        "|---|---|---:|---:|",
    ]
    order = sorted(rows.items(), key=lambda kv: -sum(kv[1]))
    for (name, where), ts in order:
        lines.append(f"| {name} | {where} | {len(ts)} | {sum(ts):.2f} |")
    total = collections.defaultdict(float)
    for (_, where), ts in rows.items():
        total[where] += sum(ts)
    lines += ["", "| where | seconds |", "|---|---:|", *(f"| {w} | {s:.2f} |" for w, s in sorted(total.items()))]
    lines += [
        "",
        f"MLFF_DISTILLER_SPECIALIZE_COUNTS={os.environ.get('MLFF_DISTILLER_SPECIALIZE_COUNTS', '0')}. What set the "
        "compiles of a kernel apart (constexprs and Triton's specialisation attributes, by argument name), for each "
        "kernel compiled more than once:",
        "",
    ]
    for name, seen in sorted(specs.items()):
        if len(seen) > 1:
            lines += [f"- {name}:", *(f"  - {x}" for x in seen)]
    write_lines(lines, args.out, args.name)
    print("\n".join(lines))
    return lines


def _specialisation(fn, key, signature, device, constexprs, options, attrs, *rest) -> str:
    """The compile's constexprs and specialisation attributes (divisibility, alignment) by argument name
    (Triton 3.6-3.9 ``_do_compile(key, signature, device, constexprs, options, attrs, warmup)``)."""
    names = list(getattr(fn, "arg_names", []))

    def named(path) -> str:
        i = path[0] if isinstance(path, tuple) and path else path
        return names[i] if isinstance(i, int) and i < len(names) else str(path)

    try:
        const = ", ".join(
            f"{named(k)}={v}" for k, v in sorted(constexprs.items(), key=lambda kv: str(kv[0])) if named(k) != "PDL"
        )
        spec = ", ".join(f"{named(k)}:{v}" for k, v in sorted(attrs.items(), key=lambda kv: str(kv[0])))
        return f"[{const}] [{spec}]"
    except Exception as exc:  # another Triton's layout: say so, keep the run
        return f"(unreadable: {type(exc).__name__})"


if __name__ == "__main__":
    main()
