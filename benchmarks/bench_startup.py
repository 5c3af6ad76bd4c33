"""Cold vs warm start: fresh processes from ``import torch`` to the first benzene energy + forces.

The parent runs one child process per (variant, phase). "cold" is a new, empty compile/Triton cache directory
(``ForceEngine(cache_dir=...)``: Inductor and Triton caches), "warm" a second process on the same directory.
The child imports nothing heavy before its clock starts, so ``import torch``, ``from ase.build import molecule``
(the input's builder), ``import mlff_distiller`` (or ``sevenn``) and model load → first result are timed apart.
Before stop 26's last runs, the package's column included ase.build's import.

    python benchmarks/bench_startup.py [--device cuda] [--out benchmarks/results] [--variants auto] [--name NAME]
        [--profile]

``--variants`` picks the variants by their first word (``auto``, ``cudagraph``; default all of the device's);
``--profile`` has each child of ours write a cProfile table of its load → first result phase (the 30 largest
cumulative entries) next to the JSON, as ``<name>_profile_<variant>_<phase>.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["DEFAULT_VARIANTS", "run_startup"]

# (label, child arguments); eager and auto share the cold cost on CUDA (the Triton JIT of our kernels).
DEFAULT_VARIANTS = {
    "cuda": [
        ("auto (CUDA graphs)", ["--mode", "auto"]),
        ("cudagraph + compile default", ["--mode", "cudagraph", "--compile-mode", "default"]),
    ],
    "cpu": [("eager", ["--mode", "eager"])],
}


def _sync(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def child(args) -> dict:
    """Time one fresh start; returns seconds for each phase, the second call in ms and (ours) the median of the
    next 20 calls in ms."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 - timed on its own

    t0b = time.perf_counter()
    from ase.build import molecule  # the input's builder, not the package: timed on its own (0.4-0.8 s, scipy)

    atoms = molecule("C6H6")
    t1 = time.perf_counter()
    if args.peer == "sevennet":
        import warnings

        warnings.simplefilter("ignore")
        from sevenn.calculator import SevenNetCalculator

        t2 = time.perf_counter()
        atoms.calc = SevenNetCalculator("7net-0", device=args.device)
        atoms.get_forces()
        _sync(args.device)
        t3 = time.perf_counter()
        atoms.rattle(1e-3)
        atoms.get_forces()
        _sync(args.device)
        t4 = time.perf_counter()
    else:
        import warnings

        from mlff_distiller import AtomsBatch, ForceEngine, load_model

        t2 = time.perf_counter()
        prof = None
        if args.profile_out:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = ForceEngine(
                load_model(args.checkpoint),
                device=args.device,
                mode=args.mode,
                compile_mode=args.compile_mode,
                cache_dir=args.cache_dir,
            )
            engine.compute(AtomsBatch.from_atoms(atoms), to_host=True)
            t3 = time.perf_counter()
            if prof is not None:
                import io
                import pstats

                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
                Path(args.profile_out).write_text(text.getvalue())
            engine.compute(AtomsBatch.from_atoms(atoms), to_host=True)
            t4 = time.perf_counter()
            steady = []
            for _ in range(20):
                t = time.perf_counter()
                engine.compute(AtomsBatch.from_atoms(atoms), to_host=True)
                steady.append(time.perf_counter() - t)
    row = {
        "import_torch_s": t0b - t0,
        "import_ase_build_s": t1 - t0b,
        "import_package_s": t2 - t1,
        "first_result_s": t3 - t2,
        "second_call_ms": 1e3 * (t4 - t3),
    }
    if args.peer != "sevennet":
        row["steady_call_ms"] = 1e3 * sorted(steady)[len(steady) // 2]  # calls 3-22, median
    return row


def run_startup(
    model, device: str, time_left, variants=None, sevennet: bool = False, profile_prefix: Path | None = None
) -> list[dict]:
    """Run the cold/warm children for ``model`` (saved to a temporary checkpoint) on ``device``.

    ``time_left()`` gives the seconds the caller still has; a child that would not fit is reported as skipped.
    Returns one row per child: ``impl``, ``phase`` and :func:`child`'s fields (or ``skipped`` / ``error``).
    ``profile_prefix``: our children write their load → first result profile to ``<prefix>_<variant>_<phase>.txt``."""
    import torch

    kind = torch.device(device).type
    variants = DEFAULT_VARIANTS.get(kind, DEFAULT_VARIANTS["cpu"]) if variants is None else variants
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "student.pt"
        model.save(ckpt)
        jobs = [(label, phase, extra) for label, extra in variants for phase in ("cold", "warm")]
        if sevennet:
            jobs.append(("SevenNet-0 (ASE calculator)", "cold", ["--peer", "sevennet"]))
        # The children choose their own cache directories: the parent's must not leak into them.
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        for label, phase, extra in jobs:
            row = {"section": "startup", "impl": label, "kind": "peer" if "SevenNet" in label else "ours"}
            row["phase"] = phase
            need = 90 if "compile" in label else 25
            if time_left() < need:
                rows.append({**row, "skipped": "time budget"})
                continue
            cache = Path(tmp) / "".join(c if c.isalnum() else "_" for c in label)
            cmd = [sys.executable, __file__, "--child", str(ckpt), "--cache-dir", str(cache), "--device", device]
            if profile_prefix is not None and row["kind"] == "ours":
                cmd += ["--profile-out", f"{profile_prefix}_{label.split()[0]}_{phase}.txt"]
            t0 = time.perf_counter()
            try:
                res = subprocess.run(
                    [*cmd, *extra], capture_output=True, text=True, env=env, timeout=max(20, time_left() - 10)
                )
                lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
                if lines:
                    row.update(json.loads(lines[-1]))
                else:
                    row["error"] = (res.stderr.strip().splitlines() or ["no output"])[-1][:200]
            except subprocess.TimeoutExpired:
                row["error"] = "timed out"
            row["process_wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--compile-mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variants", default=None, help="comma-separated first words of the variants to run")
    p.add_argument("--name", default=None, help="output file stem (default bench_startup_<cpu|gpu>)")
    p.add_argument("--profile", action="store_true", help="profile each of our children's load -> first result")
    args = p.parse_args(argv)
    if args.child:
        args.checkpoint = args.child
        print(json.dumps(child(args)), flush=True)
        return 0
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import environment
    from peers import make_student

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = torch.device(device).type
    variants = DEFAULT_VARIANTS.get(kind, DEFAULT_VARIANTS["cpu"])
    if args.variants:
        wanted = {w.strip() for w in args.variants.split(",") if w.strip()}
        unknown = wanted - {label.split()[0] for label, _ in variants}
        if unknown:
            p.error(
                f"unknown variants {sorted(unknown)} for {kind}; choose from {[lb.split()[0] for lb, _ in variants]}"
            )
        variants = [(label, extra) for label, extra in variants if label.split()[0] in wanted]
    name = args.name or f"bench_startup_{'cpu' if device == 'cpu' else 'gpu'}"
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_startup(
        make_student(),
        device,
        lambda: 600.0,
        variants=variants,
        profile_prefix=(args.out / f"{name}_profile") if args.profile else None,
    )
    env = environment(torch.device(device), float("nan"))
    (args.out / f"{name}.json").write_text(json.dumps({"env": env.__dict__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
