"""bench_engine's report (benchmarks/bench_engine.py): the markdown of a run's rows, headed by issue 5's targets read
off those rows. Apart from the benchmark so that a report can be rebuilt from saved JSON without a GPU (stop 80's
``results/stop80_gpu/issue5_64x3_h200.md`` merges two calls' rows)."""

from __future__ import annotations

from pathlib import Path

REFERENCE_LABEL = "reference (torch kernels, eager)"  # bench_engine.REFERENCE's label: the rows never counted as ours


def _fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def _ours(r: dict) -> bool:
    """A row of ours that ran: not the torch reference, not skipped."""
    return r.get("variant") != REFERENCE_LABEL and "skipped" not in r


def _sweep_rows(batch: int, precisions: tuple[str, ...]):
    return lambda r: (
        r["section"] == "sweep" and r.get("batch") == batch and any(p in r["variant"].split() for p in precisions)
    )


# Issue 5's targets (H100, fp32): (what, goal, unit, the rows it reads, the value of a row). Each is read off this
# run's own rows: the fastest of ours (never the torch reference) where the issue asks for "through the engine".
TARGETS = [
    ("benzene energy + forces, fp32, the step through the engine", 50.0, "µs",
     lambda r: r["section"] == "latency" and r.get("molecule") == "C6H6" and "e2e_us" in r, lambda r: r["step_us"]),
    ("ASE MD step through StudentCalculator, benzene", 200.0, "µs",
     lambda r: r["section"] == "md" and r.get("step_us") is not None, lambda r: r["step_us"]),
    ("g2 x 4,096, step per structure, strict fp32", 0.6, "µs",
     _sweep_rows(4096, ("fp32",)), lambda r: r["step_us_per_structure"]),
    ("g2 x 4,096, step per structure, tf32 or bf16 matmuls", 0.3, "µs",
     _sweep_rows(4096, ("tf32", "bf16")), lambda r: r["step_us_per_structure"]),
    ("g2 x 1,024, step per structure, strict fp32", 0.8, "µs",
     _sweep_rows(1024, ("fp32",)), lambda r: r["step_us_per_structure"]),
    ("warm start: a second process, load → first benzene result (fast path)", 2.0, "s",
     lambda r: r["section"] == "startup" and r.get("phase") == "warm" and r.get("first_result_s") is not None,
     lambda r: r["first_result_s"]),
]  # fmt: skip


