"""``domain.FORCE_LIMIT`` in ``predict_forces(check_domain=True)``: a structure in which an atom felt more than the
limit (atoms pressed into one another: every number finite, nothing the student can describe) gets a finding in
its ``domain``, beside the envelope's, and counts in the warning. (The calculator's and BatchedMD's checks are tested
with them.)"""

import numpy as np
import pytest
from ase import Atoms
from ase.build import molecule

from mlff_distiller import load_model, predict_forces
from mlff_distiller.domain import OutOfDomainWarning


def test_predict_names_a_structure_beyond_the_force_limit(monkeypatch):
    import mlff_distiller.domain as domain

    model = load_model("builtin:chno-gfn2")
    calm = [molecule("CH4"), molecule("H2O")]
    pressed = Atoms("OH", positions=[[0, 0, 0], [0.45, 0, 0]])  # inside the wall: ZBL's forces, hundreds of eV/Å
    plain = predict_forces(model, [*calm, pressed], device="cpu")
    peaks = [np.abs(r["forces"]).max() for r in plain]
    assert peaks[2] > domain.FORCE_LIMIT > 10 * max(peaks[:2])
    with pytest.warns(OutOfDomainWarning, match="1 of 3 structures"):
        got = predict_forces(model, [*calm, pressed], device="cpu", check_domain=True)
    assert got[0]["domain"] == [] and got[1]["domain"] == []
    assert any("an atom felt a force of" in f for f in got[2]["domain"])
    assert any("H-O pair" in f for f in got[2]["domain"])  # the envelope's finding too
    monkeypatch.setattr(domain, "FORCE_LIMIT", float(peaks[2]) * 2)
    with pytest.warns(OutOfDomainWarning):
        again = predict_forces(model, [*calm, pressed], device="cpu", check_domain=True)
    assert not any("an atom felt" in f for f in again[2]["domain"])
