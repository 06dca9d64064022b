"""randattn: randomized attention approximation and tensor sketching, from NumPy and PyTorch.

Attention of 2-D ``(n, d)`` or 4-D ``(batch, heads, n, d)`` float32/float64 arrays or CPU torch
tensors, or float16 and bfloat16 ones (computed in float32, rounded once), exact or approximated
(random features, hybrids, LSH)::

    out = randattn.attention(q, k, v, method="favor", features=256, seed=0)

One layer's key/value cache for decoding, exact or with sublinear retrieval::

    cache = randattn.KVCache(head_dim=128, value_dim=128, kv_heads=2, mode="lsh-sample", bits=12, tables=128)
    cache.append(k, v)      # (kv_heads, t, d), (kv_heads, t, dv)
    out = cache.attend(q)   # (q_heads, d) -> (q_heads, dv)

Results have the kind (NumPy or torch), dtype and layout of ``q``. C-contiguous inputs are read
in place; others are copied once. Computations release the GIL. Invalid arguments raise
ValueError (or TypeError for wrong types). See :func:`methods` for every method and its options.
"""

import numpy as np

from . import _core
from ._arrays import HALF_NAMES, as_numpy, dtype_name, half_name, is_tensor, like, rounded_like, widened
from ._autograd import attention_backward, attention_with_grad, needs_grad
from ._kv_cache import KVCache
from ._sketch import SparseSketch, hosvd, sparsify

__version__ = _core.__version__
__all__ = ["attention", "attention_backward", "methods", "FeatureMap", "Decoder", "KVCache", "sparsify", "hosvd", "SparseSketch"]


def methods():
    """{name: {"summary", "shared_qk", "options": {option: default}, "differentiable"}} for every
    method, from the library's method registry ("differentiable": it has a backward pass) (the command line's ``randattn-cli methods --json`` lists the same)."""
    return {name: {"summary": m["summary"], "shared_qk": m["shared_qk"], "options": dict(m["options"]),
                   "differentiable": m["differentiable"]}
            for name, m in _core.methods.items()}


