"""The MD step queued on the device behind the one in flight (``ForceEngine.chain_ahead``).

The calculator launches a velocity-Verlet step ahead on the positions it predicts (``StudentCalculator._launch_ahead``),
but it can predict them only once the step before has returned its forces: the host's wait, the prediction and the
launch sit between two steps (~50 µs of a ~200 µs step of the 128 x 3 student on the H200,
``benchmarks/results/stop81_gpu/d/md_phases_h128.txt``). An :class:`MDChain` moves the prediction onto the device.
Two captured steps (parities 0 and 1) each read the forces of the step before them from the other's packed output,
take the positions and momenta that ASE holds at the calculation before (written by the host when it queues them),
predict ASE's next positions as ``StudentCalculator._verlet_next`` and ``_moved`` do, and run the Verlet bucket's
zero-copy step on them. So the next step is queued before the host waits for the current one.

The prediction is ASE's arithmetic op for op, in float64: ``kick = F * (0.5 dt)``, ``p' = p + kick``, ``p' += kick``,
``x' = x + (p' * dt) / m``, then ``x' - origin`` cast to the engine's float32
(:func:`mlff_distiller.kernels.verlet_predict.verlet_predict`: one Triton kernel compiled without contraction into
FMAs, or the same ops as torch elementwise kernels). On the H200 both gave NumPy's bits for every coordinate tried
(``benchmarks/results/stop81_gpu/d/probe_verlet_predict.md``). The engine takes a chained step only where the positions
it read equal, byte for byte, the ones the calculator predicted on the host: a difference costs a fresh step, never a
wrong result.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from mlff_distiller.cudagraph import HostBuffer, copy_bits
from mlff_distiller.kernels.verlet_predict import verlet_predict, verlet_predict_reference

__all__ = ["MDChain"]


class MDChain:
    """The two chained steps of one Verlet bucket and atom count (see the module docstring).

    ``steps[k]``: a :class:`~mlff_distiller.engine_verlet._MDStep` whose runner predicts its positions into
    ``steps[k].positions`` and writes its packed output into ``steps[k].packed``; it reads the forces from
    ``steps[1 - k].packed``. ``x[k]``, ``p[k]``: the float64 positions and momenta of the calculation before it
    (host buffers the host fills when it queues step k). ``consts``: ``0.5 dt``, ``dt``, the origin (3) and the
    masses (n), float64, rewritten only while no chained step is in flight.
    """

    # The prediction as one Triton kernel where the kernel backend is Triton (kernels/verlet_predict.py); False: as
    # torch's elementwise ops, ~10 kernels in the graph (probes time the two; the same bits either way).
    device_kernel: ClassVar[bool] = True

    def __init__(self, engine, md, fill, n: int, step) -> None:
        from mlff_distiller.engine_verlet import _MDStep

        device, dtype = engine.device, engine.dtype
        a = fill.bucket.atoms
        w = a * 8 // dtype.itemsize  # the packed output's layout: engine_padded.unpack
        self.md = md  # the bucket's own zero-copy step for this count (the chain is dropped with it)
        self.n = n
        self.rows = slice(w + a, w + 4 * a)
        self.consts = HostBuffer((5 + n,), torch.float64, device)
        self.consts_key: tuple | None = None
        self.x = tuple(HostBuffer((n, 3), torch.float64, device) for _ in range(2))
        self.p = tuple(HostBuffer((n, 3), torch.float64, device) for _ in range(2))
        positions = [HostBuffer((n, 3), dtype, device) for _ in range(2)]
        packed = [HostBuffer(md.packed.host.shape, dtype, device) for _ in range(2)]
        # A capture's warm-up runs the step: let it predict sane positions (those of the fill, at rest).
        x0 = fill.positions.detach().cpu().numpy().astype(np.float64)
        self.consts.array[:] = 0.0
        self.consts.array[5:] = 1.0
        for k in range(2):
            self.x[k].array[:] = x0
        static = fill.graph.positions[:n]
        key = (fill.bucket, n)
        runners = [
            engine._capture(self._chained(k, positions, packed, static, step), fill.graph, key, {}) for k in (0, 1)
        ]
        self.steps = tuple(_MDStep(runners[k], positions[k], packed[k], md.dense) for k in range(2))

    def _chained(self, k: int, positions, packed, static, step):
        n = self.n
        prev = packed[1 - k].view[self.rows].view(-1, 3)[:n]
        consts, x, p, out = self.consts.view, self.x[k].view, self.p[k].view, positions[k].view
        predict = verlet_predict if self.device_kernel else verlet_predict_reference

        def chained_step(*inputs):
            predict(prev, x, p, consts, out, static)
            result = step(*inputs)
            copy_bits(result, packed[k].view)
            return result

        return chained_step

    def set_consts(self, dt: float, origin: torch.Tensor, masses: np.ndarray, busy: bool) -> bool:
        """Write the time step, origin (the batch's ``[1, 3]`` float64 tensor) and masses ``[n, 1]`` if they changed;
        False where they changed while a chained step may still read them (``busy``: the step in flight is one of
        this chain's)."""
        kept = self.consts_key
        if kept is not None and dt == kept[0] and origin is kept[3] and masses is kept[4]:
            return True  # (the calculator's MD step hands the same objects each call: their bytes not read again)
        origin_values = origin.numpy()
        key = (dt, origin_values.tobytes(), masses.tobytes(), origin, masses)
        if kept is not None and key[:3] == kept[:3]:
            self.consts_key = key
            return True
        if busy:
            return False
        c = self.consts.array
        c[0], c[1] = 0.5 * dt, dt
        c[2:5] = origin_values.reshape(3)
        c[5:] = masses.reshape(-1)
        self.consts_key = key
        return True

    def queue(self, k: int, positions: np.ndarray, momenta: np.ndarray, source=None) -> None:
        """Queue step ``k`` behind what the stream holds: the positions and momenta of this calculation into its
        host buffers, the forces of the step before from ``source`` (an _MDStep outside the chain, whose packed
        output is copied into the other parity's first) or from ``steps[1 - k]``."""
        np.copyto(self.x[k].array, positions)
        np.copyto(self.p[k].array, momenta)
        if source is not None:
            copy_bits(source.packed.view[self.rows], self.steps[1 - k].packed.view[self.rows])
        self.steps[k].runner.replay()
