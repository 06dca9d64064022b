"""Training and conversion with randattn attention (examples/python/train_tiny_lm.py, convert_model.py,
attention_layers.py) on tiny random checkpoints: gradients that lower the loss for every
differentiable method, attention transfer, feature-map files, causality of a converted model and the
scripts' refusals."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
randattn = pytest.importorskip("randattn")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"
sys.path.insert(0, str(EXAMPLES))
import attention_layers  # noqa: E402
import bpe  # noqa: E402
import llama2c  # noqa: E402
import train_tiny_lm  # noqa: E402
from test_model_eval import random_model  # noqa: E402

# Options that make a method run causally on a 24-token sequence of heads of 8 (fitted maps need
# their fit given under causal masking).
METHOD_OPTIONS = {"oprf": {"fit": "given", "rho": 1.0}, "sderf": {"fit": "given", "rho": 1.0},
                  "favor": {"features": 16}, "favor-hyp": {"features": 8}, "trig": {"features": 16},
                  "hybrid": {"features": 8}, "hybrid-gaussian": {"features": 8}, "hedgehog": {"features": 8},
                  "lsf": {"eta": 0.5}, "sparse-lowrank": {"fit": "given", "rho": 1.0}}


def differentiable_methods():
    return [name for name, entry in randattn.methods().items() if entry["differentiable"]]


def small_model(seed=0):
    return random_model(seed=seed, dim=32, hidden=48, layers=2, heads=4, kv_heads=2, seq_len=48)


@pytest.mark.parametrize("method", differentiable_methods())
def test_training_lowers_the_loss_on_a_repeated_batch(method):
    """Only the attention's inputs (wq, wk, wv) and the feature maps learn, so the loss falls through
    randattn's backward alone; attention is far from uniform (scale·‖q‖² of a few units)."""
    model = small_model().train()
    train_tiny_lm.init_weights(model, seed=1)
    with torch.no_grad():
        for w in (model.wq, model.wk, model.wv):
            w.mul_(5)
    attention = attention_layers.ModelAttention(method, model.config, METHOD_OPTIONS.get(method, {}))
    batch = torch.randint(0, 256, (2, 25), generator=torch.Generator().manual_seed(3))
    params = [model.wq, model.wk, model.wv] + list(attention.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(6):
        logits = model(batch[:, :-1], attention)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.05, losses


def test_learned_map_gets_gradients_and_round_trips(tmp_path):
    model = small_model()
    attention = attention_layers.ModelAttention("hedgehog", model.config, {"features": 8})
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    model(tokens, attention).square().sum().backward()
    for layer in attention:
        assert layer.weight.grad is not None and float(layer.weight.grad.abs().sum()) > 0
        assert layer.bias.grad is not None and float(layer.bias.grad.abs().sum()) > 0
    with torch.no_grad():  # move away from the initial values, so loading is what sets them
        for p in attention.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    path = tmp_path / "maps.npz"
    attention.save(path)
    again = attention_layers.ModelAttention("hedgehog", model.config, {"features": 8})
    assert again.load(path) == {"features": 8}
    with torch.no_grad():
        assert torch.equal(model(tokens, attention), model(tokens, again))
    other = random_model(dim=32, hidden=48, layers=3, heads=4, kv_heads=2, seq_len=48)
    with pytest.raises(ValueError, match="for a model of shape"):
        attention_layers.ModelAttention("hedgehog", other.config, {"features": 8}).load(path)


def run(script, *args):
    return subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def files(tmp_path):
    checkpoint = tmp_path / "tiny.bin"
    llama2c.write_checkpoint(small_model(), checkpoint)
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(np.random.default_rng(1).integers(32, 127, size=3000, dtype=np.uint8)))
    return checkpoint, text


def losses_of(stdout, when):
    line = next(line for line in stdout.splitlines() if line.startswith("transfer") and when in line)
    return [float(x) for x in line.split(":")[-1].split()]


