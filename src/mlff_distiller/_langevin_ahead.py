"""The next positions of ASE's ``Langevin`` integrator, predicted during its force call (``StudentCalculator.follow``).

The calculator's launch ahead (``StudentCalculator._launch_ahead``) starts the next MD step's device work before
ASE asks for it, and the engine takes that work only where the next call's positions are, byte for byte, the ones
launched. Velocity Verlet's next positions follow from the momenta and forces. Langevin's also take the next step's
noise, drawn from the integrator's random generator at the start of that step: here the same draws are made from a
copy of the generator (the integrator's own generator is left as it was), and ASE's operations are repeated in
ASE's order, on the same float64 arrays, so that the result is bit for bit the one ASE will set:

1. the rest of this step: ``v += c1 F / m - c2 v + rnd_vel``, then ``set_momenta(v m)`` (the constraints'
   ``adjust_momenta``);
2. the next step: ``v = p / m`` (``get_velocities``), ``xi`` then ``eta`` from the generator, ``rnd_pos = c5 eta``,
   ``rnd_vel = c3 xi - c4 eta`` (with ``fixcm``'s corrections), ``v += c1 F / m - c2 v + rnd_vel`` and
   ``x + dt v + rnd_pos`` through the constraints' ``adjust_positions`` (``set_positions``).

``F`` is what ``atoms.get_forces(md=True)`` returns at the start of the next step: the calculator's forces, adjusted
by the constraints that add a potential energy. Written against ASE 3.23-3.29's ``Langevin.step``; a version that
computes otherwise makes predictions that the engine does not take (its result stays exact), and
``tests/test_launch_ahead.py`` compares the prediction with ASE's positions step by step.
"""

from __future__ import annotations

import copy

import numpy as np

__all__ = ["is_langevin", "next_positions"]


def is_langevin(dyn) -> bool:
    from ase.md.langevin import Langevin

    return type(dyn) is Langevin  # (a subclass may step otherwise)


# One twin generator per kind of generator, whose state is set from the integrator's before each draw: a state copy
# costs ~4 µs where copy.deepcopy of a NumPy Generator costs ~57 µs (development CPU), which made a followed
# Langevin step slower than one not followed (benchmarks/results/stop68_gpu/d/).
_TWINS: dict = {}


def _draws(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``xi, eta`` as the next step draws them from ``rng``, which is left as it was: drawn from a twin generator
    in ``rng``'s state (NumPy's global generator: its state saved and restored)."""
    if isinstance(rng, np.random.Generator):
        bits = rng.bit_generator
        twin = _TWINS.get(type(bits))
        if twin is None:
            twin = _TWINS[type(bits)] = np.random.Generator(type(bits)())
        twin.bit_generator.state = bits.state
    elif isinstance(rng, np.random.RandomState):
        twin = _TWINS.get(np.random.RandomState)
        if twin is None:
            twin = _TWINS[np.random.RandomState] = np.random.RandomState()
        twin.set_state(rng.get_state())
    elif rng is np.random:
        state = np.random.get_state()  # noqa: NPY002 (ASE Langevin's default rng is the legacy global one)
        try:
            return rng.standard_normal(size=(n, 3)), rng.standard_normal(size=(n, 3))
        finally:
            np.random.set_state(state)  # noqa: NPY002
    else:  # another object with standard_normal: a copy of it
        twin = copy.deepcopy(rng)
    return twin.standard_normal(size=(n, 3)), twin.standard_normal(size=(n, 3))


def next_positions(dyn, atoms, forces: np.ndarray) -> np.ndarray | None:
    """The positions ASE's ``Langevin`` ``dyn`` will set in its next step, called from the force call of its current
    step on ``atoms`` (its own atoms) with the calculator's ``forces``; None where this module does not repeat the
    step (other atoms, no step under way, constraints that redistribute the noise, a parallel communicator)."""
    if dyn.atoms is not atoms or getattr(dyn, "v", None) is None or getattr(dyn, "rnd_vel", None) is None:
        return None
    n = len(atoms)
    if dyn.v.shape != (n, 3) or forces.shape != (n, 3) or getattr(dyn.comm, "size", 1) != 1:
        return None
    constraints = atoms.constraints
    if any(hasattr(c, "redistribute_forces_md") for c in constraints):
        return None
    masses = dyn.masses
    m = atoms.get_masses()  # (get_velocities' and FixCom's; dyn.masses is the [n, 1] copy made with the integrator)
    # 1. the rest of this step (Langevin.step after its second get_forces)
    v = dyn.v + (dyn.c1 * forces / masses - dyn.c2 * dyn.v + dyn.rnd_vel)
    momenta = v * masses
    for c in constraints:
        if _whole_fixcom(c):  # FixCom.adjust_momenta's operations, the masses fetched once
            momenta -= m[:, None] * (momenta.sum(axis=0) / m.sum())
        elif hasattr(c, "adjust_momenta"):
            c.adjust_momenta(atoms, momenta)
    # 2. the next step up to set_positions
    f = forces  # get_forces(md=True): adjusted by the constraints with a potential energy (on a copy)
    for c in constraints:
        if hasattr(c, "adjust_potential_energy"):
            f = f.copy() if f is forces else f
            c.adjust_forces(atoms, f)
    v = momenta / m[:, np.newaxis]
    xi, eta = _draws(dyn.rng, n)
    rnd_pos = dyn.c5 * eta
    rnd_vel = dyn.c3 * xi - dyn.c4 * eta
    if dyn.fix_com:
        factor = np.sqrt(n / (n - 1.0))
        rnd_pos -= rnd_pos.sum(axis=0) / n
        rnd_vel -= (rnd_vel * masses).sum(axis=0) / (masses * n)
        rnd_pos *= factor
        rnd_vel *= factor
    v += dyn.c1 * f / masses - dyn.c2 * v + rnd_vel
    x = atoms.arrays["positions"]
    new = x + dyn.dt * v + rnd_pos
    for c in constraints:  # (set_positions adjusts a float copy; ``new`` is this function's own)
        if _whole_fixcom(c):  # FixCom.adjust_positions: the old centre of mass as get_center_of_mass makes it
            total = m.sum()
            new += m @ x / total - m @ new / total
        else:
            c.adjust_positions(atoms, new)
    return new


def _whole_fixcom(c) -> bool:
    """``c`` is ASE's ``FixCom`` over every atom, whose adjustments :func:`next_positions` makes itself (the same
    operations; ~25 µs of its ~56 on the development CPU went to the constraint's calls)."""
    from ase.constraints import FixCom

    return type(c) is FixCom and getattr(c, "index", None) == slice(None)
