"""Why one ASE MD step of benzene takes ~135 µs in one process and ~230 µs in the next on the same GPU machine
(issue 5's "≤ 0.20 ms per MD step"; stop 74 measured 229.0 and 136.1 µs in two fresh processes of one call).

One fresh process per run of this probe; the shell around it pins the process (``taskset -c``) or not. It prints
one JSON line: the CPUs the process may run on and the ones its main thread was seen on, the core's speed on pure
host work (a fixed NumPy + Python loop, µs), ASE's integrator with a calculator that hands back stored forces (the
host floor, µs a step), one tiny kernel launch + ``synchronize`` (the launch and wait latency, µs) and the MD step
through ``StudentCalculator`` (the shipped 64 x 3 student, fp32, mode auto: the dense step; median µs of three
rounds in the one process).

    taskset -c 3 python benchmarks/probe_md_affinity.py --label core3 >> rows.jsonl
    python benchmarks/probe_md_affinity.py --table rows.jsonl > table.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import host_work_us, wall_us
from probe_md_step import _benzene, _md_us, stored_calculator


def _cpu_now() -> int:
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39: the CPU last run on
    except (OSError, ValueError, IndexError):
        return -1


def measure(label: str, steps: int, model: str) -> dict:
    from mlff_distiller import StudentCalculator, load_model

    seen = {_cpu_now()}
    row = {"label": label, "allowed": sorted(os.sched_getaffinity(0)), "host_work_us": host_work_us()}

    atoms = _benzene()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator(load_model(model), device="cuda", precision="fp32")
    atoms.calc = calc
    forces = atoms.get_forces().copy()
    floor = _benzene()
    row["ase_floor_us"] = _md_us(floor, stored_calculator(forces), steps)[0]
    seen.add(_cpu_now())
    md = []
    for _ in range(3):  # three rounds: does one process stay fast or slow?
        med, p20 = _md_us(atoms, calc, steps)
        md.append(med)
        seen.add(_cpu_now())
    row["md_us_rounds"] = md
    row["md_us"] = float(np.median(md))
    row["md_p20_us"] = p20
    x = torch.ones(16, device="cuda")

    def launch_sync():
        x.add_(1.0)
        torch.cuda.synchronize()

    row["launch_sync_us"] = wall_us(launch_sync, 3000)[0]
    row["host_work_us_after"] = host_work_us()
    row["cpus_seen"] = sorted(seen)
    return row


def table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    out = [
        "| run | allowed CPUs | CPUs seen | host work µs (before / after) | ASE floor µs | launch + sync µs | "
        "MD step µs (3 rounds) | median |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        allowed = r["allowed"]
        allowed = f"{allowed[0]}-{allowed[-1]}" if len(allowed) > 2 else ",".join(map(str, allowed))
        out.append(
            f"| {r['label']} | {allowed} | {','.join(map(str, r['cpus_seen']))} | {r['host_work_us']:.1f} / "
            f"{r['host_work_us_after']:.1f} | {r['ase_floor_us']:.1f} | {r['launch_sync_us']:.1f} | "
            f"{' / '.join(f'{x:.1f}' for x in r['md_us_rounds'])} | **{r['md_us']:.1f}** |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default="unpinned")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--model", default="builtin:chno-gfn2-small")
    p.add_argument("--table", type=Path, help="print the markdown table of a file of this probe's JSON lines")
    args = p.parse_args(argv)
    if args.table is not None:
        print(table(args.table), end="")
        return
    if not torch.cuda.is_available():
        print("probe_md_affinity: needs CUDA")
        return
    t0 = time.perf_counter()
    row = measure(args.label, args.steps, args.model)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    row["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(row))


if __name__ == "__main__":
    main()
