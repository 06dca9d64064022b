"""Every registered method is reachable from both front ends with the same defaults, and gives
the same bits from Python as from randattn-cli on the same inputs, options and seed."""

import json
import subprocess

import numpy as np
import pytest

import randattn
from conftest import DTYPES, cli_path, run_cli


def cli_methods():
    out = subprocess.run([cli_path(), "methods", "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_cli_and_python_list_the_same_methods_and_defaults():
    cli = cli_methods()
    py = randattn.methods()
    assert list(cli) == list(py)
    for name, m in py.items():
        assert cli[name]["summary"] == m["summary"]
        assert cli[name]["shared_qk"] == m["shared_qk"]
        assert {o: spec["default"] for o, spec in cli[name]["options"].items()} == m["options"], name


def test_help_lists_every_method_and_option():
    text = subprocess.run([cli_path(), "attention", "--help"], check=True, capture_output=True, text=True).stdout
    assert "(" + ", ".join(randattn.methods()) + ")" in text
    assert "--shared-qk" in text
    for m in cli_methods().values():
        for spec in m["options"].values():
            assert spec["flag"] in text


def test_both_front_ends_offer_the_declared_layout_inputs():
    """One declaration (the registry's layout inputs): a --kebab-case flag each, a keyword each."""
    text = subprocess.run([cli_path(), "attention", "--help"], check=True, capture_output=True, text=True).stdout
    names = [spec["name"] for spec in randattn._core.layout_inputs]
    assert names == ["key_lengths", "key_padding_mask", "cu_seqlens", "exclude_self"]
    for spec in randattn._core.layout_inputs:
        assert "--" + spec["name"].replace("_", "-") in text
        assert spec["help"].split()[0] in text
    q = np.ones((1, 1, 3, 2))
    for spec in randattn._core.layout_inputs:  # a keyword of every method, None or False: no layout
        off = False if spec["type"] == "flag" else None
        np.testing.assert_array_equal(randattn.attention(q, q, q, **{spec["name"]: off}), randattn.attention(q, q, q))


# Options each method is run with (besides its defaults), as Python keywords; flags are derived.
RUNS = {
    "exact": [{}, {"causal": True}],
    "favor": [{"features": 16}, {"features": 16, "projection": "hadamard", "causal": True}],
    "favor-hyp": [{"features": 16, "projection": "iid"}],
    "trig": [{"features": 16}],
    "oprf": [{"features": 16}, {"features": 16, "fit": "given", "rho": 2.5, "causal": True}],
    "sderf": [{"features": 16}, {"features": 16, "fit": "given", "rho": 1.5}],
    "hybrid": [{"features": 8, "lambda_features": 4}],
    "hybrid-gaussian": [{"features": 8, "lambda_features": 4, "bandwidth": 0.8}],
    "hedgehog": [{"features": 16}, {"features": 8, "causal": True}],
    "lsh": [{"chunk": 8, "rounds": 3}, {"chunk": 8, "causal": True, "dedupe": False},
            {"buckets": 4, "exact_buckets": True, "separate": True},
            {"chunk": 8, "rounds": 2, "separate": True}, {"chunk": 8, "causal": True, "separate": True}],
    "lsf": [{"filters": 16, "tables": 3, "eta": 0.5}, {"filters": 16, "alpha": 0.6, "causal": True}],
    "sparse-lowrank": [
        {"support": "lsh", "chunk": 8, "remainder": "oprf", "features": 16},
        {"support": "window,blocks", "window": 4, "sinks": 1, "block_size": 8, "top_blocks": 1,
         "remainder": "sample", "samples": 4, "causal": True, "centre_keys": True},
        {"support": "lsf", "filters": 16, "eta": 0.5, "remainder": "none", "centre_keys": True},
        {"support": "lsh,window", "chunk": 8, "window": 3, "remainder": "sderf", "fit": "given", "rho": 2.0,
         "features": 16, "causal": True},
        {"support": "blocks", "block_size": 8, "remainder": "favor", "features": 16, "sampling": "uniform"},
    ],
    "auto": [{"crossover": 0, "features": 16}, {"approximation": "lsh", "crossover": 1000, "causal": True},
             {"approximation": "lsf", "crossover": 24, "alpha": 0.6}],
}


def ran(method, options):
    """The method a call runs: auto's path (24 keys against its crossover), else the method."""
    if method != "auto":
        return method
    return "exact" if 24 < options["crossover"] else options.get("approximation", "favor")


def test_every_registered_method_is_exercised():
    assert set(RUNS) == set(randattn.methods())


def flags_of(options):
    flags = []
    for name, value in options.items():
        if value is True:
            flags.append("--" + name.replace("_", "-"))
        elif value is False:
            flags.append("--no-" + name.replace("_", "-"))
        else:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", list(RUNS))
def test_python_and_cli_give_the_same_bits(tmp_path, method, dtype):
    rng = np.random.default_rng(20261201)
    q, k, v = (rng.standard_normal((2, 2, 24, 8)).astype(dtype) for _ in range(3))
    shared_qk = randattn.methods()[method]["shared_qk"]
    for i, options in enumerate(RUNS[method]):
        options = dict(options)
        separate = options.pop("separate", False) or not shared_qk
        keys = k if separate else None
        out, report = randattn.attention(q, keys, v, method=method, seed=7, shared_qk=keys is None, report=True,
                                         **options)
        arrays = dict(q=q, v=v) if keys is None else dict(q=q, k=k, v=v)
        flags = ["attention", "--method", method, "--seed", "7"] + flags_of(options)
        flags += [] if separate else ["--shared-qk"]
        cli = run_cli(tmp_path, flags, **arrays)
        assert out.dtype == cli.dtype == dtype
        assert np.array_equal(out, cli), (method, options)
        assert report["method"] == ran(method, options) and report["shared_qk"] == (keys is None)
        assert report["seconds"] >= 0


@pytest.mark.parametrize("method", list(RUNS))
def test_python_report_has_the_cli_report_fields(tmp_path, method):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((16, 8)) for _ in range(3))
    options = {key: value for key, value in RUNS[method][0].items() if key != "separate"}
    shared = randattn.methods()[method]["shared_qk"]
    keys = None if shared else k
    _, report = randattn.attention(q, keys, v, method=method, shared_qk=shared, report=True, **options)
    cmd = [cli_path(), "attention", "--method", method, "--report"] + flags_of(options)
    for name, a in (("q", q), ("v", v)) + ((("k", k),) if not shared else ()):
        np.save(tmp_path / f"{name}.npy", a)
        cmd += [f"--{name}", str(tmp_path / f"{name}.npy")]
    cmd += ["--shared-qk"] if shared else []
    line = subprocess.run(cmd + ["--out", str(tmp_path / "o.npy")], check=True, capture_output=True,
                          text=True).stdout
    cli = json.loads(line)
    # The CLI adds what only it knows (file shapes, dtype, threads); every Python field is there.
    for key, value in report.items():
        assert key in cli, key
        if key != "seconds" and not key.endswith("_seconds"):  # timings differ between runs
            assert cli[key] == pytest.approx(value) if isinstance(value, float) else cli[key] == value, key
    for key in ("feature_dim", "pairs_scored", "predicted_rel_mse"):
        assert (key in cli) == (key in report)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hedgehog_weight_and_bias_files_give_the_python_bits(tmp_path, dtype):
    """--weight W.npy --bias B.npy with grouped heads (4 query heads over 2 key/value heads)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 24, 8)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 24, 8)).astype(dtype) for _ in range(2))
    weight = (0.5 * rng.standard_normal((2, 6, 8))).astype(dtype)
    bias = rng.standard_normal((2, 6)).astype(dtype)
    out, report = randattn.attention(q, k, v, method="hedgehog", causal=True, weight=weight, bias=bias,
                                     report=True)
    cli = run_cli(tmp_path, ["attention", "--method", "hedgehog", "--causal"], q=q, k=k, v=v, weight=weight,
                  bias=bias)
    assert out.dtype == cli.dtype == dtype
    assert np.array_equal(out, cli)
    assert report["features"] == 6 and report["feature_dim"] == 12


def test_lsh_report_has_pairs_scored():
    rng = np.random.default_rng(5)
    n = 24
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for _ in range(3))
    # One chunk holding the sequence: shared QK scores every pair but the diagonal, causal shared
    # QK the i earlier keys of each query (position 0: itself), separate keys every pair.
    _, r = randattn.attention(q, None, v, method="lsh", shared_qk=True, chunk=n, report=True)
    assert r["pairs_scored"] == pytest.approx((n - 1) / n)
    _, r = randattn.attention(q, None, v, method="lsh", shared_qk=True, chunk=n, causal=True, report=True)
    assert r["pairs_scored"] == pytest.approx((1 + n * (n - 1) / 2) / n**2)
    _, r = randattn.attention(q, k, v, method="lsh", chunk=n, report=True)
    assert r["pairs_scored"] == pytest.approx(1.0)
    # Short chunks score a part of the pairs: at most two chunks of c keys per round and query.
    _, r = randattn.attention(q, k, v, method="lsh", chunk=4, rounds=2, report=True)
    assert 0 < r["pairs_scored"] <= 2 * 2 * 4 / n


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_runs_exact_below_the_crossover_and_the_approximation_from_it(dtype):
    rng = np.random.default_rng(11)
    for n, path in ((31, "exact"), (32, "favor")):
        q, k, v = (rng.standard_normal((2, 2, n, 8)).astype(dtype) for _ in range(3))
        out, r = randattn.attention(q, k, v, method="auto", crossover=32, features=16, seed=5, report=True)
        kw = {"features": 16} if path == "favor" else {}
        np.testing.assert_array_equal(out, randattn.attention(q, k, v, method=path, seed=5, **kw))
        assert r["method"] == path
        assert r["auto_reason"] == f"n_k {n} {'<' if path == 'exact' else '>='} crossover 32 (given)"
        if path == "favor":
            assert r["feature_dim"] == 16


def test_auto_takes_its_crossover_from_the_table_by_default():
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((16, 64)) for _ in range(3))
    _, r = randattn.attention(q, k, v, method="auto", approximation="lsh", report=True)
    assert "table row lsh d=" in r["auto_reason"] or "no table row for lsh" in r["auto_reason"]
    assert r["method"] in ("exact", "lsh")


def test_auto_refuses_options_of_other_methods_than_its_approximation():
    q = np.ones((4, 8))
    with pytest.raises(ValueError, match="not an option of approximation=favor"):
        randattn.attention(q, q, q, method="auto", chunk=8)
    with pytest.raises(ValueError, match="approximation must be one of"):
        randattn.attention(q, q, q, method="auto", approximation="exact")
    with pytest.raises(ValueError, match="crossover must be non-negative"):
        randattn.attention(q, q, q, method="auto", crossover=-1)