def target_rows(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """Issue 5's targets against this run's rows: ``(target, measured (by which variant), goal, result)``, the
    result ``pass``, ``FAIL`` or ``not measured`` (no row of ours in the run for it)."""
    out = []
    for what, goal, unit, picks, value in TARGETS:
        cands = [(value(r), r["variant"]) for r in rows if _ours(r) and picks(r)]
        if not cands:
            out.append((what, "—", f"≤ {goal:g} {unit}", "not measured"))
            continue
        best, variant = min(cands)
        shown = f"{best:.3f}" if unit == "µs" and best < 10 else f"{best:.2f}" if unit == "s" else f"{best:.1f}"
        out.append((what, f"{shown} {unit} ({variant})", f"≤ {goal:g} {unit}", "pass" if best <= goal else "FAIL"))
    return out


def write_report(data: dict, md_path: Path) -> None:
    env, rows = data.get("env", {}), data["rows"]
    lines = [
        "# ForceEngine on the GPU (issue 5)",
        "",
        f"{env.get('device')} · torch {env.get('torch')} · triton {env.get('triton')} · commit {env.get('commit')}"
        f" · Python {env.get('python')} · student weights {env.get('weights', 'as-trained')} · {data.get('timestamp')}",
        "",
        f"Model: student of {data.get('model', '128 x 3')} (features x layers; the default student is 64 x 3 since "
        "stop 85, builtin:chno-gfn2 is 128 x 3), 20 Bessel, "
        "5 Å cutoff, 14 g2 species, random weights.",
        "Reference = the same model with torch-reference kernels in eager mode, measured in the same run.",
        "Times: median of `triton.testing.do_bench` (CUDA events) unless noted. `e2e` = `engine.compute` from a "
        "host batch to host results (GPU neighbour list + padding + step + one copy back); `step` = the energy + "
        "forces step alone (a graph replay in the padded modes).",
        "",
        "## Targets (issue 5; set for an H100 in fp32, measured on the device named above)",
        "",
        "Each is the fastest of ours in this file's rows (never the torch reference); a section not run this time "
        "reads `not measured`.",
        "",
        "| target | measured | goal | result |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in target_rows(rows)),
        "",
    ]
    lat = [r for r in rows if r["section"] == "latency"]
    if lat:
        ref = {r["molecule"]: r for r in lat if r["variant"] == REFERENCE_LABEL and "e2e_us" in r}
        lines += [
            "## Single-molecule latency, fp32 (µs)",
            "",
            "| variant | molecule | atoms | e2e µs | step µs | e2e vs reference | first call s | step taken |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in lat:
            if "skipped" in r:
                lines.append(f"| {r['variant']} | {r['molecule']} | | skipped: {r['skipped']} | | | | |")
                continue
            base = ref.get(r["molecule"])
            ratio = base["e2e_us"] / r["e2e_us"] if base else None
            lines.append(
                f"| {r['variant']} | {r['molecule']} | {r['atoms']} | {r['e2e_us']:.1f} | "
                f"{r['step_us']:.1f} | {_fmt(ratio, '.2f')}× | {r['first_call_s']:.2f} | {r.get('step_taken', '')} |"
            )
        lines.append("")
    md = [r for r in rows if r["section"] == "md"]
    if md:
        lines += [
            "## ASE MD step through StudentCalculator (benzene, velocity Verlet at 0.5 fs, 300 K, fp32, wall clock)",
            "",
            "| variant | µs / step (median) | mean | list builds | launches ahead | captured graphs | dense step | "
            "host work µs, before / after |",
            "|---|---:|---:|---:|---|---:|---|---:|",
        ]
        for r in md:
            dense = "" if "dense" not in r else ("yes" if r["dense"] else "no")
            host = " / ".join(f"{x:.1f}" for x in r["host_us"]) if r.get("host_us") else ""
            lines.append(
                f"| {r['variant']} | {_fmt(r.get('step_us'))} | {_fmt(r.get('mean_us'))} | {r.get('builds', '')} | "
                f"{r.get('ahead', '')} | {r.get('graphs', r.get('skipped', ''))} | {dense} | {host} |"
            )
        lines += [
            "",
            "The step is host-bound where the host's work a step exceeds the device's (the 64-wide students' dense "
            "step of ~50 µs, and the 128 x 3 student's ~150 µs captured step at slow-phase hosts), else device-bound "
            "(the 128 x 3 student at fast-phase hosts: stop 84, 138.5-138.9 µs). The last column times a fixed piece "
            "of host work (`harness.host_work_us`) before and after the variant's run. The H200 guests here run it in "
            "~40-47 µs or ~80-100 µs by phase, and a host-bound step follows (stop 77: 151-170 µs against 244-381).",
        ]
        lines.append("")
    sw = [r for r in rows if r["section"] == "sweep"]
    if sw:
        lines += [
            "## Batch sweep over ASE g2 molecules (µs per structure)",
            "",
            "| variant | batch | atoms | step µs/structure | e2e µs/structure | structures/s (e2e) | first call s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sw:
            if "skipped" in r:
                lines.append(f"| {r['variant']} | {r['batch']} | | skipped: {r['skipped']} | | | |")
                continue
            lines.append(
                f"| {r['variant']} | {r['batch']} | {r['atoms']} | {r['step_us_per_structure']:.3f} | "
                f"{r['e2e_us_per_structure']:.3f} | {r['structures_per_s']:.3g} | "
                f"{r['first_call_s']:.2f} |"
            )
        lines.append("")
    for section, title in (
        ("errors", "Error vs fp64 (324 g2 molecules, this run's random student)"),
        ("errors_builtin", "Error vs fp64, the shipped `builtin:chno-gfn2` (the H/C/N/O g2 molecules)"),
    ):
        er = [r for r in rows if r["section"] == section]
        if not er:
            continue
        lines += [
            f"## {title}",
            "",
            "| precision | mode | max abs ΔE eV | max rel ΔE | MAE ΔE/atom eV | max abs ΔF eV/Å | RMSE ΔF eV/Å "
            "| max abs F eV/Å |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in er:
            lines.append(
                f"| {r['precision']} | {r['mode']} | {r['energy_max_abs_eV']:.2e} | "
                f"{r['energy_max_rel']:.2e} | {r['energy_mae_per_atom_eV']:.2e} | "
                f"{r['force_max_abs_eVA']:.2e} | {r['force_rmse_eVA']:.2e} | {r['force_scale_eVA']:.2f} |"
            )
        lines.append("")
    st = [r for r in rows if r["section"] == "startup"]
    if st:
        lines += [
            "## Start-up: a fresh process, load model → first benzene result (s, excl. `import torch`)",
            "",
            "| variant | cache | first result s | second call ms | step taken |",
            "|---|---|---:|---:|---|",
        ]
        for r in st:
            lines.append(
                f"| {r['variant']} | {r['phase']} | {_fmt(r.get('first_result_s'), '.2f')} | "
                f"{_fmt(r.get('second_call_ms'), '.2f')} {r.get('skipped', '')} | {r.get('step_taken', '')} |"
            )
        lines.append("")
    notes = data.get("notes")
    if notes:
        lines += ["## Notes", "", notes, ""]
    md_path.write_text("\n".join(lines) + "\n")
