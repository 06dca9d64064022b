"""The model-in-the-loop examples (examples/python/llama2c.py, model_eval.py): the llama2.c reader and
writer, the torch forward against run.c's algorithm, exact attention through randattn against the
torch reference, and model_eval.py end to end, all on tiny random checkpoints."""

import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"
sys.path.insert(0, str(EXAMPLES))
import llama2c  # noqa: E402


def random_model(shared=True, seed=0, dim=32, hidden=48, layers=2, heads=4, kv_heads=2, vocab=256, seq_len=48):
    """A model with random weights large enough that attention is not uniform (|logits| of a few units)."""
    config = llama2c.Config(dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared_classifier=shared)
    model = llama2c.Transformer(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm")
                    else 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "tiny.bin"
    llama2c.write_checkpoint(random_model(shared=False), path)
    return path


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(np.random.default_rng(1).integers(32, 127, size=4000, dtype=np.uint8)))
    return path


@pytest.mark.parametrize("shared", [True, False])
def test_checkpoint_round_trip(tmp_path, shared):
    model = random_model(shared=shared)
    path = tmp_path / "m.bin"
    llama2c.write_checkpoint(model, path)
    c = model.config
    hs = c.head_size
    floats = (c.vocab_size * c.dim * (1 if shared else 2) + c.n_layers * (2 * c.dim + 2 * c.dim * c.dim
              + 2 * c.kv_dim * c.dim + 3 * c.dim * c.hidden_dim) + c.dim + c.seq_len * hs)
    assert path.stat().st_size == 28 + 4 * floats
    header = struct.unpack("<7i", path.read_bytes()[:28])
    assert header == (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                      c.vocab_size if shared else -c.vocab_size, c.seq_len)
    back = llama2c.read_checkpoint(path)
    assert back.config == c
    for (name, p), (name_back, p_back) in zip(model.named_parameters(), back.named_parameters()):
        assert name == name_back
        assert torch.equal(p, p_back)
    # A truncated file or one with trailing data is refused.
    data = path.read_bytes()
    for bad in (data[:-4], data + b"\0\0\0\0", data[:20]):
        path.write_bytes(bad)
        with pytest.raises(ValueError):
            llama2c.read_checkpoint(path)


def run_c_logits(path, tokens):
    """Logits of every position computed as llama2.c's run.c does, token by token with a key/value
    cache, in float64, from the file's raw arrays (parsed here independently of llama2c.py)."""
    raw = path.read_bytes()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared, vocab = vocab > 0, abs(vocab)
    w = np.frombuffer(raw[28:], dtype="<f4").astype(np.float64)
    hs = dim // heads
    kv_dim = kv_heads * hs
    sizes = [("emb", vocab * dim), ("rms_att", layers * dim), ("wq", layers * dim * dim),
             ("wk", layers * kv_dim * dim), ("wv", layers * kv_dim * dim), ("wo", layers * dim * dim),
             ("rms_ffn", layers * dim), ("w1", layers * hidden * dim), ("w2", layers * dim * hidden),
             ("w3", layers * hidden * dim), ("rms_final", dim), ("freq", seq_len * hs)]
    arrays, offset = {}, 0
    for name, size in sizes:
        arrays[name] = w[offset:offset + size]
        offset += size
    wcls = arrays["emb"] if shared else w[offset:offset + vocab * dim]

    def mat(name, layer, rows, cols):
        return arrays[name][layer * rows * cols:(layer + 1) * rows * cols].reshape(rows, cols)

    def rmsnorm(x, weight):
        return weight * x / np.sqrt(np.mean(x * x) + 1e-5)

    key_cache = np.zeros((layers, len(tokens), kv_dim))
    value_cache = np.zeros((layers, len(tokens), kv_dim))
    out = []
    for pos, token in enumerate(tokens):
        x = arrays["emb"][token * dim:(token + 1) * dim].copy()
        for l in range(layers):
            xb = rmsnorm(x, arrays["rms_att"][l * dim:(l + 1) * dim])
            q = mat("wq", l, dim, dim) @ xb
            k = mat("wk", l, kv_dim, dim) @ xb
            v = mat("wv", l, kv_dim, dim) @ xb
            for i in range(0, dim, 2):
                angle = pos / 10000.0 ** ((i % hs) / hs)
                c, s = np.cos(angle), np.sin(angle)
                q[i], q[i + 1] = q[i] * c - q[i + 1] * s, q[i] * s + q[i + 1] * c
                if i < kv_dim:
                    k[i], k[i + 1] = k[i] * c - k[i + 1] * s, k[i] * s + k[i + 1] * c
            key_cache[l, pos], value_cache[l, pos] = k, v
            att_out = np.zeros(dim)
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                keys = key_cache[l, :pos + 1, kvh * hs:(kvh + 1) * hs]
                scores = keys @ q[h * hs:(h + 1) * hs] / np.sqrt(hs)
                p = np.exp(scores - scores.max())
                att_out[h * hs:(h + 1) * hs] = (p / p.sum()) @ value_cache[l, :pos + 1, kvh * hs:(kvh + 1) * hs]
            x = x + mat("wo", l, dim, dim) @ att_out
            xb = rmsnorm(x, arrays["rms_ffn"][l * dim:(l + 1) * dim])
            h1 = mat("w1", l, hidden, dim) @ xb
            x = x + mat("w2", l, dim, hidden) @ (h1 / (1 + np.exp(-h1)) * (mat("w3", l, hidden, dim) @ xb))
        out.append(wcls.reshape(vocab, dim) @ rmsnorm(x, arrays["rms_final"]))
    return np.array(out)


