"""Key padding, packed variable-length sequences and grouped-query heads, for every registered
method: each equals the plain method on the cut, gathered or repeated inputs with the same seed,
bit for bit (the sub-calls run the same code on the same rows); masked keys never influence any
output; queries without a valid key get zeros."""

import subprocess

import numpy as np
import pytest

import randattn
from conftest import DTYPES, assert_close, cli_path, run_cli

# Options per method (bidirectional, causal): small sizes, every method's required options.
OPTIONS = {
    "exact": {},
    "favor": {"features": 16},
    "favor-hyp": {"features": 8},
    "trig": {"features": 8},
    "oprf": {"features": 16, "fit": "given", "rho": 2.0},
    "sderf": {"features": 16, "fit": "given", "rho": 1.5},
    "hybrid": {"features": 8, "lambda_features": 4},
    "hybrid-gaussian": {"features": 8, "lambda_features": 4},
    "hedgehog": {"features": 8},
    "lsh": {"chunk": 4, "rounds": 2},
    "lsf": {"filters": 16, "tables": 2, "eta": 0.3},
    "sparse-lowrank": {"support": "window", "window": 3, "sinks": 1, "remainder": "favor", "features": 8},
    "auto": {"approximation": "favor", "features": 16, "crossover": 8},
}
CASES = [(m, c) for m in OPTIONS for c in (False, True)]


def test_every_method_is_covered():
    assert set(OPTIONS) == set(randattn.methods())


def data(batch=2, heads=2, kv_heads=None, n=12, d=4, dv=3, dtype=np.float64, seed=7):
    rng = np.random.default_rng(seed)
    kv = heads if kv_heads is None else kv_heads
    q = rng.standard_normal((batch, heads, n, d)).astype(dtype)
    k = rng.standard_normal((batch, kv, n, d)).astype(dtype)
    v = rng.standard_normal((batch, kv, n, dv)).astype(dtype)
    return q, k, v


def run(method, q, k, v, causal=False, **kw):
    return randattn.attention(q, k, v, method=method, causal=causal, seed=3, **OPTIONS[method], **kw)


def padded_reference(method, q, k, v, valid, causal):
    """Slice by slice: the plain 2-D method on the valid keys (gathered); under causal, the
    queries at valid positions causally on the gathered sequence and each run of padded
    positions against the valid keys before it."""
    out = np.zeros(q.shape[:3] + (v.shape[3],), q.dtype)
    for b in range(q.shape[0]):
        keep = np.flatnonzero(valid[b])
        for h in range(q.shape[1]):
            qs, ks, vs = q[b, h], k[b, h][keep], v[b, h][keep]
            if not causal:
                if len(keep):
                    out[b, h] = run(method, qs, ks, vs)
                continue
            if len(keep):
                out[b, h][keep] = run(method, qs[keep], ks, vs, causal=True)
            n = q.shape[2]
            a = 0
            while a < n:
                if valid[b, a]:
                    a += 1
                    continue
                e = a
                while e < n and not valid[b, e]:
                    e += 1
                before = int(valid[b, :a].sum())
                if before:
                    out[b, h, a:e] = run(method, qs[a:e], ks[:before], vs[:before])
                a = e
    return out


@pytest.mark.parametrize("method,causal", CASES)
def test_key_lengths_equal_the_cut_inputs(method, causal):
    q, k, v = data()
    lengths = np.array([7, 12])
    out = run(method, q, k, v, causal, key_lengths=lengths)
    valid = np.arange(12)[None, :] < lengths[:, None]
    np.testing.assert_array_equal(out, padded_reference(method, q, k, v, valid, causal))


@pytest.mark.parametrize("method,causal", CASES)
def test_key_lengths_are_the_mask_true_at_and_beyond_them(method, causal):
    q, k, v = data()
    lengths = np.array([5, 9])
    mask = np.arange(12)[None, :] >= lengths[:, None]
    np.testing.assert_array_equal(run(method, q, k, v, causal, key_lengths=lengths),
                                  run(method, q, k, v, causal, key_padding_mask=mask))


