"""Attention attached to torch's autograd graph, and the NumPy backward.

Every method whose registry entry declares a backward (``methods()[name]["differentiable"]``)
runs its forward through ``_core.GradientCall``: the same bits as ``attention()``, keeping what the
backward needs (row statistics, buckets, feature rows). The backward is the gradient of that same
estimate: projections, hashes, filters and samples are fixed by the seed and the forward.
"""

import numpy as np

from . import _core
from ._arrays import _torch, is_tensor, tensor_values, to_tensor


def _numpy(x):
    """A tensor's values as NumPy (detached), or x itself."""
    return tensor_values(x) if is_tensor(x) else x


def _check_differentiable(method, option_gradients):
    entry = _core.methods.get(method)
    if entry is None:
        return  # the registry names the unknown method
    if not entry["differentiable"]:
        able = ", ".join(name for name, m in _core.methods.items() if m["differentiable"])
        raise ValueError(f"method {method!r} has no backward pass (methods with one: {able})")
    for name in option_gradients:
        if name not in entry["differentiable_options"]:
            raise ValueError(f"method {method!r} has no gradient with respect to {name!r}")


def gradient_call(q, k, v, method, causal, scale, seed, check_finite, threads, shared_qk, report, options,
                  option_gradients=()):
    """A ``_core.GradientCall`` on the values of q, k, v and the options (tensors detached)."""
    _check_differentiable(method, option_gradients)
    plain = {name: _numpy(value) for name, value in options.items()}
    return _core.GradientCall(_numpy(q), None if k is None else _numpy(k), _numpy(v), method, causal, scale, seed,
                              check_finite, threads, shared_qk, report, plain, list(option_gradients))


def _function_class():
    torch = _torch()

    class AttentionFunction(torch.autograd.Function):
        """forward(call, report_box, option_names, q, k, v, *options) -> out; the option tensors (a
        learned ω, a learned map's weight and bias) take part only for their gradients."""

        @staticmethod
        def forward(ctx, call, report_box, option_names, q, k, v, *options):
            result = call.forward()
            if isinstance(result, tuple):
                result, report_box[0] = result
            ctx.call, ctx.option_names = call, option_names
            ctx.option_shapes = [(t.shape, t.dtype) for t in options]
            ctx.save_for_backward(q, k, v, *options)
            return to_tensor(result)

        @staticmethod
        def backward(ctx, grad_out):
            if torch.is_grad_enabled():  # create_graph=True: a graph of the backward is asked for
                raise RuntimeError("randattn attention cannot differentiate twice: its backward is not "
                                   "differentiable (do not pass create_graph=True through it)")
            ctx.saved_tensors  # raises if an input was changed in place since the forward
            dq, dk, dv, options = ctx.call.backward(tensor_values(grad_out.contiguous()))
            grads = [to_tensor(dq), None if dk is None else to_tensor(dk), to_tensor(dv)]
            for name, (shape, dtype) in zip(ctx.option_names, ctx.option_shapes):
                grads.append(torch.from_numpy(options[name].reshape(tuple(shape))).to(dtype)
                             if name in options else None)
            needs = ctx.needs_input_grad[3:]
            return (None, None, None) + tuple(g if need else None for g, need in zip(grads, needs))

    return AttentionFunction


_FUNCTION = []


def attention_with_grad(q, k, v, *, method, causal, scale, seed, check_finite, threads, shared_qk, report, options):
    """``attention()`` on torch tensors, attached to the autograd graph."""
    torch = _torch()
    learned = [name for name, value in options.items()
               if isinstance(value, torch.Tensor) and value.requires_grad]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: a differentiable call takes torch tensors for q, k and v, got "
                            f"{type(t).__name__}")
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{name} is on device {t.device}; randattn runs on the CPU: move it with .cpu()")
    call = gradient_call(q, k, v, method, causal, scale, seed, check_finite, threads, shared_qk, report, options,
                         learned)
    if not _FUNCTION:
        _FUNCTION.append(_function_class())
    report_box = [None]
    out = _FUNCTION[0].apply(call, report_box, tuple(learned), q, k, v, *(options[name] for name in learned))
    return (out, report_box[0]) if report else out


def needs_grad(*tensors):
    """True when grad is enabled and a torch tensor among ``tensors`` requires grad."""
    torch = _torch()
    return (torch is not None and torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors))


def attention_backward(q, k, v, grad_out, *, method="exact", causal=False, scale=None, seed=0, check_finite=True,
                       threads=None, shared_qk=False, **options):
    """(dq, dk, dv): the gradients of sum(grad_out * attention(q, k, v, ...)) with respect to
    q, k and v, for NumPy arrays (dk is None under shared_qk, where dq includes the path through
    the keys). Same arguments as ``attention()``; grad_out has the output's shape and dtype and
    must be finite (ValueError otherwise)."""
    call = gradient_call(q, k, v, method, causal, scale, seed, check_finite, threads, shared_qk, False, options)
    call.forward()
    dq, dk, dv, _ = call.backward(np.asarray(_numpy(grad_out)))
    return dq, dk, dv
