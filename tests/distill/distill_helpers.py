"""Small sampling set-ups shared by the distillation tests (a module, so test files import it by a unique name)."""

from ase.build import molecule

from mlff_distiller.distill import SamplingConfig


def emt_seeds():
    return [molecule("H2O"), molecule("CH4"), molecule("NH3")]


def small_sampling(**kw) -> SamplingConfig:
    opts = dict(temperatures=[300.0, 500.0], md_steps=80, sample_every=4, timestep_fs=0.5, rattle_per_seed=4)
    opts.update(kw)
    return SamplingConfig(**opts)