@pytest.mark.parametrize("method,causal", CASES)
def test_a_scattered_mask_equals_the_gathered_keys(method, causal):
    q, k, v = data()
    mask = np.zeros((2, 12), bool)
    mask[0, [1, 4, 5, 10]] = True
    mask[1, [0, 11]] = True
    out = run(method, q, k, v, causal, key_padding_mask=mask)
    np.testing.assert_array_equal(out, padded_reference(method, q, k, v, ~mask, causal))


@pytest.mark.parametrize("method,causal", CASES)
def test_masked_keys_never_influence_the_output(method, causal):
    q, k, v = data()
    mask = np.zeros((2, 12), bool)
    mask[0, [2, 3, 9]] = True
    mask[1, 6:] = True
    out = run(method, q, k, v, causal, key_padding_mask=mask)
    k2, v2 = k.copy(), v.copy()
    k2[np.broadcast_to(mask[:, None, :], k.shape[:3])] = 1e30
    v2[np.broadcast_to(mask[:, None, :], v.shape[:3])] = np.nan
    np.testing.assert_array_equal(run(method, q, k2, v2, causal, key_padding_mask=mask), out)


@pytest.mark.parametrize("method,causal", CASES)
def test_queries_without_a_valid_key_get_zeros(method, causal):
    q, k, v = data()
    mask = np.zeros((2, 12), bool)
    mask[0] = True  # batch item 0: no key at all
    mask[1, :4] = True  # batch item 1, causal: queries 0..3 see no key
    out = run(method, q, k, v, causal, key_padding_mask=mask)
    assert np.isfinite(out).all()
    assert (out[0] == 0).all()
    if causal:
        assert (out[1, :, :4] == 0).all()
    assert (np.abs(out[1, :, 4:]).sum(axis=-1) > 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_exact_with_a_mask_matches_masked_softmax(dtype, causal):
    q, k, v = data(dtype=dtype)
    mask = np.zeros((2, 12), bool)
    mask[0, [1, 4, 5, 10]] = True
    mask[1, 3:] = True
    out = run("exact", q, k, v, causal, key_padding_mask=mask)
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) / 2.0
    allowed = ~mask[:, None, None, :]
    if causal:
        allowed = allowed & np.tril(np.ones((12, 12), bool))
    s = np.where(allowed, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = (w / w.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)
    assert_close(out, ref, dtype, 12)


@pytest.mark.parametrize("method,causal", CASES)
def test_packed_sequences_equal_separate_calls(method, causal):
    q, k, v = (x[0, 0] for x in data(batch=1, heads=1, n=14))
    cu = np.array([0, 5, 6, 14])
    out = run(method, q, k, v, causal, cu_seqlens=cu)
    for a, e in zip(cu[:-1], cu[1:]):
        np.testing.assert_array_equal(out[a:e], run(method, q[a:e], k[a:e], v[a:e], causal))


@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences_with_shared_qk(causal):
    q, _, v = (x[0, 0] for x in data(batch=1, heads=1, n=14))
    cu = np.array([0, 8, 14])
    kw = dict(method="lsh", shared_qk=True, causal=causal, chunk=4, seed=1)
    out = randattn.attention(q, None, v, cu_seqlens=cu, **kw)
    for a, e in zip(cu[:-1], cu[1:]):
        np.testing.assert_array_equal(out[a:e], randattn.attention(q[a:e], None, v[a:e], **kw))


@pytest.mark.parametrize("method,causal", CASES)
def test_grouped_heads_equal_repeated_heads(method, causal):
    q, k, v = data(heads=4, kv_heads=2)
    out = run(method, q, k, v, causal)
    expected = run(method, q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), causal)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("method,causal", CASES)
def test_grouped_heads_compose_with_padding(method, causal):
    q, k, v = data(heads=4, kv_heads=1)
    lengths = np.array([3, 10])
    out = run(method, q, k, v, causal, key_lengths=lengths)
    expected = run(method, q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), causal, key_lengths=lengths)
    np.testing.assert_array_equal(out, expected)


