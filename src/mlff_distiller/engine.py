"""``ForceEngine``: energies of a batch, then forces (and stress) from one ``torch.autograd.grad`` call.

Stress uses the strain trick: positions and cell are deformed by a symmetric strain ε (zero-valued, but part of
the graph), and σ = (1/V) ∂E/∂ε: ASE's sign convention (pressure = −trace(σ)/3, as ``ase.Atoms.get_stress``
reports). Voigt order: xx, yy, zz, yz, xz, xy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

import torch

from mlff_distiller.batch import AtomsBatch
from mlff_distiller.model import StudentModel
from mlff_distiller.neighbors import neighbor_list

__all__ = ["PRECISIONS", "ForceEngine", "default_device"]

# Model/positions dtype and whether float32 matmuls may use TF32 tensor cores.
PRECISIONS: dict[str, tuple[torch.dtype, bool]] = {
    "fp64": (torch.float64, False),
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
}
# Atoms per chunk when predict() is given no batch_size: keeps the reference path's [E, 3F] tensors in memory.
DEFAULT_ATOM_BUDGET = {"cuda": 8192, "cpu": 2048}
_VOIGT = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def _matmul_precision(allow_tf32: bool) -> Iterator[None]:
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@contextlib.contextmanager
def _frozen(model: torch.nn.Module) -> Iterator[None]:
    """Parameters stop requiring grad, so inference keeps no graph for them; restored afterwards."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class ForceEngine:
    """Energy, forces and stress for batches of structures with a :class:`StudentModel`.

    Args:
        model: the student (it is copied only if it must change device or dtype).
        device: ``"cuda"``, ``"cpu"``, ... (default: CUDA when available).
        precision: ``"fp64"``, ``"fp32"`` (strict IEEE float32 matmuls) or ``"tf32"``.
        neighbor_method: neighbour-list backend (``"auto"``, ``"brute"``, ``"cell_list"``).
    """

    def __init__(
        self,
        model: StudentModel,
        *,
        device: torch.device | str | None = None,
        precision: str = "fp32",
        neighbor_method: str = "auto",
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(PRECISIONS)}")
        if not isinstance(model, StudentModel):
            raise ValueError(f"ForceEngine needs a StudentModel, got {type(model).__name__}")
        self.device = torch.device(device) if device is not None else default_device()
        self.precision = precision
        self.dtype, self.allow_tf32 = PRECISIONS[precision]
        self.neighbor_method = neighbor_method
        p = next(model.parameters())
        if p.device != self.device or p.dtype != self.dtype:
            model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype)
        self.model = model.eval()

    @property
    def cutoff(self) -> float:
        return self.model.cutoff

    def compute(self, batch: AtomsBatch, *, forces: bool = True, stress: bool = False) -> dict[str, torch.Tensor]:
        """Run one batch. Returns tensors on the engine's device:

        ``energy [B]`` eV, ``atomic_energies [N]`` eV, ``forces [N, 3]`` eV/Å (if ``forces``), and
        ``stress [B, 6]`` eV/Å³ Voigt (if ``stress``; meaningful only for fully periodic structures, whose
        mask is ``stress_valid [B]``). Forces and stress come from a single ``autograd.grad`` call.
        """
        self.model.check_species(batch.numbers)
        batch = batch.to(self.device, self.dtype)
        with torch.no_grad():
            nl = neighbor_list(
                batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, self.cutoff, self.neighbor_method
            )
        need_grad = forces or stress
        with _matmul_precision(self.allow_tf32), _frozen(self.model), torch.set_grad_enabled(need_grad):
            positions = batch.positions.detach().requires_grad_(need_grad)
            pos, shift_vectors, strain = positions, nl.shift_vectors, None
            if stress:
                strain = torch.zeros_like(batch.cell).requires_grad_(True)
                sym = 0.5 * (strain + strain.transpose(1, 2))
                pos = positions + torch.einsum("ni,nij->nj", positions, sym[batch.batch])
                cell = batch.cell + torch.bmm(batch.cell, sym)
                edge_struct = batch.batch[nl.edge_index[0]]
                shift_vectors = torch.einsum("ei,eij->ej", nl.shifts.to(self.dtype), cell[edge_struct])
            out = self.model(batch.numbers, pos, nl.edge_index, shift_vectors, batch.batch, batch.num_structures)
            result = {"energy": out["energy"].detach(), "atomic_energies": out["atomic_energies"].detach()}
            if not need_grad:
                return result
            inputs = [positions] + ([strain] if stress else [])
            grads = torch.autograd.grad(out["energy"].sum(), inputs, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)]
        if forces:
            result["forces"] = -grads[0]
        if stress:
            volume = torch.linalg.det(batch.cell).abs()
            valid = batch.pbc.all(dim=1) & (volume > 0)
            sigma = grads[1] / torch.where(valid, volume, torch.ones_like(volume))[:, None, None]
            result["stress"] = torch.stack([sigma[:, a, b] for a, b in _VOIGT], dim=1)
            result["stress_valid"] = valid
        return result

    def predict(
        self,
        structures: Sequence,
        *,
        batch_size: int | None = None,
        stress: bool = False,
        atom_budget: int | None = None,
    ) -> list[dict]:
        """Energies, forces (and stress for periodic structures) as one dict per structure, in input order.

        ``batch_size`` is a number of structures per batch; when None, batches are filled up to an atom budget.
        """
        structures = list(structures)
        results: list[dict] = []
        for chunk in _chunks(structures, batch_size, atom_budget or DEFAULT_ATOM_BUDGET[self.device.type]):
            batch = AtomsBatch.from_atoms(chunk, dtype=self.dtype)
            out = self.compute(batch, forces=True, stress=stress)
            energy = out["energy"].double().cpu().numpy()
            forces = [f.double().cpu().numpy() for f in batch.split(out["forces"])]
            atomic = [e.double().cpu().numpy() for e in batch.split(out["atomic_energies"])]
            for b in range(len(chunk)):
                row = {"energy": float(energy[b]), "forces": forces[b], "energies": atomic[b]}
                if stress and bool(out["stress_valid"][b]):
                    row["stress"] = out["stress"][b].double().cpu().numpy()
                results.append(row)
        return results


def _chunks(structures: list, batch_size: int | None, atom_budget: int) -> Iterator[list]:
    if batch_size is not None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for k in range(0, len(structures), int(batch_size)):
            yield structures[k : k + int(batch_size)]
        return
    chunk: list = []
    atoms = 0
    for s in structures:
        n = len(s)
        if chunk and atoms + n > atom_budget:
            yield chunk
            chunk, atoms = [], 0
        chunk.append(s)
        atoms += n
    if chunk:
        yield chunk
