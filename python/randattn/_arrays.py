"""NumPy and torch inputs seen as NumPy arrays without copies, and results returned in the kind
of the inputs (a NumPy array, or a torch tensor sharing the result's memory).

NumPy has no bfloat16: a torch bfloat16 tensor is seen as an array of ``BFLOAT16``, a structured
dtype holding each value's 16 bits, which the compiled core reads as bfloat16 (and returns
bfloat16 results in)."""

import sys

import numpy as np

BFLOAT16 = np.dtype([("bfloat16", "=u2")])


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
    """'float32' or 'float64' from a NumPy dtype-like or a torch dtype."""
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        names = {torch.float32: "float32", torch.float64: "float64"}
        if dtype not in names:
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        return names[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if d not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64, got {d}")
    return d.name