def test_forward_matches_run_c(checkpoint):
    """The torch forward (float64) reproduces run.c's token-by-token algorithm on the same file."""
    model = llama2c.read_checkpoint(checkpoint).double()
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, size=20)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)[None])[0].numpy()
    expected = run_c_logits(checkpoint, tokens)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-9 * np.abs(expected).max())


def test_randattn_exact_reproduces_reference(checkpoint):
    """Every layer's attention by randattn's exact method equals the torch reference to float32
    rounding, and so do the logits: their difference is within a few times the float32-vs-float64
    difference of the reference itself."""
    randattn = pytest.importorskip("randattn")  # noqa: F841
    from conftest import assert_close
    model = llama2c.read_checkpoint(checkpoint)
    tokens = torch.from_numpy(np.random.default_rng(3).integers(0, 256, size=(2, model.config.seq_len)))
    n = tokens.shape[1]

    checked = []

    def both(q, k, v):
        reference = llama2c.exact_attention(q, k, v)
        ours = llama2c.RandattnAttention("exact")(q, k, v)
        assert_close(ours.numpy(), llama2c.exact_attention(q.double(), k.double(), v.double()).numpy(),
                     np.float32, n)
        checked.append(float((reference - ours).abs().max()))
        return ours

    with torch.no_grad():
        through_randattn = model(tokens, both)
        reference = model(tokens)
        reference64 = model.double()(tokens)
    assert len(checked) == model.config.n_layers
    rounding = float((reference.double() - reference64).abs().max())
    assert rounding > 0
    assert float((through_randattn - reference).abs().max()) <= 4 * rounding
    # The bound discriminates: it is far below the logits' magnitude.
    assert 4 * rounding < 1e-4 * float(reference.abs().max())


def run_model_eval(*args):
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES)] + [p for p in sys.path if p])
    return subprocess.run([sys.executable, str(EXAMPLES / "model_eval.py"), *map(str, args)],
                          capture_output=True, text=True, env=env)


def table_rows(stdout):
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 8 and cells[0] != "method":
            rows[cells[0]] = cells[1:]
    return rows


