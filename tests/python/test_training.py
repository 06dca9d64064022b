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
