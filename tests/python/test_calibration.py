"""OPRF and SDERF fitted per slice: to each (batch, head) slice's own queries and keys, to
per-head calibration rows, and to separate sample queries and keys (calibration_q,
calibration_k). Every batched result equals 2-D calls on its slices bit for bit, and the command
line gives the same bits as Python."""

import subprocess

import numpy as np
import pytest

import randattn
from conftest import DTYPES, cli_path, run_cli

METHODS = ["oprf", "sderf"]
B, H, N, D, DV, R = 2, 3, 20, 8, 4, 12


def inputs(dtype, seed=20261202):
    rng = np.random.default_rng(seed)
    q = (0.8 * rng.standard_normal((B, H, N, D))).astype(dtype)
    k = (0.8 * rng.standard_normal((B, H, N + 3, D))).astype(dtype)
    v = rng.standard_normal((B, H, N + 3, DV)).astype(dtype)
    return q, k, v


def calibration(shape, seed):
    return 0.7 * np.random.default_rng(seed).standard_normal(shape)


def run(q, k, v, method, **options):
    return randattn.attention(q, k, v, method=method, seed=5, features=16, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_fit_to_queries_and_keys_is_per_slice(method, dtype):
    q, k, v = inputs(dtype)
    out = run(q, k, v, method)
    for b in range(B):
        for h in range(H):
            assert np.array_equal(out[b, h], run(q[b, h], k[b, h], v[b, h], method)), (b, h)
    # Not one statistic over all slices: a slice's output depends only on its own rows.
    q2 = q.copy()
    q2[1] *= 1.5
    assert np.array_equal(run(q2, k, v, method)[0], out[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pair", [False, True])
def test_per_head_calibration_equals_2d_calls_with_that_head(method, dtype, pair):
    q, k, v = inputs(dtype)
    cq, ck = calibration((H, R, D), 1), calibration((H, R + 5, D), 2)
    given = dict(calibration_q=cq, calibration_k=ck) if pair else dict(calibration=cq)
    out = run(q, k, v, method, fit="given", **given)
    for h in range(H):
        given_h = dict(calibration_q=cq[h], calibration_k=ck[h]) if pair else dict(calibration=cq[h])
        whole = run(q, k, v, method, fit="given", **given_h)  # head h's rows for every slice
        for b in range(B):
            ref = run(q[b, h], k[b, h], v[b, h], method, fit="given", **given_h)
            assert np.array_equal(out[b, h], ref), (b, h)
            assert np.array_equal(whole[b, h], ref), (b, h)
        if h > 0:  # each head's own rows, not head 0's
            first = dict(calibration_q=cq[0], calibration_k=ck[0]) if pair else dict(calibration=cq[0])
            assert not np.array_equal(out[:, h], run(q, k, v, method, fit="given", **first)[:, h])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_separate_query_and_key_calibration(method, dtype):
    q, k, v = inputs(dtype)
    cq, ck = calibration((R, D), 3), 1.6 * calibration((R + 5, D), 4)
    out = run(q, k, v, method, fit="given", calibration_q=cq, calibration_k=ck)
    assert not np.array_equal(out, run(q, k, v, method, fit="given", calibration=cq))
    assert not np.array_equal(out, run(q, k, v, method, fit="given", calibration=ck))
    # The library's fit(q_rows, k_rows): a 2-D call fitted to its own queries and keys, with
    # those rows as the queries and keys, is the same map.
    qc, kc = cq.astype(dtype), ck.astype(dtype)
    vc = np.random.default_rng(6).standard_normal((R + 5, DV)).astype(dtype)
    assert np.array_equal(run(qc, kc, vc, method),
                          run(qc, kc, vc, method, fit="given", calibration_q=qc, calibration_k=kc))
    # Every slice used the one 2-D map.
    for b in range(B):
        for h in range(H):
            assert np.array_equal(out[b, h], run(q[b, h], k[b, h], v[b, h], method, fit="given",
                                                 calibration_q=cq, calibration_k=ck))


@pytest.mark.parametrize("method", METHODS)
def test_calibration_rows_as_both_equals_the_pair_with_the_same_rows(method):
    q, k, v = inputs(np.float64)
    c = calibration((H, R, D), 7)
    assert np.array_equal(run(q, k, v, method, fit="given", calibration=c),
                          run(q, k, v, method, fit="given", calibration_q=c, calibration_k=c))


@pytest.mark.parametrize("method", METHODS)
def test_predicted_error_is_the_mean_over_slices(method):
    q, k, v = inputs(np.float64)
    _, report = randattn.attention(q, k, v, method=method, seed=5, features=16, report=True)
    per_slice = [randattn.attention(q[b, h], k[b, h], v[b, h], method=method, seed=5, features=16,
                                    report=True)[1]["predicted_rel_mse"] for b in range(B) for h in range(H)]
    assert report["predicted_rel_mse"] == pytest.approx(np.mean(per_slice), rel=1e-12)
    c = calibration((H, R, D), 8)
    _, report = randattn.attention(q, k, v, method=method, seed=5, features=16, report=True, fit="given",
                                   calibration_q=c, calibration_k=c)
    assert report["predicted_rel_mse"] > 0
    assert report["calibration_q"] == report["calibration_k"] == "array"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_cli_and_python_agree(tmp_path, method, dtype):
    q, k, v = inputs(dtype)
    cases = [
        ({}, {}),
        ({"fit": "given"}, {"calibration_q": calibration((R, D), 9), "calibration_k": calibration((R + 2, D), 10)}),
        ({"fit": "given"}, {"calibration_q": calibration((H, R, D), 11), "calibration_k": calibration((H, R, D), 12)}),
        ({"fit": "given"}, {"calibration": calibration((H, R, D), 13)}),
    ]
    for flags, arrays in cases:
        out = run(q, k, v, method, **flags, **arrays)
        args = ["attention", "--method", method, "--seed", "5", "--features", "16"]
        for name, value in flags.items():
            args += ["--" + name, value]
        cli = run_cli(tmp_path, args, q=q, k=k, v=v, **arrays)
        assert cli.dtype == out.dtype == dtype
        assert np.array_equal(out, cli), (flags, list(arrays))


def cli_error(tmp_path, args, **arrays):
    cmd = [cli_path()] + args
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
        cmd += [f"--{name.replace('_', '-')}", str(tmp_path / f"{name}.npy")]
    r = subprocess.run(cmd + ["--out", str(tmp_path / "o.npy")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    return r.stderr


@pytest.mark.parametrize("method", METHODS)
def test_errors(tmp_path, method):
    q, k, v = inputs(np.float64)
    c2, c3 = calibration((R, D), 1), calibration((H, R, D), 2)
    bad = [
        (dict(fit="given", calibration_q=c2), ["calibration_q and calibration_k", "calibration_k is missing"]),
        (dict(fit="given", calibration_k=c2), ["calibration_q and calibration_k", "calibration_q is missing"]),
        (dict(calibration=c2), ["need fit=given"]),
        (dict(calibration_q=c2, calibration_k=c2), ["need fit=given"]),
        (dict(fit="given"), ["exactly one of rho, calibration, or calibration_q with calibration_k"]),
        (dict(fit="given", calibration=c2, calibration_q=c2, calibration_k=c2), ["exactly one"]),
        (dict(fit="given", rho=1.0, calibration_q=c2, calibration_k=c2), ["exactly one"]),
        (dict(fit="given", calibration=calibration((H + 1, R, D), 3)), ["calibration:", "(3, r, 8)", "(4, 12, 8)"]),
        (dict(fit="given", calibration=calibration((R, D + 1), 3)), ["calibration:", "(r, 8)", "(12, 9)"]),
        (dict(fit="given", calibration_q=c2, calibration_k=calibration((H, R, D + 1), 3)),
         ["calibration_k:", "(3, 12, 9)"]),
        (dict(fit="given", calibration_q=c3, calibration_k=c2), ["must both be (r, d) or both per-head", "(3, 12, 8)"]),
        (dict(fit="given", calibration=calibration((1, 2, R, D), 3)), ["calibration:", "(1, 2, 12, 8)"]),
        (dict(fit="given", calibration=np.zeros((0, D))), ["calibration:", "r >= 1"]),
    ]
    for options, words in bad:
        with pytest.raises(ValueError) as e:
            run(q, k, v, method, **options)
        for w in words:
            assert w in str(e.value), (options, str(e.value))
    # 2-D inputs have one head.
    with pytest.raises(ValueError, match=r"\(1, r, 8\)"):
        run(q[0, 0], k[0, 0], v[0, 0], method, fit="given", calibration=c3)
    # The command line names its flags.
    err = cli_error(tmp_path, ["attention", "--method", method, "--fit", "given"], q=q, k=k, v=v, calibration_q=c2)
    assert "--calibration-q and --calibration-k" in err and "--calibration-k is missing" in err
    err = cli_error(tmp_path, ["attention", "--method", method, "--fit", "given"], q=q, k=k, v=v,
                    calibration=calibration((H + 1, R, D), 3))
    assert "--calibration:" in err and "(3, r, 8)" in err
    err = cli_error(tmp_path, ["attention", "--method", method], q=q, k=k, v=v, calibration_q=c2, calibration_k=c2)
    assert "need --fit given" in err
