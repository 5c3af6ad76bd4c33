"""The package imports its public names on first use: ``import mlff_distiller``, the command line's parser and the
extxyz worker processes import neither torch nor ASE, while every public name and submodule stays reachable."""

import subprocess
import sys

import pytest

import mlff_distiller

HEAVY = ("torch", "ase", "triton", "scipy")


def _loaded_after(code: str, modules: tuple[str, ...] = HEAVY) -> list[str]:
    """Which of ``modules`` a fresh interpreter has imported after running ``code``."""
    probe = f"import sys\n{code}\nprint(sorted(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, check=True)
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "code",
    [
        "import mlff_distiller",
        "import mlff_distiller; mlff_distiller.__version__",
        "import mlff_distiller._extxyz_parallel",  # what the forkserver of predict_file's workers imports
        "from mlff_distiller.frames import FrameTable",
        "import mlff_distiller.distill; mlff_distiller.distill.__all__",
        "from mlff_distiller.cli import make_parser; make_parser()",
    ],
)
def test_light_imports(code):
    assert _loaded_after(code) == []


def test_help_imports_nothing_heavy():
    code = "from mlff_distiller.cli import main\ntry:\n    main(['predict', '--help'])\nexcept SystemExit:\n    pass"
    assert _loaded_after(code) == []


def test_job_classes_import_no_md_or_scipy():
    """A command's job (``SamplingConfig`` and ``TrainConfig`` among its fields) needs torch, not ASE's MD, its
    optimisers or SciPy (~0.5 s more; the labelling task imports them when it runs)."""
    assert _loaded_after("import mlff_distiller.cli_jobs", ("scipy", "ase.md", "ase.optimize")) == []


def test_distill_names_resolve():
    from mlff_distiller import distill
    from mlff_distiller.distill.sampling import SamplingConfig

    assert distill.SamplingConfig is SamplingConfig
    assert set(distill.__all__) == set(distill._EXPORTS)
    for name in distill.__all__:
        assert getattr(distill, name) is not None
    assert distill.labelling.label is distill.label  # a submodule as an attribute
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = distill.not_a_name


def test_every_public_name_resolves():
    from mlff_distiller.batch import AtomsBatch
    from mlff_distiller.engine import ForceEngine
    from mlff_distiller.frames import FrameTable

    for name in mlff_distiller.__all__:
        assert getattr(mlff_distiller, name) is not None
    assert mlff_distiller.ForceEngine is ForceEngine and mlff_distiller.AtomsBatch is AtomsBatch
    assert mlff_distiller.FrameTable is FrameTable
    from mlff_distiller.batch import FrameTable as from_batch

    assert from_batch is FrameTable  # batch re-exports it
    # Plain constants of the package itself (no import behind them): the version and the default student's name.
    assert set(mlff_distiller.__all__) == {*mlff_distiller._EXPORTS, "__version__", "DEFAULT_MODEL"}
    assert set(mlff_distiller.__all__) <= set(dir(mlff_distiller))


def test_star_import_gives_the_public_api():
    namespace: dict = {}
    exec("from mlff_distiller import *", namespace)
    assert {k for k in namespace if not k.startswith("__")} | {"__version__"} == set(mlff_distiller.__all__)


def test_submodules_are_attributes_and_unknown_names_raise():
    assert mlff_distiller.predict.predict_forces is mlff_distiller.predict_forces  # as with the eager package
    assert hasattr(mlff_distiller.kernels, "message_passing")
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = mlff_distiller.not_a_name
    assert not hasattr(mlff_distiller, "__not_a_dunder__")


def test_cli_job_classes_through_the_cli_module():
    from mlff_distiller import cli, cli_jobs, committee

    assert cli.TrainJob is cli_jobs.TrainJob and cli.JOBS is cli_jobs.JOBS
    assert cli_jobs.CheckJob().models == list(committee.DEFAULT_COMMITTEE)
    assert cli_jobs.CheckJob().threshold == committee.DISAGREEMENT_THRESHOLD
    with pytest.raises(AttributeError):
        _ = cli.NotAJob
