"""Shared data for the distillation tests: small EMT-labelled sets (EMT is fast and always installed)."""

import pytest
from distill_helpers import emt_seeds, small_sampling

from mlff_distiller.distill import label, read_frames


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
