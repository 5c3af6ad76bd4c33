"""Samples/s of data-parallel training (issue 6: 2 GPUs must give >= 1.7x the samples/s of one).

Labels a fixed set of small molecules with EMT once (cheap, no GPU), then runs the same training for
``--steps`` steps under ``torchrun`` with 1 and with ``--gpus`` processes (global batch fixed, so each rank's
share shrinks) and compares the steady samples/s (``TrainResult.steady_step_seconds``, after warm-up and
excluding validations). Writes ``<out>/bench_ddp.md`` and ``.json``.

    python benchmarks/bench_ddp.py --gpus 2 --out DIR           # needs 2 GPUs (or --device cpu: gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

_CHILD = """
import json, os, sys
import torch
from mlff_distiller.distill import TrainConfig, read_frames, split_frames, train

labels, out, device, steps, batch, hidden = sys.argv[1:7]
train_f, val_f = split_frames(read_frames(labels), 0.1)
cfg = TrainConfig(
    model=dict(species=[1, 6, 7, 8], hidden=int(hidden), layers=3, n_rbf=20, cutoff=5.0), batch_size=int(batch),
    lr=1e-3, warmup_steps=10, eval_every=10**6, ema_decay=0.99, device=device, patience=0, max_steps=int(steps),
    train_step="plain",
)
res = train(train_f, val_f, cfg)
if os.environ.get("RANK", "0") == "0":
    with open(out, "w") as f:
        json.dump({"steps": res.steps, "steady_step_seconds": res.steady_step_seconds, "seconds": res.seconds}, f)
"""


def _label(directory: Path, frames: int) -> None:
    from ase.build import molecule

    from mlff_distiller.distill import SamplingConfig, label

    if (directory / "frames.db").exists():
        return
    seeds = [molecule(n) for n in ("CH3CH2OH", "CH3COOH", "C6H6", "CH3NO2", "CH3OH", "C2H6")]
    per_seed = max(1, frames // len(seeds))
    cfg = SamplingConfig(temperatures=[300.0], md_steps=0, sample_every=1, timestep_fs=0.5, rattle_per_seed=per_seed)
    label(seeds, "emt", directory, cfg, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64, help="global batch (frames)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--frames", type=int, default=2048)
    ap.add_argument("--work", default="/tmp/bench_ddp")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from harness import environment

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    _label(work / "labels", args.frames)
    script = work / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for n in (1, args.gpus):
        res_path = work / f"result{n}.json"
        res_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), str(script)]
        cmd += [str(work / "labels"), str(res_path), args.device, str(args.steps), str(args.batch), str(args.hidden)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            rows.append({"processes": n, "error": proc.stderr[-800:]})
            continue
        r = json.loads(res_path.read_text())
        r.update(processes=n, wall_s=wall, samples_per_s=args.batch / r["steady_step_seconds"])
        rows.append(r)
    ok = [r for r in rows if "samples_per_s" in r]
    speedup = ok[-1]["samples_per_s"] / ok[0]["samples_per_s"] if len(ok) == 2 else float("nan")
    import torch

    dev = torch.device("cuda" if args.device.startswith("cuda") and torch.cuda.is_available() else "cpu")
    e = environment(dev, float("nan"))
    gpus = torch.cuda.device_count() if dev.type == "cuda" else 0
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    env_info = f"{e.device} x{gpus} · torch {e.torch} · triton {e.triton} · commit {e.commit} · {stamp}"
    lines = [
        "# Data-parallel training throughput (benchmarks/bench_ddp.py)",
        "",
        f"{env_info}",
        "",
        f"Global batch {args.batch} frames, {args.steps} steps, hidden {args.hidden}, device {args.device}, "
        f"EMT-labelled rattled molecules ({args.frames} frames). Steady = after warm-up, validations excluded.",
        "",
        "| processes | steady ms/step | samples/s | wall s |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['processes']} | error: {r['error'][-200:]!r} | | |")
        else:
            ms = 1000 * r["steady_step_seconds"]
            lines.append(f"| {r['processes']} | {ms:.2f} | {r['samples_per_s']:.1f} | {r['wall_s']:.1f} |")
    verdict = "PASS" if speedup >= 1.7 else "FAIL"
    lines += ["", f"Speed-up {args.gpus} vs 1: **{speedup:.2f}x** (target >= 1.7x: {verdict})"]
    text = "\n".join(lines) + "\n"
    (out / "bench_ddp.md").write_text(text)
    (out / "bench_ddp.json").write_text(json.dumps({"rows": rows, "speedup": speedup, "env": str(env_info)}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
