"""randattn attention as a torch module on CPU tensors, for inference and training.

``Attention(method="favor", features=256)`` takes (batch, heads, n, d) query, key and value
tensors, like ``torch.nn.functional.scaled_dot_product_attention``, and returns
(batch, heads, n, dv). Keys and values may have fewer heads than the queries (grouped-query
attention; their heads must divide the query heads). float16 and bfloat16 tensors run in float32
and give float32's result (and gradients) rounded to their dtype. When an input requires grad (grad enabled),
the result is attached to the autograd graph: the backward is the method's own (see
docs/gradients.md), the gradient of the same seeded estimate. Double backward raises.

``learn_projection=True`` (favor, favor-hyp, trig, hybrid, hybrid-gaussian) holds the projection ω
as an ``nn.Parameter`` ``omega``, initialised from the seed's draw (``head_dim`` gives d), float32
until ``.double()`` or ``.to()``; its gradient is computed with the inputs'. Its shape is (m, d),
or for the hybrids (lambda_features + 2m, d): the weight estimator's projections, then each base's. ``redraw(seed)`` draws a new
ω between steps (for a learned ω, it overwrites the parameter's values in place).

``attn_mask`` takes boolean masks as ``scaled_dot_product_attention`` does (True = takes part),
in the shapes that function broadcasts to (batch, heads, n_q, n_k), when they are one of:
  - a key padding mask: the same for every query row, e.g. (n_k,), (batch, 1, 1, n_k) or
    (batch, 1, n_q, n_k) with equal rows;
  - a causal mask: lower triangular (query i, key j <= i), as ``is_causal=True``;
  - a causal mask with key padding: lower triangular and the same padding in every row.
Masks that differ between heads, other patterns and float (additive) masks raise ValueError.
A query row with no valid key gets zeros (``scaled_dot_product_attention`` gives NaN there).

Output reuse (``reuse_output=True``; off by default): when no gradient can be needed (grad
disabled, or no input requires grad), results are written into buffers the module keeps for the
last shape, dtype and inference mode, so a loop over calls does not allocate and first-touch a
new result each time. A buffer is reused only once no Python reference to it is left but the
module's (two buffers alternate, so ``out = attn(q, k, v)`` in a loop reuses them); a *view* of a
result (``out[0]``, ``out.transpose(1, 2)``, a ``reshape`` that does not copy) does not count as a
reference and would be overwritten by a later call. That is why reuse is opt-in: turn it on where
every result is consumed, or ``clone()``d, before the next call.
"""

import sys

import torch

import randattn

_ACCEPTED = ("boolean masks (True = takes part) that are a key padding mask (n_k,), (batch, 1, 1, n_k), "
             "a lower-triangular causal mask (n_q, n_k), or a causal mask with key padding, in shapes "
             "broadcasting to (batch, heads, n_q, n_k) with one head")


def _mask_layout(mask, batch, n_q, n_k):
    """(key_padding_mask (batch, n_k) with True = padding, or None; causal) of an SDPA boolean mask."""
    if mask.dtype != torch.bool:
        raise ValueError(f"attn_mask of dtype {mask.dtype} is not supported: randattn.torch.Attention accepts "
                         + _ACCEPTED)
    if mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dimensions, got shape {tuple(mask.shape)}")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).cpu()
    b, h, rows, cols = m.shape
    if cols != n_k or rows not in (1, n_q) or b not in (1, batch) or h != 1:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (batch, 1, n_q, n_k) = "
                         f"({batch}, 1, {n_q}, {n_k}); accepted: " + _ACCEPTED)
    m = m[:, 0].expand(batch, rows, n_k)
    valid = m[:, -1, :]  # under a causal mask, the last row holds the padding (n_q == n_k)
    if bool((m == valid[:, None, :]).all()):
        return (~valid).numpy().copy(), False
    if n_q == n_k:
        tril = torch.ones(n_q, n_k, dtype=torch.bool).tril()
        if bool((m == (tril[None] & valid[:, None, :])).all()):
            padding = ~valid
            return (padding.numpy().copy() if bool(padding.any()) else None), True
    raise ValueError("attn_mask is neither a key padding mask nor a causal mask (with or without key "
                     "padding); accepted: " + _ACCEPTED)


