"""Gradients through torch autograd and randattn.attention_backward: torch.autograd.gradcheck
(central finite differences in float64, atol 1e-5, rtol 1e-3) for every method with a backward,
2-D and 4-D, causal and not, with grouped-query heads and key padding; the forward's bits with
grad enabled; learned projections; and the errors of bad gradients and misuse."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import randattn  # noqa: E402
import randattn.torch  # noqa: E402
from conftest import SMALL_OPTIONS, assert_close  # noqa: E402

OPTIONS = SMALL_OPTIONS
DIFFERENTIABLE = [name for name, m in randattn.methods().items() if m["differentiable"]]


def inputs(shape_q, shape_kv, dv, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = (0.5 * torch.randn(*shape_q, generator=g, dtype=dtype)).requires_grad_()
    k = (0.5 * torch.randn(*shape_kv, generator=g, dtype=dtype)).requires_grad_()
    v = torch.randn(*shape_kv[:-1], dv, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("method", DIFFERENTIABLE)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_2d(method, causal):
    q, k, v = inputs((37, 4), (37, 4), 3, seed=1)
    options = dict(OPTIONS[method])
    torch.autograd.gradcheck(
        lambda q, k, v: randattn.attention(q, k, v, method=method, causal=causal, seed=2, **options),
        (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("method", DIFFERENTIABLE)
def test_gradcheck_grouped_heads_and_key_padding(method):
    # 4 query heads over 2 key/value heads; batch item 1 has two padded keys in the middle.
    q, k, v = inputs((2, 4, 13, 3), (2, 2, 13, 3), 2, seed=3)
    mask = np.zeros((2, 13), dtype=bool)
    mask[1, 5:7] = True
    options = dict(OPTIONS[method])
    torch.autograd.gradcheck(
        lambda q, k, v: randattn.attention(q, k, v, method=method, causal=True, seed=4, key_padding_mask=mask,
                                           **options),
        (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("method", DIFFERENTIABLE)
def test_forward_bits_do_not_change_with_grad(method):
    q, k, v = inputs((1, 2, 37, 4), (1, 2, 37, 4), 3, seed=5, dtype=torch.float32)
    options = dict(OPTIONS[method])
    with_grad, report = randattn.attention(q, k, v, method=method, seed=6, report=True, **options)
    assert with_grad.requires_grad and with_grad.grad_fn is not None
    assert report["method"] in (method, "favor")
    plain = randattn.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), method=method, seed=6,
                               **options)
    np.testing.assert_array_equal(with_grad.detach().numpy(), plain)


@pytest.mark.parametrize("method", DIFFERENTIABLE)
def test_numpy_backward_is_the_autograd_backward(method):
    q, k, v = inputs((37, 4), (37, 4), 3, seed=7)
    g = torch.randn(37, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    options = dict(OPTIONS[method])
    out = randattn.attention(q, k, v, method=method, causal=True, seed=9, **options)
    out.backward(g)
    dq, dk, dv = randattn.attention_backward(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
                                             g.numpy(), method=method, causal=True, seed=9, **options)
    np.testing.assert_array_equal(dq, q.grad.numpy())
    np.testing.assert_array_equal(dk, k.grad.numpy())
    np.testing.assert_array_equal(dv, v.grad.numpy())


def test_float32_gradients_are_close_to_float64():
    # Exact attention at n = 300: every gradient is a sum over at most n terms of products of
    # O(1) factors and exponentials, so float32's relative error is at most ~n·eps32 ≈ 3.6e-5
    # per sum; 1e-3 of the gradient's norm leaves room for the three chained products.
    q, k, v = inputs((300, 8), (300, 8), 4, seed=10)
    g = torch.randn(300, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        args = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        randattn.attention(*args, method="exact", causal=True).backward(g.to(dtype))
        grads[dtype] = [a.grad.double() for a in args]
    for g32, g64 in zip(grads[torch.float32], grads[torch.float64]):
        assert float((g32 - g64).norm() / g64.norm()) < 300 * np.finfo(np.float32).eps * 4


def test_module_trains_and_learns_its_projection():
    torch.manual_seed(0)
    attn = randattn.torch.Attention("favor", features=16, learn_projection=True, head_dim=8, seed=1)
    assert isinstance(attn.omega, torch.nn.Parameter) and attn.omega.shape == (16, 8)
    assert attn.omega.dtype == torch.float32
    drawn = randattn.FeatureMap("positive", 8, seed=1, features=16).omega
    np.testing.assert_array_equal(attn.omega.detach().numpy(), drawn.astype(np.float32))
    attn.double()
    assert attn.omega.dtype == torch.float64
    q, k, v = inputs((1, 2, 21, 8), (1, 2, 21, 8), 4, seed=12)
    w = attn.omega.detach().clone().requires_grad_()
    torch.autograd.gradcheck(
        lambda q, k, v, w: randattn.attention(q, k, v, method="favor", causal=True, omega=w),
        (q, k, v, w), eps=1e-6, atol=1e-5, rtol=1e-3)
    out = attn(q, k, v, is_causal=True)
    out.square().sum().backward()
    assert attn.omega.grad is not None and torch.isfinite(attn.omega.grad).all()
    before = attn.omega.detach().clone()
    attn.redraw(5)
    assert not torch.equal(before, attn.omega.detach())
    redrawn = randattn.FeatureMap("positive", 8, seed=5, features=16).omega.astype(np.float32)
    np.testing.assert_array_equal(attn.omega.detach().numpy(), redrawn.astype(np.float64))


@pytest.mark.parametrize("method,kind", [("hybrid", "hybrid"), ("hybrid-gaussian", "hybrid-gaussian")])
def test_hybrid_learns_its_stacked_projections(method, kind):
    # Weight estimator (4 rows) then the two bases (6 rows each): one parameter of 16 rows.
    attn = randattn.torch.Attention(method, features=6, lambda_features=4, learn_projection=True,
                                    head_dim=5, seed=3)
    assert attn.omega.shape == (16, 5)
    drawn = randattn.FeatureMap(kind, 5, seed=3, features=6, lambda_features=4).omega
    np.testing.assert_array_equal(attn.omega.detach().numpy(), drawn.astype(np.float32))
    q, k, v = inputs((1, 2, 13, 5), (1, 2, 13, 5), 3, seed=14)
    w = torch.from_numpy(drawn).requires_grad_()
    # The angular weight estimator's sign features are piecewise constant, so its τ rows get a
    # zero gradient; finite differences agree away from sign changes (small eps).
    torch.autograd.gradcheck(
        lambda q, k, v, w: randattn.attention(q, k, v, method=method, causal=True, lambda_features=4,
                                              omega=w),
        (q, k, v, w), eps=1e-7, atol=1e-5, rtol=1e-3)
    attn.double()
    attn(q, k, v, is_causal=True).square().sum().backward()
    assert attn.omega.grad.shape == (16, 5) and torch.isfinite(attn.omega.grad).all()
    with pytest.raises(ValueError, match="lambda_features = 4 rows"):
        randattn.attention(q, k, v, method=method, lambda_features=4, omega=drawn[:15])


def test_errors():
    q, k, v = inputs((9, 4), (9, 4), 3, seed=13)
    with pytest.raises(ValueError, match="out cannot hold a result that needs a gradient"):
        randattn.attention(q, k, v, out=torch.empty(9, 3, dtype=torch.float64))
    # A backward after an input changed in place.
    base = q * 1
    out = randattn.attention(base, k, v)
    with torch.no_grad():
        base.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    # Double backward.
    out = randattn.attention(q, k, v)
    with pytest.raises(RuntimeError, match="cannot differentiate twice"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    # grad_out: wrong shape, dtype, non-finite.
    qn, kn, vn = (t.detach().numpy() for t in (q, k, v))
    with pytest.raises(ValueError, match="shape"):
        randattn.attention_backward(qn, kn, vn, np.ones((9, 4)))
    with pytest.raises(ValueError, match="dtype"):
        randattn.attention_backward(qn, kn, vn, np.ones((9, 3), dtype=np.float32))
    bad = np.ones((9, 3))
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        randattn.attention_backward(qn, kn, vn, bad)
    with pytest.raises(ValueError, match="learn_projection"):
        randattn.torch.Attention("exact", learn_projection=True, head_dim=4)
    for name, m in randattn.methods().items():
        if not m["differentiable"]:
            with pytest.raises(ValueError, match="has no backward pass"):
                randattn.attention(q, k, v, method=name, **OPTIONS.get(name, {}))


def hedgehog_reference(q, k, v, weight, bias, causal, scale=None):
    """Hedgehog linear attention from its definition in torch: φ(x) = [softmax(u); softmax(-u)]
    with u = W (c x) + b, c = scale ** 0.5, key/value head h // group's map for query head h;
    out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) (j <= i when causal)."""
    group = q.shape[1] // k.shape[1]
    c = (q.shape[-1] ** -0.5 if scale is None else scale) ** 0.5
    w = weight.repeat_interleave(group, dim=0)[None, :, None]  # (1, heads, 1, m, d)
    b = bias.repeat_interleave(group, dim=0)[None, :, None]    # (1, heads, 1, m)

    def phi(x):
        u = (w @ (c * x)[..., None])[..., 0] + b
        return torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], -1)

    a = phi(q) @ phi(k.repeat_interleave(group, dim=1)).transpose(-1, -2)
    if causal:
        a = a.tril()
    return (a @ v.repeat_interleave(group, dim=1)) / a.sum(-1, keepdim=True)


def hedgehog_parameters(kv_heads, m, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(0.7 * torch.randn(kv_heads, m, d, generator=g, dtype=dtype))
    bias = torch.nn.Parameter(0.5 * torch.randn(kv_heads, m, generator=g, dtype=dtype))
    return weight, bias


@pytest.mark.parametrize("causal", [False, True])
def test_hedgehog_gradcheck_weight_and_bias_with_grouped_heads(causal):
    # 4 query heads over 2 key/value heads: each key/value head's map serves two query heads.
    q, k, v = inputs((1, 4, 11, 3), (1, 2, 11, 3), 2, seed=21)
    weight, bias = hedgehog_parameters(2, 4, 3, seed=22, dtype=torch.float64)
    torch.autograd.gradcheck(
        lambda q, k, v, w, b: randattn.attention(q, k, v, method="hedgehog", causal=causal, weight=w, bias=b),
        (q, k, v, weight, bias), eps=1e-6, atol=1e-5, rtol=1e-3)


def test_hedgehog_matches_a_torch_reference_in_float32_and_float64():
    """The model-training call: nn.Parameters of shape (kv_heads, m, d) and (kv_heads, m), float32
    (batch, heads, n, d) queries over (batch, kv_heads, n, d) keys and values, causal."""
    batch, heads, kv_heads, n, d, m = 2, 4, 2, 45, 8, 6
    for dtype in (torch.float64, torch.float32):
        q, k, v = inputs((batch, heads, n, d), (batch, kv_heads, n, d), 5, seed=23, dtype=dtype)
        weight, bias = hedgehog_parameters(kv_heads, m, d, seed=24, dtype=dtype)
        out = randattn.attention(q, k, v, method="hedgehog", causal=True, weight=weight, bias=bias, features=m)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(25), dtype=dtype)
        out.backward(g)
        ours = [t.grad.clone() for t in (q, k, v, weight, bias)]
        for t in (q, k, v, weight, bias):
            t.grad = None
        ref = hedgehog_reference(q.double(), k.double(), v.double(), weight.double(), bias.double(), causal=True)
        ref.backward(g.double())
        assert out.dtype == dtype and out.shape == (batch, heads, n, 5)
        if dtype == torch.float64:
            torch.testing.assert_close(out.detach(), ref.detach(), rtol=0, atol=1e-12)
            for name, mine, t in zip("q k v weight bias".split(), ours, (q, k, v, weight, bias)):
                torch.testing.assert_close(mine, t.grad, rtol=1e-9, atol=1e-11, msg=name)
        else:
            # Each output is a ratio of sums of n products of 2m-term dot products of softmax
            # values (each within a few float32 roundings): the conftest bound for n·2m terms.
            assert_close(out.detach().numpy(), ref.detach().numpy(), np.float32, terms=n * 2 * m)


def test_hedgehog_seeded_map_without_weight():
    q, k, v = inputs((1, 2, 9, 4), (1, 2, 9, 4), 3, seed=26)
    out = randattn.attention(q, k, v, method="hedgehog", causal=True, features=5, seed=1)
    again = randattn.attention(q, k, v, method="hedgehog", causal=True, features=5, seed=1)
    other = randattn.attention(q, k, v, method="hedgehog", causal=True, features=5, seed=2)
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    assert not torch.equal(out, other)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="weight and bias go together: bias is missing"):
        randattn.attention(q, k, v, method="hedgehog", weight=torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match=r"expected a \(kv_heads, m, d\) = \(2, m, 4\)"):
        randattn.attention(q, k, v, method="hedgehog", weight=torch.zeros(3, 5, 4), bias=torch.zeros(3, 5))
