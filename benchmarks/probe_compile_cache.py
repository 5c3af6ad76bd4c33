"""Does a warm compile cache make a second process's ``torch.compile`` start fast? (a probe)

bench_engine's start-up rows (stop 80, ``results/stop80_gpu/b/``) gave the compiled fast path (``mode="cudagraph"``
with ``compile_mode="default"``) 10.56 s cold and 11.52 s warm: the cache directory did not shorten it, where the
plain captured path went 5.44 -> 1.15 s. This probe runs the same start-up in two fresh processes over one cache
directory and has each child report, besides its phases' seconds, torch's own cache counters (FX graph cache and
AOTAutograd cache hits, misses and bypasses), the reasons torch logs for a bypass, and Dynamo's compile-time table,
so the cold and warm children can be compared stage by stage.

    python benchmarks/probe_compile_cache.py [--device cuda] [--compile-mode default] [--out DIR --name NAME]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines
from peers import make_student

# torch's loggers that say why a graph skipped a cache
_CACHE_LOGGERS = (
    "torch._functorch._aot_autograd.autograd_cache",
    "torch._inductor.codecache",
    "torch._inductor.compile_fx",
    "torch._dynamo.convert_frame",
)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(k in msg.lower() for k in ("bypass", "cache hit", "cache miss", "recompil")):
            self.lines.append(f"{record.name}: {msg[:300]}")


def child(args) -> None:
    from ase.build import molecule

    from mlff_distiller import AtomsBatch, ForceEngine, load_model

    handler = _Collect()
    for name in _CACHE_LOGGERS:
        lg = logging.getLogger(name)
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    if args.device == "cuda":
        torch.cuda.init()
    t0 = time.perf_counter()
    model = load_model(args.child)
    t1 = time.perf_counter()
    engine = ForceEngine(
        model, device=args.device, mode=args.mode, compile_mode=args.compile_mode, cache_dir=args.cache_dir
    )
    t2 = time.perf_counter()
    engine.compute(AtomsBatch.from_atoms(molecule("C6H6")), to_host=True)
    t3 = time.perf_counter()
    engine.compute(AtomsBatch.from_atoms(molecule("C6H6")), to_host=True)
    t4 = time.perf_counter()
    from torch._dynamo.utils import compile_times, counters

    out = dict(
        load_s=t1 - t0,
        engine_s=t2 - t1,
        first_result_s=t3 - t0,
        first_compute_s=t3 - t2,
        second_call_ms=1e3 * (t4 - t3),
        counters={k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd", "stats", "frames")},
        compile_times=compile_times(repr="str", aggregate=True),
        cache_log=handler.lines[:40],
    )
    print("RESULT " + json.dumps(out, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mode", default="cudagraph")
    ap.add_argument("--compile-mode", default="default")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="probe_compile_cache")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    lines = [
        f"# {__doc__.splitlines()[0]}",
        "",
        f"torch {torch.__version__}, device {args.device}, mode "
        f"{args.mode}, compile_mode {args.compile_mode}, student {args.hidden} x 3 (random weights)",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "student.pt"
        make_student(hidden=args.hidden, layers=3).save(ckpt)
        for phase in ("cold", "warm"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                str(ckpt),
                "--cache-dir",
                str(Path(tmp) / "cache"),
                "--device",
                args.device,
                "--mode",
                args.mode,
                "--compile-mode",
                args.compile_mode,
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            got = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
            lines += [f"## {phase}", ""]
            if not got:
                lines += ["```", res.stderr[-3000:], "```", ""]
                continue
            r = json.loads(got[-1][len("RESULT ") :])
            lines += [
                f"load {r['load_s']:.2f} s, engine {r['engine_s']:.2f} s, first compute {r['first_compute_s']:.2f} s, "
                f"first result {r['first_result_s']:.2f} s, second call {r['second_call_ms']:.2f} ms",
                "",
                "counters: `" + json.dumps(r["counters"]) + "`",
                "",
                "```",
                str(r["compile_times"]),
                "```",
                "",
                "cache log:",
                "",
                *[f"- {x}" for x in r["cache_log"]],
                "",
            ]
    if args.out:
        write_lines(lines, Path(args.out), args.name)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
