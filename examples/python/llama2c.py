"""llama2.c-format checkpoints and a torch forward pass with pluggable attention.

The file format is the one karpathy/llama2.c's run.c reads: a header of 7 int32 (dim, hidden_dim,
n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the classifier is
not tied to the token embedding), then float32 arrays, row-major, each in torch's nn.Linear layout
(out_features, in_features):

    token embedding (vocab, dim)
    rms_att (layers, dim)
    wq (layers, n_heads·hs, dim)     wk, wv (layers, n_kv_heads·hs, dim)     wo (layers, dim, n_heads·hs)
    rms_ffn (layers, dim)
    w1 (layers, hidden, dim)   w2 (layers, dim, hidden)   w3 (layers, hidden, dim)
    rms_final (dim,)
    freq_cis_real, freq_cis_imag (seq_len, hs/2 each; unused by current readers, skipped here)
    wcls (vocab, dim), only when vocab_size < 0

with hs = dim / n_heads. The model: pre-norm RMSNorm (eps 1e-5), rotary positions on consecutive
pairs (2j, 2j+1) of each head with frequency 10000^(-2j/hs), grouped-query attention (query head h
reads key/value head h // (n_heads / n_kv_heads)), logit scale 1/sqrt(hs), SwiGLU feed-forward
w2(silu(w1 x) * w3 x), final RMSNorm and the classifier.

Attention is a callable ``attend(q, k, v)`` on (batch, n_heads, n, hs) queries and
(batch, n_kv_heads, n, hs) keys and values, causal; :func:`exact_attention` is the torch reference
and :class:`RandattnAttention` runs any ``randattn.attention`` method.
"""

import argparse
import struct
import time
from dataclasses import dataclass

import numpy as np
import torch

HEADER = struct.Struct("<7i")
RMS_EPS = 1e-5
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Config:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool = True

    def __post_init__(self):
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"llama2.c config: {name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"llama2.c config: dim {self.dim} must be n_heads ({self.n_heads}) times an even head size")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"llama2.c config: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def head_size(self):
        return self.dim // self.n_heads

    @property
    def kv_dim(self):
        return self.n_kv_heads * self.head_size


