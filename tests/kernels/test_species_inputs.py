"""kernels.species_inputs: the species index, embedding rows, v = 0 and the first φ rows of a PaiNN model in one
Triton kernel, against the torch ops (exact: gathers and zeros), and when it may run."""

import pytest
import torch
from mlff_distiller.kernels import (
    species_inputs,
    species_inputs_fusable,
    species_inputs_reference,
    triton_available,
    use_backend,
)


def _tables(dtype, device, n_species=5, f=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    species = torch.tensor([1, 6, 7, 8, 29][:n_species])
    z_to_index = torch.full((119,), -1, dtype=torch.long)
    z_to_index[species] = torch.arange(n_species)
    emb = torch.randn(n_species, f, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    phi = torch.randn(n_species, 3 * f, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    return species, z_to_index.to(device), emb, phi


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, f", [(0, 24), (1, 24), (37, 24), (70, 128), (5, 20)])
@pytest.mark.parametrize("with_phi", [True, False])
def test_species_inputs_equal_the_torch_ops(triton_device, poison, dtype, n, f, with_phi):
    """Every output equal, bit for bit, to the torch ops (odd atom counts, widths not a power of two, none)."""
    if triton_device.type == "cuda" and dtype == torch.float64:
        pytest.skip("float32 on the GPU (float64 takes the torch ops there)")
    species, z_to_index, emb, phi = _tables(dtype, triton_device, f=f, seed=n + f)
    numbers = species[torch.randint(0, len(species), (n,), generator=torch.Generator().manual_seed(n))]
    numbers = numbers.to(triton_device)
    table = phi if with_phi else None
    poison(4 * n * f + 64, dtype, triton_device)
    with use_backend("triton"):
        assert species_inputs_fusable(numbers, emb, table)
        got = species_inputs(numbers, z_to_index, emb, table)
    want = species_inputs_reference(numbers, z_to_index, emb, table)
    for g, w in zip(got[:3], want[:3], strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
    if with_phi:
        assert torch.equal(got[3], want[3])
    else:
        assert got[3] is None and want[3] is None


def test_unknown_numbers_give_nan_rows_not_a_neighbours_row(triton_device):
    """A number outside the model's species (z_to_index -1), or outside the table: idx -1 and a NaN embedding row,
    so that a caller that skipped check_species gets non-finite energies; the other atoms' rows stay exact."""
    _, z_to_index, emb, phi = _tables(torch.float32, triton_device)
    numbers = torch.tensor([6, 2, 8, 500, 1], device=triton_device)
    with use_backend("triton"):
        idx, s, v, rows = species_inputs(numbers, z_to_index, emb, phi)
    assert idx.tolist() == [1, -1, 3, -1, 0]
    assert torch.isnan(s[1]).all() and torch.isnan(s[3]).all()
    ok = torch.tensor([0, 2, 4], device=triton_device)
    assert torch.equal(s[ok], emb[idx[ok]]) and torch.equal(rows[ok], phi[idx[ok]])
    assert not v.any()


def test_species_inputs_fusable_rules():
    """The torch ops where a table wants a gradient (training), on the torch backend, with mixed devices or dtypes;
    a φ table of the wrong width is refused."""
    species, z_to_index, emb, phi = _tables(torch.float64, torch.device("cpu"))
    numbers = species[:3]
    with use_backend("torch"):
        assert not species_inputs_fusable(numbers, emb, phi)
    if not triton_available("cpu"):
        pytest.skip("the Triton backend on CPU tensors needs the interpreter (TRITON_INTERPRET=1)")
    with use_backend("triton"):
        trained = emb.clone().requires_grad_(True)
        assert not species_inputs_fusable(numbers, trained, phi)
        with torch.no_grad():
            assert species_inputs_fusable(numbers, trained, phi) == (numbers.device.type == "cpu")
        assert not species_inputs_fusable(numbers, emb, phi.float())
        out = species_inputs(numbers, z_to_index, trained, phi)  # the torch ops: differentiable
        out[1].sum().backward()
        assert trained.grad is not None
    with pytest.raises(ValueError, match="phi_table"):
        species_inputs(numbers, z_to_index, emb, phi[:, :10])
