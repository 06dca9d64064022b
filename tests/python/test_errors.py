"""Every class of bad input of the command line's error table (tests/test_cli.cpp) raises
ValueError, or TypeError for wrong types, with the library's message; nothing is written."""

import numpy as np
import pytest

import randattn


@pytest.fixture
def data(rng):
    return dict(q=rng.standard_normal((5, 4)), k=rng.standard_normal((5, 4)), v=rng.standard_normal((5, 4)))


def call(data, **changes):
    args = dict(data)
    args.update({name: value for name, value in changes.items() if name in ("q", "k", "v")})
    options = {name: value for name, value in changes.items() if name not in ("q", "k", "v")}
    return randattn.attention(args["q"], args["k"], args["v"], **options)


def v4(shape):
    return np.ones(shape)


BAD_ATTENTION = [
    # (changes, exception, phrase of the message)
    (dict(q=np.ones((1, 5, 4))), ValueError, "got shape (1, 5, 4)"),
    (dict(q=np.ones(4)), ValueError, "got shape (4,)"),
    (dict(q=np.ones((1, 1, 5, 4))), ValueError, "same number of dimensions"),
    (dict(k=np.ones((5, 5))), ValueError, "feature dimension"),
    (dict(v=np.ones((6, 4))), ValueError, "number of tokens"),
    (dict(q=v4((1, 2, 5, 4)), k=v4((1, 2, 5, 4)), v=v4((2, 2, 5, 4))), ValueError, "batch dimensions of q, k and v"),
    (dict(q=v4((1, 4, 5, 4)), k=v4((1, 3, 5, 4)), v=v4((1, 3, 5, 4))), ValueError, "must divide the heads of q"),
    (dict(q=v4((1, 4, 5, 4)), k=v4((1, 2, 5, 4)), v=v4((1, 1, 5, 4))), ValueError, "head dimensions of k and v"),
    (dict(k=np.ones((0, 4)), v=np.ones((0, 4))), ValueError, "at least one key"),
    (dict(q=np.ones((3, 4)), causal=True), ValueError, "causal"),
    (dict(q=np.full((5, 4), np.nan)), ValueError, "non-finite"),
    (dict(v=np.full((5, 4), np.inf)), ValueError, "non-finite"),
    (dict(method="nosuch"), ValueError, "unknown method 'nosuch'"),
    (dict(bogus=1), TypeError, "unexpected keyword argument 'bogus'"),
    (dict(threads=0), ValueError, "threads"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale="abc"), TypeError, "scale"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(k=np.ones((5, 4), dtype=np.int32)), TypeError, "dtype float16, bfloat16, float32 or float64"),
    (dict(k=np.ones((5, 4), dtype=np.float16)), TypeError, "same dtype, got q float64, k float16"),
    (dict(v=np.ones((5, 4), dtype=np.float32)), TypeError, "same dtype"),
    (dict(k=None), ValueError, "k is required for method 'exact'"),
    (dict(method="lsh", k=None), ValueError, "shared_qk=True"),
    (dict(k=None, shared_qk=True), ValueError, "does not support shared_qk=True"),
    (dict(method="lsh", shared_qk=True), ValueError, "exclude each other"),
    (dict(method="lsh", k=None, shared_qk="yes"), TypeError, "shared_qk"),
    (dict(method="lsf"), ValueError, "exactly one of eta and alpha"),
    (dict(method="lsf", eta=1.0, min_probes=300), ValueError, "min_probes"),
    (dict(method="oprf", causal=True), ValueError, "fit=given"),
    (dict(q=[["a", "b"]]), TypeError, "dtype"),
    # Options of another method, and bad option values.
    (dict(features=8), TypeError, "belongs to method 'favor'"),
    (dict(method="favor", chunk=8), TypeError, "belongs to method 'lsh'"),
    (dict(method="hybrid", fit="given"), TypeError, "belongs to method"),
    (dict(method="favor", bandwidth=2.0), TypeError, "belongs to method 'hybrid-gaussian'"),
    (dict(method="favor", features=0), ValueError, "features"),
    (dict(method="favor", features="many"), TypeError, "features"),
    (dict(method="favor", projection="gaussian"), ValueError, "projection"),
    (dict(method="favor", features=4, omega=np.ones((3, 4))), ValueError, "rows of omega"),
    (dict(method="favor", projection="iid", omega=np.ones((3, 4))), ValueError, "cannot be combined"),
    (dict(method="trig", omega=np.ones((3, 5))), ValueError, "expected an (r, 4)"),
    (dict(method="trig", omega=np.full((3, 4), np.nan)), ValueError, "non-finite"),
    (dict(method="hybrid-gaussian", bandwidth=-1.0), ValueError, "bandwidth"),
    (dict(method="hybrid", lambda_features=0), ValueError, "lambda_features"),
    (dict(method="lsh", k=None, shared_qk=True, buckets=7), ValueError, "buckets must be even"),
    (dict(method="lsh", k=None, shared_qk=True, rounds=0), ValueError, "rounds"),
    (dict(method="lsh", k=None, shared_qk=True, chunk=0), ValueError, "chunk"),
    (dict(method="lsh", k=None, shared_qk=True, rotation="gaussian"), ValueError, "rotation"),
    (dict(method="lsh", k=None, shared_qk=True, rotations=np.ones((4, 2))), ValueError, "(d, r, b/2)"),
    (dict(method="lsh", k=None, shared_qk=True, rotations=np.ones((5, 2, 2))), ValueError, "d = 4"),
    (dict(method="lsh", k=None, shared_qk=True, rotations=np.ones((4, 2, 2)), rounds=3), ValueError, "rounds=3"),
    (dict(method="lsh", k=None, shared_qk=True, rotations=np.ones((4, 2, 2)), buckets=6), ValueError, "buckets=6"),
    (dict(method="lsh", k=None, shared_qk=True, rotations=np.ones((4, 2, 2)), rotation="dense"), ValueError, "exclude"),
    (dict(method="lsh", k=None, shared_qk=True, exact_buckets="no"), TypeError, "exact_buckets"),
]