def _weight_shapes(c):
    """(name, shape) of every stored array in file order; None names the skipped RoPE tables."""
    L, hs = c.n_layers, c.head_size
    shapes = [("tok_embeddings", (c.vocab_size, c.dim)),
              ("attention_norm", (L, c.dim)),
              ("wq", (L, c.n_heads * hs, c.dim)),
              ("wk", (L, c.kv_dim, c.dim)),
              ("wv", (L, c.kv_dim, c.dim)),
              ("wo", (L, c.dim, c.n_heads * hs)),
              ("ffn_norm", (L, c.dim)),
              ("w1", (L, c.hidden_dim, c.dim)),
              ("w2", (L, c.dim, c.hidden_dim)),
              ("w3", (L, c.hidden_dim, c.dim)),
              ("norm", (c.dim,)),
              (None, (c.seq_len, hs // 2)),
              (None, (c.seq_len, hs // 2))]
    if not c.shared_classifier:
        shapes.append(("output", (c.vocab_size, c.dim)))
    return shapes


def rope_tables(positions, head_size, dtype=torch.float32):
    """cos and sin of position · 10000^(-2j/hs), (len(positions), hs/2), computed in float64."""
    freq = 1.0 / ROPE_BASE ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angle = torch.as_tensor(positions, dtype=torch.float64)[:, None] * freq[None, :]
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def rope_rotation(positions, head_size, dtype=torch.float32):
    """The rotations of the pairs of a head as complex cos + i·sin with parts of `dtype`,
    (len(positions), hs/2)."""
    return torch.complex(*rope_tables(positions, head_size, dtype))


def apply_rope(x, rotation):
    """Rotates consecutive pairs (2j, 2j+1) of the last axis of x (..., n, hs) by a rotation
    table of rope_rotation (or one that broadcasts against x's pairs, such as (n, 1, hs/2) for x of
    (..., n, heads, hs)). As a complex product it is one pass forward and one backward, and rounds
    exactly as x0·cos − x1·sin, x0·sin + x1·cos does."""
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2)


def rmsnorm(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS))


def repeat_kv(x, n_heads):
    """(batch, kv_heads, n, hs) -> (batch, n_heads, n, hs): each key/value head serves n_heads/kv_heads
    consecutive query heads."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def exact_attention(q, k, v):
    """Causal softmax attention in torch (the reference), grouped-query heads."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    n = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


class RandattnAttention:
    """Causal attention by ``randattn.attention(method=..., **options)`` over all heads at once,
    grouped-query heads as they are (query head h reads key/value head h // (n_heads / n_kv_heads),
    as randattn's grouped heads do). ``layer_options`` (one dict per layer, optional) adds options
    to the calls of each layer, the calls of a forward pass coming in layer order. Accumulates the
    seconds spent in randattn and the reports of every call."""

    def __init__(self, method, layer_options=None, **options):
        import randattn  # noqa: F401  (imported here: the reader and trainer do not need it)
        self.method = method
        self.options = options
        self.layer_options = layer_options
        self.calls = 0
        self.seconds = 0.0
        self.reports = []

    def __call__(self, q, k, v):
        import randattn
        q, k, v = (t.detach().contiguous() for t in (q, k, v))
        options = dict(self.options)
        if self.layer_options:
            options.update(self.layer_options[self.calls % len(self.layer_options)])
        self.calls += 1
        start = time.perf_counter()
        out, report = randattn.attention(q, k, v, method=self.method, causal=True, report=True, **options)
        self.seconds += time.perf_counter() - start
        self.reports.append(report)
        return out


class Transformer(torch.nn.Module):
    """The llama2.c architecture; parameters named as the file's arrays (see the module docstring)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        for name, shape in _weight_shapes(config):
            if name is not None:
                setattr(self, name, torch.nn.Parameter(torch.zeros(shape)))

    def classifier(self):
        return self.tok_embeddings if self.config.shared_classifier else self.output

    # The pieces shared by the full-sequence forward and token-by-token decoding.
    def layer_weights(self):
        """One dict of weights per layer (the layer's rows of the stored arrays). Taken once per
        forward pass: each layer indexing the stacked arrays would add a full-size gradient per
        layer in the backward pass."""
        names = ("attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3")
        return [dict(zip(names, rows)) for rows in zip(*(getattr(self, name).unbind(0) for name in names))]

    def qkv(self, w, x, rotation):
        """Rotated queries (batch, n_heads, n, hs), keys and values (batch, n_kv_heads, n, hs) of the
        layer of weights `w` (one entry of layer_weights()) for the residual stream x (batch, n, dim)
        at the positions of `rotation` (rope_rotation)."""
        c = self.config
        h = rmsnorm(x, w["attention_norm"])
        # One product for the three projections, and the rotation of queries and keys in one pass
        # while each token's heads are contiguous: in a model this small, the products and the
        # elementwise passes around attention take as long as attention itself.
        qk, v = (h @ torch.cat((w["wq"], w["wk"], w["wv"])).T).split((c.dim + c.kv_dim, c.kv_dim), dim=-1)
        qk = apply_rope(qk.unflatten(-1, (-1, c.head_size)), rotation[:, None])
        q, k = qk.split((c.n_heads, c.n_kv_heads), dim=-2)
        return q.transpose(1, 2), k.transpose(1, 2), v.unflatten(-1, (c.n_kv_heads, c.head_size)).transpose(1, 2)

    def finish_layer(self, w, x, attended):
        """The residual stream after the layer of weights `w`, given its attention output (batch,
        n_heads, n, hs)."""
        x = x + attended.transpose(1, 2).flatten(-2) @ w["wo"].T
        h = rmsnorm(x, w["ffn_norm"])
        gate, up = (h @ torch.cat((w["w1"], w["w3"])).T).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ w["w2"].T

    def logits(self, x):
        return rmsnorm(x, self.norm) @ self.classifier().T

    def forward(self, tokens, attention=exact_attention):
        """Logits (batch, n, vocab) of tokens (batch, n) at positions 0..n-1; `attention(q, k, v)` is
        called once per layer, in layer order, or `attention[layer](q, k, v)` when it is a sequence
        of one callable per layer."""
        c = self.config
        if tokens.shape[1] > c.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds the model's seq_len {c.seq_len}")
        x = self.tok_embeddings[tokens]
        rotation = rope_rotation(torch.arange(tokens.shape[1]), c.head_size, x.dtype)
        for layer, w in enumerate(self.layer_weights()):
            q, k, v = self.qkv(w, x, rotation)
            attend = attention[layer] if isinstance(attention, (list, tuple, torch.nn.ModuleList)) else attention
            x = self.finish_layer(w, x, attend(q, k, v))
        return self.logits(x)


def read_checkpoint(path):
    """Transformer (float32, eval mode) from a llama2.c-format file; ValueError on a malformed file."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
        if len(head) != HEADER.size:
            raise ValueError(f"{path}: too short for a llama2.c header ({len(head)} bytes)")
        dim, hidden, layers, heads, kv_heads, vocab, seq_len = HEADER.unpack(head)
        config = Config(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len, shared_classifier=vocab > 0)
        data = np.fromfile(f, dtype="<f4")
    shapes = _weight_shapes(config)
    expected = sum(int(np.prod(s)) for _, s in shapes)
    if data.size != expected:
        raise ValueError(f"{path}: {data.size} float32 after the header, the config {config} needs {expected}")
    model = Transformer(config)
    offset = 0
    with torch.no_grad():
        for name, shape in shapes:
            size = int(np.prod(shape))
            if name is not None:
                getattr(model, name).copy_(torch.from_numpy(data[offset:offset + size].reshape(shape)))
            offset += size
    return model.eval()


def write_checkpoint(model, path):
    """Writes a Transformer in llama2.c format (the RoPE tables filled as older readers expect)."""
    c = model.config
    cos, sin = rope_tables(torch.arange(c.seq_len), c.head_size)
    rope = iter((cos, sin))
    with open(path, "wb") as f:
        f.write(HEADER.pack(c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                            c.vocab_size if c.shared_classifier else -c.vocab_size, c.seq_len))
        for name, shape in _weight_shapes(c):
            t = next(rope) if name is None else getattr(model, name)
            f.write(t.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())


def byte_tokens(text_bytes, offset=0):
    """Token ids of raw bytes: byte b -> b + offset (offset 0 for a byte-level vocabulary of 256,
    3 for llama2.c's sentencepiece vocabularies, whose byte-fallback tokens <0x00>..<0xFF> are 3..258)."""
    return torch.from_numpy(np.frombuffer(text_bytes, dtype=np.uint8).astype(np.int64) + offset)


def text_codec(vocab_size, token_offset=0, tokenizer=None):
    """(encode, decode) of a model's text: bytes -> int64 token tensor and token ids -> bytes. With a
    tokenizer (a bpe.Tokenizer or its file, e.g. train_tiny_lm.py --vocab bpe:N's), its BPE, which
    must have the model's vocabulary; else byte b is token b + token_offset. ValueError when they
    do not fit."""
    if tokenizer is not None:
        import bpe
        if token_offset:
            raise ValueError("a token offset applies to bytes as tokens, not with a tokenizer")
        bpe_tokens = tokenizer if isinstance(tokenizer, bpe.Tokenizer) else bpe.Tokenizer.load(tokenizer)
        if bpe_tokens.vocab_size != vocab_size:
            raise ValueError(f"{tokenizer}: a vocabulary of {bpe_tokens.vocab_size} tokens, the model's has {vocab_size}")
        return (lambda data: torch.from_numpy(bpe_tokens.encode(data))), bpe_tokens.decode
    if token_offset < 0 or token_offset + 256 > vocab_size:
        raise ValueError(f"bytes with token offset {token_offset} do not fit the model's vocabulary of {vocab_size}")
    return (lambda data: byte_tokens(data, token_offset)), (lambda ids: bytes((int(t) - token_offset) % 256 for t in ids))


def read_tokens(path, vocab_size, token_offset=0, tokenizer=None):
    """Training or conversion data: a text file encoded as text_codec encodes it (bytes + token_offset,
    or the BPE of a tokenizer file), a 1-D token stream; or a .npy of token ids of shape (sequences,
    length), e.g. made with a model's own tokenizer. ValueError on ids outside the vocabulary."""
    path = str(path)
    if path.endswith(".npy"):
        ids = np.load(path, allow_pickle=False)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected integer token ids of shape (sequences, length), got "
                             f"{ids.dtype} of shape {ids.shape}")
        tokens = torch.from_numpy(ids.astype(np.int64))
    else:
        encode, _ = text_codec(vocab_size, token_offset, tokenizer)
        with open(path, "rb") as f:
            tokens = encode(f.read())
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"{path}: token ids {int(tokens.min())}..{int(tokens.max())} outside the model's "
                         f"vocabulary 0..{vocab_size - 1}")
    return tokens


def check_windows(tokens, length, path):
    """ValueError unless the data holds at least one window of `length` + 1 tokens."""
    have = tokens.shape[-1]
    if have < length + 1:
        raise ValueError(f"{path}: {'sequences of ' if tokens.dim() == 2 else ''}{have} tokens, shorter than one "
                         f"training window of {length} + 1")


def sample_windows(tokens, length, batch, rng):
    """(batch, length + 1) windows at random places of a token stream or of random rows of
    (sequences, n) token ids."""
    starts = rng.integers(0, tokens.shape[-1] - length, size=batch)
    if tokens.dim() == 1:
        return torch.stack([tokens[s:s + length + 1] for s in starts])
    rows = rng.integers(0, tokens.shape[0], size=batch)
    return torch.stack([tokens[r, s:s + length + 1] for r, s in zip(rows, starts)])


# Command-line spelling shared by the scripts: "--method NAME [--option KEY=VALUE ...] ...".
def parse_value(text):
    """An option value: int, float, true/false, else the text itself (so "none" stays text: it is a
    value of some options; leave an option out for its default)."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_option(text, error):
    """(key, value) of a "key=value" command-line option (dashes in the key become underscores);
    error(message) on anything else."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        error(f"--option {text}: expected key=value")
    return key.replace("-", "_"), parse_value(value)


def method_label(name, options):
    """"name key=value ..." as a table row's label."""
    return name + "".join(f" {k}={v}" for k, v in options.items())


def add_method_arguments(parser, flag):
    """Adds the repeatable `flag NAME` and `--option KEY=VALUE` (applying to the latest `flag`) to an
    argparse parser; the result is `namespace.methods`, a list of (name, {option: value}), or None."""

    class Method(argparse.Action):
        def __call__(self, parser, namespace, value, option_string=None):
            namespace.methods = (namespace.methods or []) + [(value, {})]

    class Option(argparse.Action):
        def __call__(self, parser, namespace, value, option_string=None):
            if not namespace.methods:
                parser.error(f"--option {value}: no {flag} before it")
            key, parsed = parse_option(value, parser.error)
            namespace.methods[-1][1][key] = parsed

    parser.add_argument(flag, action=Method, dest="methods", default=None, metavar="NAME")
    parser.add_argument("--option", action=Option, metavar="KEY=VALUE", help=f"an option of the last {flag}")
