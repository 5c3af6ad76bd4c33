"""Where ``predict_forces`` of one small molecule goes on the GPU host (stop 76 measured ``engine.predict`` of one
benzene at 532.5 µs against ~0.2 ms for ``compute`` of its host batch): the median µs of each layer of the call,
then ``predict_forces`` under cProfile (by own and by cumulative time; read the ranking, not the µs). The shipped
64 x 3 student, fp32, mode auto (the dense step).

    python benchmarks/probe_predict_one.py --calls 2000 > predict_one.txt
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import host_work_us, profile_tables, wall_us


def _state_walk(model) -> tuple:
    """``predict._state`` as it was until stop 77 (for the comparison)."""
    return tuple((id(t), t.data_ptr(), t._version) for t in (*model.parameters(), *model.buffers()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--model", default="builtin:chno-gfn2-small")
    p.add_argument("--molecule", default="C6H6")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_predict_one: needs CUDA")
        return
    from ase.build import molecule

    from mlff_distiller import load_model, predict_forces
    from mlff_distiller.batch import AtomsBatch
    from mlff_distiller.predict import _engine_for, _state

    model = load_model(args.model)
    atoms = molecule(args.molecule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(20):
            predict_forces(model, [atoms])
    settings = {"device": None, "precision": "fp32", "mode": "auto", "compile_mode": None, "memory_budget": None}
    settings["capture_after"] = 1
    engine = _engine_for(model, settings)
    batch = AtomsBatch.from_atoms([atoms], dtype=engine.dtype)
    rows = [
        ("predict_forces(model, [atoms])", lambda: predict_forces(model, [atoms])),
        ("engine.predict([atoms])", lambda: engine.predict([atoms])),
        ("engine.predict([atoms], pipeline=False)", lambda: engine.predict([atoms], pipeline=False)),
        ("engine.predict([atoms], pipeline=True)", lambda: engine.predict([atoms], pipeline=True)),
        ("engine.compute(host batch, as_numpy=True)", lambda: engine.compute(batch, forces=True, as_numpy=True)),
        ("AtomsBatch.from_atoms([atoms])", lambda: AtomsBatch.from_atoms([atoms], dtype=engine.dtype)),
        ("predict._state(model)", lambda: _state(model)),
        ("stop 76's _state (model.parameters() + model.buffers())", lambda: _state_walk(model)),
        ("predict._engine_for(model, settings)", lambda: _engine_for(model, settings)),
    ]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.molecule}, {args.model}")
    before = host_work_us()
    print("\n| call | median µs | p20 µs |\n|---|---:|---:|")
    for label, fn in rows:
        med, p20 = wall_us(fn, args.calls)
        print(f"| {label} | {med:.1f} | {p20:.1f} |")
    # the host's speed now (its phase: ~47 or ~90 µs on the H200 guests, stop 77): these rows are host-bound
    after = host_work_us()
    print(f"| fixed host work (harness.host_work_us), before / after the rows | {before:.1f} / {after:.1f} | |")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        predict_forces(model, [atoms])
    prof.disable()
    print(profile_tables(prof, args.top, title="predict_forces"))


if __name__ == "__main__":
    main()
