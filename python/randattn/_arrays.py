"""NumPy and torch inputs seen as NumPy arrays without copies, and results returned in the kind
of the inputs (a NumPy array, or a torch tensor sharing the result's memory).

NumPy has no bfloat16: a torch bfloat16 tensor is seen as an array of ``BFLOAT16``, a structured
dtype holding each value's 16 bits, which the compiled core reads as bfloat16 (and returns
bfloat16 results in)."""

import sys

import numpy as np

BFLOAT16 = np.dtype([("bfloat16", "=u2")])
# The half-precision types, which the classes of the package run in float32 (widened exactly)
# with results rounded once to the type.
HALF_NAMES = ("float16", "bfloat16")


def _torch():
    """The torch module if the caller has imported it (randattn never imports it itself)."""
    return sys.modules.get("torch")


def is_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def as_numpy(x, name):
    """x as a NumPy array sharing its memory: NumPy arrays as they are, CPU torch tensors through
    tensor.numpy(); anything else through numpy.asarray (lists of numbers, for instance)."""
    if isinstance(x, np.ndarray):
        return x
    if is_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"{name} is on device {x.device}; randattn runs on the CPU: move it with .cpu()")
        if x.requires_grad and _torch().is_grad_enabled():
            raise ValueError(
                f"{name} requires grad, and this call computes no gradients; call it under "
                "torch.no_grad() or torch.inference_mode(), or pass tensor.detach()")
        return tensor_values(x)
    try:
        return np.asarray(x)
    except Exception as e:  # e.g. ragged nested lists
        raise TypeError(f"{name} must be an array, got {type(x).__name__}: {e}") from None


def tensor_values(x):
    """A CPU tensor's values as a NumPy array sharing its memory (detached); bfloat16 as BFLOAT16."""
    torch = _torch()
    x = x.detach()
    # A lazily negated or conjugated view has no NumPy equivalent: materialise it (one copy).
    if x.is_neg():
        x = x.resolve_neg()
    if x.is_conj():
        x = x.resolve_conj()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(BFLOAT16)
    return x.numpy()


def to_tensor(result):
    """A NumPy result as a torch tensor sharing its memory (BFLOAT16 as torch.bfloat16)."""
    torch = _torch()
    if result.dtype == BFLOAT16:
        return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(result)


def like(result, template):
    """result (a NumPy array) as a torch tensor when template is one, sharing memory."""
    if is_tensor(template):
        return to_tensor(result)
    return result


def dtype_name(dtype):
    """'float32', 'float64', 'float16' or 'bfloat16' from a name, a NumPy dtype-like or a torch
    dtype; TypeError for any other."""
    names = ("float32", "float64") + HALF_NAMES
    name = type_name(dtype, "dtype")
    if name not in names:
        try:
            name = np.dtype(name).name  # aliases such as "f4" or "double"
        except TypeError:
            pass
    if name not in names:
        raise TypeError(f"dtype must be float32, float64, float16 or bfloat16, got {name}")
    return name


def type_name(t, what):
    """A type's name from a string, a NumPy dtype-like or a torch dtype (None stays None)."""
    if t is None or isinstance(t, str):
        return t
    name = str(t)
    if name.startswith("torch."):
        return name[len("torch."):]
    try:
        return np.dtype(t).name
    except TypeError:
        raise TypeError(f"{what} must be a name or a dtype, got {t!r}") from None


def half_name(x):
    """'float16' or 'bfloat16' for a half-precision NumPy array or torch tensor, else None."""
    if is_tensor(x):
        name = str(x.dtype)[len("torch."):]
    else:
        name = getattr(getattr(x, "dtype", None), "name", None)
    return name if name in HALF_NAMES else None


def widened(x, name):
    """x as a NumPy array; half precision widened to float32 (exact: every such value is a float)."""
    if half_name(x) is None:
        return as_numpy(x, name)
    if is_tensor(x):
        return as_numpy(x.float(), name)
    return x.astype(np.float32)


def rounded_like(out, template, where, advice):
    """The float32 result ``out`` in the template's kind and, for a half-precision template, its
    type (rounded once to nearest); a finite result beyond that type's range raises ValueError
    (``where: ...; advice``) instead of becoming Inf."""
    half = half_name(template)
    if half is None:
        return like(out, template)
    if is_tensor(template):
        rounded = to_tensor(out).to(template.dtype)
        finite = bool(rounded.float().isfinite().all())
    else:
        with np.errstate(over="ignore"):  # overflow is reported below
            rounded = out.astype(np.float16)
        finite = bool(np.isfinite(rounded).all())
    if not finite and np.isfinite(out).all():
        largest = "65504" if half == "float16" else "3.39e38"
        raise ValueError(f"{where}: the result exceeds the range of {half} (±{largest}); {advice}")
    return rounded
