"""The whole benchmark suite in one command, our student and its peers side by side in the same run.

Writes ``<out>/<gpu>-<date>.md``, ``.json``, ``-sweep.png``, ``-scaling.png``, ``-breakdown.png`` and
``-trace.json.gz`` (``<gpu>`` is ``h100``, ``h200``, ... or ``cpu``). Sections (``--sections``; results are
written after each one, so a run cut short still leaves its finished sections):

* ``latency``  (a) one molecule (H2, H2O, CH4, benzene), energy-only and energy + forces;
* ``sweep``    (b) batches of 1 … 4096 g2 molecules: µs per structure, structures/s, peak memory;
* ``matrix``   (c) modes × precisions (eager, CUDA graphs, TorchScript trace, fp64/fp32/tf32/bf16/fp16):
  time and error vs fp64;
* ``breakdown`` (d) per-stage time of an eager step, kernels and launches per step, a chrome trace;
* ``scaling``  (e) water boxes from 12 to 100,000 atoms: time, µs/atom, peak memory;
* ``compile``  (c, continued) ``torch.compile`` default / reduce-overhead and CUDA graphs over compiled code
  (benzene): late, because each compilation costs tens of seconds;
* ``startup``  (f) fresh processes, load → first result, cold (empty compile cache) and warm;
* ``autotune`` (c, continued) ``torch.compile`` max-autotune: last, its autotuning costs minutes.

Every time is host data → host results (neighbour list, transfers and one backward included), median of
``harness.time_fn`` (``triton.testing.do_bench`` on CUDA, wall clock on CPU). Rows: ``ours`` (ForceEngine),
``reference`` (the same weights through the plain-PyTorch kernels, eager) and the ``peer`` s: PyG SchNet at a
matched parameter count with our edges, and the teacher SevenNet-0 through its ASE calculator. Each row
carries its ratio to our best time in the same group (``× ours``: > 1 means ours is that many times faster).
The student is the packaged ``builtin:chno-gfn2`` when present (``--model``), else seeded random weights of
the same configuration.

    python benchmarks/run_all.py [--device cuda|cpu] [--quick] [--out DIR] [--budget-s 420] [--sections ...]
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_breakdown import breakdown, count_launches, profile_step  # noqa: E402
from bench_startup import run_startup  # noqa: E402
from harness import device_slug, environment, peak_memory_bytes, sync, time_fn  # noqa: E402
from peers import (  # noqa: E402
    CalculatorImpl,
    Impl,
    OursImpl,
    SchNetImpl,
    SevenNetImpl,
    StepImpl,
    TracedImpl,
    count_params,
    make_student,
    torchscript_script_error,
)
from systems import g2_chno, water_box  # noqa: E402

SECTIONS = ("latency", "sweep", "matrix", "breakdown", "scaling", "compile", "startup", "autotune")
MOLECULES = ("H2", "H2O", "CH4", "C6H6")
IMPL_KEYS = ("ours", "ours_eager", "ours_calc", "ref", "schnet", "sevennet", "ours_step", "ref_step")
SWEEP = (1, 4, 8, 16, 32, 64, 256, 1024, 4096)
SWEEP_QUICK = (1, 4, 16, 64)
SCALING = (12, 96, 384, 1536, 6144, 24576, 100_000)
SCALING_QUICK = (12, 96, 384)
PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16")
# The seeds' measurements (issues 4 and 5; H100, plain-PyTorch PaiNN student, energy + forces), shown beside ours.
SEEDS = {
    "benzene eager ms": 6.73,
    "benzene torch.compile ms": 4.43,
    "benzene torch.compile first call s": 16.0,
    "benzene CUDA graph ms": 1.00,
    "batch 1024 µs/structure": "5.0-8.5",
    "batch 16 target ms/structure": 2.0,
    "fp16 speed-up": 0.93,
    "autograd backward share of the step": "75 %",
}


class Clock:
    """The run's time budget: sections and measurements check it and are skipped (and reported) when spent."""

    def __init__(self, budget_s: float) -> None:
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:200]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(impl, structures, forces: bool, device: torch.device, rep_ms: float = 100, memory: bool = False):
    """Time ``impl`` on ``structures``: dict with ``us``, ``p20_us``, ``p80_us``, ``first_call_s`` (prepare
    and first call, i.e. capture / compile / JIT) and optionally ``peak_mem_mb``; or ``error``."""
    if not impl.available:
        return {"na": impl.why_unavailable}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sync(device)
            t0 = time.perf_counter()
            fn = impl.prepare(structures, forces)
            fn()
            sync(device)
            first = time.perf_counter() - t0
            t = time_fn(fn, device, rep_ms=rep_ms)
            out = {"us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us, "first_call_s": first}
            if memory:
                mem = peak_memory_bytes(fn, device)
                if mem is not None:
                    out["peak_mem_mb"] = mem / 2**20
            return out
    except torch.OutOfMemoryError as exc:
        _free(device)
        return {"error": "out of memory: " + _err(exc)[:120]}
    except Exception as exc:  # a failing implementation is a row, not the end of the run
        _free(device)
        return {"error": _err(exc)}


def load_student(spec: str):
    """``(model, description)``: ``builtin:<name>``, a checkpoint path, or ``random`` (seeded random weights).
    ``auto`` takes the first built-in student when the package ships one, else ``random``."""
    from mlff_distiller import builtin_models, load_model

    if spec == "auto":
        spec = f"builtin:{builtin_models()[0]}" if builtin_models() else "random"
    if spec == "random":
        return make_student(), "random weights (seed 0), default config"
    return load_model(spec).float(), spec


def _sizes(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    if not text:
        return default
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"sizes must be comma-separated integers, got {text!r}") from None
    if any(n < 1 for n in sizes):
        raise ValueError(f"sizes must be >= 1, got {sizes}")
    return sizes


# ------------------------------------------------------------------------------------------------- the run
class Suite:
    def __init__(self, args) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.quick = args.quick
        self.clock = Clock(args.budget_s)
        self.model, self.model_name = load_student(args.model)
        self.rows: list[dict] = []
        self.extra: dict = {}
        self.impls: dict[str, object] = {}
        date = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
        self.name = args.name or f"{device_slug(self.device)}-{date}"
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------------------------------------- impls
    def keys(self, *keys: str) -> list[str]:
        """The implementation keys a section uses, minus those ``--impls`` leaves out; ``ours_eager`` only on
        CUDA (elsewhere ``ours`` is already the eager engine)."""
        keep = self.args.impls.split(",") if self.args.impls else None
        return [k for k in keys if (keep is None or k in keep) and (k != "ours_eager" or self.cuda)]

    def impl(self, key: str):
        """Implementations are built on first use (SevenNet's load and CUDA-graph captures cost seconds)."""
        if key in self.impls:
            return self.impls[key]
        try:
            impl = self._build(key)
        except ValueError:
            raise
        except Exception as exc:  # an implementation that cannot even be built is a row saying why
            impl = Impl(label=key, kind="peer" if key in ("schnet", "sevennet") else "ours", device=self.device)
            impl.why_unavailable = f"could not be built: {_err(exc)}"
        self.impls[key] = impl
        return impl

    def _build(self, key: str):
        m, d = self.model, self.device
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if key == "ours":
                label = "ours: ForceEngine auto (CUDA graphs)" if self.cuda else "ours: ForceEngine auto (eager)"
                impl = OursImpl(label, "ours", m, d, mode="auto")
            elif key == "ours_eager":
                impl = OursImpl("ours: ForceEngine eager, Triton kernels", "ours", m, d, mode="eager")
            elif key == "ours_calc":
                impl = CalculatorImpl("ours: StudentCalculator (ASE, auto)", m, d, mode="auto")
            elif key == "ref":
                impl = OursImpl(
                    "reference: plain-PyTorch student, eager (same weights)",
                    "reference",
                    m,
                    d,
                    backend="torch",
                    mode="eager",
                )
            elif key == "ours_step":
                label = "ours auto: step only (captured replay)" if self.cuda else "ours: step only (model + grad)"
                impl = StepImpl(label, "ours", m, d, mode="auto")
            elif key == "ref_step":
                impl = StepImpl("reference: step only (model + grad)", "reference", m, d, backend="torch", mode="eager")
            elif key == "schnet":
                impl = SchNetImpl("PyG SchNet (matched size, our edges)", count_params(m), m.cutoff, d)
            elif key == "sevennet":
                impl = SevenNetImpl("SevenNet-0 teacher (ASE calculator)", d)
                if impl.available:
                    self.extra["sevennet_load_s"] = impl.load_s
            else:
                raise ValueError(f"unknown implementation {key!r}")
        return impl

    def row(self, section: str, impl, **fields) -> dict:
        r = {"section": section, "impl": impl.label, "kind": impl.kind, "scope": impl.scope, **fields}
        if impl.note and "note" not in r:
            r["note"] = impl.note
        self.rows.append(r)
        print(json.dumps(r, default=str), flush=True)
        return r

    def skip(self, section: str, label: str, why: str, **fields) -> None:
        self.rows.append({"section": section, "impl": label, "kind": "", "skipped": why, **fields})

    # ------------------------------------------------------------------------------------------- (a) latency
    def latency(self) -> None:
        from ase.build import molecule

        keys = self.keys("ours", "ours_eager", "ours_calc", "ref", "schnet", "sevennet", "ours_step", "ref_step")
        for name in self.args.molecules.split(","):
            atoms = molecule(name)
            for task, forces in (("energy", False), ("energy+forces", True)):
                for key in keys:
                    impl = self.impl(key)
                    base = dict(system=name, atoms=len(atoms), task=task, batch=1)
                    if key in ("ours_step", "ref_step") and not forces:
                        continue
                    if key == "sevennet" and not forces:
                        self.row("latency", impl, **base, na="the ASE calculator always computes E, F and stress")
                        continue
                    if self.clock.left() < 5:
                        self.skip("latency", impl.label, "time budget", **base)
                        continue
                    res = measure(impl, [atoms], forces, self.device)
                    note = {}
                    if not forces and key in ("ours", "ours_calc") and self.cuda:
                        note = {"note": "energy-only runs the eager path (padded modes serve E+F)"}
                    self.row("latency", impl, **base, **res, **note)

    # --------------------------------------------------------------------------------------------- (b) sweep
    def sweep(self) -> None:
        sizes = _sizes(self.args.sweep_sizes, SWEEP_QUICK if self.quick else SWEEP)
        keys = self.keys("ours", "ours_eager", "ref", "schnet", "sevennet", "ours_step", "ref_step")
        last: dict[str, tuple[int, float]] = {}
        for b in sizes:
            structures = g2_chno(b, seed=1)
            n_atoms = sum(len(a) for a in structures)
            for key in keys:
                impl = self.impl(key)
                base = dict(system=f"g2 x{b}", atoms=n_atoms, task="energy+forces", batch=b)
                if key == "sevennet" and b > (4 if self.quick else 16):
                    self.row("sweep", impl, **base, na="one ASE call per structure: per-structure cost = batch 1")
                    continue
                # Skip what would eat the budget: ~15 calls at the last measured size scaled by the growth.
                if key in last and 15 * last[key][1] * 1e-6 * b / last[key][0] > 0.25 * self.clock.left():
                    self.skip("sweep", impl.label, "time budget (extrapolated)", **base)
                    continue
                if self.clock.left() < 10:
                    self.skip("sweep", impl.label, "time budget", **base)
                    continue
                res = measure(impl, structures, True, self.device, memory=True)
                if "us" in res:
                    last[key] = (b, res["us"])
                    res["us_per_structure"] = res["us"] / b
                    res["structures_per_s"] = b / (res["us"] * 1e-6)
                self.row("sweep", impl, **base, **res)
            _free(self.device)

    # -------------------------------------------------------------------------------------------- (c) matrix
    def _errors(self, impl, structures, reference: dict) -> dict:
        try:
            with warnings.catch_warnings(), impl.context():
                warnings.simplefilter("ignore")
                out = impl.prepare(structures, True)()
        except Exception as exc:
            return {"error_eval": _err(exc)}
        n = torch.tensor([len(a) for a in structures], dtype=torch.float64)
        de = (out["energy"].double().reshape(-1) - reference["energy"]).abs() / n
        df = out["forces"].double() - reference["forces"]
        return {
            "max_dE_per_atom_eV": float(de.max()),
            "max_dF_eVA": float(df.abs().max()),
            "rmse_dF_eVA": float(df.pow(2).mean().sqrt()),
        }

    def _fp64_reference(self, structures) -> dict:
        ref = OursImpl("fp64", "reference", self.model, self.device, backend="torch", mode="eager", precision="fp64")
        with ref.context():
            out = ref.prepare(structures, True)()
        return {"energy": out["energy"].double().reshape(-1), "forces": out["forces"].double()}

    def _matrix_rows(self, configs, systems) -> None:
        refs = {}
        for name, structures in systems:
            try:
                refs[name] = self._fp64_reference(structures)
            except Exception as exc:  # the timings stand without the error columns
                refs[name] = None
                self.extra.setdefault("fp64_reference_errors", {})[name] = _err(exc)
        for label, kind, make in configs:
            if self.clock.left() < 10:
                self.skip("matrix", label, "time budget")
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    impl = make()
            except Exception as exc:
                self.rows.append({"section": "matrix", "impl": label, "kind": kind, "error": _err(exc)})
                continue
            if not impl.available:
                self.row("matrix", impl, na=impl.why_unavailable)
                continue
            for name, structures in systems:
                b = len(structures)
                res = measure(impl, structures, True, self.device)
                if "us" in res:
                    res["us_per_structure"] = res["us"] / b
                    if refs[name] is not None:
                        res.update(self._errors(impl, structures, refs[name]))
                atoms = sum(len(a) for a in structures)
                self.row("matrix", impl, system=name, atoms=atoms, batch=b, task="energy+forces", **res)
            del impl
            _free(self.device)

    def matrix(self) -> None:
        from ase.build import molecule

        m, d = self.model, self.device
        systems = [
            ("C6H6", [molecule("C6H6")]),
            (f"g2 x{16 if self.quick else 256}", g2_chno(16 if self.quick else 256)),
        ]
        configs = [
            (
                "reference eager fp32 (torch kernels)",
                "reference",
                lambda: OursImpl(
                    "reference eager fp32 (torch kernels)", "reference", m, d, backend="torch", mode="eager"
                ),
            ),
        ]
        modes = ["eager", "cudagraph"] if self.cuda else ["eager"]
        for mode in modes:
            for prec in PRECISIONS:
                label = f"{mode} {prec}" + (" (Triton kernels)" if self.cuda else "")
                configs.append(
                    (
                        label,
                        "ours",
                        lambda mode=mode, prec=prec, label=label: OursImpl(
                            label, "ours", m, d, mode=mode, precision=prec
                        ),
                    )
                )
        if not self.cuda:
            for prec in ("fp32", "bf16"):
                self.rows.append(
                    {
                        "section": "matrix",
                        "impl": f"cudagraph {prec}",
                        "kind": "ours",
                        "na": "CUDA graphs need a CUDA device",
                    }
                )
        why = torchscript_script_error(copy.deepcopy(self.model))
        self.rows.append(
            {
                "section": "matrix",
                "impl": "TorchScript torch.jit.script",
                "kind": "ours",
                "na": f"does not compile: {why}" if why else "scripts (not timed)",
            }
        )
        for backend in ["torch"] + (["triton"] if self.cuda else []):
            label = f"TorchScript torch.jit.trace fp32 ({backend} kernels)"
            configs.append(
                (
                    label,
                    "ours",
                    lambda backend=backend, label=label: TracedImpl(
                        label, "ours", copy.deepcopy(m), d, backend=backend
                    ),
                )
            )
        self._matrix_rows(configs, systems)

    def _compile_variants(self, variants) -> None:
        from ase.build import molecule

        m, d = self.model, self.device
        if not self.cuda:
            for label, _, _ in variants:
                self.rows.append(
                    {
                        "section": "matrix",
                        "impl": label,
                        "kind": "ours",
                        "na": "the engine's compile modes target CUDA (on CPU they run padded eager)",
                    }
                )
            return
        systems = [("C6H6", [molecule("C6H6")])]
        for label, kw, need in variants:
            if self.clock.left() < need:
                self.skip("matrix", label, f"time budget (needs ~{need} s)", system="C6H6")
                continue
            torch._dynamo.reset()
            self._matrix_rows(
                [(label, "ours", lambda label=label, kw=kw: OursImpl(label, "ours", m, d, **kw))], systems
            )
            self.save(plots=False)  # a compilation is long: keep what is done if the run is cut short

    def compile(self) -> None:
        """torch.compile modes (and CUDA graphs over compiled code) on benzene, with errors vs fp64."""
        self._compile_variants(
            [
                ("compile default", dict(mode="compile", compile_mode="default"), 60),
                ("compile reduce-overhead", dict(mode="compile", compile_mode="reduce-overhead"), 60),
                ("cudagraph + compile default", dict(mode="cudagraph", compile_mode="default"), 60),
            ]
        )

    def autotune(self) -> None:
        """``max-autotune`` last: its autotuning costs minutes."""
        self._compile_variants([("compile max-autotune", dict(mode="compile", compile_mode="max-autotune"), 150)])

    # ----------------------------------------------------------------------------------------- (d) breakdown
    def breakdown(self) -> None:
        from ase.build import molecule

        systems = [("C6H6", [molecule("C6H6")]), ("water", [water_box(96 if self.quick else 3000)])]
        backends = ["torch"] + (["triton"] if self.cuda else [])
        trace = self.out / f"{self.name}-trace.json.gz"
        for name, structures in systems:
            for backend in backends:
                if self.clock.left() < 15:
                    self.skip("breakdown", backend, "time budget", system=name)
                    continue
                try:
                    r = breakdown(
                        copy.deepcopy(self.model), structures, self.device, backend, reps=3 if self.quick else 10
                    )
                    want_trace = name == "C6H6" and backend == backends[-1]
                    r["profile"] = profile_step(
                        copy.deepcopy(self.model), structures, self.device, backend, trace if want_trace else None
                    )
                except Exception as exc:
                    self.rows.append({"section": "breakdown", "impl": backend, "system": name, "error": _err(exc)})
                    continue
                self.rows.append(
                    {"section": "breakdown", "impl": f"eager, {backend} kernels", "kind": "ours", "system": name, **r}
                )
                print(json.dumps(self.rows[-1], default=str), flush=True)
        # Launches per end-to-end call (engine.compute from host data), per mode.
        from ase.build import molecule as mol

        benzene = [mol("C6H6")]
        for key in self.keys("ref", "ours", "ours_eager"):
            impl = self.impl(key)
            if not impl.available or self.clock.left() < 10:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    counts = count_launches(impl.prepare(benzene, True), self.device)
            except Exception as exc:
                counts = {"error": _err(exc)}
            self.rows.append({"section": "launches", "impl": impl.label, "kind": impl.kind, "system": "C6H6", **counts})
            print(json.dumps(self.rows[-1], default=str), flush=True)

    # ------------------------------------------------------------------------------------------- (e) scaling
    def scaling(self) -> None:
        sizes = _sizes(self.args.scaling_sizes, SCALING_QUICK if self.quick else SCALING)
        keys = self.keys("ours", "ours_eager", "ref", "schnet", "sevennet")
        sevennet_max = 1536 if self.cuda else 96
        last: dict[str, tuple[int, float]] = {}
        for n in sizes:
            if self.clock.left() < 10:
                self.skip("scaling", "all", "time budget", atoms=n)
                continue
            box = water_box(n)
            for key in keys:
                impl = self.impl(key)
                base = dict(system=f"water {len(box)}", atoms=len(box), task="energy+forces", batch=1)
                if key == "sevennet" and len(box) > sevennet_max:
                    self.skip("scaling", impl.label, f"not run above {sevennet_max} atoms (time budget)", **base)
                    continue
                if key in last:
                    n0, us0 = last[key]
                    if 15 * us0 * 1e-6 * len(box) / n0 > 0.25 * self.clock.left():
                        self.skip("scaling", impl.label, "time budget (extrapolated)", **base)
                        continue
                if self.clock.left() < 10:
                    self.skip("scaling", impl.label, "time budget", **base)
                    continue
                res = measure(impl, [box], True, self.device, rep_ms=50, memory=True)
                if "us" in res:
                    last[key] = (len(box), res["us"])
                    res["us_per_atom"] = res["us"] / len(box)
                self.row("scaling", impl, **base, **res)
            _free(self.device)

    # ------------------------------------------------------------------------------------------- (f) startup
    def startup(self) -> None:
        sevennet = bool(self.keys("sevennet")) and self.impl("sevennet").available
        self.rows.extend(run_startup(self.model, str(self.device), self.clock.left, sevennet=sevennet))

    # ------------------------------------------------------------------------------------------------ output
    def save(self, plots: bool = True) -> None:
        env = environment(self.device, float("nan"))
        data = {
            "name": self.name,
            "env": {
                **env.__dict__,
                "python": platform.python_version(),
                "quick": self.quick,
                "budget_s": self.args.budget_s,
            },
            "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "models": {
                k: {
                    "label": v.label,
                    "kind": v.kind,
                    "params": v.params,
                    "available": v.available,
                    "why_unavailable": v.why_unavailable,
                    "note": v.note,
                }
                for k, v in self.impls.items()
            },
            "student": self.model_name,
            "seeds": SEEDS,
            "extra": self.extra,
            "rows": self.rows,
        }
        (self.out / f"{self.name}.json").write_text(json.dumps(data, indent=1, default=str))
        write_markdown(data, self.out / f"{self.name}.md")
        (self.out / f"{self.name}.json").write_text(json.dumps(data, indent=1, default=str))
        if not plots:
            return
        try:
            write_plots(data, self.out, self.name)
        except Exception as exc:  # plots are a convenience; the tables are the result
            print(f"plots failed: {_err(exc)}", file=sys.stderr)

    def run(self, sections) -> None:
        # CPU timings depend on what else runs on the machine: record the load around the run.
        if hasattr(os, "getloadavg"):
            self.extra["loadavg_1min_start"] = os.getloadavg()[0]
            self.extra["cpu_count"] = os.cpu_count()
            self.extra["torch_threads"] = torch.get_num_threads()
        for s in sections:
            t0 = time.perf_counter()
            try:
                getattr(self, s)()
            except Exception as exc:
                self.rows.append({"section": s, "impl": "section", "error": _err(exc)})
                print(f"section {s} failed: {_err(exc)}", file=sys.stderr, flush=True)
            self.extra.setdefault("section_s", {})[s] = time.perf_counter() - t0
            if hasattr(os, "getloadavg"):
                self.extra.setdefault("loadavg_1min_after", {})[s] = os.getloadavg()[0]
            self.save()
            print(
                f"## {s} done in {time.perf_counter() - t0:.1f} s; {self.clock.left():.0f} s of budget left", flush=True
            )


