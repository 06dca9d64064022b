"""Tensor sparsification and HOSVD ("Effective Tensor Sketching via Sparsification")."""

import numpy as np

from . import _core
from ._arrays import as_numpy, like


class SparseSketch(tuple):
    """A sparsified tensor in coordinate form; unpacks as ``(indices, values)``.

    ``indices`` is an ``(order, nnz)`` int64 array of multi-indices (``dense[tuple(indices)] =
    values``, or ``torch.sparse_coo_tensor(indices, values, shape)``), in increasing row-major
    order; ``values`` holds the kept entries divided by their keep probabilities.
    """

    def __new__(cls, indices, values, shape, flat_indices, stats):
        self = super().__new__(cls, (indices, values))
        self.shape = shape
        self.flat_indices = flat_indices
        self.stats = stats
        return self

    @property
    def indices(self):
        return self[0]

    @property
    def values(self):
        return self[1]

    @property
    def nnz(self):
        return len(self.flat_indices)

    def to_dense(self):
        """The sketch as a dense array of the tensor's shape."""
        values = as_numpy(self.values, "values")
        dense = np.zeros(int(np.prod(self.shape)), dtype=values.dtype)
        dense[self.flat_indices] = values
        return like(dense.reshape(self.shape), self.values)

    def to_scipy(self, mode):
        """The mode-``mode`` unfolding M_j, a ``scipy.sparse.csr_matrix`` of shape
        (d_j, size / d_j) whose columns run over the other indices in row-major order."""
        try:
            import scipy.sparse
        except ImportError as e:  # pragma: no cover - SciPy is optional
            raise ImportError("SparseSketch.to_scipy needs SciPy") from e
        data, indices, indptr, shape = _core.unfold(
            self.shape, self.flat_indices, as_numpy(self.values, "values"), mode)
        return scipy.sparse.csr_matrix((data, indices, indptr), shape=shape)

    def __repr__(self):
        return (f"SparseSketch(shape={self.shape}, nnz={self.nnz}, "
                f"expected_nnz={self.stats['expected_nnz']:.6g}, scheme={self.stats['scheme']!r})")


def sparsify(a, budget, scheme="spa", seed=0):
    """Sparsify a tensor of order k >= 2 (float32 or float64, NumPy or CPU torch).

    ``scheme``: ``"spa"`` (Algorithm 1: keep large entries, sample moderate ones proportionally
    to a^2, small ones uniformly), or the baselines ``"ndt"``, ``"l2"``, ``"uniform"`` matched to
    the same expected nnz. The result is unbiased for ``spa``, ``l2`` and ``uniform`` and a pure
    function of (tensor, budget, scheme, seed). Returns a :class:`SparseSketch`, which unpacks as
    ``(indices, values)``.
    """
    arr = as_numpy(a, "a")
    flat, values, stats = _core.sparsify(arr, budget, scheme, seed)
    shape = tuple(int(n) for n in arr.shape)
    coords = np.stack(np.unravel_index(flat, shape)) if flat.size else np.zeros((len(shape), 0), np.int64)
    coords = coords.astype(np.int64, copy=False)
    return SparseSketch(like(coords, a), like(values, a), shape, flat, stats)


def hosvd(a, ranks, budget=None, seed=0):
    """HOSVD subspaces of a tensor: a list of factors U_j (d_j, r_j) with orthonormal columns,
    leading first, each signed so that its largest-magnitude entry is positive.

    Exact without ``budget``; with one, Algorithm 2 (two independent sketches of that budget,
    drawn from ``seed``).
    """
    factors = _core.hosvd(as_numpy(a, "a"), ranks, budget, seed)
    return [like(u, a) for u in factors]
