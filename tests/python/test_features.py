"""FeatureMap against the feature formulas on a given ω, redraw, and Decoder against causal
attention with the same map."""

import numpy as np
import pytest

import randattn
from conftest import DTYPES, assert_close, feature_rows, linear_attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["positive", "hyperbolic", "trig"])
def test_features_match_the_formulas(rng, dtype, kind):
    d, m = 6, 10
    omega = rng.standard_normal((m, d))
    x = (0.7 * rng.standard_normal((9, d))).astype(dtype)
    fm = randattn.FeatureMap(kind, d, omega=omega)
    assert fm.projections == m and fm.feature_dim == (m if kind == "positive" else 2 * m)
    np.testing.assert_array_equal(fm.omega, omega)
    for c in (1.0, 0.6):
        values, log_scale = fm.features(x, normaliser=c)
        assert values.dtype == dtype and log_scale.shape == (9,)
        phi = np.exp(log_scale.astype(np.float64))[:, None] * values
        assert_close(phi, feature_rows(kind, c * x.astype(np.float64), omega), dtype, terms=4 * d)


@pytest.mark.parametrize("kind", ["positive", "hyperbolic", "trig", "hybrid", "hybrid-gaussian"])
def test_map_draws_are_those_of_the_methods(rng, kind):
    """FeatureMap(kind, seed=s) and the method of that kind with seed=s use the same ω: attention
    computed from the map's features equals the method's output."""
    method = {"positive": "favor", "hyperbolic": "favor-hyp"}.get(kind, kind)
    d = 5
    q, k, v = (0.5 * rng.standard_normal((20, d)) for _ in range(3))
    options = dict(features=12, seed=4) if "hybrid" not in kind else dict(features=8, lambda_features=3, seed=4)
    fm = randattn.FeatureMap(kind, d, **options)
    c = (1 / np.sqrt(d)) ** 0.5
    qv, ql = fm.features(q, c, "query")
    kv, kl = fm.features(k, c, "key")
    ref = linear_attention(np.exp(ql)[:, None] * qv, np.exp(kl)[:, None] * kv, v, signs=fm.signs)
    out = randattn.attention(q, k, v, method=method, **options)
    assert_close(out, ref, np.float64, terms=40 + fm.feature_dim)


def test_redraw_changes_the_draw_reproducibly(rng):
    x = rng.standard_normal((4, 3))
    fm = randattn.FeatureMap("hyperbolic", 3, features=8, seed=1)
    first = fm.features(x)[0]
    fm.redraw(2)
    assert fm.seed == 2
    second = fm.features(x)[0]
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(second, randattn.FeatureMap("hyperbolic", 3, features=8, seed=2).features(x)[0])
    fm.redraw(1)
    np.testing.assert_array_equal(first, fm.features(x)[0])


@pytest.mark.parametrize("projection", ["iid", "orthogonal", "hadamard"])
def test_float32_and_float64_maps_share_their_draw(rng, projection):
    x = rng.standard_normal((5, 6))
    fm = randattn.FeatureMap("positive", 6, features=16, projection=projection)
    v64, l64 = fm.features(x)
    v32, l32 = fm.features(x.astype(np.float32))
    phi64 = np.exp(l64)[:, None] * v64
    phi32 = np.exp(l32.astype(np.float64))[:, None] * v32
    assert_close(phi32, phi64, np.float32, terms=4 * 6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["positive", "trig", "hybrid"])
def test_decoder_matches_causal_attention(rng, dtype, kind):
    method = {"positive": "favor"}.get(kind, kind)
    n, d, dv = 14, 4, 3
    q, k, v = ((0.5 * rng.standard_normal((n, dd))).astype(dtype) for dd in (d, d, dv))
    options = dict(features=16, seed=9) if kind != "hybrid" else dict(features=8, lambda_features=4, seed=9)
    fm = randattn.FeatureMap(kind, d, **options)
    decoder = randattn.Decoder(fm, dv, dtype=dtype)
    rows = []
    for t in range(n):
        decoder.append(k[t], v[t])
        rows.append(decoder.query(q[t]))
    assert len(decoder) == n and rows[0].dtype == dtype
    expected = randattn.attention(q, k, v, method=method, causal=True, **options)
    assert_close(np.stack(rows), expected, dtype, terms=n + fm.feature_dim)
    decoder.reset()
    assert len(decoder) == 0


def test_decoder_with_torch(rng):
    torch = pytest.importorskip("torch")
    fm = randattn.FeatureMap("positive", 4, features=8)
    decoder = randattn.Decoder(fm, 2, dtype=torch.float32)
    decoder.append(torch.ones(4), torch.ones(2))
    out = decoder.query(torch.ones(4))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), 1.0, rtol=1e-6)
