"""Half precision in and out: NumPy float16, torch bfloat16 and float16 through every registered
method, forward and backward. A half call widens its inputs to float32 (exactly), runs the
float32 method and rounds the result once, so against float32 attention on the same rounded
inputs it must give float32's bits rounded to the inputs' type: every entry within the unit
roundoff u of its float32 value (u = 2^-8 for bfloat16, 2^-11 for float16; float16 entries below
2^-14 are subnormal and within 2^-25), hence a relative error (Frobenius) of at most u: 3.9e-3 and
4.9e-4, inside the goals of 1e-2 and 2e-3."""

import numpy as np
import pytest

import randattn
from conftest import SMALL_OPTIONS

torch = pytest.importorskip("torch")

import randattn.torch  # noqa: E402

METHODS = list(randattn.methods())
DIFFERENTIABLE = [name for name, m in randattn.methods().items() if m["differentiable"]]
# Unit roundoff and the largest rounding error of a subnormal value, per half type.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SUBNORMAL_ERROR = {torch.bfloat16: 0.0, torch.float16: 2.0 ** -25}
HALVES = [torch.bfloat16, torch.float16]


def rounded_inputs(shape_q, shape_kv, dv, seed, dtype):
    """q, k, v drawn in float32 and rounded to dtype (what a half model hands over)."""
    g = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(*shape_q, generator=g)
    k = 0.5 * torch.randn(*shape_kv, generator=g)
    v = torch.randn(*shape_kv[:-1], dv, generator=g)
    return [t.to(dtype) for t in (q, k, v)]


def assert_rounded(half, exact32, dtype, name=""):
    """half is exact32 rounded to dtype: the same bits as torch's rounding, and every entry within
    u·|x| (or the subnormal spacing) of its float32 value; returns the relative (Frobenius) error."""
    assert half.dtype == dtype, name
    assert torch.equal(half, exact32.to(dtype)), f"{name}: not float32's result rounded to {dtype}"
    err = (half.double() - exact32.double()).abs()
    bound = np.maximum(UNIT_ROUNDOFF[dtype] * exact32.double().abs(), SUBNORMAL_ERROR[dtype])
    assert bool((err <= bound).all()), name
    rel = float((half.double() - exact32.double()).norm() / exact32.double().norm())
    assert rel <= UNIT_ROUNDOFF[dtype], name
    return rel


def test_every_registered_method_is_covered():
    assert set(SMALL_OPTIONS) == set(METHODS)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_in_half_is_float32_rounded(method, dtype):
    q, k, v = rounded_inputs((2, 2, 37, 8), (2, 2, 37, 8), 5, seed=1, dtype=dtype)
    for causal in (False, True):
        args = dict(method=method, causal=causal, seed=3, **SMALL_OPTIONS[method])
        out = randattn.attention(q, k, v, **args)
        assert isinstance(out, torch.Tensor) and out.shape == (2, 2, 37, 5)
        reference = randattn.attention(q.float(), k.float(), v.float(), **args)
        assert_rounded(out, reference, dtype, f"{method} causal={causal}")


@pytest.mark.parametrize("method", METHODS)
def test_numpy_float16_is_float32_rounded(method):
    q, k, v = (t.numpy() for t in rounded_inputs((37, 6), (29, 6), 4, seed=2, dtype=torch.float16))
    args = dict(method=method, seed=4, **SMALL_OPTIONS[method])
    out = randattn.attention(q, k, v, **args)
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
    reference = randattn.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), **args)
    assert_rounded(torch.from_numpy(out), torch.from_numpy(reference), torch.float16, method)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("method", DIFFERENTIABLE)
