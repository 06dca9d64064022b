"""randattn.attention against NumPy references written from the formulas (exact attention, the
three plain feature maps on a given ω, the hybrids on the FeatureMap's own features) and against
randattn-cli for the same seed (LSH, hybrids)."""

import numpy as np
import pytest

import randattn
from conftest import (DTYPES, assert_close, batched, feature_rows, linear_attention, run_cli,
                      softmax_attention)

SHAPES = {"2d": (48, 8, 5), "4d": (2, 3, 40, 8, 5)}


def qkv(rng, layout, dtype, spread=0.5):
    """Queries, keys and values of moderate norm (logits of order one)."""
    if layout == "2d":
        n, d, dv = SHAPES["2d"]
        lead = ()
    else:
        *lead, n, d, dv = SHAPES["4d"]
        lead = tuple(lead)
    q = spread * rng.standard_normal(lead + (n, d))
    k = spread * rng.standard_normal(lead + (n, d))
    v = rng.standard_normal(lead + (n, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["2d", "4d"])
@pytest.mark.parametrize("causal", [False, True])
def test_exact_matches_numpy(rng, dtype, layout, causal):
    q, k, v = qkv(rng, layout, dtype, spread=1.0)
    for scale in (None, 0.7):
        out = randattn.attention(q, k, v, method="exact", causal=causal, scale=scale)
        assert out.dtype == dtype and out.shape == q.shape[:-1] + (v.shape[-1],)
        ref = batched(lambda a, b, c: softmax_attention(a, b, c, scale, causal), q, k, v)
        assert_close(out, ref, dtype, terms=q.shape[-2] + q.shape[-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["2d", "4d"])
@pytest.mark.parametrize("method,kind", [("favor", "positive"), ("favor-hyp", "hyperbolic"), ("trig", "trig")])
@pytest.mark.parametrize("causal", [False, True])
def test_feature_methods_match_numpy_on_given_omega(rng, dtype, layout, method, kind, causal):
    q, k, v = qkv(rng, layout, dtype)
    d = q.shape[-1]
    omega = rng.standard_normal((24, d))
    scale = 1 / np.sqrt(d)
    out = randattn.attention(q, k, v, method=method, omega=omega, causal=causal)
    c = np.sqrt(scale)  # the data normaliser: φ(c q)ᵀφ(c k) estimates exp(scale qᵀk)

    def ref(qs, ks, vs):
        return linear_attention(feature_rows(kind, c * qs, omega), feature_rows(kind, c * ks, omega), vs, causal)

    assert out.dtype == dtype
    assert_close(out, batched(ref, q, k, v), dtype, terms=q.shape[-2] + 2 * omega.shape[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["hybrid", "hybrid-gaussian"])
@pytest.mark.parametrize("causal", [False, True])
def test_hybrids_match_numpy_on_their_features(rng, dtype, method, causal):
    """A hybrid method is linear attention on the signed features of the FeatureMap of the same
    kind, options and seed; the features come from the map, the attention from NumPy."""
    q, k, v = qkv(rng, "4d", dtype)
    d = q.shape[-1]
    options = dict(features=16, lambda_features=4, seed=7)
    fm = randattn.FeatureMap(method, d, **options)
    c = (1 / np.sqrt(d)) ** 0.5

    def ref(qs, ks, vs):
        qv, ql = fm.features(qs.astype(dtype), c, "query")
        kv, kl = fm.features(ks.astype(dtype), c, "key")
        qf = np.exp(ql.astype(np.float64))[:, None] * qv
        kf = np.exp(kl.astype(np.float64))[:, None] * kv
        return linear_attention(qf, kf, vs, causal, signs=fm.signs)

    out = randattn.attention(q, k, v, method=method, causal=causal, **options)
    assert_close(out, batched(ref, q, k, v), dtype, terms=q.shape[-2] + fm.feature_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method,extra", [
    ("hybrid", ["--lambda-features", "4"]),
    ("hybrid-gaussian", ["--lambda-features", "4", "--bandwidth", "0.8"]),
    ("favor", ["--projection", "hadamard"]),
])
def test_random_methods_match_the_cli(rng, tmp_path, dtype, method, extra):
    q, k, v = qkv(rng, "4d", dtype)
    options = {a[2:].replace("-", "_"): b for a, b in zip(extra[::2], extra[1::2])}
    options = {key: (val if key == "projection" else float(val) if "." in val else int(val))
               for key, val in options.items()}
    out = randattn.attention(q, k, v, method=method, features=16, seed=3, **options)
    cli = run_cli(tmp_path, ["attention", "--method", method, "--features", "16", "--seed", "3"] + extra,
                  q=q, k=k, v=v)
    # The same library code on the same inputs: only code generation (contractions, vector
    # width) may differ between the two binaries.
    assert_close(out, cli, dtype, terms=8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["2d", "4d"])
@pytest.mark.parametrize("variant", ["chunked", "chunked-causal", "exact-buckets", "separate-keys",
                                     "separate-keys-chunked", "separate-keys-chunked-causal", "hadamard"])
def test_lsh_matches_the_cli(rng, tmp_path, dtype, layout, variant):
    q, k, v = qkv(rng, layout, dtype, spread=1.5)
    flags = ["--chunk", "8", "--rounds", "3", "--seed", "11"]
    options = dict(chunk=8, rounds=3, seed=11)
    keys = None
    if variant.endswith("-causal"):
        flags.append("--causal")
        options["causal"] = True
    if variant in ("exact-buckets", "separate-keys"):
        flags += ["--exact-buckets", "--buckets", "6"]
        options.update(exact_buckets=True, buckets=6)
    if variant.startswith("separate-keys"):
        keys = k
    if variant == "hadamard":
        flags += ["--rotation", "hadamard", "--no-dedupe"]
        options.update(rotation="hadamard", dedupe=False)
    out = randattn.attention(q, keys, v, method="lsh", shared_qk=keys is None, **options)
    arrays = dict(q=q, v=v) if keys is None else dict(q=q, k=keys, v=v)
    shared = ["--shared-qk"] if keys is None else []
    cli = run_cli(tmp_path, ["attention", "--method", "lsh"] + shared + flags, **arrays)
    assert out.dtype == dtype and out.shape == cli.shape
    assert_close(out, cli, dtype, terms=8)


def test_lsh_with_given_rotations_matches_numpy_limit(rng):
    """With one bucket per round (b = 2 and a zero rotation every token hashes to bucket 0),
    shared-QK LSH with exact buckets is exact attention over the normalised keys without self."""
    n, d = 12, 4
    q = rng.standard_normal((n, d))
    v = rng.standard_normal((n, 3))
    rotations = np.zeros((d, 2, 1))
    out = randattn.attention(q, None, v, method="lsh", shared_qk=True, rotations=rotations, exact_buckets=True,
                             dedupe=True, scale=1.0)
    keys = q / np.linalg.norm(q, axis=1, keepdims=True)
    logits = q @ keys.T
    np.fill_diagonal(logits, -np.inf)
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    assert_close(out, (w @ v) / w.sum(axis=1, keepdims=True), np.float64, terms=2 * n)


OPTIONS = {"lsf": dict(eta=0.5)}


@pytest.mark.parametrize("method", list(randattn.methods()))
def test_thread_count_does_not_change_results(rng, method):
    q, k, v = qkv(rng, "4d", np.float64)
    options = OPTIONS.get(method, {})
    keys = None if method == "lsh" else k
    one = randattn.attention(q, keys, v, method=method, shared_qk=keys is None, threads=1, **options)
    two = randattn.attention(q, keys, v, method=method, shared_qk=keys is None, threads=2, **options)
    np.testing.assert_array_equal(one, two)


def test_method_table_defaults_are_the_cli_defaults():
    m = randattn.methods()
    assert list(m) == ["exact", "favor", "favor-hyp", "trig", "oprf", "sderf", "hybrid", "hybrid-gaussian",
                       "hedgehog", "lsh", "lsf", "sparse-lowrank", "auto"]
    assert m["hedgehog"]["options"] == {"features": 64, "weight": None, "bias": None}
    assert m["exact"]["options"] == {}
    assert m["auto"]["options"] == {"approximation": "favor", "crossover": None}
    for name in ("favor", "favor-hyp", "trig"):
        assert m[name]["options"] == {"features": 256, "projection": "orthogonal", "omega": None}
    assert m["hybrid"]["options"] == {"features": 256, "projection": "orthogonal", "lambda_features": 16,
                                      "omega": None}
    assert m["hybrid-gaussian"]["options"] == {"features": 256, "projection": "orthogonal",
                                               "lambda_features": 16, "bandwidth": 1.0, "omega": None}
    assert m["lsh"]["options"] == {"buckets": None, "chunk": 64, "rounds": 4, "rotation": "dense",
                                   "rotations": None, "dedupe": True, "exact_buckets": False}
    for name in ("oprf", "sderf"):
        assert m[name]["options"] == {"features": 256, "projection": "orthogonal", "omega": None,
                                      "fit": "queries+keys", "rho": None, "calibration": None,
                                      "calibration_q": None, "calibration_k": None}
    assert m["lsf"]["options"] == {"filters": 256, "tables": 4, "eta": None, "alpha": None, "min_probes": 1,
                                   "rotation": "dense"}
    # sparse-lowrank: its own options, then those of its parts (lsh, lsf, oprf/sderf) with their
    # defaults, each once.
    own = {"support": "lsh", "remainder": "oprf", "window": 64, "sinks": 0, "block_size": 64, "top_blocks": 2,
           "clusters": 16, "probe": 2, "margin": 24 * np.log(2), "samples": 64, "sampling": "bounds", "centre_keys": False,
           "centre_prefix": 64}
    parts = {**m["lsh"]["options"], **m["lsf"]["options"], **m["oprf"]["options"]}
    assert m["sparse-lowrank"]["options"] == {**own, **parts}
    assert list(m["sparse-lowrank"]["options"])[:len(own)] == list(own)
    assert m["lsh"]["shared_qk"] and not any(m[name]["shared_qk"] for name in m if name != "lsh")


def test_defaults_equal_explicit_options(rng):
    q, k, v = qkv(rng, "2d", np.float64)
    implicit = randattn.attention(q, k, v, method="favor")
    explicit = randattn.attention(q, k, v, method="favor", features=256, projection="orthogonal", seed=0)
    np.testing.assert_array_equal(implicit, explicit)
    assert not np.array_equal(implicit, randattn.attention(q, k, v, method="favor", seed=1))


def test_edge_sizes(rng):
    # No queries: an empty result; one key: every query returns that value.
    k = rng.standard_normal((1, 3))
    v = rng.standard_normal((1, 2))
    empty = randattn.attention(np.zeros((0, 3)), k, v)
    assert empty.shape == (0, 2)
    for method in ("exact", "favor", "favor-hyp", "hybrid"):
        out = randattn.attention(rng.standard_normal((4, 3)), k, v, method=method)
        assert_close(out, np.repeat(v, 4, axis=0), np.float64, terms=8)


OUT_METHODS = [("exact", {}), ("favor", {"features": 16}), ("lsh", {"chunk": 16}),
               ("lsf", {"filters": 8, "tables": 2, "alpha": 0.6})]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["2d", "4d"])
@pytest.mark.parametrize("method,extra", OUT_METHODS)
def test_out_is_the_allocating_result_bit_for_bit(rng, dtype, layout, method, extra):
    q, k, v = qkv(rng, layout, dtype)
    for causal in (False, True):
        expected = randattn.attention(q, k, v, method=method, causal=causal, seed=3, **extra)
        out = np.full(expected.shape, -7.5, dtype=dtype)
        result = randattn.attention(q, k, v, method=method, causal=causal, seed=3, out=out, **extra)
        assert result is out
        np.testing.assert_array_equal(out, expected)
        assert out.tobytes() == expected.tobytes()
        pair = randattn.attention(q, k, v, method=method, causal=causal, seed=3, out=out, report=True,
                                  **extra)
        assert isinstance(pair, tuple) and pair[0] is out and pair[1]["method"] == method
        assert out.tobytes() == expected.tobytes()


def test_out_with_no_queries_and_shared_qk(rng):
    q, k, v = qkv(rng, "2d", np.float64)
    out = np.empty((0, v.shape[1]))
    assert randattn.attention(q[:0], k, v, out=out) is out
    expected = randattn.attention(q, None, v, method="lsh", shared_qk=True, chunk=16)
    out = np.empty_like(expected)
    randattn.attention(q, None, v, method="lsh", shared_qk=True, chunk=16, out=out)
    assert out.tobytes() == expected.tobytes()


def bad_outs(q, k, v, dtype):
    """(description, out, expected message) for every kind of unusable out; the last three overlap
    an input."""
    n, dv = q.shape[0], v.shape[1]
    other = np.float64 if dtype == np.float32 else np.float32
    readonly = np.zeros((n, dv), dtype)
    readonly.flags.writeable = False
    yield "dtype", np.zeros((n, dv), other), "dtype"
    yield "rows", np.zeros((n + 1, dv), dtype), "shape"
    yield "cols", np.zeros((n, dv + 1), dtype), "shape"
    yield "ndim", np.zeros((1, n, dv), dtype), "shape"
    yield "fortran", np.zeros((n, dv), dtype, order="F"), "C-contiguous"
    yield "strided", np.zeros((n, 2 * dv), dtype)[:, ::2], "C-contiguous"
    yield "readonly", readonly, "read-only"
    yield "q", q.reshape(-1)[: n * dv].reshape(n, dv), "shares memory with q"
    yield "k", k.reshape(-1)[-n * dv:].reshape(n, dv), "shares memory with k"
    yield "v", v.reshape(-1)[: n * dv].reshape(n, dv), "shares memory with v"


@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_out_raises_and_is_not_written(rng, dtype):
    n, d, dv = SHAPES["2d"]
    # Inputs laid out inside one buffer so that an out can overlap any one of them.
    pool = rng.standard_normal(2 * n * d + n * d).astype(dtype)
    q = pool[: n * d].reshape(n, d)
    k = pool[n * d: 2 * n * d].reshape(n, d)
    v = pool[2 * n * d: 2 * n * d + n * dv].reshape(n, dv)
    good = randattn.attention(q, k, v)
    for what, out, message in bad_outs(q, k, v, dtype):
        before = out.copy()
        pool_before = pool.copy()
        with pytest.raises(ValueError, match=message):
            randattn.attention(q, k, v, out=out)
        np.testing.assert_array_equal(out, before, err_msg=what)
        np.testing.assert_array_equal(pool, pool_before, err_msg=what)
    # An out right after v in the same buffer, sharing no element, is fine.
    tail = np.zeros(2 * n * d + n * d + n * dv, dtype)
    tail[: pool.size] = pool
    qt, kt = tail[: n * d].reshape(n, d), tail[n * d: 2 * n * d].reshape(n, d)
    vt = tail[2 * n * d: 2 * n * d + n * dv].reshape(n, dv)
    out = tail[3 * n * d:].reshape(n, dv)
    assert randattn.attention(qt, kt, vt, out=out) is out
    assert out.tobytes() == good.tobytes()
    for wrong in ([[0.0] * dv] * n, 3.0):
        with pytest.raises(TypeError, match="out must be"):
            randattn.attention(q, k, v, out=wrong)
