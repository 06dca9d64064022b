"""Shared helpers of the Python tests: NumPy reference implementations written from the formulas
(independent of the library's code), tolerances, and the command-line tool for comparisons."""

import os
import subprocess

import numpy as np
import pytest

DTYPES = [np.float32, np.float64]

# Small options of every method: enough features, rounds and filters to exercise the paths at
# n = 37 (no multiple of any chunk or block, spanning several).
SMALL_OPTIONS = {
    "exact": {},
    "favor": {"features": 16},
    "favor-hyp": {"features": 8},
    "trig": {"features": 8},
    "oprf": {"features": 16, "fit": "given", "rho": 1.0},
    "sderf": {"features": 16, "fit": "given", "rho": 1.0},
    "hybrid": {"features": 8, "lambda_features": 4},
    "hybrid-gaussian": {"features": 8, "lambda_features": 4},
    "hedgehog": {"features": 8},
    "lsh": {"chunk": 8, "rounds": 2},
    "lsf": {"filters": 16, "tables": 2, "eta": 0.3},
    "sparse-lowrank": {"support": "window", "window": 8, "remainder": "favor", "features": 16},
    "auto": {"approximation": "favor", "crossover": 0, "features": 16},
}


def tolerance(dtype, terms):
    """Bound on the relative rounding error of a result built from sums of `terms` products and
    a few exponentials, computed in `dtype` against a float64 reference: each sum contributes at
    most terms * eps (the classic bound for recursive summation), doubled for the exponentials
    and the final division. The reference's own error (float64) is negligible for float32 and of
    the same order for float64, hence the factor 4."""
    return 4.0 * terms * np.finfo(dtype).eps


def assert_close(actual, expected, dtype, terms):
    """|actual - expected| <= tol * max(1, max|expected|) entrywise: attention outputs are convex
    combinations of the values, so their rounding error scales with the largest magnitude."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    scale = max(np.abs(expected).max(), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance(dtype, terms) * scale)


def slices(x):
    """The (n, ·) slices of a 2-D or 4-D array, with a function putting results back in shape."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 2:
        return [x]
    return list(x.reshape(-1, *x.shape[2:]))


def batched(fn, q, k, v):
    """fn applied to every (batch, head) slice; the output in the layout of q."""
    ks = slices(k) if k is not None else [None] * len(slices(q))
    outs = [fn(qs, kk, vs) for qs, kk, vs in zip(slices(q), ks, slices(v))]
    out = np.stack(outs)
    return out[0] if np.ndim(q) == 2 else out.reshape(*np.shape(q)[:2], *out.shape[1:])


def softmax_attention(q, k, v, scale=None, causal=False):
    """softmax(scale q kᵀ [masked]) v in float64, one (n, d) slice."""
    scale = 1 / np.sqrt(q.shape[1]) if scale is None else scale
    logits = scale * q @ k.T
    if causal:
        logits = np.where(np.tril(np.ones_like(logits, dtype=bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (w @ v) / w.sum(axis=1, keepdims=True)


def feature_rows(kind, x, omega):
    """φ(x) of the three plain maps for projections omega (m, d), from their definitions."""
    m = omega.shape[0]
    u = x @ omega.T
    sq = 0.5 * (x * x).sum(axis=1, keepdims=True)
    if kind == "positive":
        return np.exp(u - sq) / np.sqrt(m)
    if kind == "hyperbolic":
        return np.exp(-sq) * np.hstack([np.exp(u), np.exp(-u)]) / np.sqrt(2 * m)
    if kind == "trig":
        return np.exp(sq) * np.hstack([np.sin(u), np.cos(u)]) / np.sqrt(m)
    raise ValueError(kind)


def linear_attention(qf, kf, v, causal=False, signs=None):
    """Σ_j w_ij v_j / Σ_j w_ij with w_ij = φ(q_i)ᵀ diag(signs) φ(k_j) (j <= i when causal)."""
    if signs is not None:
        kf = kf * signs
    w = qf @ kf.T
    if causal:
        w = np.tril(w)
    return (w @ v) / w.sum(axis=1, keepdims=True)


def cli_path():
    path = os.environ.get("RANDATTN_CLI")
    if not path:
        pytest.skip("RANDATTN_CLI is not set (the command-line tool is not built)")
    return path


def run_cli(tmp_path, args, **arrays):
    """Runs `randattn-cli` with each array saved as <name>.npy and passed as --<name>; returns the
    loaded --out array."""
    cmd = [cli_path()] + list(args)
    for name, a in arrays.items():
        path = tmp_path / f"{name}.npy"
        np.save(path, a)
        cmd += [f"--{name.replace('_', '-')}", str(path)]
    out = tmp_path / "out.npy"
    subprocess.run(cmd + ["--out", str(out)], check=True, capture_output=True, text=True)
    return np.load(out)


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)