@pytest.mark.parametrize("changes,exception,phrase", BAD_ATTENTION, ids=[str(i) for i in range(len(BAD_ATTENTION))])
def test_bad_attention_input(data, changes, exception, phrase):
    with pytest.raises(exception) as info:
        call(data, **changes)
    assert phrase in str(info.value)


def test_library_messages_reach_python(data):
    with pytest.raises(ValueError, match=r"randattn::exact_attention_batched: .*non-finite entry nan at \(0, 0\)"):
        call(data, q=np.full((5, 4), np.nan))


def test_check_finite_false_skips_the_scan(data):
    q = data["q"].copy()
    q[1, 2] = np.nan
    out = call(data, q=q, check_finite=False)
    assert np.isnan(out[1]).all() and np.isfinite(np.delete(out, 1, axis=0)).all()


def test_torch_specific_errors(data):
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(data["q"]).requires_grad_()
    # A differentiable call takes its inputs as tensors (NumPy arrays would lose their gradients).
    with pytest.raises(TypeError, match="torch tensors for q, k and v, got ndarray"):
        randattn.attention(q, data["k"], data["v"])
    with torch.no_grad():
        randattn.attention(q, data["k"], data["v"])
    with pytest.raises(TypeError, match="dtype"):
        randattn.attention(torch.ones(5, 4, dtype=torch.int64), data["k"], data["v"])
    with pytest.raises(TypeError, match="same dtype, got q float16, k float64"):
        randattn.attention(torch.ones(5, 4, dtype=torch.float16), data["k"], data["v"])


BAD_SKETCH = [
    (lambda a: randattn.sparsify(a, 0), ValueError, "budget must be a positive"),
    (lambda a: randattn.sparsify(a, -2), ValueError, "budget"),
    (lambda a: randattn.sparsify(np.zeros((3, 4, 5)), 5), ValueError, "all zero"),
    (lambda a: randattn.sparsify(np.where(np.arange(60).reshape(3, 4, 5) == 23, np.nan, a), 5), ValueError,
     "non-finite entry at (1, 0, 3)"),
    (lambda a: randattn.sparsify(np.ones(7), 5), ValueError, "order k >= 2 is needed, got shape (7,)"),
    (lambda a: randattn.sparsify(a, 5, scheme="foo"), ValueError, "unknown sparsification scheme 'foo'"),
    (lambda a: randattn.sparsify(a.astype(np.int64), 5), TypeError, "dtype"),
    (lambda a: randattn.sparsify(a, "many"), TypeError, "budget"),
    (lambda a: randattn.hosvd(a, [2, 6, 2]), ValueError, "rank 6 of mode 1 must be in [1, d_1] = [1, 4]"),
    (lambda a: randattn.hosvd(a, [0, 1, 1]), ValueError, "rank 0 of mode 0"),
    (lambda a: randattn.hosvd(a, [2, 2]), ValueError, "2 ranks given for a tensor of order 3"),
    (lambda a: randattn.hosvd(a, [2, 2, 2], budget=0), ValueError, "budget"),
    (lambda a: randattn.hosvd(np.full((3, 4, 5), np.nan), [1, 1, 1]), ValueError, "non-finite"),
    (lambda a: randattn.hosvd(np.zeros((3, 4, 5)), [1, 1, 1], budget=5), ValueError, "all zero"),
    (lambda a: randattn.hosvd(np.ones(7), [1]), ValueError, "order k >= 2"),
    (lambda a: randattn.hosvd(a, 2), TypeError, "ranks"),
]


