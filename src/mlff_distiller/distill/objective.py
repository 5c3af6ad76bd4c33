"""What the student is trained and judged on: its forward with the parameters' graph kept, the force-matching
loss, and its errors on a labelled dataset.

Loss per batch (units eV², so the weights are dimensionless)::

    L = w_E · mean_b ((E_b − E_b^T) / n_b)² + w_F · mean_{i,α} (F_iα − F_iα^T)² + w_H · mean (Hv − Hv^T)² · Å²
        + w_S · mean_{b with a stress label, v} ((σ_bv − σ_bv^T) · V_b / n_b)²

With ``loss: huber`` the energy and force squares become Huber terms (:func:`residual_loss`).

Each mean is weighted by the frames' loss weights c_b (``LabelledBatch.weight``: a frame's
``info["config_weight"]`` times its source's ``--data-weight``, MACE's ``config_weight``), an atom's terms by its
frame's: mean_b x_b = Σ_b c_b x_b / Σ_b c_b and mean_{i,α} x_iα = Σ_i c_b(i) Σ_α x_iα / (3 Σ_i c_b(i))
(:func:`_weighted_mean`; 0 when every weight is 0). All weights 1.0 give the plain means, bit for bit; a frame of
weight 0 leaves the loss and its gradient untouched; weight 2 is the frame twice in the batch. Validation
(:func:`evaluate_dataset`) is unweighted. So a weight acts relative to the other frames of its batch: a batch whose
frames all weigh 0.2 trains as if they weighed 1. ``weight_norm: count`` divides by the number of frames (atoms)
instead, as MACE does: Σ_b c_b x_b / B, so that a weight scales its frames' share of the loss absolutely (all weights
1.0: the same loss as ``sum``, bit for bit).

The stress term compares virials per atom (eV), so its weight is dimensionless like the others; the student's σ
is (1/V) ∂E/∂ε from the same ``autograd.grad`` call as its forces (a zero strain applied to the positions and the
cell), only on the plain step.

Forces are ``−∂E/∂x`` from ``torch.autograd.grad(..., create_graph=True)``, so the loss differentiates through
them (double backward of the model's ops; on the GPU that is the Triton kernels' backward-of-backward). The
optional Hessian term matches the student's H·v, taken by the same central finite difference the teacher
labels used, H·v ≈ −(F(x + εv) − F(x − εv)) / 2ε: two extra force evaluations and only second derivatives,
rather than a third-order autograd through the kernels.

The forward here mirrors :meth:`mlff_distiller.ForceEngine.compute` (same graph, same model call) but keeps
the parameters' graph; the engine freezes them for inference. The padded static step
(:mod:`mlff_distiller.distill.train_steps`) computes the same loss with masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mlff_distiller.distill.dataset import FrameDataset, LabelledBatch
from mlff_distiller.engine_padded import edge_virial, stress_from_strain_gradient
from mlff_distiller.model import StudentModel

if TYPE_CHECKING:
    from mlff_distiller.distill.training import TrainConfig

__all__ = [
    "energy_reference_correction",
    "evaluate_dataset",
    "residual_loss",
    "student_forward",
    "student_forward_stress",
]

_NO_HVP_LABELS = "hvp_weight > 0 needs frames labelled with Hessian-vector products (sampling hvp: true)"
_NO_STRESS_LABELS = "stress_weight > 0 needs periodic frames labelled with a teacher stress"


def student_forward(
    model: StudentModel, batch: LabelledBatch, *, create_graph: bool, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Energies ``[B]`` (eV) and forces ``[N, 3]`` (eV/Å) with the parameters' graph kept.

    ``create_graph=True`` keeps the graph of the forces themselves, so a loss on them can be back-propagated.
    ``positions`` replaces the batch's positions (for finite differences).
    """
    a = batch.atoms
    pos = (a.positions if positions is None else positions).detach().requires_grad_(True)
    out = model(a.numbers, pos, batch.edge_index, batch.shift_vectors(), a.batch, a.num_structures)
    (grad,) = torch.autograd.grad(out["energy"].sum(), pos, create_graph=create_graph)
    return out["energy"], -grad