def test_model_eval_end_to_end(checkpoint, text):
    pytest.importorskip("randattn")
    n = 40
    result = run_model_eval(checkpoint, text, "--seqs", 2, "--len", n, "--stats",
                            "--method", "exact", "--method", "favor", "--option", "features=64",
                            "--method", "oprf", "--option", "features=64",
                            "--method", "lsf", "--option", "eta=0.5", "--option", "filters=16",
                            "--method", "oracle-topk", "--option", "k=8",
                            "--method", "oracle-topk", "--option", "k=40",
                            "--method", "window", "--option", "window=4", "--option", "sinks=1",
                            "--method", "sparse-lowrank", "--option", "support=window", "--option", "window=4",
                            "--option", "sinks=1", "--option", "remainder=sample", "--option", "samples=4",
                            "--method", "uniform")
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert set(rows) == {"exact", "favor features=64", "oprf features=64", "lsf eta=0.5 filters=16", "oracle-topk k=8",
                         "oracle-topk k=40", "window window=4 sinks=1", "uniform",
                         "sparse-lowrank support=window window=4 sinks=1 remainder=sample samples=4"}
    kl, top1, nll, pairs, oracle, ratio, seconds = rows["exact"]
    assert float(kl) < 1e-6 and (float(top1), pairs, oracle, ratio) == (1.0, "1.000", f"0 [{n}]", "-")
    # Top-k over all n keys is exact attention.
    assert float(rows["oracle-topk k=40"][0]) < 1e-4 and rows["oracle-topk k=40"][3] == "1.000"
    causal = n * (n + 1) / 2
    assert float(rows["oracle-topk k=8"][3]) == pytest.approx(sum(min(8, i + 1) for i in range(n)) / causal, abs=1e-3)
    window_pairs = sum(len(set(range(max(0, i - 3), i + 1)) | {0}) for i in range(n))
    assert float(rows["window window=4 sinks=1"][3]) == pytest.approx(window_pairs / causal, abs=1e-3)
    assert 0 < float(rows["lsf eta=0.5 filters=16"][3]) <= 1
    assert rows["favor features=64"][3:6] == ["-"] * 3 and rows["uniform"][3:6] == ["-"] * 3
    for name, (kl, top1, nll, *_) in rows.items():
        assert float(kl) >= 0 and 0 <= float(top1) <= 1 and float(nll) > 0, name
    assert float(rows["uniform"][0]) > float(rows["oracle-topk k=8"][0])
    # The oracle column of an oracle row is that row itself; a method's is the oracle with the
    # smallest k whose share covers the method's, and the ratio divides the two KLs.
    kl8 = rows["oracle-topk k=8"][0]
    assert rows["oracle-topk k=8"][4:6] == [f"{kl8} [8]", "1.00"]
    window_k = next(k for k in range(1, n + 1) if sum(min(k, i + 1) for i in range(n)) >= window_pairs)
    kl_w, _, _, _, oracle_w, ratio_w, _ = rows["window window=4 sinks=1"]
    assert oracle_w.endswith(f"[{window_k}]")
    assert float(ratio_w) == pytest.approx(float(kl_w) / float(oracle_w.split()[0]), rel=2e-2)
    # A sampled remainder's drawn keys count in its share, and the oracle is taken at the sum.
    support, plus, drawn, word = rows["sparse-lowrank support=window window=4 sinks=1 remainder=sample samples=4"][3].split()
    assert float(support) == pytest.approx(window_pairs / causal, abs=1e-3) and (plus, word) == ("+", "drawn")
    # (Here the sampling's key blocks, 64 long, hold every key: query i's own block, whose keys
    # j <= i outside the support are all taken, so support and drawn keys cover every pair.)
    assert 0 < float(drawn) and float(support) + float(drawn) == pytest.approx(1.0, abs=2e-3)
    sampled_k = next(k for k in range(1, n + 1)
                     if sum(min(k, i + 1) for i in range(n)) / causal >= float(support) + float(drawn) - 1e-3)
    oracle_s = rows["sparse-lowrank support=window window=4 sinks=1 remainder=sample samples=4"][4]
    assert abs(int(oracle_s.split("[")[1].rstrip("]")) - sampled_k) <= 1


