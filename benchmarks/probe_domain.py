"""Does the shipped students' disagreement flag molecules outside their training set? (``mlff_distiller.committee``)

    python benchmarks/probe_domain.py --out benchmarks/results [--quick]

For molecules inside the shipped students' training set (g2 H/C/N/O molecules) and outside it (ASE's extras
1,4-benzenediamine and biphenyl): GFN2-xTB Langevin MD frames at 300, 500 and 700 K (a seed other than the
training labels'), then per molecule the force disagreement of ``builtin:chno-gfn2`` and ``builtin:chno-gfn2-small``
(mean absolute difference of their force components, float64) beside the 128 x 3 student's force error against
GFN2-xTB on the same frames, and whether ``committee_disagreement`` flags them. Needs tblite. Writes
``<out>/domain_committee_cpu.md`` (``--name`` to change it). ``--all-g2``: every one of the 61 training molecules
inside (the false-flag rate). ``--quick``: few frames, one molecule each side.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from ase.build import molecule

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import git_commit, write_lines

from mlff_distiller import load_model, predict_forces
from mlff_distiller.committee import DEFAULT_COMMITTEE, DISAGREEMENT_THRESHOLD, committee_disagreement
from mlff_distiller.distill import SamplingConfig, label, read_frames

INSIDE = ["H2O", "C6H6", "CH3CH2OH", "CH3COOH", "CH3NO2", "CH3CONH2"]  # g2 molecules: in the training set
OUTSIDE = ["BDA", "biphenyl", "C7NH5"]  # ase.build.molecule extras, not in g2


def measure(name: str, work: Path, md_steps: int) -> dict:
    cfg = SamplingConfig(temperatures=[300.0, 500.0, 700.0], md_steps=md_steps, sample_every=10, seed=1234)
    label([molecule(name)], "gfn2-xtb", work / name, cfg, progress=False)
    frames = read_frames(work / name)
    rows = committee_disagreement(DEFAULT_COMMITTEE, frames, device="cpu", precision="fp64")
    pred = predict_forces(load_model(DEFAULT_COMMITTEE[0]), frames, device="cpu", precision="fp64")
    err = np.concatenate([np.abs(p["forces"] - f.get_forces()).ravel() for p, f in zip(pred, frames, strict=True)])
    dis = np.array([r["force_disagreement_mev_a"] for r in rows])
    return {
        "molecule": name,
        "atoms": len(frames[0]),
        "frames": len(frames),
        "disagreement": float(dis.mean()),
        "error": 1000 * float(err.mean()),
        "flagged": int(sum(r["flagged"] for r in rows)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="domain_committee_cpu")
    p.add_argument("--md-steps", type=int, default=200)
    p.add_argument("--all-g2", action="store_true", help="every g2 molecule of the training set inside (61)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    inside, outside = (INSIDE[:1], OUTSIDE[:1]) if args.quick else (INSIDE, OUTSIDE)
    if args.all_g2:
        from mlff_distiller.distill import g2_chno

        inside = [a.info["name"] for a in g2_chno()]
    md_steps = 20 if args.quick else args.md_steps
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            (where, measure(m, Path(tmp), md_steps)) for where, ms in (("in", inside), ("out", outside)) for m in ms
        ]
    lines = [
        "# probe_domain.py: the shipped students' disagreement, inside and outside their training set",
        "",
        f"{platform.machine()} · {torch.get_num_threads()} torch threads · torch {torch.__version__} · commit "
        f"{git_commit()}; GFN2-xTB (tblite) Langevin MD at 300/500/700 K, {md_steps} steps each, a frame every 10.",
        f"Committee: {', '.join(DEFAULT_COMMITTEE)} (float64). Disagreement: mean absolute difference of the two "
        f"students' force components; error: `{DEFAULT_COMMITTEE[0]}` against GFN2-xTB on the same frames; flagged: "
        f"frames above {DISAGREEMENT_THRESHOLD:g} meV/Å.",
        "",
        "| molecule | training set | atoms | frames | disagreement meV/Å | error meV/Å | flagged |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for where, r in rows:
        lines.append(
            f"| {r['molecule']} | {'inside' if where == 'in' else '**outside**'} | {r['atoms']} | {r['frames']} | "
            f"{r['disagreement']:.1f} | {r['error']:.1f} | {r['flagged']} / {r['frames']} |"
        )
    for where in ("in", "out"):
        sel = [r for w, r in rows if w == where]
        frames, flagged = sum(r["frames"] for r in sel), sum(r["flagged"] for r in sel)
        dis = [r["disagreement"] for r in sel]
        lines.append(
            f"| **all {len(sel)} {'inside' if where == 'in' else 'outside'}** | | | {frames} | "
            f"{min(dis):.1f}-{max(dis):.1f} | | {flagged} / {frames} |"
        )
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
