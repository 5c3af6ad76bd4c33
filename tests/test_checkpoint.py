import pytest
import torch
from ase.build import molecule

from mlff_distiller import StudentModel, load_model, predict_forces
from mlff_distiller.checkpoint import FORMAT_VERSION


def test_roundtrip(tmp_path, model):
    path = tmp_path / "m.pt"
    model.save(path, metadata={"teacher": "emt"})
    loaded = load_model(path)
    assert isinstance(loaded, StudentModel) and loaded.config == model.config
    assert loaded.metadata == {"teacher": "emt"} and loaded.cutoff == model.cutoff
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    mol = molecule("CH3OH")
    e0 = predict_forces(model, [mol], precision="fp64")[0]["energy"]
    assert predict_forces(loaded, [mol], precision="fp64")[0]["energy"] == pytest.approx(e0, abs=1e-12)
    assert predict_forces(str(path), [mol], precision="fp64")[0]["energy"] == pytest.approx(e0, abs=1e-12)


def test_corrupt_file(tmp_path):
    path = tmp_path / "bad.pt"
    path.write_bytes(b"definitely not a checkpoint")
    with pytest.raises(ValueError, match="not a readable mlff-distiller checkpoint"):
        load_model(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope.pt")


def test_missing_key_and_newer_format(tmp_path, model):
    path = tmp_path / "m.pt"
    model.save(path)
    payload = torch.load(path, weights_only=True)
    del payload["state_dict"]
    torch.save(payload, tmp_path / "nokey.pt")
    with pytest.raises(ValueError, match="missing checkpoint key"):
        load_model(tmp_path / "nokey.pt")
    payload = torch.load(path, weights_only=True)
    payload["format_version"] = FORMAT_VERSION + 1
    torch.save(payload, tmp_path / "newer.pt")
    with pytest.raises(ValueError, match="newer than this mlff-distiller"):
        load_model(tmp_path / "newer.pt")


def test_checkpoint_never_runs_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"format": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="not a readable"):
        load_model(tmp_path / "evil.pt")


def test_unknown_builtin():
    with pytest.raises(ValueError, match="no built-in model"):
        load_model("builtin:does-not-exist")