def test_gradients_in_half_are_float32_gradients_rounded(method, dtype):
    q, k, v = (t.requires_grad_() for t in rounded_inputs((1, 2, 37, 4), (1, 2, 37, 4), 3, seed=5, dtype=dtype))
    g = torch.randn(1, 2, 37, 3, generator=torch.Generator().manual_seed(6)).to(dtype)
    args = dict(method=method, causal=True, seed=7, **SMALL_OPTIONS[method])
    out = randattn.attention(q, k, v, **args)
    out.backward(g)
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = randattn.attention(*wide, **args)
    reference.backward(g.float())
    assert_rounded(out.detach(), reference.detach(), dtype, "out")
    for name, half, w in zip("qkv", (q, k, v), wide):
        assert_rounded(half.grad, w.grad, dtype, f"{method} d{name}")
    # The NumPy backward gives the same float16 bits.
    if dtype == torch.float16:
        dq, dk, dv = randattn.attention_backward(*(t.detach().numpy() for t in (q, k, v)), g.numpy(), **args)
        for mine, half in zip((dq, dk, dv), (q, k, v)):
            assert mine.dtype == np.float16
            np.testing.assert_array_equal(mine, half.grad.numpy())


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_layouts_in_half(dtype):
    # Grouped heads with key padding, packed sequences and shared QK: the layout runs in float32.
    q, k, v = rounded_inputs((2, 4, 21, 8), (2, 2, 21, 8), 3, seed=8, dtype=dtype)
    mask = np.zeros((2, 21), dtype=bool)
    mask[0, 15:] = True
    mask[1, [2, 3, 11]] = True
    runs = [(q, k, v, dict(method="exact", key_padding_mask=mask, causal=True)),
            (q, k, v, dict(method="lsh", chunk=4, rounds=2, key_padding_mask=mask, exclude_self=True)),
            (q[0, 0], k[0, 0], v[0, 0], dict(method="favor", features=16, cu_seqlens=np.array([0, 7, 21]))),
            (q, None, q[..., :3], dict(method="lsh", chunk=4, shared_qk=True, causal=True))]
    for qq, kk, vv, args in runs:
        out = randattn.attention(qq, kk, vv, **args)
        reference = randattn.attention(qq.float(), None if kk is None else kk.float(), vv.float(), **args)
        assert_rounded(out, reference, dtype, args["method"])


def test_strided_and_out_arguments_in_half():
    q, k, v = rounded_inputs((2, 2, 40, 8), (2, 2, 40, 8), 3, seed=9, dtype=torch.bfloat16)
    # A strided view (every other token) is read through one copy.
    strided = q[:, :, ::2]
    out = randattn.attention(strided, k, v, method="favor", features=16)
    reference = randattn.attention(strided.float(), k.float(), v.float(), method="favor", features=16)
    assert_rounded(out, reference, torch.bfloat16)
    # out= of the inputs' dtype is written in place; another dtype is refused.
    buffer = torch.empty(2, 2, 40, 3, dtype=torch.bfloat16)
    assert randattn.attention(q, k, v, out=buffer) is buffer
    assert torch.equal(buffer, randattn.attention(q, k, v))
    with pytest.raises(ValueError, match="out has dtype float32, expected bfloat16"):
        randattn.attention(q, k, v, out=torch.empty(2, 2, 40, 3))
    qh, kh, vh = (t.to(torch.float16).numpy() for t in (q, k, v))
    with pytest.raises(ValueError, match="out has dtype bfloat16, expected float16"):
        randattn.attention(qh, kh, vh, out=buffer)
    mine = np.empty((2, 2, 40, 3), dtype=np.float16)
    out, report = randattn.attention(qh, kh, vh, method="lsh", chunk=8, out=mine, report=True)
    assert out is mine and report["method"] == "lsh"
    np.testing.assert_array_equal(mine, randattn.attention(qh, kh, vh, method="lsh", chunk=8))