def attention(q, k, v, *, method="exact", causal=False, scale=None, seed=0, check_finite=True, threads=None,
              shared_qk=False, report=False, out=None, **options):
    """softmax(scale · q kᵀ) v, exactly or estimated by ``method``.

    q: (n_q, d) or (batch, heads, n_q, d); k: (n_k, d) or (batch, heads, n_k, d), or None with
    shared_qk=True (methods that support it: lsh); v: (n_k, dv) or (batch, heads, n_k, dv).
    Returns (n_q, dv) or (batch, heads, n_q, dv), as a NumPy array or a torch tensor like q.
    q, k and v share one dtype (TypeError otherwise): float32 or float64, or float16 (NumPy or
    torch) and bfloat16 (torch), which run in float32 on the exactly widened inputs and give its
    result rounded to their dtype (ValueError for a float16 result beyond 65504); gradients too. On
    torch tensors that require grad (grad enabled), the result is attached to the autograd graph
    for the methods with a backward pass (see docs/gradients.md; ``out`` is then refused); with
    report=True, (out, report) where report is the command line's --report fields as a dict
    (method, scale, the method's effective parameters, feature_dim, pairs_scored,
    predicted_rel_mse where the method gives them, shared_qk, seconds).

    Options of every method (the command line's ``randattn-cli attention`` flags):
      causal        query i sees keys j <= i only (needs n_q == n_k)
      scale         logit scale (default 1/sqrt(d), for every method)
      seed          seed of the method's random draws (ignored by exact)
      check_finite  reject NaN and Inf inputs (ValueError naming the first one)
      threads       OpenMP threads for this call (default: the process setting)
      shared_qk     keys := the normalised queries, each query's own key excluded (k=None; lsh)
      report        also return the report dict
      out           write the result into this array (or CPU torch tensor) and return it: it must
                    be writeable, C-contiguous, of q's dtype and of the result's shape, and share
                    no memory with q, k or v (ValueError otherwise, out left untouched). A loop
                    that reuses out skips the allocation and first touch of fresh pages per call.

    Method-specific keyword options, with the command line's defaults:
      favor, favor-hyp, trig: features=256, projection="orthogonal" ("iid", "hadamard"),
                              omega=None (an (m, d) array of projections, used as given)
      oprf, sderf:            as favor, and fit="queries+keys" ("given"), rho=None,
                              calibration=None, calibration_q=None, calibration_k=None.
                              fit="queries+keys" fits each (batch, head) slice to its own
                              queries and keys; fit="given" takes exactly one of rho,
                              calibration (sample rows used as both queries and keys) or
                              calibration_q with calibration_k (sample queries and sample
                              keys). Calibration arrays are (r, d), one fit for every slice, or
                              (heads, r, d), head h's rows for every slice (b, h).
      hybrid:                 features=256, projection="orthogonal", lambda_features=16,
                              omega=None (a (lambda_features + 2m, d) array: the weight
                              estimator's projections, then each base's m, used as given)
      hybrid-gaussian:        as hybrid, and bandwidth=1.0
      hedgehog:               weight=None, bias=None (given together: (kv_heads, m, d) and
                              (kv_heads, m), the learned map [softmax(u); softmax(-u)],
                              u = W (c x) + b, of each key/value head; or (m, d) and (m,) for
                              every head), features=64 (m of the seeded map used without them).
                              As torch tensors that require grad (nn.Parameters), weight and bias
                              get their gradients from autograd.
      lsh:                    buckets=None (2*ceil(n/chunk)), chunk=64, rounds=4,
                              rotation="dense" ("hadamard"), rotations=None ((d, r, b/2) array),
                              dedupe=True, exact_buckets=False
      lsf:                    filters=256, tables=4, eta=None, alpha=None (exactly one of the
                              two), min_probes=1, rotation="dense" ("hadamard")
    ``methods()`` lists them all. An option of another method raises TypeError.

    Key layouts (every method; see docs/masks.md), keywords as declared in ``_core.layout_inputs``:
      key_lengths       ints (batch,): keys j >= key_lengths[b] of batch item b take no part
      key_padding_mask  bools (batch, n_k), True = padding (as torch.nn.MultiheadAttention);
                        exclusive with key_lengths. A query with no valid key gets zeros.
      cu_seqlens        ints (S + 1,): packed sequences [cu_seqlens[i], cu_seqlens[i+1]) along n
                        (0 first, n last, strictly increasing), each attending within itself
      exclude_self      queries and keys are the same positions (n_q == n_k): query i never
                        attends to key i unless it has no other valid key (every method but
                        sparse-lowrank)
      grouped-query heads: k and v with kv_heads heads dividing the heads of q (query head h
                        reads key head h // (heads // kv_heads)); nothing is copied
    """
    if needs_grad(q, k, v, *options.values()):
        if out is not None:
            raise ValueError("out cannot hold a result that needs a gradient (an input requires grad): "
                             "drop out=, or call under torch.no_grad()")
        return attention_with_grad(q, k, v, method=method, causal=causal, scale=scale, seed=seed,
                                   check_finite=check_finite, threads=threads, shared_qk=shared_qk, report=report,
                                   options=options)
    arrays = [as_numpy(q, "q"), None if k is None else as_numpy(k, "k"), as_numpy(v, "v")]
    for spec in _core.layout_inputs:  # arrays (or torch tensors) as NumPy; the library checks them
        name = spec["name"]
        if spec["type"] != "flag" and options.get(name) is not None:
            options[name] = as_numpy(options[name], name)
    for name, value in options.items():  # array options given as tensors (a module's ω)
        if is_tensor(value):
            options[name] = as_numpy(value, name)
    out_array = None
    if out is not None:
        if not (isinstance(out, np.ndarray) or is_tensor(out)):
            raise TypeError(f"out must be a NumPy array or a CPU torch tensor, got {type(out).__name__}")
        out_array = as_numpy(out, "out")
    result = _core.attention(*arrays, method, causal, scale, seed, check_finite, threads, shared_qk, report,
                             options, out_array)
    if out is not None:
        return (out, result[1]) if report else out
    if report:
        result, fields = result
        return like(result, q), fields
    return like(result, q)


