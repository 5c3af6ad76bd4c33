"""ASE names that moved between the releases this package supports (``ase>=3.23``), for the package, its examples
and scripts."""

from __future__ import annotations

import numpy as np
from ase import Atoms

__all__ = ["maxwell_boltzmann"]


def maxwell_boltzmann(atoms: Atoms, temperature_K: float, rng: np.random.Generator | None = None) -> None:
    """Set ``atoms``' momenta to a Maxwell-Boltzmann draw at ``temperature_K``.

    ``thermalize_momenta`` from ASE 3.29 on; ``MaxwellBoltzmannDistribution`` (deprecated in 3.29, a thin wrapper of
    the former there) before it. The same ``rng`` gives the same momenta with either."""
    try:
        from ase.md.velocitydistribution import thermalize_momenta
    except ImportError:  # ASE < 3.29
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

        MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=rng)
        return
    thermalize_momenta(atoms, temperature_K, rng=rng)