def test_conversion_lowers_the_transfer_loss_and_model_eval_reads_it(tmp_path, files):
    checkpoint, text = files
    out = tmp_path / "converted.bin"
    r = run("convert_model.py", checkpoint, "--method", "hedgehog", "--option", "features=8", "--data", text,
            "--steps", 30, "--lr", 0.05, "--finetune-steps", 2, "--lora-rank", 2, "--seq-len", 32, "--out", out)
    assert r.returncode == 0, r.stderr
    before, after = losses_of(r.stdout, "before"), losses_of(r.stdout, "after")
    assert len(before) == len(after) == 2 and sum(after) < sum(before), r.stdout
    maps = attention_layers.feature_map_path(out)
    assert out.exists() and maps.exists()

    # The converted model does not see the future: logits at i < 20 do not change when later tokens do.
    model = llama2c.read_checkpoint(out)
    attention = attention_layers.ModelAttention("hedgehog", model.config, {"features": 8})
    attention.load(maps)
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(6))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 7) % 256
    with torch.no_grad():
        assert torch.equal(model(tokens, attention)[:, :20], model(changed, attention)[:, :20])

    r = run("model_eval.py", out, text, "--seqs", 2, "--len", 32, "--feature-maps", maps, "--reference", checkpoint,
            "--method", "hedgehog", "--method", "exact")
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| ")}
    kl = float(rows["hedgehog"].split("|")[2])
    assert np.isfinite(kl) and kl >= 0
    assert float(rows["exact"].split("|")[2]) > 0  # the fine-tuned weights differ from the reference's