@pytest.mark.parametrize("fn,exception,phrase", BAD_SKETCH, ids=[str(i) for i in range(len(BAD_SKETCH))])
def test_bad_sketch_input(rng, fn, exception, phrase):
    a = rng.standard_normal((3, 4, 5))
    with pytest.raises(exception) as info:
        fn(a)
    assert phrase in str(info.value)


BAD_FEATURES = [
    (lambda: randattn.FeatureMap("gaussian", 4), ValueError, "unknown feature map kind"),
    (lambda: randattn.FeatureMap("positive", 0), ValueError, "d must be at least 1"),
    (lambda: randattn.FeatureMap("positive", 4, bandwidth=2.0), TypeError, "belongs to kind 'hybrid-gaussian'"),
    (lambda: randattn.FeatureMap("positive", 4, features=0), ValueError, "features"),
    (lambda: randattn.FeatureMap("positive", 4).features(np.ones((2, 3))), ValueError, "expected an (n, 4)"),
    (lambda: randattn.FeatureMap("positive", 4).features(np.ones((2, 4)), side="left"), ValueError, "side"),
    (lambda: randattn.FeatureMap("positive", 4).features(np.ones((2, 4)), normaliser=0.0), ValueError, "normaliser"),
    (lambda: randattn.FeatureMap("positive", 4, omega=np.ones((2, 4))).redraw(1), ValueError, "cannot be redrawn"),
    (lambda: randattn.Decoder(randattn.FeatureMap("positive", 4), 3).append(np.ones(4), np.ones(2)), ValueError,
     "expected shape (3,)"),
    (lambda: randattn.Decoder(randattn.FeatureMap("positive", 4), 3).query(np.ones(4, np.float32)), TypeError,
     "dtype float32"),
    (lambda: randattn.Decoder(randattn.FeatureMap("positive", 4), 3, dtype=np.int32), TypeError, "dtype"),
    (lambda: randattn.Decoder(randattn.FeatureMap("trig", 4), 3, denominator_epsilon=0.0), ValueError,
     "denominator_epsilon"),
    (lambda: randattn.Decoder("positive", 3), TypeError, "FeatureMap"),
]


@pytest.mark.parametrize("fn,exception,phrase", BAD_FEATURES, ids=[str(i) for i in range(len(BAD_FEATURES))])
def test_bad_feature_map_input(fn, exception, phrase):
    with pytest.raises(exception) as info:
        fn()
    assert phrase in str(info.value)


# --- Robustness: the same behaviour as the command line (tests/test_cli.cpp, "[robustness]") ---

OUT_OF_RANGE = [
    (dict(threads=65536), "threads must be in [1, 1024]"),
    (dict(threads=2**31 - 1), "threads must be in [1, 1024]"),
    (dict(seed=2**64), "seed must be an integer in [0, 2**64)"),
    (dict(seed=-1), "seed must be an integer in [0, 2**64)"),
    (dict(method="lsh", k=None, shared_qk=True, rounds=10**6), "rounds must be in [1, 4096]"),
    (dict(method="lsh", k=None, shared_qk=True, buckets=10**9), "buckets must be in [2, 16777216]"),
    (dict(method="favor", features=10**9), "features must be in [1, 16777216]"),
    (dict(method="hybrid", lambda_features=10**9), "lambda_features must be in [1, 16777216]"),
    (dict(method="lsf", eta=0.0, filters=10**9), "filters must be in [1, 8388608]"),
    (dict(method="lsf", eta=0.0, tables=10**5), "tables must be in [1, 4096]"),
    (dict(method="lsf", eta=float("inf")), "eta must be a finite number or -inf"),
    (dict(method="lsf", eta=float("nan")), "eta must be a finite number or -inf"),
    (dict(v=np.ones((5, 0))), "value dimension dv must be positive"),
]


@pytest.mark.parametrize("changes,phrase", OUT_OF_RANGE, ids=[str(i) for i in range(len(OUT_OF_RANGE))])
def test_out_of_range_is_refused_before_any_work(data, changes, phrase):
    with pytest.raises(ValueError) as info:
        call(data, **changes)
    assert phrase in str(info.value)


def test_largest_seed_is_accepted(data):
    assert np.isfinite(call(data, method="favor", seed=2**64 - 1)).all()
    for method, options in (("favor", {}), ("lsh", {}), ("lsf", {"eta": 0.5}), ("sparse-lowrank", {})):
        _, report = randattn.attention(data["q"], data["k"], data["v"], method=method, seed=2**64 - 1,
                                       report=True, **options)
        assert report["seed"] == 2**64 - 1