@pytest.mark.parametrize("args, message", [
    (["--method", "nosuch"], "nosuch"),
    (["--method", "favor", "--option", "bogus=1"], "bogus"),
    (["--method", "oracle-topk", "--option", "k=0"], "k must be"),
    (["--option", "k=1"], "no --method"),
    (["--len", "1000"], "--len"),
    (["--seqs", "500"], "need"),
])
def test_model_eval_errors(checkpoint, text, args, message):
    result = run_model_eval(checkpoint, text, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def kv_cache_factory(model, mode="exact", **options):
    import randattn
    c = model.config
    return lambda: randattn.KVCache(head_dim=c.head_size, value_dim=c.head_size, kv_heads=c.n_kv_heads,
                                    mode=mode, **options)


def test_generate_exact_cache_reproduces_forward(checkpoint):
    """Token-by-token decoding with exact KVCaches gives the full forward's logits to float32
    rounding; with steps, the appended tokens are the greedy choices."""
    pytest.importorskip("randattn")
    import generate
    model = llama2c.read_checkpoint(checkpoint)
    prompt = torch.from_numpy(np.random.default_rng(4).integers(0, 256, size=30))
    with torch.inference_mode():
        tokens, logits, seconds, cache_seconds, reports = generate.decode(model, prompt, kv_cache_factory(model), 6)
        reference = model(tokens[None])[0]
        reference64 = model.double()(tokens[None])[0]
    assert tokens.shape == (36,) and torch.equal(tokens[:30], prompt)
    assert torch.equal(tokens[30:], logits[29:35].argmax(-1))
    assert len(reports) == 36 * model.config.n_layers and 0 < cache_seconds < seconds
    rounding = float((reference.double() - reference64).abs().max())
    assert float((logits - reference).abs().max()) <= 4 * rounding
    assert 4 * rounding < 1e-4 * float(reference.abs().max())


def run_generate(*args):
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES)] + [p for p in sys.path if p])
    return subprocess.run([sys.executable, str(EXAMPLES / "generate.py"), *map(str, args)],
                          capture_output=True, text=True, env=env)


def test_generate_end_to_end(checkpoint, text):
    pytest.importorskip("randattn")
    result = run_generate(checkpoint, text, "--prompt-len", 24, "--steps", 8,
                          "--mode", "exact",
                          "--mode", "blocks", "--option", "page_size=4", "--option", "top_pages=100",
                          "--option", "window=2", "--option", "sinks=1",
                          "--mode", "blocks", "--option", "page_size=4", "--option", "top_pages=1",
                          "--option", "window=2", "--option", "sinks=1",
                          "--mode", "lsh-sample", "--option", "window=2", "--option", "sinks=1",
                          "--mode", "lsf", "--option", "window=2", "--option", "sinks=1", "--option", "eta=0.5")
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 14 and cells[0] != "mode":
            rows[cells[0]] = cells[1:]
    assert len(rows) == 5, result.stdout
    for name in ("exact", "blocks page_size=4 top_pages=100 window=2 sinks=1"):
        tokens_per_s, cache_us, top1_gen, top1_all, kl, scored, oracle, ratio, kl_gen, scored_gen, *_ = rows[name]
        # Every page attended: exact decoding (up to float rounding in the merge), and the oracle
        # given every key is exact decoding too.
        assert (top1_gen, top1_all, scored, scored_gen) == ("1.0000", "1.0000", "1.000", "1.000"), name
        assert float(kl) < 1e-5 and float(kl_gen) < 1e-5, name
        assert name == "exact" or float(oracle) < 1e-5
        assert float(tokens_per_s) > 0 and float(cache_us) > 0
    assert rows["exact"][6:8] == ["-", "-"] and rows["exact"][10:12] == ["-", "-"]
    few = rows["blocks page_size=4 top_pages=1 window=2 sinks=1"]
    assert 0 < float(few[5]) < 1 and 0 < float(few[9]) < 1
    # The last 8 of 32 positions have the longest caches, so their share scored is smaller.
    assert float(few[9]) < float(few[5])
    for kl, oracle, ratio in ((few[4], few[6], few[7]), (few[8], few[10], few[11])):
        if float(oracle) > 0:
            assert float(ratio) == pytest.approx(float(kl) / float(oracle), rel=2e-3)
    for name, (tokens_per_s, cache_us, top1_gen, top1_all, kl, scored, oracle, _, kl_gen, *_) in rows.items():
        assert 0 <= float(top1_gen) <= 1 and float(kl) >= 0 and 0 < float(scored) <= 1, name
        assert float(kl_gen) >= 0 and (name == "exact" or float(oracle) >= 0), name


