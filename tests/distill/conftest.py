"""Shared data for the distillation tests: small EMT-labelled sets (EMT is fast and always installed)."""

import pytest
from ase.build import molecule

from mlff_distiller.distill import SamplingConfig, label, read_frames


def emt_seeds():
    return [molecule("H2O"), molecule("CH4"), molecule("NH3")]


def small_sampling(**kw) -> SamplingConfig:
    opts = dict(temperatures=[300.0, 500.0], md_steps=80, sample_every=4, timestep_fs=0.5, rattle_per_seed=4)
    opts.update(kw)
    return SamplingConfig(**opts)


@pytest.fixture(scope="session")
def emt_labels(tmp_path_factory):
    """Label directory of EMT training frames (H2O, CH4, NH3; 300 and 500 K; a few rattles)."""
    out = tmp_path_factory.mktemp("emt_labels")
    label(emt_seeds(), "emt", out, small_sampling(), progress=False)
    return out


@pytest.fixture(scope="session")
def emt_test_labels(tmp_path_factory):
    """Held-out EMT frames: separate trajectories (another base seed)."""
    out = tmp_path_factory.mktemp("emt_test")
    label(emt_seeds(), "emt", out, small_sampling(seed=99, md_steps=60, rattle_per_seed=0), progress=False)
    return out


@pytest.fixture(scope="session")
def emt_frames(emt_labels):
    return read_frames(emt_labels)