class FeatureMap:
    """A random-feature map of the softmax kernel exp(xᵀy), as the random-feature methods use.

    kind: "positive" (FAVOR+, m features), "hyperbolic" (2m), "trig" (2m), "hybrid" (angular
    hybrid of hyperbolic and trig) or "hybrid-gaussian" (Gaussian hybrid of trig and positive);
    d: input dimension; options as for the matching attention method (features, projection,
    omega, lambda_features, bandwidth). Maps of the same kind, options and seed as a method's
    draw the same ω as that method.
    """

    def __init__(self, kind, d, *, seed=0, **options):
        self._map = _core.FeatureMap(kind, d, seed, options)

    def features(self, x, normaliser=1.0, side="query", check_finite=True):
        """(values (n, M), log_scale (n,)) for the rows of ``normaliser * x``: row i stands for
        exp(log_scale[i]) * values[i], and φ(x)ᵀ diag(signs) φ(y) estimates exp(xᵀy). For
        attention with scale s the normaliser is s ** 0.5. ``side`` ("query" or "key") matters
        only for maps that differ between the two. As for attention, ``check_finite`` refuses
        NaN or Inf in x and reports features that overflow (ValueError) instead of returning
        them; with ``check_finite=False`` NaN and Inf propagate.

        x of float16 or bfloat16 (NumPy float16, torch float16 or bfloat16) is mapped in float32
        on its exact values: ``values`` come back in x's dtype, rounded once, and ``log_scale`` in
        float32 (rounded to 8 bits it would scale a row by up to exp(|log_scale| · 2⁻⁸))."""
        values, log_scale = self._map.features(widened(x, "x"), normaliser, side, check_finite)
        values = rounded_like(values, x, "FeatureMap.features", "map float32 x")
        return values, like(log_scale, x)

    def redraw(self, seed):
        """Draw new projections of the same kind and shape from ``seed``."""
        self._map.redraw(seed)

    kind = property(lambda self: self._map.kind)
    input_dim = property(lambda self: self._map.input_dim)
    feature_dim = property(lambda self: self._map.feature_dim, doc="M, the length of a feature row")
    projections = property(lambda self: self._map.projections, doc="m, the number of projections")
    seed = property(lambda self: self._map.seed)
    signs = property(lambda self: self._map.signs, doc="±1 per feature (all +1 but for hybrids)")
    omega = property(lambda self: self._map.omega,
                     doc="the projections (float64): (m, d), or for hybrids (lambda_features + 2m, d), "
                         "the weight estimator's then each base's (the hybrid methods' omega)")

    def __repr__(self):
        return (f"FeatureMap({self.kind!r}, d={self.input_dim}, projections={self.projections}, "
                f"feature_dim={self.feature_dim}, seed={self.seed})")


class Decoder:
    """Causal random-feature attention one token at a time (decoding), over a FeatureMap:
    ``append(k, v)`` adds position t, then ``query(q)`` returns its output (value_dim,). Costs
    O(M · value_dim) per token; gives what ``attention(..., causal=True)`` gives with the same map.

    ``dtype`` (float32, float64, or the half types float16 and bfloat16, as names, NumPy or torch
    dtypes) is the dtype of every k, v and q (TypeError for another) and of the outputs. A
    half-precision decoder runs in float32 on the tokens' exact values and rounds each output
    once to its dtype (ValueError for a float16 output beyond ±65504).
    """

    def __init__(self, feature_map, value_dim, *, dtype="float64", scale=None, denominator_epsilon=None,
                 check_finite=True):
        if not isinstance(feature_map, FeatureMap):
            raise TypeError(f"feature_map must be a randattn.FeatureMap, got {type(feature_map).__name__}")
        self.feature_map = feature_map
        dtype = dtype_name(dtype)
        self._half = dtype if dtype in HALF_NAMES else None
        self._decoder = _core.Decoder(feature_map._map, value_dim, "float32" if self._half else dtype, scale,
                                      denominator_epsilon, check_finite)

    def _token(self, x, name):
        """A token as the core decoder takes it: half precision only in a half decoder, widened."""
        if half_name(x) != self._half:
            given = half_name(x) or as_numpy(x, name).dtype.name
            raise TypeError(f"{name} has dtype {given} but the decoder works in {self.dtype}")
        return widened(x, name)

    def append(self, k, v):
        self._decoder.append(self._token(k, "k"), self._token(v, "v"))

    def query(self, q):
        out = self._decoder.query(self._token(q, "q"))
        return rounded_like(out, q, "Decoder.query", "decode in float32")

    def reset(self):
        self._decoder.reset()

    def __len__(self):
        return self._decoder.length

    dtype = property(lambda self: self._half or self._decoder.dtype)