def student_forward_stress(
    model: StudentModel, batch: LabelledBatch, *, create_graph: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Energies ``[B]``, forces ``[N, 3]`` and stress ``[B, 6]`` (Voigt, eV/Å³, ASE sign; meaningful for the
    fully periodic frames) from one ``autograd.grad`` over the positions and the shift vectors (the pairs' gradient,
    summed into the strain derivative by ``edge_virial``)."""
    a = batch.atoms
    pos = a.positions.detach().requires_grad_(True)
    shift_vectors = batch.shift_vectors().detach().requires_grad_(True)
    out = model(a.numbers, pos, batch.edge_index, shift_vectors, a.batch, a.num_structures)
    grad_pos, grad_pairs = torch.autograd.grad(out["energy"].sum(), (pos, shift_vectors), create_graph=create_graph)
    de_deps = edge_virial(pos, shift_vectors, grad_pairs, batch.edge_index, a.batch, a.num_structures)
    return out["energy"], -grad_pos, stress_from_strain_gradient(de_deps, a.cell, a.pbc)["stress"]


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor, support: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w_k Σ_j v_kj / (m Σ_k w_k) of ``values`` ``[K]`` or ``[K, m]`` (row k weighted by ``weights[k]``), 0 when
    every weight is 0. With all weights 1 the same sum and divisor as ``values.mean()``, so the same bits. The plain
    and the static step share it (no host sync: it is captured in a CUDA graph).

    ``support`` (``weight_norm: count``, MACE's normalisation): divide by m times the number of rows that count
    (``support``: 1 for a real, labelled row, 0 for padding or a frame without that label) instead of the weights'
    sum, so that a weight scales its rows' share of the loss absolutely, whatever else shares the batch."""
    per_row = math.prod(values.shape[1:])
    total = weights.sum() if support is None else support.sum()
    weighted = values * (weights if values.dim() == 1 else weights[:, None])
    return weighted.sum() / (per_row * torch.where(total > 0, total, torch.ones_like(total)))


def _stress_loss(stress: torch.Tensor, batch: LabelledBatch, weight: torch.Tensor, count: bool) -> torch.Tensor:
    """Weighted mean over the labelled frames and the 6 components of ((σ − σ^T) V / n)², eV²; 0 without labelled
    frames. ``weight``: ``[B]`` the frames' loss weights; ``count``: ``weight_norm: count``."""
    a = batch.atoms
    scale = torch.linalg.det(a.cell).abs() / a.counts.to(stress.dtype)
    sq = (((stress - batch.stress) * scale[:, None]) ** 2).mean(dim=1)
    labelled = batch.stress_mask.to(stress.dtype)
    return _weighted_mean(sq, labelled * weight, labelled if count else None)


def _central_hvp(
    forces_at: Callable[[torch.Tensor], torch.Tensor], positions: torch.Tensor, v: torch.Tensor, eps: float
) -> torch.Tensor:
    """H·v ≈ −(F(x + εv) − F(x − εv)) / 2ε (eV/Å² times the units of ``v``), ``forces_at(x)`` the forces
    (eV/Å) at positions ``x`` (Å), ``eps`` in Å. The plain loss and the static step share it."""
    f_plus = forces_at(positions + eps * v)
    f_minus = forces_at(positions - eps * v)
    return -(f_plus - f_minus) / (2 * eps)


def _student_hvp(model: StudentModel, batch: LabelledBatch, eps: float) -> torch.Tensor:
    """The student's H·v ``[N, 3]`` along ``batch.hvp_dir`` by :func:`_central_hvp` (forces keep their graph)."""

    def forces_at(positions: torch.Tensor) -> torch.Tensor:
        return student_forward(model, batch, create_graph=True, positions=positions)[1]

    return _central_hvp(forces_at, batch.atoms.positions, batch.hvp_dir, eps)


def residual_loss(residual: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """Elementwise loss of a residual (eV/atom of energy, eV/Å of force components): its square for ``loss:
    mse``; for ``loss: huber`` the square up to ``huber_delta`` and linear beyond, ``2 δ |r| − δ²`` (continuous, with
    a continuous slope; below δ the same as ``mse``). A few frames far from the student (a fine-tuning round on
    geometries where it failed by volts per ångström) then pull on the weights like their absolute error, not its
    square. The plain and the static step share it."""
    if cfg.loss == "mse":
        return residual.square()
    delta = float(cfg.huber_delta)
    a = residual.abs()
    return torch.where(a <= delta, residual.square(), 2.0 * delta * a - delta * delta)


def _loss(model: StudentModel, batch: LabelledBatch, cfg: TrainConfig) -> tuple[torch.Tensor, dict]:
    """The loss of the module docstring on one (unpadded) batch and its parts as floats (a host sync)."""
    if cfg.stress_weight > 0:
        if batch.stress is None:
            raise ValueError(_NO_STRESS_LABELS)
        energy, forces, stress = student_forward_stress(model, batch, create_graph=True)
    else:
        energy, forces = student_forward(model, batch, create_graph=True)
    n = batch.atoms.counts.to(energy.dtype)
    weight = batch.weight if batch.weight is not None else torch.ones_like(energy.detach())
    atom_weight = weight[batch.atoms.batch]
    count = cfg.weight_norm == "count"  # every frame and atom of an unpadded batch counts
    frames, atoms = (torch.ones_like(weight), torch.ones_like(atom_weight)) if count else (None, None)
    e_loss = _weighted_mean(residual_loss((energy - batch.energy) / n, cfg), weight, frames)
    f_loss = _weighted_mean(residual_loss(forces - batch.forces, cfg), atom_weight, atoms)
    loss = cfg.energy_weight * e_loss + cfg.force_weight * f_loss
    parts = {"energy": float(e_loss.detach()), "forces": float(f_loss.detach())}
    if cfg.stress_weight > 0:
        s_loss = _stress_loss(stress, batch, weight, count)
        loss = loss + cfg.stress_weight * s_loss
        parts["stress"] = float(s_loss.detach())
    if cfg.hvp_weight > 0:
        if batch.hvp is None:
            raise ValueError(_NO_HVP_LABELS)
        bare = getattr(model, "module", model)  # DDP: the wrapped forward runs once per step
        h_loss = _weighted_mean((_student_hvp(bare, batch, cfg.hvp_eps) - batch.hvp) ** 2, atom_weight, atoms)
        loss = loss + cfg.hvp_weight * h_loss
        parts["hvp"] = float(h_loss.detach())
    return loss, parts


def evaluate_dataset(model: StudentModel, dataset: FrameDataset, batch_size: int = 64) -> dict:
    """Errors of ``model`` on ``dataset``: energy MAE/RMSE (meV/atom), force MAE/RMSE (meV/Å); with stress
    labels also ``stress_mae_mev_a3`` over the labelled frames' Voigt components. Unweighted: the frames' loss
    weights (``config_weight``) do not enter."""
    was_training = model.training
    model.eval()
    e_err, f_err, s_err, counts = [], [], [], []
    for batch in dataset.batches(batch_size):
        if dataset.has_stress:
            energy, forces, stress = student_forward_stress(model, batch, create_graph=False)
            s_err.append((stress.detach() - batch.stress)[batch.stress_mask].double().cpu().reshape(-1))
        else:
            energy, forces = student_forward(model, batch, create_graph=False)
        n = batch.atoms.counts
        e_err.append(((energy.detach() - batch.energy) / n).double().cpu())
        f_err.append((forces.detach() - batch.forces).double().cpu().reshape(-1))
        counts.append(n.cpu())
    model.train(was_training)
    e = torch.cat(e_err)
    f = torch.cat(f_err)
    extra = {}
    if s_err and torch.cat(s_err).numel():
        extra["stress_mae_mev_a3"] = 1000 * float(torch.cat(s_err).abs().mean())
    return extra | {
        "energy_mae_mev_atom": 1000 * float(e.abs().mean()),
        "energy_rmse_mev_atom": 1000 * float(e.pow(2).mean().sqrt()),
        "force_mae_mev_a": 1000 * float(f.abs().mean()),
        "force_rmse_mev_a": 1000 * float(f.pow(2).mean().sqrt()),
        "frames": len(dataset),
        "atoms": int(torch.cat(counts).sum()),
    }


def energy_reference_correction(model: StudentModel, dataset: FrameDataset, batch_size: int = 64) -> torch.Tensor:
    """Per-species change Δμ_z (eV, ordered like ``model.species_list``) of the student's energy shift that best
    fits ``dataset``'s teacher energies: the least-squares solution of Σ_z n_z Δμ_z ≈ E_teacher − E_student over
    the frames, each weighted by its loss weight (``config_weight``). Fine-tuning on labels from another teacher
    (another energy zero: DFT after GFN2-xTB, say) adds it to the shift, so the student starts from its learned
    energy surface moved to the new zero instead of learning the offset through its weights. Returns float64 on
    the CPU."""
    was_training = model.training
    model.eval()
    energies = []
    with torch.no_grad():
        for batch in dataset.batches(batch_size):
            a = batch.atoms
            out = model(a.numbers, a.positions, batch.edge_index, batch.shift_vectors(), a.batch, a.num_structures)
            energies.append(out["energy"].double().cpu())
    model.train(was_training)
    root = dataset.weight.detach().double().cpu().sqrt()
    residual = (dataset.energy.detach().double().cpu() - torch.cat(energies)) * root
    comp = torch.as_tensor(dataset.composition(model.species_list), dtype=torch.float64) * root[:, None]
    return torch.linalg.lstsq(comp, residual[:, None], driver="gelsd").solution[:, 0]
