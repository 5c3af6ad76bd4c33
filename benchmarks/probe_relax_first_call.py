"""Where a relaxation's first call goes (a probe, prepared at stop 40 for the next GPU session).

``probe_relax_file.py`` measured 16,384 g2 relaxations at 11.6-16.7 s in their first run and 9.3-10.5 s in their
second, in one process with the engine kept: every run meets new bucket sizes as its batch shrinks. This probe
relaxes the same structures twice per setting, each setting in a fresh engine (``clear_engine_cache``), and counts
per call: wall seconds, engine calls (FIRE steps of the batch), buckets captured, the seconds spent inside the
engine's captures (``ForceEngine._capture``: compile-ahead dry run, warm-up and capture) and the distinct batch
sizes met. Settings: the engine's ``capture_after`` (0, relax's default: a bucket is captured at first use; 1 and
4: captured at its second / fifth use, the first ones eager) and ``mode="eager"``.

    python benchmarks/probe_relax_first_call.py --out benchmarks/results --name probe_relax_first_call_h100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batched_relax import rattled
from harness import environment, sync, write_lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_relax_first_call_h100")
    ap.add_argument("--structures", type=int, default=16384)
    ap.add_argument("--settings", default="capture_after=0,capture_after=1,capture_after=4,eager")
    ap.add_argument("--model", default="builtin:chno-gfn2")
    args = ap.parse_args(argv)
    import mlff_distiller.batched_relax as br
    from mlff_distiller import load_model
    from mlff_distiller.engine import ForceEngine
    from mlff_distiller.predict import clear_engine_cache

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, 0.0)
    model = load_model(args.model)
    structures = rattled(args.structures)
    lines = [
        "# A relaxation's first call against its second (probe_relax_first_call.py)",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · {args.model}, fp32",
        "",
        f"{args.structures} rattled g2 molecules, fmax 0.05, relax_batch called twice per setting on a fresh engine. "
        "capture s: inside the engine's bucket captures (compile-ahead dry run, warm-up, capture).",
        "",
        "| setting | call | seconds | engine calls | buckets captured | capture s | distinct batch sizes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    real_make, real_capture, real_compute = br.batch_engine, ForceEngine._capture, ForceEngine.compute
    for setting in [s.strip() for s in args.settings.split(",") if s.strip()]:
        key, _, value = setting.partition("=")
        extra = {"capture_after": int(value)} if key == "capture_after" else {}
        mode = "eager" if key == "eager" else "auto"
        clear_engine_cache()

        def make(*a, extra=extra, **kw):
            engine = real_make(*a, **kw)
            for name, v in extra.items():
                setattr(engine, name, v)
            return engine

        counts = {"capture_s": 0.0, "captures": 0, "calls": 0, "sizes": set()}

        def capture(self, *a, counts=counts, **kw):
            sync(device)
            t0 = time.perf_counter()
            try:
                return real_capture(self, *a, **kw)
            finally:
                sync(device)
                counts["capture_s"] += time.perf_counter() - t0
                counts["captures"] += 1

        def compute(self, batch, counts=counts, **kw):
            counts["calls"] += 1
            counts["sizes"].add(int(batch.num_atoms))
            return real_compute(self, batch, **kw)

        br.batch_engine, ForceEngine._capture, ForceEngine.compute = make, capture, compute
        try:
            for call in (1, 2):
                for k in ("capture_s", "captures", "calls"):
                    counts[k] = 0 if k != "capture_s" else 0.0
                counts["sizes"] = set()
                sync(device)
                t0 = time.perf_counter()
                br.relax_batch(model, structures, device=device, mode=mode)
                sync(device)
                seconds = time.perf_counter() - t0
                lines.append(
                    f"| {setting} | {call} | {seconds:.2f} | {counts['calls']} | {counts['captures']} | "
                    f"{counts['capture_s']:.2f} | {len(counts['sizes'])} |"
                )
                print(lines[-1], flush=True)
        finally:
            br.batch_engine, ForceEngine._capture, ForceEngine.compute = real_make, real_capture, real_compute
    clear_engine_cache()
    write_lines(lines, args.out, args.name)
    return lines


if __name__ == "__main__":
    main()
