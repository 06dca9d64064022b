"""randattn.KVCache: one layer's key/value cache for decoding (the library's KvCache)."""

import os

from . import _core
from ._arrays import HALF_NAMES, dtype_name, rounded_like, type_name, widened


class KVCache:
    """Softmax attention of a new token's query heads over a growing key/value cache, exact or
    with sublinear retrieval; one cache per layer.

    ``KVCache(head_dim=d, value_dim=dv, kv_heads=h, mode="exact", sinks=4, window=256,
    scale=None, dtype="float32", storage=None, check_finite=True, **mode_options)``

    mode and its options (defaults in parentheses; ``randattn.KVCache.modes()`` lists them):
      "exact"       every cached key (the reference)
      "blocks"      Quest page bounds: page_size (32) tokens per page, top_pages (64) attended,
                    axes (0): > 0 bounds the pages in the principal axes of the first `axes` keys
      "lsh-sample"  MagicPIG SimHash sampling with importance weights: bits (8) K per table,
                    tables (64) L, hash_block (64) keys hashed per block, seed (0)
      "lsf"         locality-sensitive filters: filters (256) per table, tables (4), eta (None:
                    from alpha), alpha (0.5), min_probes (1), seed (0)
      "clusters"    key clusters: clusters (64) per kv head, probe (8) clusters at least opened
                    per query head (probe == clusters is exact), margin (24 ln 2: further
                    clusters whose bound is within it of the best logit; -inf: the probe
                    clusters alone), samples (0) keys drawn from the closed clusters with
                    importance weights, seed (0) of the splits and draws
    Every retrieval mode also takes centre_tokens (0) or key_centre (None) for key centring, and
    attends exactly to the first ``sinks`` and last ``window`` tokens. An option of another mode
    raises ValueError naming it; an unknown keyword raises TypeError.

    Arrays are NumPy arrays or CPU torch tensors of float32 or float64. The cache's dtype is fixed
    at construction (``dtype``); inputs of the other dtype are converted to it (float64 → float32
    rounds to nearest), and results have the cache's dtype (a torch tensor when q is one).

    ``storage`` is how keys and values are held, independent of ``dtype`` (its default):
    "float32", "float64", "bfloat16", "float16" (rounded to nearest even; a finite entry beyond
    ±65504 raises ValueError) or "int8" (one scale per token and kv head: x ≈ s·round(x/s),
    s = max|x|/127; NaN/Inf raise ValueError even with check_finite=False). NumPy and torch
    dtypes name them too. Every mode reads the stored rows directly; ``memory_bytes`` is the
    whole cache's size and ``bytes_per_token`` one token's keys and values as stored.

    Half precision: ``dtype="bfloat16"`` or ``"float16"`` (or the torch/NumPy dtype) makes a
    float32 cache whose storage defaults to that type. Any cache takes NumPy float16 and torch
    float16/bfloat16 arrays (widened exactly); ``attend`` of a half-precision query returns its
    dtype, the float result rounded once to nearest (a float16 result beyond ±65504 raises
    ValueError).

    - ``append(k, v)``: k (kv_heads, t, head_dim), v (kv_heads, t, value_dim); t tokens, oldest
      first ((kv_heads, head_dim) and (kv_heads, value_dim) append one token).
    - ``attend(q)``: q (q_heads, head_dim), q_heads a multiple of kv_heads (query head i uses kv
      head i // (q_heads // kv_heads)) → (q_heads, value_dim); ``attend(q, report=True)`` →
      (out, report dict: keys_scored, exact_keys, retrieved_keys, pages_scored, pages_opened,
      tables_probed, bucket_entries, filters_opened, clusters_opened, empty_heads,
      bytes_per_token, mode, size).
    - ``save(path)``, ``KVCache.load(path)``: portable file (the storage type and the rows as
      stored); a loaded cache gives bit-identical results and keeps growing like the original.
    - ``len(cache)``: tokens cached.

    ``attend`` releases the GIL and runs concurrently with other attends on the same cache;
    ``append`` waits for running attends and blocks new ones while it runs. Bad input (shapes,
    non-finite values with check_finite, a corrupt or truncated file) raises ValueError and
    leaves the cache unchanged.
    """

    def __init__(self, head_dim, value_dim, kv_heads, mode="exact", sinks=4, window=256, scale=None, *,
                 dtype="float32", storage=None, check_finite=True, **mode_options):
        storage, dtype = type_name(storage, "storage"), dtype_name(dtype)
        if dtype in HALF_NAMES:
            dtype, storage = "float32", storage or dtype
        self._cache = _core.KVCache(head_dim, value_dim, kv_heads, mode, sinks, window, scale,
                                    dtype, storage, check_finite, mode_options)

    @classmethod
    def load(cls, path):
        """The cache saved at ``path`` (its dtype is the saved one)."""
        self = cls.__new__(cls)
        self._cache = _core.KVCache.load(os.fspath(path))
        return self

    @staticmethod
    def modes():
        """{mode: {option: default}} of every mode."""
        return {name: dict(options) for name, options in _core.kv_cache_modes.items()}

    def append(self, k, v):
        self._cache.append(widened(k, "k"), widened(v, "v"))

    def attend(self, q, report=False):
        if not isinstance(report, bool):
            raise TypeError(f"report must be True or False, got {type(report).__name__}")
        out, fields = self._cache.attend(widened(q, "q"), report)
        out = rounded_like(out, q, "KVCache.attend", "attend with a float32 query")
        return (out, fields) if report else out

    def save(self, path):
        self._cache.save(os.fspath(path))

    def __len__(self):
        return self._cache.size

    mode = property(lambda self: self._cache.mode)
    dtype = property(lambda self: self._cache.dtype)
    storage = property(lambda self: self._cache.storage, doc="how keys and values are stored")
    memory_bytes = property(lambda self: self._cache.memory_bytes,
                            doc="bytes of keys, values, scales and the retrieval index")
    bytes_per_token = property(lambda self: self._cache.bytes_per_token,
                               doc="bytes of one token's keys and values (all kv heads) as stored")
    head_dim = property(lambda self: self._cache.head_dim)
    value_dim = property(lambda self: self._cache.value_dim)
    kv_heads = property(lambda self: self._cache.kv_heads)
    scale = property(lambda self: self._cache.scale, doc="the logit scale in use")
    options = property(lambda self: self._cache.options,
                       doc="sinks, window, check_finite and the mode's options as in use")

    def __repr__(self):
        return (f"KVCache(head_dim={self.head_dim}, value_dim={self.value_dim}, kv_heads={self.kv_heads}, "
                f"mode={self.mode!r}, dtype={self.dtype!r}, storage={self.storage!r}, "
                f"size={len(self)})")
