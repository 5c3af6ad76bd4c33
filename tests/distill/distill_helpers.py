"""Small sampling set-ups shared by the distillation tests (a module, so test files import it by a unique name)."""

from ase.build import molecule

from mlff_distiller.distill import SamplingConfig, TrainConfig


def emt_seeds():
    return [molecule("H2O"), molecule("CH4"), molecule("NH3")]


def small_sampling(**kw) -> SamplingConfig:
    opts = dict(temperatures=[300.0, 500.0], md_steps=80, sample_every=4, timestep_fs=0.5, rattle_per_seed=4)
    opts.update(kw)
    return SamplingConfig(**opts)


def small_train_config(**kw) -> TrainConfig:
    """A small student trained on the CPU (16 features, 2 layers); ``kw`` overrides any setting."""
    opts = dict(
        model=dict(hidden=16, layers=2, n_rbf=8, cutoff=4.0),
        batch_size=8,
        lr=3e-3,
        warmup_steps=5,
        eval_every=10,
        ema_decay=0.9,
        device="cpu",
        patience=0,
    )
    opts.update(kw)
    return TrainConfig(**opts)
