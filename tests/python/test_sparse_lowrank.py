"""sparse-lowrank from Python: the support method alone without remainder (bit for bit), the exact
limit of a support holding every key, the clusters support (every cluster probed is exact
attention, causality, seeding), the report's fields, and one clear ValueError per bad option."""

import numpy as np
import pytest

import randattn
from conftest import DTYPES, assert_close


def inputs(dtype, n=40, d=8, dv=3, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, w)).astype(dtype) for w in (d, d, dv)]


def exact_reference(q, k, v, causal=False):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    s = q @ k.T / np.sqrt(q.shape[1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape, dtype=bool)), s, -np.inf)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (w @ v) / w.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_without_remainder_lsh_and_lsf_supports_are_their_methods(dtype, causal):
    q, k, v = inputs(dtype)
    lsh = dict(chunk=8, rounds=3, causal=causal, seed=3)
    alone = randattn.attention(q, k, v, method="lsh", **lsh)
    both = randattn.attention(q, k, v, method="sparse-lowrank", support="lsh", remainder="none", **lsh)
    assert np.array_equal(alone, both)
    lsf = dict(filters=16, tables=2, eta=0.5, causal=causal, seed=3)
    alone = randattn.attention(q, k, v, method="lsf", **lsf)
    both = randattn.attention(q, k, v, method="sparse-lowrank", support="lsf", remainder="none", **lsf)
    assert np.array_equal(alone, both)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("remainder", ["none", "favor", "sample"])
def test_a_support_holding_every_key_is_exact(dtype, remainder):
    q, k, v = inputs(dtype)
    out, report = randattn.attention(q, k, v, method="sparse-lowrank", support="window", window=40,
                                     remainder=remainder, features=8, report=True)
    assert_close(out, exact_reference(q, k, v), dtype, terms=40)
    assert report["pairs_scored"] == 1.0
    assert report["clamped_rows"] == 0


def test_report_fields():
    q, k, v = inputs(np.float64)
    _, r = randattn.attention(q, k, v, method="sparse-lowrank", support="lsh,window", chunk=8, window=2,
                              remainder="oprf", features=16, report=True)
    assert r["support"] == "lsh,window" and r["remainder"] == "oprf"
    assert 0 < r["pairs_scored"] < 1
    assert r["feature_dim"] == 16
    for part in ("support_seconds", "exact_seconds", "remainder_seconds"):
        assert r[part] >= 0
    _, r = randattn.attention(q, k, v, method="sparse-lowrank", support="blocks", block_size=8, top_blocks=1,
                              remainder="sample", samples=4, causal=True, report=True)
    assert r["samples"] > 0 and "feature_dim" not in r


@pytest.mark.parametrize("options, phrase", [
    (dict(support="hash"), "unknown support 'hash'"),
    (dict(support="lsh,lsh"), "listed twice"),
    (dict(support="window,"), "unknown support ''"),
    (dict(remainder="exact"), "remainder must be one of"),
    (dict(remainder="sample", samples=0), "samples must be at least 1"),
    (dict(support="window", window=-1), "window must be non-negative"),
    (dict(support="window", sinks=-2), "sinks must be non-negative"),
    (dict(support="window", window=0), "window support needs"),
    (dict(support="blocks", block_size=0), "block_size must be at least 1"),
    (dict(support="lsf"), "exactly one of eta and alpha"),
    (dict(support="lsh", dedupe=False), "dedupe=false"),
    (dict(remainder="oprf", causal=True), "fit=given"),
    (dict(remainder="favor", rho=1.0), "applies to the oprf and sderf remainders"),
    (dict(support="clusters", clusters=0), "clusters must be at least 1"),
    (dict(support="clusters", probe=0), "probe must be at least 1"),
    (dict(support="clusters", clusters=4, probe=5), "probe must be at most"),
])
def test_bad_options_raise_one_clear_value_error(options, phrase):
    q, k, v = inputs(np.float64)
    with pytest.raises(ValueError, match=None) as err:
        randattn.attention(q, k, v, method="sparse-lowrank", **options)
    assert phrase in str(err.value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("remainder", ["none", "sample"])
def test_clusters_all_probed_is_exact_attention(dtype, causal, remainder):
    q, k, v = inputs(dtype, n=70)
    exact = randattn.attention(q, k, v, method="exact", causal=causal)
    out, report = randattn.attention(q, k, v, method="sparse-lowrank", support="clusters", clusters=6,
                                     probe=6, block_size=16, remainder=remainder, causal=causal,
                                     report=True)
    assert np.array_equal(out, exact)
    assert report["clusters"] == 6 and report["probe"] == 6 and report["block_size"] == 16
    assert report["pairs_scored"] == (70 * 71 / 2 if causal else 70 * 70) / (70 * 70)


def clustered_inputs(n=200, d=8, topics=10, beta=10.0, seed=3):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((topics, d))
    k = centres[rng.integers(topics, size=n)] + 0.05 * rng.standard_normal((n, d))
    q = beta * centres[rng.integers(topics, size=n)] + 0.05 * rng.standard_normal((n, d))
    return q, k, rng.standard_normal((n, 3))


@pytest.mark.parametrize("remainder", ["none", "sample"])
def test_clusters_causal_outputs_do_not_see_later_keys(remainder):
    q, k, v = clustered_inputs()
    options = dict(method="sparse-lowrank", support="clusters", clusters=20, probe=1, block_size=16,
                   remainder=remainder, samples=8, causal=True, seed=4)
    before, report = randattn.attention(q, k, v, report=True, **options)
    assert report["pairs_scored"] < 0.5 * (200 * 201 / 2) / (200 * 200)  # clusters left closed
    j = 90
    k2, v2 = k.copy(), v.copy()
    k2[j:] = -7 * k2[j:] + 1
    v2[j:] = 100
    after = randattn.attention(q, k2, v2, **options)
    assert np.array_equal(before[:j], after[:j])
    assert not np.array_equal(before[j:], after[j:])


def test_clusters_seed_gives_the_clusters():
    q, k, v = clustered_inputs()
    options = dict(method="sparse-lowrank", support="clusters", clusters=20, probe=1, remainder="none",
                   report=True)
    a, ra = randattn.attention(q, k, v, seed=1, **options)
    b, rb = randattn.attention(q, k, v, seed=1, **options)
    assert np.array_equal(a, b) and ra["pairs_scored"] == rb["pairs_scored"]
    pairs = {randattn.attention(q, k, v, seed=s, **options)[1]["pairs_scored"] for s in range(2, 6)}
    assert len(pairs | {ra["pairs_scored"]}) > 1  # other seeds, other clusters


@pytest.mark.parametrize("causal", [False, True])
def test_clusters_margin_minus_infinity_opens_the_probed_clusters_alone(causal):
    q, k, v = inputs("float64", n=120)
    options = dict(method="sparse-lowrank", support="clusters", clusters=12, probe=2, block_size=16,
                   remainder="none", causal=causal, report=True, seed=2)
    _, wide = randattn.attention(q, k, v, **options)
    out, fixed = randattn.attention(q, k, v, margin=float("-inf"), **options)
    assert np.all(np.isfinite(out))
    assert fixed["pairs_scored"] < wide["pairs_scored"]
    # Every cluster probed is exact attention whatever the margin.
    exact = randattn.attention(q, k, v, method="exact", causal=causal)
    all_probed = dict(options, probe=12, report=False)
    assert np.array_equal(randattn.attention(q, k, v, margin=float("-inf"), **all_probed), exact)
    with pytest.raises(ValueError, match="margin"):
        randattn.attention(q, k, v, margin=float("nan"), **options)
