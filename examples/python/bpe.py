"""A byte-level BPE tokenizer (Sennrich et al. 2016, on bytes as GPT-2 does): token ids 0..255 are
the bytes, and id 256 + r is the r-th learned merge of two earlier tokens. Encoding applies the merges
in the order they were learned, each to every non-overlapping occurrence from left to right, so it
reproduces the segmentation that training produced; decoding concatenates the tokens' bytes.

Training counts the adjacent pairs of the corpus and merges the most frequent one (the smaller pair
of ids on ties), vocab_size - 256 times. Both run on NumPy arrays, one vectorised pass per merge.

File format (JSON): {"format": "randattn-bpe", "version": 1, "vocab_size": N, "merges": [[a, b], ...]}
with N = 256 + the number of merges. train_tiny_lm.py --vocab bpe:N writes it beside the checkpoint
(the --out path with ".tokenizer.json" appended); model_eval.py and generate.py read it with
--tokenizer FILE.
"""

import json
import pathlib

import numpy as np

FORMAT = "randattn-bpe"
VERSION = 1


def tokenizer_path(checkpoint):
    """Where a checkpoint's tokenizer is kept: the checkpoint's path with ".tokenizer.json" appended."""
    checkpoint = pathlib.Path(checkpoint)
    return checkpoint.with_name(checkpoint.name + ".tokenizer.json")


def _merge(ids, a, b, new):
    """ids with every non-overlapping occurrence of the pair (a, b), from the left, replaced by new."""
    at = np.flatnonzero((ids[:-1] == a) & (ids[1:] == b))
    if at.size == 0:
        return ids
    if a == b and at.size > 1:
        # In a run of a's, pairs start at consecutive positions; keep every other one from the
        # run's start (position parity within the run), as a left-to-right scan would.
        run_start = np.ones(at.size, dtype=bool)
        run_start[1:] = at[1:] != at[:-1] + 1
        start_of = np.maximum.accumulate(np.where(run_start, np.arange(at.size), 0))
        at = at[(np.arange(at.size) - start_of) % 2 == 0]
    out = ids.copy()
    out[at] = new
    keep = np.ones(ids.size, dtype=bool)
    keep[at + 1] = False
    return out[keep]


class Tokenizer:
    """A trained byte-level BPE (see the module docstring)."""

    def __init__(self, merges):
        merges = [(int(a), int(b)) for a, b in merges]
        for r, (a, b) in enumerate(merges):
            if not (0 <= a < 256 + r and 0 <= b < 256 + r):
                raise ValueError(f"BPE merge {r} ({a}, {b}) refers to a token not defined before it")
        self.merges = merges
        self.pieces = [bytes([i]) for i in range(256)]
        for a, b in merges:
            self.pieces.append(self.pieces[a] + self.pieces[b])

    @property
    def vocab_size(self):
        return 256 + len(self.merges)

    @classmethod
    def train(cls, data, vocab_size):
        """Learns vocab_size - 256 merges from the bytes `data`."""
        if vocab_size < 256:
            raise ValueError(f"a BPE vocabulary holds the 256 bytes, got vocab_size {vocab_size}")
        ids = np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int32)
        merges = []
        for r in range(vocab_size - 256):
            if ids.size < 2:
                break
            width = 256 + r
            counts = np.bincount(ids[:-1].astype(np.int64) * width + ids[1:], minlength=width * width)
            best = int(np.argmax(counts))  # the first maximum: the smallest (a, b) on ties
            if counts[best] < 2:
                break  # nothing repeats: further merges would only memorise the corpus
            a, b = divmod(best, width)
            merges.append((a, b))
            ids = _merge(ids, a, b, width)
        return cls(merges)

    def encode(self, data):
        """Token ids (int64 NumPy array) of the bytes `data`."""
        ids = np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int32)
        for r, (a, b) in enumerate(self.merges):
            ids = _merge(ids, a, b, 256 + r)
        return ids.astype(np.int64)

    def decode(self, ids):
        """The bytes of token ids; ValueError on an id outside the vocabulary."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the tokenizer's vocabulary of {self.vocab_size}")
        return b"".join(self.pieces[i] for i in ids)

    def save(self, path):
        pathlib.Path(path).write_text(json.dumps({"format": FORMAT, "version": VERSION, "vocab_size": self.vocab_size,
                                                  "merges": self.merges}))

    @classmethod
    def load(cls, path):
        """The tokenizer of a file written by save(); ValueError (naming the file) on anything else."""
        try:
            spec = json.loads(pathlib.Path(path).read_text())
            if not isinstance(spec, dict) or spec.get("format") != FORMAT or spec.get("version") != VERSION:
                raise ValueError(f"not a {FORMAT} version {VERSION} tokenizer")
            tokenizer = cls(spec["merges"])
            if spec["vocab_size"] != tokenizer.vocab_size:
                raise ValueError(f"vocab_size {spec['vocab_size']} but {len(spec['merges'])} merges")
            return tokenizer
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a {FORMAT} tokenizer file ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
