"""randattn attention as a torch module, for inference on CPU tensors.

``Attention(method="favor", features=256)`` takes (batch, heads, n, d) query, key and value
tensors, like ``torch.nn.functional.scaled_dot_product_attention``, and returns
(batch, heads, n, dv). It computes no gradients: with grad enabled, an input that requires grad
raises RuntimeError (run the model under ``torch.no_grad()`` or ``torch.inference_mode()``).
"""

import torch

import randattn


class Attention(torch.nn.Module):
    """Attention by randattn's ``method`` with fixed options (see :func:`randattn.attention`)."""

    def __init__(self, method="exact", **options):
        super().__init__()
        if method not in randattn.methods():
            raise ValueError(f"unknown method {method!r} (available: {', '.join(randattn.methods())})")
        self.method = method
        self.options = dict(options)

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if attn_mask is not None:
            raise ValueError("randattn.torch.Attention takes no attn_mask; use is_causal=True for causal masking")
        if dropout_p != 0.0:
            raise ValueError("randattn.torch.Attention is for inference: dropout_p must be 0")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t is not None and t.dim() != 4:
                raise ValueError(f"{name}: expected a (batch, heads, n, d) tensor, got shape {tuple(t.shape)}")
        options = dict(self.options)
        options["causal"] = bool(is_causal) or options.get("causal", False)
        if scale is not None:
            options["scale"] = scale
        return randattn.attention(query, key, value, method=self.method, **options)

    def extra_repr(self):
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"method={self.method!r}{opts}"