def test_oracle_cache_with_every_key_is_exact_decoding(checkpoint):
    """generate.OracleCache given as many keys as are cached decodes as the exact KVCache does, and
    given one key per head attends to that head's highest-logit key alone."""
    pytest.importorskip("randattn")
    import generate
    model = llama2c.read_checkpoint(checkpoint)
    c = model.config
    prompt = torch.from_numpy(np.random.default_rng(5).integers(0, 256, size=20))
    everything = iter([c.n_heads * (t + 1) for t in range(20) for _ in range(c.n_layers)])
    with torch.inference_mode():
        _, exact, *_ = generate.decode(model, prompt, kv_cache_factory(model))
        _, oracle, *_ = generate.decode(model, prompt, lambda: generate.OracleCache(c, everything))
    assert float((exact - oracle).abs().max()) < 1e-4 * float(exact.abs().max())
    cache = generate.OracleCache(c, iter([c.n_heads]))
    rng = np.random.default_rng(6)
    keys = rng.standard_normal((5, c.n_kv_heads, 1, c.head_size)).astype(np.float32)
    values = rng.standard_normal((5, c.n_kv_heads, 1, c.head_size)).astype(np.float32)
    for k, v in zip(keys, values):
        cache.append(k, v)
    q = rng.standard_normal((c.n_heads, c.head_size)).astype(np.float32)
    out = cache.attend(q)
    group = c.n_heads // c.n_kv_heads
    for h in range(c.n_heads):
        best = int(np.argmax(keys[:, h // group, 0] @ q[h]))
        np.testing.assert_array_equal(out[h], values[best, h // group, 0])


@pytest.mark.parametrize("args, message", [
    (["--prompt-len", "20", "--steps", "4", "--mode", "nosuch"], "nosuch"),
    (["--prompt-len", "20", "--steps", "4", "--mode", "blocks", "--option", "bits=3"], "bits"),
    (["--prompt-len", "40", "--steps", "20"], "seq_len"),
])
def test_generate_errors(checkpoint, text, args, message):
    result = run_generate(checkpoint, text, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_bound_slack_bounds_hold_and_script_runs(checkpoint, text):
    import bound_slack
    rng = np.random.default_rng(3)
    k = rng.standard_normal((60, 6)) * np.linspace(3, 0.3, 6) + 1.0
    q = 2 * rng.standard_normal((9, 6))
    axes = bound_slack.principal_axes(k[:20])
    assert np.allclose(axes.T @ axes, np.eye(6), atol=1e-12)
    groups = [np.arange(i, min(i + 7, 60)) for i in range(0, 60, 7)]
    bounds = bound_slack.group_bounds(q, k, groups, axes)
    true = np.stack([(q @ k[g].T).max(1) for g in groups], 1)
    for name, b in bounds.items():
        assert (b >= true - 1e-9).all(), name  # every bound bounds
    assert (bounds["box ∧ ball"] <= np.minimum(bounds["box"], bounds["ball"])).all()
    result = subprocess.run([sys.executable, str(EXAMPLES / "bound_slack.py"), str(checkpoint), str(text),
                             "--seqs", "2", "--page", "4", "--top", "2"],
                            capture_output=True, text=True, env={"PYTHONPATH": str(EXAMPLES)})
    assert result.returncode == 0, result.stderr
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines() if line.startswith("| pages")
            or line.startswith("| clusters")]
    assert len(rows) == 8, result.stdout
    for kind, name, slack, top, mass in rows:
        assert float(slack) >= 0 and float(top) >= 0 and 0 < float(mass) <= 1 + 1e-9, (kind, name)