@pytest.mark.parametrize("method", ["exact", "favor", "favor-hyp", "trig", "oprf", "hybrid", "lsh", "lsf"])
def test_scale_not_representable_in_float32_is_refused_by_every_method(data, method):
    f32 = {name: x.astype(np.float32) for name, x in data.items()}
    options = dict(eta=0.0) if method == "lsf" else {}
    with pytest.raises(ValueError, match=r"scale = 1e\+39 is not representable in float32"):
        randattn.attention(f32["q"], f32["k"], f32["v"], method=method, scale=1e39, **options)


def test_eta_minus_infinity_opens_every_filter(rng):
    q, k, v = rng.standard_normal((7, 4)), rng.standard_normal((9, 4)), rng.standard_normal((9, 3))
    out = randattn.attention(q, k, v, method="lsf", eta=-np.inf)
    np.testing.assert_allclose(out, randattn.attention(q, k, v), rtol=0, atol=1e-12)


def test_memory_error_names_the_size_it_needs():
    # A strided view whose C-contiguous copy needs 8 TB: MemoryError, not pybind11's RuntimeError.
    q = np.lib.stride_tricks.as_strided(np.zeros(1), shape=(10**6, 10**6), strides=(0, 0))
    with pytest.raises(MemoryError):
        randattn.attention(q, q, q)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_values_near_the_maximum_give_finite_convex_combinations(rng, dtype):
    big = np.ldexp(dtype(1), np.finfo(dtype).maxexp - 1)
    q, k = rng.standard_normal((12, 4)).astype(dtype), rng.standard_normal((12, 4)).astype(dtype)
    v = np.clip(rng.standard_normal((12, 3)), -1, 1).astype(dtype)
    for method, options in [("lsh", dict(exact_buckets=True, buckets=4)), ("lsf", dict(eta=0.0))]:
        small = randattn.attention(q, k, v, method=method, **options)
        large = randattn.attention(q, k, v * big, method=method, **options)
        assert np.isfinite(large).all()
        np.testing.assert_array_equal(large, small * big)


def test_logits_beyond_the_range_raise_the_overflow_error(rng):
    q = (rng.standard_normal((8, 4)) * 1e30).astype(np.float32)
    k = (rng.standard_normal((8, 4)) * 1e30).astype(np.float32)
    v = rng.standard_normal((8, 3)).astype(np.float32)
    for method, options in [("exact", {}), ("lsf", dict(eta=0.0))]:
        with pytest.raises(ValueError, match="overflowed the floating-point range"):
            randattn.attention(q, k, v, method=method, **options)


def test_hosvd_of_entries_near_1e20_reports_overflow(rng):
    a = (rng.standard_normal((4, 5, 6)) * 1e20).astype(np.float32)
    with pytest.raises(ValueError, match="overflowed the floating-point range"):
        randattn.hosvd(a, [2, 2, 2])


@pytest.mark.parametrize("kind", ["positive", "hyperbolic", "trig", "hybrid", "hybrid-gaussian"])
def test_feature_map_features_checks_finiteness_and_overflow(kind):
    fmap = randattn.FeatureMap(kind, 4, features=8)
    with pytest.raises(ValueError, match="non-finite entry nan"):
        fmap.features(np.array([[1.0, np.nan, 0.0, 0.0]]))
    values, log_scale = fmap.features(np.array([[1.0, np.nan, 0.0, 0.0]]), check_finite=False)
    assert values.shape[0] == 1
    # Finite input: finite features or the overflow error, never NaN or -inf log-scales.
    huge = np.full((3, 4), 1e300)
    try:
        values, log_scale = fmap.features(huge)
    except ValueError as e:
        assert "overflowed the floating-point range" in str(e)
    else:
        assert np.isfinite(values).all() and np.isfinite(log_scale).all()


def test_feature_map_sizes_out_of_range():
    with pytest.raises(ValueError, match=r"features must be in \[1, 16777216\]"):
        randattn.FeatureMap("positive", 4, features=10**9)


def test_torch_negative_and_conjugate_views(data):
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(data["q"])
    neg = torch._neg_view(q) if hasattr(torch, "_neg_view") else -q
    out = randattn.attention(neg, data["k"], data["v"])
    np.testing.assert_allclose(out.numpy(), randattn.attention(-data["q"], data["k"], data["v"]), rtol=0, atol=0)
    conj = torch.ones(5, 4, dtype=torch.complex64).conj()
    with pytest.raises(TypeError, match="dtype float16, bfloat16, float32 or float64"):
        randattn.attention(conj, data["k"], data["v"])