def test_per_head_calibration_with_grouped_heads():
    q, k, v = data(heads=4, kv_heads=2)
    calibration = np.random.default_rng(0).standard_normal((4, 6, 4))
    kw = dict(method="oprf", features=16, fit="given", calibration=calibration, seed=2)
    out = randattn.attention(q, k, v, **kw)
    np.testing.assert_array_equal(out, randattn.attention(q, np.repeat(k, 2, 1), np.repeat(v, 2, 1), **kw))


def test_report_of_a_padded_call():
    q, k, v = data()
    _, r = randattn.attention(q, k, v, method="lsh", chunk=4, key_lengths=np.array([6, 12]), report=True)
    assert r["method"] == "lsh"
    assert r["sub_calls"] == 4
    assert 0 < r["pairs_scored"] <= 1


@pytest.mark.parametrize("kw,message", [
    (dict(key_lengths=np.array([3, 13])), "key_lengths"),
    (dict(key_lengths=np.array([-1, 3])), "key_lengths"),
    (dict(key_lengths=np.array([3])), "key_lengths"),
    (dict(key_padding_mask=np.zeros((2, 11), bool)), "key_padding_mask"),
    (dict(key_padding_mask=np.zeros((1, 12), bool)), "key_padding_mask"),
    (dict(cu_seqlens=np.array([0, 5, 5, 12])), "cu_seqlens"),
    (dict(cu_seqlens=np.array([0, 7, 5, 12])), "cu_seqlens"),
    (dict(cu_seqlens=np.array([0, 5, 11])), "cu_seqlens"),
    (dict(cu_seqlens=np.array([1, 5, 12])), "cu_seqlens"),
    (dict(key_lengths=np.array([3, 4]), key_padding_mask=np.zeros((2, 12), bool)), "at most one"),
    (dict(key_lengths=np.array([3, 4]), cu_seqlens=np.array([0, 12])), "cu_seqlens"),
])
def test_bad_layouts_raise_value_error(kw, message):
    q, k, v = data()
    with pytest.raises(ValueError, match=message):
        randattn.attention(q, k, v, method="favor", **kw)


def test_bad_layout_types_raise_type_error():
    q, k, v = data()
    with pytest.raises(TypeError, match="key_padding_mask must be a boolean array"):
        randattn.attention(q, k, v, key_padding_mask=np.zeros((2, 12)))
    with pytest.raises(TypeError, match="key_lengths must be an integer array"):
        randattn.attention(q, k, v, key_lengths=np.array([1.5, 2.0]))


def test_kv_heads_must_divide_the_query_heads():
    q, k, v = data(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="must divide the heads of q"):
        randattn.attention(q, k, v, method="favor")


# Self-exclusion: the methods that support it (every one but sparse-lowrank, which refuses it:
# tested below).
SELF = list(OPTIONS)


