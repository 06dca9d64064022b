"""randattn.torch.Attention: a drop-in for scaled-dot-product attention at inference."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import randattn  # noqa: E402
import randattn.torch  # noqa: E402


def reference(q, k, v, causal=False):
    logits = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[-2]
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_exact_module_matches_softmax_attention(dtype, causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 32, 8, generator=g, dtype=dtype) for _ in range(3))
    module = randattn.torch.Attention()
    with torch.no_grad():
        out = module(q, k, v, is_causal=causal)
    assert out.dtype == dtype and out.shape == (2, 3, 32, 8)
    # Both are float computations of the same quantity: a few eps times the sum length.
    tol = 4 * (32 + 8) * torch.finfo(dtype).eps
    torch.testing.assert_close(out, reference(q, k, v, causal), rtol=0, atol=tol)


def test_favor_module_is_the_function():
    g = torch.Generator().manual_seed(1)
    q, k, v = (0.5 * torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    module = randattn.torch.Attention(method="favor", features=64, seed=3)
    with torch.inference_mode():
        out = module(q, k, v)
    expected = randattn.attention(q.numpy(), k.numpy(), v.numpy(), method="favor", features=64, seed=3)
    np.testing.assert_array_equal(out.numpy(), expected)
    assert "favor" in repr(module)


def test_gradients_are_refused_with_a_clear_message():
    q = torch.randn(1, 1, 4, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"torch.no_grad\(\) or torch.inference_mode\(\)"):
        randattn.torch.Attention()(q, q, q)


def test_unsupported_arguments():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="4-D|batch, heads"):
        randattn.torch.Attention()(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="attn_mask"):
        randattn.torch.Attention()(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout"):
        randattn.torch.Attention()(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="unknown method"):
        randattn.torch.Attention(method="nosuch")


def test_inside_a_model():
    layer = torch.nn.Linear(8, 24)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = layer
            self.attention = randattn.torch.Attention(method="favor-hyp", features=32)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
            return self.attention(q, k, v)

    with torch.no_grad():
        out = Block()(torch.randn(2, 10, 8))
    assert out.shape == (2, 2, 10, 4) and torch.isfinite(out).all()
