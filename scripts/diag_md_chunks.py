"""Stop 36: does BatchedMD's trajectory depend on how its steps are split into run() calls? (The 2,000 K probe failed
more often with run(500) than with run(10).) The same seed, fp64 and fp32, 300 steps as one run(300), as 30 x
run(10), and as run(300) again (the run-to-run spread from the device's float atomics); max |Δ positions|."""

import warnings

import torch

warnings.simplefilter("ignore")
from mlff_distiller import BatchedMD, load_model  # noqa: E402
from mlff_distiller.distill.seeds import g2_chno  # noqa: E402

structures = [a for a in g2_chno() for _ in range(16)]
for precision in ("fp64", "fp32"):
    for wall in (False, True):
        model = load_model("builtin:chno-gfn2")
        if not wall:
            model.set_repulsion(None)
        finals = {}
        for name, chunks in (("run(300)", [300]), ("30 x run(10)", [10] * 30), ("run(300) again", [300])):
            md = BatchedMD(model, structures, temperature_K=2000.0, seed=0, precision=precision, check_domain=500)
            for c in chunks:
                md.run(c)
            finals[name] = md._batch.positions.clone()
            del md
            torch.cuda.empty_cache()
        ref = finals["run(300)"]
        for name in ("30 x run(10)", "run(300) again"):
            d = (finals[name] - ref).abs().max().item()
            print(f"{precision} wall={wall}: {name} vs run(300): max |dr| = {d:.3e} Å", flush=True)