# ------------------------------------------------------------------------------------------------- report
PEER_COLUMNS = (
    ("reference", "reference (plain PyTorch)"),
    ("schnet", "PyG SchNet"),
    ("sevennet", "SevenNet-0"),
)


def _peer_key(row: dict) -> str | None:
    if row.get("kind") == "reference":
        return "reference"
    label = row.get("impl", "")
    if "SchNet" in label:
        return "schnet"
    if "SevenNet" in label:
        return "sevennet"
    return None


def annotate(rows: list[dict]) -> None:
    """Add ``x_ours`` (this time / our best time in the same section, system, task, batch and scope: > 1 means
    ours is faster) and ``vs_reference`` (the plain-PyTorch reference's time / this time) to every timed row.
    Scope ``e2e`` rows (host data to host results) and ``step`` rows (the compute step alone) never mix."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "us" in r:
            key = (r["section"], r.get("system"), r.get("task"), r.get("batch"), r.get("scope", "e2e"))
            groups.setdefault(key, []).append(r)
    for grp in groups.values():
        ours = [r["us"] for r in grp if r.get("kind") == "ours"]
        ref = [r["us"] for r in grp if r.get("kind") == "reference"]
        for r in grp:
            if ours:
                r["x_ours"] = r["us"] / min(ours)
            if ref:
                r["vs_reference"] = min(ref) / r["us"]


def _f(x, spec=".1f", empty="—") -> str:
    return empty if x is None else format(x, spec)


def _status(r: dict) -> str:
    for k in ("na", "skipped", "error"):
        if k in r:
            return {"na": "n/a", "skipped": "skipped", "error": "error"}[k] + f": {r[k]}"
    return ""


def _pivot(rows, section, value="us", scale=1.0, unit="µs") -> list[str]:
    """One line per (system, task): our best time and each peer's, with our ratio to each."""
    sel = [r for r in rows if r["section"] == section and r.get("system") and r.get("scope", "e2e") == "e2e"]
    keys = list(dict.fromkeys((r["system"], r.get("task"), r.get("atoms")) for r in sel))
    head = f"| system | atoms | task | ours, best {unit} | ours: which |"
    sep = "|---|---:|---|---:|---|"
    for _, name in PEER_COLUMNS:
        head += f" {name} {unit} | ours × |"
        sep += "---:|---:|"
    lines = [head, sep]
    for system, task, atoms in keys:
        grp = [r for r in sel if r["system"] == system and r.get("task") == task]
        ours = [r for r in grp if r.get("kind") == "ours" and value in r]
        best = min(ours, key=lambda r: r[value]) if ours else None
        line = f"| {system} | {atoms or ''} | {task} | {_f(best[value] * scale if best else None, '.3g')} | "
        line += f"{best['impl'].replace('ours: ', '') if best else ''} |"
        for key, _ in PEER_COLUMNS:
            peer = [r for r in grp if _peer_key(r) == key]
            timed = [r for r in peer if value in r]
            if timed and best:
                v = min(r[value] for r in timed)
                line += f" {v * scale:.3g} | **{v / best[value]:.2f}×** |"
            elif peer:
                line += f" {_status(peer[0])[:60]} | — |"
            else:
                line += " — | — |"
        lines.append(line)
    return lines


