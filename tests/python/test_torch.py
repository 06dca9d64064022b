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


def test_a_result_is_attached_to_the_graph():
    q = torch.randn(1, 1, 4, 2, requires_grad=True)
    out = randattn.torch.Attention()(q, q, q)
    assert out.requires_grad
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.isfinite(q.grad).all()


def test_unsupported_arguments():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="4-D|batch, heads"):
        randattn.torch.Attention()(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="attn_mask of dtype torch.float32 is not supported.*boolean masks"):
        randattn.torch.Attention()(q, q, q, attn_mask=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="neither a key padding mask nor a causal mask"):
        randattn.torch.Attention()(q, q, q, attn_mask=torch.eye(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        randattn.torch.Attention()(q, q, q, attn_mask=torch.ones(5, dtype=torch.bool))
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


def masked_reference(q, k, v, allowed):
    logits = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("method,options", [("exact", {}), ("favor", {"features": 16, "seed": 4}),
                                            ("lsh", {"chunk": 4, "seed": 4})])
def test_boolean_attn_masks_are_key_padding_and_causal_layouts(method, options):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, 6:] = False
    valid[1, [0, 3]] = False
    module = randattn.torch.Attention(method, **options)
    tril = torch.ones(10, 10, dtype=torch.bool).tril()
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    for mask, causal in ((valid[:, None, None, :], False),            # (batch, 1, 1, n_k)
                         (valid[:, None, None, :].expand(2, 1, 10, 10), False),  # equal rows
                         (tril, True),                                  # causal
                         (tril[None, None] & valid[:, None, None, :], True)):   # causal with padding
        out = module(q, k, v, attn_mask=mask)
        padding = None if mask is tril else (~valid).numpy()
        expected = randattn.attention(qn, kn, vn, method=method, causal=causal, key_padding_mask=padding, **options)
        assert torch.equal(out, torch.from_numpy(expected))
        if method == "exact":
            ref = masked_reference(q, k, v, mask.expand(2, 2, 10, 10))
            finite = torch.isfinite(ref).all(-1)  # SDPA gives NaN where no key is allowed, randattn zeros
            torch.testing.assert_close(out[finite], ref[finite])
            assert (out[~finite] == 0).all()
    # Equal to is_causal=True when the mask is the causal one.
    assert torch.equal(module(q, k, v, attn_mask=tril), module(q, k, v, is_causal=True))


def test_grouped_query_heads_in_the_module():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, 4, generator=g)
    k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(2))
    module = randattn.torch.Attention()
    expected = reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(module(q, k, v, enable_gqa=True), expected)


def test_attention_writes_into_a_tensor_out():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 24, 8, generator=g) for _ in range(3))
    expected = randattn.attention(q, k, v, method="favor", features=16, seed=2)
    out = torch.full((2, 3, 24, 8), -3.0)
    assert randattn.attention(q, k, v, method="favor", features=16, seed=2, out=out) is out
    assert torch.equal(out, expected)
    wrong = torch.full((2, 3, 24, 8), -3.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        randattn.attention(q, k, v, out=wrong)
    assert bool((wrong == -3.0).all())
    with pytest.raises(ValueError, match="shares memory with v"):
        randattn.attention(q, k, v, out=v)


def test_module_reuses_its_output_when_no_gradient_is_needed():
    g = torch.Generator().manual_seed(6)
    q, q2, k, v = (torch.randn(1, 2, 16, 4, generator=g) for _ in range(4))
    module = randattn.torch.Attention(method="favor", features=16, seed=1, reuse_output=True)
    assert "reuse_output=True" in repr(module)
    first = module(q, k, v)  # grad enabled, but no input requires grad: reuse allowed
    first_ptr = first.data_ptr()
    second = module(q2, k, v)  # `first` is still held: the other buffer
    assert second.data_ptr() != first_ptr
    assert torch.equal(first, randattn.attention(q, k, v, method="favor", features=16, seed=1))
    del first
    with torch.no_grad():
        third = module(q, k, v)  # `first`'s buffer is free again
    assert third.data_ptr() == first_ptr
    assert torch.equal(third, randattn.attention(q, k, v, method="favor", features=16, seed=1))
    assert torch.equal(second, randattn.attention(q2, k, v, method="favor", features=16, seed=1))
    # A loop rebinding one name alternates between the two buffers.
    buffers = {t.data_ptr() for t in module._outputs}
    del second, third
    ptrs = set()
    out = None
    for _ in range(4):
        out = module(q, k, v)
        ptrs.add(out.data_ptr())
    assert ptrs == buffers and len(ptrs) == 2
    # A new shape or dtype gets new buffers; by default (reuse_output=False) every call allocates.
    wider = module(q, k, torch.randn(1, 2, 16, 6, generator=g))
    assert wider.shape == (1, 2, 16, 6) and wider.data_ptr() not in ptrs
    fresh = randattn.torch.Attention(method="favor", features=16, seed=1)
    assert torch.equal(fresh(q, k, v), randattn.attention(q, k, v, method="favor", features=16, seed=1))
    assert fresh._outputs == [] and "reuse_output" not in repr(fresh)


def test_module_allocates_when_a_gradient_may_be_needed():
    q = torch.randn(1, 1, 4, 2)
    module = randattn.torch.Attention(reuse_output=True)
    assert module._output(q, q, q) is not None
    needs_grad = q.clone().requires_grad_(True)
    assert module._output(needs_grad, q, q) is None
    with torch.no_grad():
        assert module._output(needs_grad, q, q) is not None
