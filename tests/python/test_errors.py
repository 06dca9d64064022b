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
    (dict(k=np.ones((5, 4), dtype=np.int32)), TypeError, "dtype float32 or float64"),
    (dict(k=np.ones((5, 4), dtype=np.float16)), TypeError, "dtype float32 or float64"),
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
    (dict(method="hybrid", omega=np.ones((4, 4))), TypeError, "belongs to method"),
    (dict(method="favor", bandwidth=2.0), TypeError, "belongs to method 'hybrid-gaussian'"),
    (dict(method="favor", features=0), ValueError, "features"),
    (dict(method="favor", features="many"), TypeError, "features"),
    (dict(method="favor", projection="gaussian"), ValueError, "projection"),
    (dict(method="favor", features=4, omega=np.ones((3, 4))), ValueError, "rows of omega"),
    (dict(method="favor", projection="iid", omega=np.ones((3, 4))), ValueError, "cannot be combined"),
    (dict(method="trig", omega=np.ones((3, 5))), ValueError, "expected an (m, 4)"),
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
    with pytest.raises(RuntimeError, match="no_grad"):
        randattn.attention(q, data["k"], data["v"])
    with torch.no_grad():
        randattn.attention(q, data["k"], data["v"])
    with pytest.raises(TypeError, match="dtype"):
        randattn.attention(torch.ones(5, 4, dtype=torch.int64), data["k"], data["v"])
    with pytest.raises(TypeError, match="dtype float32 or float64"):
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