def self_excluded_softmax(q, k, v, causal):
    """Exact attention with key i masked for query i unless it is the query's only key."""
    n = q.shape[-2]
    s = np.einsum("...id,...jd->...ij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    allowed = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    only = allowed.sum(axis=1) == 1
    allowed = allowed & ~(np.eye(n, dtype=bool) & ~only[:, None])
    s = np.where(allowed, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_exact_excludes_self_unless_alone(dtype, causal):
    q, _, v = data(dtype=dtype)
    out = randattn.attention(q, q, v, causal=causal, exclude_self=True)  # K = Q
    assert_close(out, self_excluded_softmax(q, q, v, causal), dtype, 12)
    one = q[:, :, :1]
    np.testing.assert_array_equal(randattn.attention(one, one, v[:, :, :1], exclude_self=True), v[:, :, :1])


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_with_one_chunk_excludes_self_as_exact(causal):
    q, k, v = data()
    out = randattn.attention(q, k, v, method="lsh", chunk=12, rounds=2, causal=causal, exclude_self=True)
    assert_close(out, self_excluded_softmax(q, k, v, causal), np.float64, 12)


@pytest.mark.parametrize("causal", [False, True])
def test_sparse_lowrank_leaves_the_own_key_out_of_support_and_remainder(causal):
    q, _, v = data()
    reference = self_excluded_softmax(q, q, v, causal)  # K = Q
    # A window holding every key; a narrow window or an LSH support with every other key drawn
    # (samples far above n: probability 1): exact self-excluded attention in each case.
    for options in (dict(support="window", window=12, remainder="none"),
                    dict(support="window", window=2, remainder="sample", samples=1000),
                    dict(support="lsh", chunk=4, rounds=1, remainder="sample", samples=1000)):
        out = randattn.attention(q, q, v, method="sparse-lowrank", causal=causal, exclude_self=True, **options)
        assert_close(out, reference, np.float64, 12)
    one = q[:, :, :1]
    np.testing.assert_array_equal(
        randattn.attention(one, one, v[:, :, :1], method="sparse-lowrank", support="window",
                           remainder="sample", exclude_self=True), v[:, :, :1])


@pytest.mark.parametrize("causal", [False, True])
def test_lsf_opening_every_filter_excludes_self_as_exact(causal):
    q, k, v = data()
    for kv in (k, q):  # separate keys, and K = Q (each query's own key is its best match)
        out = randattn.attention(q, kv, v, method="lsf", filters=8, tables=2, eta=-np.inf, causal=causal,
                                 exclude_self=True)
        assert_close(out, self_excluded_softmax(q, kv, v, causal), np.float64, 12)
    one = q[:, :, :1]
    np.testing.assert_array_equal(
        randattn.attention(one, one, v[:, :, :1], method="lsf", eta=0.5, exclude_self=True), v[:, :, :1])


@pytest.mark.parametrize("method", SELF)
@pytest.mark.parametrize("causal", [False, True])
def test_exclude_self_composes_with_packed_sequences_padding_and_groups(method, causal):
    q, k, v = data(heads=4, kv_heads=2)
    kw = dict(causal=causal, exclude_self=True)
    kq = np.repeat(k, 2, 1)
    vq = np.repeat(v, 2, 1)
    out = run(method, q, k, v, **kw)
    np.testing.assert_array_equal(out, run(method, q, kq, vq, **kw))
    cu = np.array([0, 5, 12])
    packed = run(method, q, kq, vq, cu_seqlens=cu, **kw)
    for a, e in zip(cu[:-1], cu[1:]):
        np.testing.assert_array_equal(packed[:, :, a:e], run(method, q[:, :, a:e], kq[:, :, a:e], vq[:, :, a:e], **kw))
    lengths = np.array([7, 12])
    padded = run(method, q, kq, vq, key_lengths=lengths, **kw)
    np.testing.assert_array_equal(padded[1], run(method, q[1:], kq[1:], vq[1:], **kw)[0])
    np.testing.assert_array_equal(padded[0, :, :7], run(method, q[:1, :, :7], kq[:1, :, :7], vq[:1, :, :7], **kw)[0])
    # Padded positions' own keys are masked already: they see the valid keys (all, or those before).
    rest = run(method, q[:1, :, 7:], kq[:1, :, :7], vq[:1, :, :7])[0]
    np.testing.assert_array_equal(padded[0, :, 7:], rest)


def test_exclude_self_with_a_scattered_mask_matches_the_reference():
    q, _, v = data()
    mask = np.zeros((2, 12), bool)
    mask[0, [1, 4, 5]] = True
    for causal in (False, True):
        out = randattn.attention(q, q, v, causal=causal, exclude_self=True, key_padding_mask=mask)
        n = 12
        s = np.einsum("bhid,bhjd->bhij", q, q) / 2.0
        allowed = np.broadcast_to(~mask[:, None, None, :], s.shape).copy()
        if causal:
            allowed &= np.tril(np.ones((n, n), bool))
        eye = np.eye(n, dtype=bool)
        alone = (allowed & ~eye).sum(-1) == 0
        allowed &= ~(eye & ~alone[..., None])
        s = np.where(allowed, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        assert_close(out, (w / w.sum(-1, keepdims=True)) @ v, np.float64, 12)


def test_exclude_self_errors():
    q, k, v = data()
    with pytest.raises(ValueError, match="same positions"):
        randattn.attention(q, k[:, :, :5], v[:, :, :5], exclude_self=True)
    with pytest.raises(TypeError, match="exclude_self must be True or False"):
        randattn.attention(q, k, v, exclude_self=1)


@pytest.mark.parametrize("causal", [False, True])
def test_random_features_remove_the_estimate_of_the_own_key(causal):
    q, k, v = data(batch=1, heads=1)
    q, k, v = q[0, 0], k[0, 0], v[0, 0]
    out = randattn.attention(q, k, v, method="favor", features=16, seed=3, causal=causal, exclude_self=True)
    fmap = randattn.FeatureMap("positive", 4, seed=3, features=16)
    norm = 0.5 ** 0.5  # scale^(1/2), scale = 1/sqrt(d)
    qv, ql = fmap.features(q, norm, "query")
    kv, kl = fmap.features(k, norm, "key")
    w = (qv @ kv.T) * np.exp(ql[:, None] + kl[None, :])
    n = 12
    allowed = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    alone = allowed.sum(1) == 1
    keep = allowed & ~(np.eye(n, dtype=bool) & ~alone[:, None])
    wk = np.where(keep, w, 0)
    ref = (wk @ v) / wk.sum(1, keepdims=True)
    # The removal cancels the own term from the full sum: rounding grows with full / remaining.
    ratio = (np.where(allowed, w, 0).sum(1) / wk.sum(1)).max()
    assert_close(out, ref, np.float64, 16 * n * ratio)


# The command line: the same layouts from .npy files, the same bits; bad layouts exit 2 and
# write nothing.

def test_cli_layouts_give_the_python_bits(tmp_path):
    q, k, v = data(heads=4, kv_heads=2, dtype=np.float32)
    args = ["attention", "--method", "favor", "--features", "16", "--seed", "3", "--causal"]
    lengths = np.array([5, 12], dtype=np.int32)
    out = run_cli(tmp_path, args, q=q, k=k, v=v, key_lengths=lengths)
    np.testing.assert_array_equal(out, run("favor", q, k, v, True, key_lengths=lengths))
    mask = np.zeros((2, 12), bool)
    mask[1, [2, 7]] = True
    out = run_cli(tmp_path, args, q=q, k=k, v=v, key_padding_mask=np.asfortranarray(mask))  # Fortran order
    np.testing.assert_array_equal(out, run("favor", q, k, v, True, key_padding_mask=mask))
    cu = np.array([0, 4, 12])
    out = run_cli(tmp_path, args, q=q[0, 0], k=k[0, 0], v=v[0, 0], cu_seqlens=cu)
    np.testing.assert_array_equal(out, run("favor", q[0, 0], k[0, 0], v[0, 0], True, cu_seqlens=cu))
    out = run_cli(tmp_path, ["attention", "--exclude-self", "--causal"], q=q, k=np.repeat(k, 2, 1), v=np.repeat(v, 2, 1))
    np.testing.assert_array_equal(out, randattn.attention(q, k, v, causal=True, exclude_self=True))


@pytest.mark.parametrize("layout,message", [
    (dict(key_lengths=np.array([3, 13])), r"--key-lengths\[1\] must be in \[0, 12\]"),
    (dict(key_lengths=np.array([-1, 3])), r"--key-lengths\[0\] must be in"),
    (dict(key_lengths=np.array([1.0, 3.0])), "--key-lengths: .*unsupported dtype"),
    (dict(key_padding_mask=np.zeros((2, 11), bool)), r"--key-padding-mask must have shape \(batch, n_k\)"),
    (dict(key_padding_mask=np.zeros((2, 12), np.int64)), "--key-padding-mask must be a boolean array"),
    (dict(cu_seqlens=np.array([0, 5, 5, 12])), "--cu-seqlens must be strictly increasing"),
    (dict(cu_seqlens=np.array([0, 5, 11])), "--cu-seqlens must start at 0 and end at n = 12"),
    (dict(kv_heads=3), "must divide the heads of --q"),
])
def test_cli_bad_layouts_exit_2_and_write_nothing(tmp_path, layout, message):
    layout = dict(layout)
    q, k, v = data(heads=4, kv_heads=layout.pop("kv_heads", 2))
    if "cu_seqlens" in layout:
        q, k, v = q[:1], k[:1], v[:1]
    cmd = [cli_path(), "attention", "--method", layout.pop("method", "favor")]
    if layout.pop("exclude_self", False):
        cmd.append("--exclude-self")
    for name, a in dict(q=q, k=k, v=v, **layout).items():
        np.save(tmp_path / f"{name}.npy", a)
        cmd += [f"--{name.replace('_', '-')}", str(tmp_path / f"{name}.npy")]
    out = tmp_path / "out.npy"
    r = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1
    assert __import__("re").search(message, r.stderr), r.stderr
    assert not out.exists()


# The same bad layouts from both front ends: the registry's message, spelled by each.
SAME_ERRORS = [
    dict(key_lengths=np.array([3, 13])),
    dict(key_lengths=np.array([3])),
    dict(key_padding_mask=np.zeros((2, 11), bool)),
    dict(key_padding_mask=np.zeros((2, 12), np.int64)),
    dict(key_lengths=np.zeros((2, 12), bool)),
    dict(cu_seqlens=np.array([0, 5, 5, 12])),
    dict(cu_seqlens=np.array([[0, 12]])),
    dict(key_lengths=np.array([3, 4]), key_padding_mask=np.zeros((2, 12), bool)),
    dict(key_lengths=np.array([3, 4]), cu_seqlens=np.array([0, 12])),
    dict(kv_heads=3),
    dict(exclude_self=True, n_k=5),
]


def python_spelling(cli_message):
    """The command line's message in Python's spelling: --key-lengths as key_lengths, --q as q."""
    names = [spec["name"] for spec in randattn._core.layout_inputs if spec["type"] != "flag"]
    for name in names + ["q", "k", "v"]:
        cli_message = cli_message.replace("--" + name.replace("_", "-"), name)
    return cli_message.replace("--exclude-self", "exclude_self=True")


@pytest.mark.parametrize("layout", SAME_ERRORS)
def test_cli_and_python_give_the_same_layout_errors(tmp_path, layout):
    layout = dict(layout)
    method = layout.pop("method", "favor")
    exclude_self = layout.pop("exclude_self", False)
    q, k, v = data(heads=4, kv_heads=layout.pop("kv_heads", 2))
    n_k = layout.pop("n_k", 12)
    k, v = k[:, :, :n_k], v[:, :, :n_k]
    with pytest.raises((ValueError, TypeError)) as python:
        randattn.attention(q, k, v, method=method, exclude_self=exclude_self, **layout)
    cmd = [cli_path(), "attention", "--method", method] + (["--exclude-self"] if exclude_self else [])
    for name, a in dict(q=q, k=k, v=v, **layout).items():
        np.save(tmp_path / f"{name}.npy", a)
        cmd += [f"--{name.replace('_', '-')}", str(tmp_path / f"{name}.npy")]
    r = subprocess.run(cmd + ["--out", str(tmp_path / "out.npy")], capture_output=True, text=True)
    assert r.returncode == 2
    prefix = "randattn-cli: error: "
    assert r.stderr.startswith(prefix)
    assert python_spelling(r.stderr[len(prefix):].strip()) == str(python.value)


def test_cli_auto_reports_the_path_it_ran(tmp_path):
    import json
    q, k, v = data(dtype=np.float32)
    for crossover, path in ((13, "exact"), (12, "favor")):
        cmd = [cli_path(), "attention", "--method", "auto", "--crossover", str(crossover), "--report",
               "--features", "16"]
        for name, a in dict(q=q, k=k, v=v).items():
            np.save(tmp_path / f"{name}.npy", a)
            cmd += [f"--{name}", str(tmp_path / f"{name}.npy")]
        r = subprocess.run(cmd + ["--out", str(tmp_path / "o.npy")], check=True, capture_output=True, text=True)
        report = json.loads(r.stdout)
        assert report["method"] == path
        assert report["auto_reason"].startswith("n_k 12 ")
