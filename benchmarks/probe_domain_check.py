"""Time of the envelope check (DomainEnvelope.check) of water boxes on the GPU and on the host CPU."""

import sys
import time

sys.path.insert(0, "benchmarks")
from systems import water_box

from mlff_distiller import load_model
from mlff_distiller.domain import DomainEnvelope

env = DomainEnvelope.of_model(load_model("builtin:chno-gfn2"))
for n in (3000, 24000, 100000):
    w = water_box(n, seed=0)
    for dev in ("cuda", None):
        env.check(w, device=dev)
        t = time.perf_counter()
        f = env.check(w, device=dev)
        dt = time.perf_counter() - t
        print(f"{n} atoms, check on {dev or 'cpu'}: {dt * 1e3:.1f} ms; {len(f)} findings", flush=True)