def test_module_in_half_with_a_learned_projection():
    torch.manual_seed(0)
    attn = randattn.torch.Attention("favor", features=16, learn_projection=True, head_dim=8, seed=1,
                                    reuse_output=True)
    q, k, v = (t.requires_grad_() for t in rounded_inputs((1, 2, 19, 8), (1, 2, 19, 8), 4, seed=10,
                                                              dtype=torch.bfloat16))
    out = attn(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and attn.omega.grad.dtype == torch.float32
    assert bool(torch.isfinite(attn.omega.grad).all())
    with torch.no_grad():  # the kept output buffer, in bfloat16
        first = attn(q, k, v, is_causal=True)
        assert torch.equal(first, out.detach())
    # A projection given in half precision is read exactly: the same as its float32 values.
    omega = attn.omega.detach().to(torch.bfloat16)
    with torch.no_grad():
        a = randattn.attention(q, k, v, method="favor", omega=omega)
        b = randattn.attention(q, k, v, method="favor", omega=omega.float())
    assert torch.equal(a, b)


def test_mixed_and_unsupported_dtypes_raise_type_error():
    q, k, v = rounded_inputs((9, 4), (9, 4), 3, seed=11, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="same dtype, got q bfloat16, k float32, v bfloat16"):
        randattn.attention(q, k.float(), v)
    with pytest.raises(TypeError, match="same dtype, got q float16, k float16, v bfloat16"):
        randattn.attention(q.half(), k.half(), v)
    with pytest.raises(TypeError, match="must have dtype float16, bfloat16, float32 or float64, got int32"):
        randattn.attention(np.ones((9, 4), dtype=np.int32), k, v)
    with pytest.raises(ValueError, match="grad_out has dtype float32, expected float16"):
        randattn.attention_backward(q.half().numpy(), k.half().numpy(), v.half().numpy(), np.ones((9, 3), np.float32))


def test_float16_results_beyond_its_range_raise_value_error():
    # Uniform attention (zero queries) of 16 queries over 4 keys: dv_j = Σ_i g_i / 4 = 4 g, and
    # g = 60000 makes 240000, beyond float16's 65504; bfloat16 holds it (4 g in bfloat16, rounded).
    q = torch.zeros(16, 4, dtype=torch.float16, requires_grad=True)
    k = torch.ones(4, 4, dtype=torch.float16, requires_grad=True)
    v = torch.ones(4, 2, dtype=torch.float16, requires_grad=True)
    g = torch.full((16, 2), 60000.0, dtype=torch.float16)
    out = randattn.attention(q, k, v)
    with pytest.raises(ValueError, match=r"method 'exact', gradient dv: entry 0 is 240000, beyond the largest "
                                         r"finite float16 \(65504\)"):
        out.backward(g)
    qb, kb, vb = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    randattn.attention(qb, kb, vb).backward(g.to(torch.bfloat16))
    assert bool((vb.grad == (4 * g[0, 0].to(torch.bfloat16).float()).to(torch.bfloat16)).all())


def test_non_finite_inputs_in_half():
    q, k, v = (t.numpy() for t in rounded_inputs((5, 4), (5, 4), 3, seed=12, dtype=torch.float16))
    q[1, 2] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        randattn.attention(q, k, v)
    q[1, 2] = np.nan  # propagated as in float32 when the check is off, never an error
    out = randattn.attention(q, k, v, check_finite=False)
    assert out.dtype == np.float16
    assert np.isnan(out[1]).all() and np.isfinite(np.delete(out, 1, axis=0)).all()


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("kind", list(randattn._core.feature_map_kinds))
def test_feature_maps_in_half_are_float32_rounded(kind, dtype):
    x = rounded_inputs((23, 6), (1, 6), 1, seed=13, dtype=dtype)[0]
    fm = randattn.FeatureMap(kind, 6, features=8, seed=4)
    for side in ("query", "key"):
        values, log_scale = fm.features(x, normaliser=0.8, side=side)
        values32, log_scale32 = fm.features(x.float(), normaliser=0.8, side=side)
        assert_rounded(values, values32, dtype, f"{kind} {side}")
        assert log_scale.dtype == torch.float32 and torch.equal(log_scale, log_scale32)
    if dtype == torch.float16:  # NumPy float16 in: float16 values, float32 log-scales
        values, log_scale = fm.features(x.numpy(), normaliser=0.8)
        values32, log_scale32 = fm.features(x.float().numpy(), normaliser=0.8)
        assert values.dtype == np.float16 and log_scale.dtype == np.float32
        assert np.array_equal(values, values32.astype(np.float16)) and np.array_equal(log_scale, log_scale32)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_decoder_in_half_is_float32_rounded(dtype):
    n, name = 12, str(dtype)[len("torch."):]
    q, k, v = rounded_inputs((n, 4), (n, 4), 3, seed=5, dtype=dtype)
    fm = randattn.FeatureMap("hybrid", 4, features=8, lambda_features=4, seed=2)
    half, single = randattn.Decoder(fm, 3, dtype=dtype), randattn.Decoder(fm, 3, dtype="float32")
    assert half.dtype == name and randattn.Decoder(fm, 3, dtype=name).dtype == name
    for t in range(n):
        half.append(k[t], v[t])
        single.append(k[t].float(), v[t].float())
        assert_rounded(half.query(q[t]), single.query(q[t].float()), dtype, f"token {t}")
    assert len(half) == n
    with pytest.raises(TypeError, match=f"k has dtype float32 but the decoder works in {name}"):
        half.append(k[0].float(), v[0])
    with pytest.raises(TypeError, match=f"q has dtype {name} but the decoder works in float32"):
        single.query(q[0])
    assert len(half) == n and len(single) == n
    if dtype == torch.float16:  # NumPy float16 tokens and outputs
        numpy_half = randattn.Decoder(fm, 3, dtype=np.float16)
        for t in range(n):
            numpy_half.append(k[t].numpy(), v[t].numpy())
        out = numpy_half.query(q[-1].numpy())
        assert out.dtype == np.float16 and np.array_equal(out, single.query(q[-1].float()).numpy().astype(np.float16))
