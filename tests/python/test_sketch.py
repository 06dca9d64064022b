"""sparsify and hosvd against NumPy (keep probabilities, unfoldings, exact HOSVD) and against
randattn-cli for the same seed (which entries are kept, sketched HOSVD)."""

import subprocess

import numpy as np
import pytest

import randattn
from conftest import DTYPES, assert_close, cli_path, run_cli


def tensor(rng, dtype, shape=(6, 7, 8)):
    # Heavy-tailed entries, so that all three regimes of Algorithm 1 occur.
    return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparsify_values_are_entries_over_keep_probabilities(rng, dtype):
    a = tensor(rng, dtype)
    budget = 60.0
    sketch = randattn.sparsify(a, budget, seed=5)
    indices, values = sketch
    assert indices.shape == (3, sketch.nnz) and indices.dtype == np.int64 and values.dtype == dtype
    a64 = a.astype(np.float64)
    # Algorithm 1: p = min(1, max(n a^2 / ||A||_F^2, n / D)).
    p = np.minimum(1.0, np.maximum(budget * a64 ** 2 / (a64 ** 2).sum(), budget / a.size))
    kept = tuple(indices)
    assert_close(values, a64[kept] / p[kept], dtype, terms=4)
    assert sketch.stats["expected_nnz"] == pytest.approx(p.sum(), rel=1e-12)
    # Entries with p = 1 are always kept.
    assert set(np.flatnonzero(p == 1)) <= set(sketch.flat_indices)
    np.testing.assert_array_equal(sketch.flat_indices, np.ravel_multi_index(kept, a.shape))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", ["spa", "ndt", "l2", "uniform"])
def test_sparsify_matches_the_cli(rng, tmp_path, dtype, scheme):
    a = tensor(rng, dtype)
    dense = randattn.sparsify(a, 40, scheme=scheme, seed=3).to_dense()
    cli = run_cli(tmp_path, ["sparsify", "--budget", "40", "--scheme", scheme, "--seed", "3"], **{"in": a})
    assert dense.dtype == dtype
    np.testing.assert_array_equal(dense, cli)


def test_strided_and_fortran_tensors_give_the_same_sketch(rng):
    a = tensor(rng, np.float64)
    reference = randattn.sparsify(a, 50, seed=2)
    before = randattn._core.input_copies()
    for view in (np.asfortranarray(a), np.ascontiguousarray(a[:, ::-1, :])[:, ::-1, :]):
        s = randattn.sparsify(view, 50, seed=2)
        np.testing.assert_array_equal(s.flat_indices, reference.flat_indices)
        np.testing.assert_array_equal(s.values, reference.values)
    assert randattn._core.input_copies() == before  # strided tensors are read in place


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_to_scipy_is_the_mode_unfolding(rng, mode):
    pytest.importorskip("scipy")
    a = tensor(rng, np.float64)
    sketch = randattn.sparsify(a, 80, seed=1)
    m = sketch.to_scipy(mode)
    assert m.format == "csr"
    expected = np.moveaxis(sketch.to_dense(), mode, 0).reshape(a.shape[mode], -1)
    np.testing.assert_array_equal(m.toarray(), expected)


def numpy_hosvd(a, ranks):
    """Top left singular vectors of every unfolding, signed so the largest-magnitude entry of
    each column is positive."""
    factors = []
    for j, r in enumerate(ranks):
        u = np.linalg.svd(np.moveaxis(a, j, 0).reshape(a.shape[j], -1), full_matrices=False)[0][:, :r]
        top = np.abs(u).argmax(axis=0)
        factors.append(u * np.sign(u[top, np.arange(r)]))
    return factors


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_hosvd_matches_numpy(rng, dtype):
    a = rng.standard_normal((5, 6, 7)).astype(dtype)
    ranks = [2, 3, 2]
    factors = randattn.hosvd(a, ranks)
    for u, ref in zip(factors, numpy_hosvd(a.astype(np.float64), ranks)):
        assert u.dtype == dtype and u.shape == ref.shape
        # Singular vectors are as accurate as eps / (relative singular-value gap); the gaps of a
        # Gaussian 5..7 x 30..42 matrix are far above 1e-3, hence a margin of 1e3 eps.
        np.testing.assert_allclose(u, ref, rtol=0, atol=1e3 * np.finfo(dtype).eps)


def test_sketched_hosvd_matches_the_cli(rng, tmp_path):
    a = tensor(rng, np.float64)
    factors = randattn.hosvd(a, [2, 2, 3], budget=120, seed=8)
    np.save(tmp_path / "a.npy", a)
    subprocess.run([cli_path(), "hosvd", "--in", str(tmp_path / "a.npy"), "--ranks", "2,2,3", "--budget", "120",
                    "--seed", "8", "--out-prefix", str(tmp_path / "U")], check=True)
    for j, u in enumerate(factors):
        assert_close(u, np.load(tmp_path / f"U{j}.npy"), np.float64, terms=a.size)


def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    a = torch.from_numpy(tensor(rng, np.float32))
    indices, values = randattn.sparsify(a, 30)
    assert isinstance(indices, torch.Tensor) and isinstance(values, torch.Tensor)
    sparse = torch.sparse_coo_tensor(indices, values, a.shape).to_dense()
    np.testing.assert_array_equal(sparse.numpy(), randattn.sparsify(a.numpy(), 30).to_dense())
    assert all(isinstance(u, torch.Tensor) for u in randattn.hosvd(a, [1, 1, 1]))
