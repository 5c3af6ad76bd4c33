"""Several students on the same labelled frames, in one process: the table that decides which one ships.

    python benchmarks/compare_students.py --test runs/chno_gfn2/test_labels \
        --model shipped=builtin:chno-gfn2 --model new=runs/x/results/x.pt --out results/compare

For each ``NAME=MODEL`` (a checkpoint path or ``builtin:NAME``): its size (features, layers, parameters), whether its
weights are on the TF32 grid (what ships, ``StudentModel.round_weights_tf32``), the training it records (steps,
seconds, batch, learning rate, device), and its errors against the frames' teacher labels, in all and per value of
each ``--by`` info key (``temperature`` by default; ``formula`` groups by molecule), predicted through
``ForceEngine`` in ``--precision`` (fp32 by default) on ``--device``. Writes ``<out>.md`` (the tables) and
``<out>.json`` (every number) and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def describe(model, ckpt_meta: dict) -> dict:
    """Size, TF32 grid and recorded training of one student."""
    cfg = model.config
    train = {
        k: ckpt_meta.get(k)
        for k in ("train_seconds", "train_device", "train_frames", "val", "recipe")
        if ckpt_meta.get(k) is not None
    }
    return {
        "hidden": int(cfg.hidden),
        "layers": int(cfg.layers),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "tf32_grid": bool(model.on_tf32_grid()),
        "training": train,
    }


def compare(test_dir: str, models: list[tuple[str, str]], *, device: str, precision: str, by: list[str]) -> dict:
    """Errors of each ``(name, model)`` on the frames in ``test_dir``; see the module docstring."""
    from mlff_distiller import load_model
    from mlff_distiller.distill import error_metrics, grouped_error_metrics, predict_frames, read_frames

    frames = read_frames(test_dir)
    if not frames:
        raise ValueError(f"no labelled frames in {test_dir}")
    out: dict = {
        "test": str(test_dir),
        "frames": len(frames),
        "atoms": int(sum(len(a) for a in frames)),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
        "precision": precision,
        "torch": torch.__version__,
        "students": {},
    }
    for name, spec in models:
        model = load_model(spec)
        meta = dict(getattr(model, "metadata", None) or {})
        t0 = time.perf_counter()
        preds = predict_frames(model, frames, device=device, precision=precision)
        seconds = time.perf_counter() - t0
        m = error_metrics(frames, preds)
        entry = {
            "model": spec,
            **describe(model, meta),
            "predict_seconds": seconds,
            "all": {k: v for k, v in m.items() if not k.startswith("_")},
            "by": {key: grouped_error_metrics(frames, preds, key) for key in by},
        }
        out["students"][name] = entry
    return out


def markdown(result: dict) -> str:
    lines = [
        f"# Students on {result['frames']} held-out frames ({result['atoms']} atoms), one process",
        "",
        f"{result['device']}, torch {result['torch']}, precision {result['precision']}; frames: `{result['test']}`.",
        "",
        "| student | model | features x layers | parameters | TF32 grid | energy MAE (meV/atom) | energy RMSE "
        "| force MAE (meV/Å) | force RMSE (meV/Å) | trained |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for name, s in result["students"].items():
        a, t = s["all"], s["training"]
        trained = ", ".join(
            x
            for x in (
                f"{t['train_seconds']:.0f} s" if "train_seconds" in t else "",
                str(t.get("train_device", "")),
            )
            if x
        )
        lines.append(
            f"| {name} | `{s['model']}` | {s['hidden']} x {s['layers']} | {s['parameters']:,} | "
            f"{'yes' if s['tf32_grid'] else 'no'} | {_fmt(a['energy_mae_mev_atom'], 3)} | "
            f"{_fmt(a['energy_rmse_mev_atom'], 3)} | **{_fmt(a['force_mae_mev_a'])}** | "
            f"{_fmt(a['force_rmse_mev_a'])} | {trained or '—'} |"
        )
    names = list(result["students"])
    keys = sorted({key for s in result["students"].values() for key in s["by"]})
    for key in keys:
        values: list[str] = []
        for s in result["students"].values():
            values += [v for v in s["by"].get(key, {}) if v not in values]
        lines += [
            "",
            f"Force MAE (meV/Å) by `{key}`:",
            "",
            f"| {key} | frames | " + " | ".join(names) + " |",
            "|---|---:|" + "---:|" * len(names),
        ]
        for v in values:
            frames = next(s["by"][key][v]["frames"] for s in result["students"].values() if v in s["by"].get(key, {}))
            cells = [_fmt(s["by"].get(key, {}).get(v, {}).get("force_mae_mev_a")) for s in result["students"].values()]
            lines.append(f"| {v} | {frames} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--test", required=True, help="folder of labelled frames (read_frames)")
    ap.add_argument("--model", action="append", required=True, metavar="NAME=MODEL", help="a student to compare")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--by", action="append", default=None, help="info keys to group by (default: temperature)")
    ap.add_argument("--out", default=None, help="writes <out>.md and <out>.json")
    args = ap.parse_args(argv)
    models = []
    for item in args.model:
        name, sep, spec = item.partition("=")
        if not sep or not name or not spec:
            raise SystemExit(f"--model takes NAME=MODEL, got {item!r}")
        models.append((name, spec))
    result = compare(args.test, models, device=args.device, precision=args.precision, by=args.by or ["temperature"])
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