# The feature map kind of each method whose projection can be learned.
_PROJECTION_KINDS = {"favor": "positive", "favor-hyp": "hyperbolic", "trig": "trig", "hybrid": "hybrid",
                     "hybrid-gaussian": "hybrid-gaussian"}


class Attention(torch.nn.Module):
    """Attention by randattn's ``method`` with fixed options (see :func:`randattn.attention`)."""

    def __init__(self, method="exact", reuse_output=False, learn_projection=False, head_dim=None, **options):
        super().__init__()
        if method not in randattn.methods():
            raise ValueError(f"unknown method {method!r} (available: {', '.join(randattn.methods())})")
        self.method = method
        self.options = dict(options)
        self.reuse_output = bool(reuse_output)
        self._output_key = None
        self._outputs = []
        self.omega = None
        if learn_projection:
            if method not in _PROJECTION_KINDS:
                raise ValueError(f"learn_projection needs one of {', '.join(_PROJECTION_KINDS)}, got method {method!r}")
            if "omega" in self.options:
                raise ValueError("learn_projection draws omega from the seed: do not pass omega too")
            if head_dim is None or int(head_dim) < 1:
                raise ValueError(f"learn_projection needs head_dim (the d of omega, >= 1), got {head_dim!r}")
            self.head_dim = int(head_dim)
            self.omega = torch.nn.Parameter(self._draw(self.options.get("seed", 0)))

    def _draw(self, seed):
        """The projection the method draws from ``seed``, as a float32 tensor."""
        drawn = {k: v for k, v in self.options.items()
                 if k in ("features", "projection", "lambda_features", "bandwidth")}
        feature_map = randattn.FeatureMap(_PROJECTION_KINDS[self.method], self.head_dim, seed=seed, **drawn)
        return torch.from_numpy(feature_map.omega).to(torch.float32)

    def redraw(self, seed):
        """Draw a new projection from ``seed`` (between steps): a learned ω is re-initialised in
        place, keeping its dtype and its place in optimizers; otherwise the next calls use ``seed``."""
        self.options["seed"] = seed
        if self.omega is not None:
            with torch.no_grad():
                self.omega.copy_(self._draw(seed).to(self.omega.dtype))

    def _output(self, query, key, value):
        """A kept buffer for the result, or None (allocate): see the module docstring."""
        if not self.reuse_output:
            return None
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (query, key, value, self.omega)):
            return None
        shape = tuple(query.shape[:3]) + (value.shape[-1],)
        output_key = (shape, query.dtype, torch.is_inference_mode_enabled())
        if output_key != self._output_key:
            self._output_key, self._outputs = output_key, []
        for i in range(len(self._outputs)):
            if sys.getrefcount(self._outputs[i]) == 2:  # the list's reference and the argument's
                return self._outputs[i]
        if len(self._outputs) < 2:
            self._outputs.append(torch.empty(shape, dtype=query.dtype))
            return self._outputs[-1]
        return None

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        if dropout_p != 0.0:
            raise ValueError("randattn.torch.Attention has no attention dropout: dropout_p must be 0")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t is not None and t.dim() != 4:
                raise ValueError(f"{name}: expected a (batch, heads, n, d) tensor, got shape {tuple(t.shape)}")
        options = dict(self.options)
        causal = bool(is_causal) or options.get("causal", False)
        if attn_mask is not None:
            n_k = (key if key is not None else query).shape[2]
            padding, mask_causal = _mask_layout(attn_mask, query.shape[0], query.shape[2], n_k)
            causal = causal or mask_causal
            if padding is not None:
                options["key_padding_mask"] = padding
        options["causal"] = causal
        if scale is not None:
            options["scale"] = scale
        if self.omega is not None:
            options["omega"] = self.omega
        if query.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16) or \
                query.device.type != "cpu":
            out = None  # randattn.attention names what is wrong with the inputs
        else:
            out = self._output(query, key, value)
        return randattn.attention(query, key, value, method=self.method, out=out, **options)

    def extra_repr(self):
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        reuse = ", reuse_output=True" if self.reuse_output else ""
        learned = f", learn_projection=True, head_dim={self.head_dim}" if self.omega is not None else ""
        return f"method={self.method!r}{reuse}{learned}{opts}"