def test_training_script_writes_checkpoint_and_feature_maps(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(2)
    for name in ("a.py", "b.py", "held.py"):
        (corpus / name).write_bytes(bytes(rng.integers(32, 127, size=2000, dtype=np.uint8)))
    out = tmp_path / "m.bin"
    args = ["--corpus", corpus, "--holdout", "held.py", "--dim", 16, "--hidden", 32, "--layers", 1, "--heads", 2,
            "--seq-len", 32, "--steps", 3, "--threads", 1, "--attention", "hedgehog", "--option", "features=4",
            "--out", out]
    r = run("train_tiny_lm.py", *args)
    assert r.returncode == 0, r.stderr
    assert "valid step 3" in r.stdout
    assert out.exists() and attention_layers.feature_map_path(out).exists()
    r = run("train_tiny_lm.py", *args)  # an existing --out is kept unless --force
    assert r.returncode != 0 and "exists" in r.stderr and "Traceback" not in r.stderr


def test_train_step_bench_times_every_method_and_the_rest():
    bench = EXAMPLES.parents[1] / "bench" / "train_step_bench.py"
    args = ["--context", 16, "--rounds", 1, "--threads", 1, "--dim", 16, "--hidden", 32, "--layers", 1]
    r = subprocess.run([sys.executable, str(bench), *map(str, args), "--attention", "exact", "--attention",
                        "hedgehog", "--option", "features=4"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split()[0] for line in r.stdout.splitlines()[2:]]
    assert rows == ["exact", "hedgehog", "(no"]
    r = subprocess.run([sys.executable, str(bench), *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--attention" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("case, message", [
    ("truncated", "float32 after the header"),
    ("short", "shorter than one training window"),
    ("ids", "outside the model's vocabulary"),
])
def test_convert_refuses_bad_input(tmp_path, files, case, message):
    checkpoint, text = files
    data = text
    if case == "truncated":
        bad = tmp_path / "bad.bin"
        bad.write_bytes(checkpoint.read_bytes()[:-4])
        checkpoint = bad
    elif case == "short":
        data = tmp_path / "short.txt"
        data.write_bytes(b"x" * 20)
    else:
        data = tmp_path / "ids.npy"
        np.save(data, np.full((2, 40), 300, dtype=np.int64))
    out = tmp_path / "out.bin"
    r = run("convert_model.py", checkpoint, "--method", "hedgehog", "--data", data, "--steps", 1, "--seq-len", 32,
            "--out", out)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and not attention_layers.feature_map_path(out).exists()


def test_model_eval_refuses_feature_maps_of_another_model(tmp_path, files):
    checkpoint, text = files
    other = random_model(dim=32, hidden=48, layers=1, heads=4, kv_heads=2, seq_len=48)
    attention = attention_layers.ModelAttention("hedgehog", other.config, {"features": 8})
    maps = tmp_path / "other.feature_maps.npz"
    attention.save(maps)
    r = run("model_eval.py", checkpoint, text, "--seqs", 1, "--len", 16, "--feature-maps", maps,
            "--method", "hedgehog")
    assert r.returncode != 0 and "for a model of shape" in r.stderr and "Traceback" not in r.stderr


def naive_merge(ids, a, b, new):
    """The pair (a, b) replaced by new, scanning from the left (the definition _merge vectorises)."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == (a, b):
            out.append(new)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def test_bpe_merge_is_the_left_to_right_scan():
    rng = np.random.default_rng(0)
    for _ in range(500):  # runs of equal ids (a == b) are the delicate case: small alphabets make many
        ids = rng.integers(0, 3, size=rng.integers(0, 16)).astype(np.int32)
        a, b = (int(x) for x in rng.integers(0, 3, size=2))
        assert list(bpe._merge(ids, a, b, 7)) == naive_merge(list(ids), a, b, 7), (ids, a, b)


def test_bpe_round_trips_and_compresses(tmp_path):
    text = b"def f(self, x):\n    return self.x + x\n" * 40 + bytes(range(256))
    tokenizer = bpe.Tokenizer.train(text, 270)
    assert tokenizer.vocab_size == 270
    # Training stops when no pair repeats: the merges would only memorise the text.
    assert bpe.Tokenizer.train(b"abcdef", 300).vocab_size == 256
    assert bpe.Tokenizer.train(text, 1000).vocab_size < 1000
    ids = tokenizer.encode(text)
    # Every merge replaced at least one pair when training chose it.
    assert tokenizer.decode(ids) == text and len(ids) <= len(text) - len(tokenizer.merges)
    # Encoding reproduces training's segmentation: the merges applied in order, each a pair of
    # earlier tokens whose bytes concatenate.
    for r, (a, b) in enumerate(tokenizer.merges):
        assert a < 256 + r and b < 256 + r
        assert tokenizer.pieces[256 + r] == tokenizer.pieces[a] + tokenizer.pieces[b]
    path = tmp_path / "t.json"
    tokenizer.save(path)
    again = bpe.Tokenizer.load(path)
    assert again.merges == tokenizer.merges and np.array_equal(again.encode(text), ids)
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode([270])
    path.write_text('{"format": "randattn-bpe", "version": 1, "vocab_size": 258, "merges": [[0, 1], [256, 999]]}')
    with pytest.raises(ValueError, match="not defined before"):
        bpe.Tokenizer.load(path)
    path.write_text("[1, 2")
    with pytest.raises(ValueError, match="not a randattn-bpe tokenizer"):
        bpe.Tokenizer.load(path)


def test_bpe_model_trains_and_the_scripts_read_its_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = [b"self", b"return", b"import", b"def", b"None", b" ", b"\n", b"(", b")", b":", b"x", b"=", b"."]
    rng = np.random.default_rng(3)
    for name in ("a.py", "b.py", "held.py"):
        (corpus / name).write_bytes(b"".join(words[i] for i in rng.integers(0, len(words), size=1500)))
    out = tmp_path / "m.bin"
    r = run("train_tiny_lm.py", "--corpus", corpus, "--holdout", "held.py", "--vocab", "bpe:300", "--dim", 16,
            "--hidden", 32, "--layers", 1, "--heads", 4, "--kv-heads", 2, "--seq-len", 32, "--steps", 2,
            "--threads", 1, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "nats/token" in r.stdout and bpe.tokenizer_path(out).exists()
    assert llama2c.read_checkpoint(out).config.vocab_size == 300
    held = corpus / "held.py"
    tokenizer = ["--tokenizer", bpe.tokenizer_path(out)]
    r = run("model_eval.py", out, held, "--seqs", 2, "--len", 16, *tokenizer, "--method", "exact")
    assert r.returncode == 0, r.stderr
    assert "| exact | " in r.stdout
    r = run("generate.py", out, held, "--prompt-len", 12, "--steps", 4, *tokenizer, "--mode", "exact")
    assert r.returncode == 0, r.stderr
    # The continuation is printed as text, decoded by the tokenizer.
    assert "exact greedy continuation" in r.stdout
    r = run("convert_model.py", out, "--method", "hedgehog", "--option", "features=4", "--data", held, *tokenizer,
            "--steps", 1, "--seq-len", 16, "--threads", 1, "--out", tmp_path / "converted.bin")
    assert r.returncode == 0, r.stderr
    byte_model = tmp_path / "bytes.bin"
    llama2c.write_checkpoint(small_model(), byte_model)
    r = run("model_eval.py", byte_model, held, "--seqs", 1, "--len", 8, *tokenizer, "--method", "exact")
    assert r.returncode != 0 and "vocabulary of 300" in r.stderr and "Traceback" not in r.stderr
    r = run("train_tiny_lm.py", "--corpus", corpus, "--vocab", "bpe:12", "--out", tmp_path / "x.bin")
    assert r.returncode != 0 and "--vocab" in r.stderr and not (tmp_path / "x.bin").exists()