def _step_pivot(rows, section, value="us", unit="µs") -> list[str]:
    """The compute step alone (no neighbour list, padding or transfers): ours vs the reference."""
    sel = [r for r in rows if r["section"] == section and r.get("scope") == "step" and value in r]
    if not sel:
        return []
    lines = [
        f"Compute step alone (prepared graph; no neighbour list, padding or transfers), {unit}:",
        "",
        f"| system | atoms | ours step {unit} | reference step {unit} | ours × |",
        "|---|---:|---:|---:|---:|",
    ]
    for system in dict.fromkeys(r["system"] for r in sel):
        ours = [r[value] for r in sel if r["system"] == system and r["kind"] == "ours"]
        ref = [r[value] for r in sel if r["system"] == system and r["kind"] == "reference"]
        atoms = next(r.get("atoms", "") for r in sel if r["system"] == system)
        o, f = (min(ours) if ours else None), (min(ref) if ref else None)
        ratio = f / o if (o and f) else None
        lines.append(f"| {system} | {atoms} | {_f(o, '.4g')} | {_f(f, '.4g')} | {_f(ratio, '.2f')} |")
    return [*lines, ""]


def _detail(rows, section, extra_cols=()) -> list[str]:
    sel = [r for r in rows if r["section"] == section]
    head = "| implementation | system | atoms | task | median µs | p20–p80 µs | µs/structure | first call s "
    head += "| peak MB | × ours | vs reference |" + "".join(f" {c} |" for c, _, _ in extra_cols)
    lines = [head, "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra_cols)]
    for r in sel:
        if "us" not in r:
            lines.append(
                f"| {r['impl']} | {r.get('system', '')} | {r.get('atoms', '')} | {r.get('task', '')} | "
                f"{_status(r)} | | | | | | |" + " |" * len(extra_cols)
            )
            continue
        per = r.get("us_per_structure", r["us"] / max(1, r.get("batch") or 1))
        note = f" ({r['note']})" if r.get("note") else ""
        line = (
            f"| {r['impl']}{note} | {r.get('system', '')} | {r.get('atoms', '')} | {r.get('task', '')} | "
            f"{r['us']:.1f} | {r['p20_us']:.1f}–{r['p80_us']:.1f} | {per:.3g} | {r['first_call_s']:.2f} | "
            f"{_f(r.get('peak_mem_mb'), '.1f')} | {_f(r.get('x_ours'), '.2f')} | {_f(r.get('vs_reference'), '.2f')} |"
        )
        for _, k, spec in extra_cols:
            line += f" {_f(r.get(k), spec)} |"
        lines.append(line)
    return lines


def _seed_lines(data: dict) -> list[str]:
    rows = data["rows"]

    def find(section, impl_has, system=None, value="us", task="energy+forces", batch=None):
        for r in rows:
            if (
                r["section"] == section
                and impl_has in r.get("impl", "")
                and value in r
                and (system is None or str(r.get("system", "")).startswith(system))
                and r.get("task", task) == task
                and (batch is None or r.get("batch") == batch)
            ):
                return r[value]
        return None

    def ms(x):
        return _f(None if x is None else x / 1e3, ".3f")

    mode = "cudagraph" if any("cudagraph fp32" in r.get("impl", "") and "us" in r for r in rows) else "eager"
    fp16 = find("matrix", f"{mode} fp16", value="us_per_structure", system="g2")
    fp32 = find("matrix", f"{mode} fp32", value="us_per_structure", system="g2")
    b16 = find("sweep", "auto", "g2 x16", value="us_per_structure")
    bd = [r for r in rows if r["section"] == "breakdown" and r.get("system") == "C6H6" and "torch" in r["impl"]]
    back = bd[0]["stages_frac"].get("backward") if bd else None
    lines = [
        "| quantity | seeds (H100, plain-PyTorch PaiNN) | this run |",
        "|---|---:|---:|",
        f"| benzene E+F, eager, ms | {SEEDS['benzene eager ms']} | reference {ms(find('latency', 'reference', 'C6H6'))}"
        f" / ours eager {ms(find('latency', 'eager, Triton', 'C6H6'))} |",
        f"| benzene E+F, torch.compile, ms | {SEEDS['benzene torch.compile ms']} | "
        f"{ms(find('matrix', 'compile default', 'C6H6'))} |",
        f"| torch.compile first call, s | {SEEDS['benzene torch.compile first call s']} | "
        f"{_f(find('matrix', 'compile default', 'C6H6', value='first_call_s'), '.1f')} |",
        f"| benzene E+F, CUDA graph, ms | {SEEDS['benzene CUDA graph ms']} | {ms(find('latency', 'auto', 'C6H6'))} |",
        f"| batch 1024 g2, µs/structure | {SEEDS['batch 1024 µs/structure']} | "
        f"{_f(find('sweep', 'auto', 'g2 x1024', value='us_per_structure'), '.2f')} |",
        f"| batch 16, ms/structure (the seeds' goal) | {SEEDS['batch 16 target ms/structure']} | {ms(b16)} |",
        f"| fp16 speed-up over fp32 | {SEEDS['fp16 speed-up']} | "
        f"{_f(None if not (fp16 and fp32) else fp32 / fp16, '.2f')} ({mode}, g2 batch of the matrix) |",
        f"| backward share of the step | {SEEDS['autograd backward share of the step']} | "
        f"{_f(None if back is None else 100 * back, '.0f')} % (reference kernels, benzene) |",
    ]
    return lines


def write_markdown(data: dict, path: Path) -> None:
    rows = data["rows"]
    annotate(rows)
    env = data["env"]
    lines = [
        f"# Benchmarks: {data['name']}",
        "",
        f"{env['device']} · torch {env['torch']} · triton {env['triton']} · Python {env['python']} · "
        f"commit {env['commit']} · {data['timestamp']}" + (" · **--quick**" if env.get("quick") else ""),
        "",
        "Produced by `python benchmarks/run_all.py` in one run. Times: host data → host results (neighbour list, "
        "transfers, one backward), medians of `triton.testing.do_bench` on CUDA or a wall-clock loop on CPU. "
        "**× ours** = that implementation's time / our best time for the same work (> 1: ours is faster). "
        f"Student: {data.get('student', '?')} (PaiNN, hidden 128, 3 layers, 20 Bessel functions, 5 Å cutoff).",
        "",
        *(
            [
                f"CPU run: {data['extra'].get('cpu_count')} cores, {data['extra'].get('torch_threads')} torch threads, "
                f"1-min load average {data['extra'].get('loadavg_1min_start', float('nan')):.1f} at the start "
                "(per-section loads at the end of this file): where other processes share the cores, compare rows "
                "within one table, not across runs.",
                "",
            ]
            if env["device"] in ("cpu", "x86_64", "") or "cpu" in data["name"]
            else []
        ),
        "## Implementations",
        "",
        "| key | implementation | parameters | available | note |",
        "|---|---|---:|---|---|",
    ]
    for k, m in data["models"].items():
        lines.append(
            f"| {k} | {m['label']} | {m['params']:,} | {'yes' if m['available'] else 'no: ' + str(m['why_unavailable'])} "  # noqa: E501
            f"| {m['note']} |"
        )
    lines += ["", "## Seeds' numbers beside ours", "", *_seed_lines(data), ""]
    if any(r["section"] == "latency" for r in rows):
        lines += ["## (a) Single-molecule latency", "", *_pivot(rows, "latency"), ""]
        lines += [*_step_pivot(rows, "latency"), "All rows:", ""]
        lines += [*_detail(rows, "latency"), ""]
    if any(r["section"] == "sweep" for r in rows):
        lines += ["## (b) Batch sweep over g2 molecules (energy + forces), µs per structure", ""]
        lines += _pivot(rows, "sweep", value="us_per_structure", unit="µs/structure")
        lines += ["", *_step_pivot(rows, "sweep", value="us_per_structure", unit="µs/structure")]
        lines += ["", f"Plot: `{data['name']}-sweep.png`. All rows:", ""]
        lines += [*_detail(rows, "sweep", extra_cols=(("structures/s", "structures_per_s", ".3g"),)), ""]
    if any(r["section"] == "matrix" for r in rows):
        lines += ["## (c) Configuration matrix: time and error vs fp64 (plain-PyTorch fp64 reference)", ""]
        lines += [
            *_detail(
                rows,
                "matrix",
                extra_cols=(
                    ("max abs ΔE/atom eV", "max_dE_per_atom_eV", ".1e"),
                    ("max abs ΔF eV/Å", "max_dF_eVA", ".1e"),
                    ("RMSE ΔF eV/Å", "rmse_dF_eVA", ".1e"),
                ),
            ),
            "",
        ]
    bd = [r for r in rows if r["section"] == "breakdown" and "stages_us" in r]
    if bd:
        stages = list(dict.fromkeys(k for r in bd for k in r["stages_us"]))
        lines += [
            "## (d) Per-stage breakdown of one eager energy + forces step (synchronised per stage, µs, % of step)",
            "",
            "| system | kernels | atoms | step µs | " + " | ".join(stages) + " | kernels/step | host launches/step |",
            "|---|---|---:|---:|" + "---:|" * (len(stages) + 2),
        ]
        for r in bd:
            cells = [
                f"{r['stages_us'][s]:.0f} ({100 * r['stages_frac'][s]:.0f} %)" if s in r["stages_us"] else "—"
                for s in stages
            ]
            prof = r.get("profile", {})
            lines.append(
                f"| {r['system']} | {r['backend']} | {r['atoms']} | {r['step_us_instrumented']:.0f} | "
                + " | ".join(cells)
                + f" | {_f(prof.get('kernels_per_step'), '.0f')} | "
                f"{_f(prof.get('host_launches_per_step', prof.get('torch_ops_per_step')), '.0f')} |"
            )
        lines += [
            "",
            "Per-stage timing synchronises the device around every stage, so the instrumented step is slower "
            "than an uninstrumented one; shares are what matters. On CPU the last column counts torch operators. "
            f"Chrome trace: `{data['name']}-trace.json.gz` (open in chrome://tracing or Perfetto).",
            "",
        ]
    la = [r for r in rows if r["section"] == "launches"]
    if la:
        lines += [
            "### Kernels per end-to-end call (benzene, energy + forces, `engine.compute` from host data)",
            "",
            "| implementation | device kernels / call | host launch calls / call | of them graph launches | torch ops / call (CPU) |",  # noqa: E501
            "|---|---:|---:|---:|---:|",
        ]
        for r in la:
            lines.append(
                f"| {r['impl']} | {_f(r.get('kernels_per_step'), '.0f')} | {_f(r.get('host_launches_per_step'), '.0f')} "  # noqa: E501
                f"| {_f(r.get('graph_launches_per_step'), '.0f')} | {_f(r.get('torch_ops_per_step'), '.0f')} {r.get('error', '')} |"  # noqa: E501
            )
        lines.append("")
    if any(r["section"] == "scaling" for r in rows):
        lines += ["## (e) Scaling over water boxes (energy + forces, one structure)", ""]
        lines += _pivot(rows, "scaling", value="us", scale=1e-3, unit="ms")
        lines += ["", f"Plot: `{data['name']}-scaling.png`. All rows:", ""]
        lines += [*_detail(rows, "scaling", extra_cols=(("µs/atom", "us_per_atom", ".3g"),)), ""]
    st = [r for r in rows if r["section"] == "startup"]
    if st:
        lines += [
            "## (f) Cold vs warm start (fresh process; benzene E+F)",
            "",
            "| implementation | cache | import torch s | import package s | load → first result s | second call ms | process wall s |",  # noqa: E501
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in st:
            lines.append(
                f"| {r['impl']} | {r.get('phase', '')} | {_f(r.get('import_torch_s'), '.2f')} | "
                f"{_f(r.get('import_package_s'), '.2f')} | {_f(r.get('first_result_s'), '.2f')} | "
                f"{_f(r.get('second_call_ms'), '.2f')} | {_f(r.get('process_wall_s'), '.1f')} {_status(r)} |"
            )
        lines += ["", "cold = empty compile/Triton cache directory; warm = a second process on the same directory.", ""]
    errs = [r for r in rows if r.get("impl") == "section"]
    if errs:
        lines += ["## Sections that failed", ""] + [f"- {r['section']}: {r['error']}" for r in errs] + [""]
    extra = data.get("extra", {})
    if extra:
        lines += ["## Run", "", "```", json.dumps(extra, indent=1, default=str), "```", ""]
    path.write_text("\n".join(lines) + "\n")


def write_plots(data: dict, out: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, written = data["rows"], []

    def series(section, x, y):
        by: dict[str, list] = {}
        for r in rows:
            if r["section"] == section and y in r and r.get(x) is not None:
                by.setdefault(r["impl"], []).append((r[x], r[y]))
        return {k: sorted(v) for k, v in by.items() if v}

    sw = series("sweep", "batch", "us_per_structure")
    if sw:
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        for label, pts in sw.items():
            xs, ys = zip(*pts, strict=True)
            ax[0].loglog(xs, ys, "o-", label=label)
            ax[1].loglog(xs, [1e6 / y for y in ys], "o-", label=label)
        ax[0].set(xlabel="batch (g2 molecules)", ylabel="µs per structure (E+F)", title="cost per structure")
        ax[1].set(xlabel="batch (g2 molecules)", ylabel="structures / s", title="throughput")
        ax[0].legend(fontsize=7)
        for a in ax:
            a.grid(True, which="both", alpha=0.3)
        fig.suptitle(f"{data['env']['device']}: batch sweep")
        fig.tight_layout()
        written.append(out / f"{name}-sweep.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    sc = series("scaling", "atoms", "us")
    if sc:
        mem = series("scaling", "atoms", "peak_mem_mb")
        fig, ax = plt.subplots(1, 2 if mem else 1, figsize=(12 if mem else 6.5, 4.5), squeeze=False)
        for label, pts in sc.items():
            xs, ys = zip(*pts, strict=True)
            ax[0][0].loglog(xs, [y / 1e3 for y in ys], "o-", label=label)
        ax[0][0].set(xlabel="atoms (water box)", ylabel="ms per E+F call", title="time vs size")
        ax[0][0].legend(fontsize=7)
        if mem:
            for label, pts in mem.items():
                xs, ys = zip(*pts, strict=True)
                ax[0][1].loglog(xs, ys, "o-", label=label)
            ax[0][1].set(xlabel="atoms (water box)", ylabel="peak device memory, MB", title="memory vs size")
        for a in ax[0]:
            a.grid(True, which="both", alpha=0.3)
        fig.suptitle(f"{data['env']['device']}: scaling")
        fig.tight_layout()
        written.append(out / f"{name}-scaling.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    bd = [r for r in rows if r["section"] == "breakdown" and "stages_frac" in r]
    if bd:
        stages = list(dict.fromkeys(k for r in bd for k in r["stages_frac"]))
        fig, ax = plt.subplots(figsize=(11, 1.0 + 0.6 * len(bd)))
        labels = [f"{r['system']} ({r['atoms']} atoms), {r['backend']}" for r in bd]
        left = [0.0] * len(bd)
        cmap = plt.get_cmap("tab20")
        for k, s in enumerate(stages):
            vals = [100 * r["stages_frac"].get(s, 0.0) for r in bd]
            ax.barh(labels, vals, left=left, color=cmap(k % 20), label=s)
            left = [a + b for a, b in zip(left, vals, strict=True)]
        ax.set(xlabel="% of the instrumented eager step", xlim=(0, 100))
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
        fig.suptitle(f"{data['env']['device']}: per-stage breakdown (E+F)")
        fig.tight_layout()
        written.append(out / f"{name}-breakdown.png")
        fig.savefig(written[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small sizes and fewer points (CPU smoke runs)")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--name", default=None, help="file stem (default <gpu>-<date>)")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget; later work is skipped")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--model", default="auto", help="builtin:<name>, a checkpoint, random, or auto (default)")
    p.add_argument("--impls", default=None, help=f"only these implementation keys (from {IMPL_KEYS})")
    p.add_argument("--molecules", default=",".join(MOLECULES), help="latency molecules (ASE names)")
    p.add_argument("--sweep-sizes", default=None, help="batch sizes (default 1..4096; --quick 1,4,16,64)")
    p.add_argument("--scaling-sizes", default=None, help="water-box atom counts (default 12..100000)")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ValueError(f"unknown section(s) {bad}; choose from {SECTIONS}")
    _sizes(args.sweep_sizes, SWEEP)  # validate before any work starts
    _sizes(args.scaling_sizes, SCALING)
    if args.impls and not set(args.impls.split(",")) <= set(IMPL_KEYS):
        raise ValueError(f"unknown implementation key(s) in --impls {args.impls!r}; choose from {IMPL_KEYS}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no CUDA device is visible; use --device cpu")
    suite = Suite(args)
    print(f"# {suite.name}: sections {sections}, budget {args.budget_s:.0f} s", flush=True)
    suite.run(sections)
    print((suite.out / f"{suite.name}.md").read_text())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(min(16, os.cpu_count() or 1)))
    raise SystemExit(main())
