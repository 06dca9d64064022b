"""How inputs reach the library: C-contiguous NumPy arrays and CPU torch tensors are read in
place (the module's copy counter stays put), other layouts are copied once each; inputs are
never written; results keep the kind, dtype and layout of the inputs; the GIL is released
while the library computes."""

import sys
import threading
import time

import numpy as np
import pytest

import randattn
from randattn import _core


def copies_during(fn):
    before = _core.input_copies()
    result = fn()
    return _core.input_copies() - before, result


# Options a method needs to run at all (lsf: a threshold; sparse-lowrank causal: a remainder
# without a fit on the sequence).
OPTIONS = {"lsf": dict(eta=0.5), "sparse-lowrank": dict(remainder="sample")}


@pytest.mark.parametrize("method", list(randattn.methods()))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_c_contiguous_inputs_are_not_copied(rng, method, dtype):
    q, k, v = (rng.standard_normal((2, 2, 16, 4)).astype(dtype) for _ in range(3))
    keys = None if method == "lsh" else k
    copies, out = copies_during(lambda: randattn.attention(q, keys, v, method=method, shared_qk=keys is None,
                                                           **OPTIONS.get(method, {})))
    assert copies == 0
    assert out.dtype == dtype and out.flags.c_contiguous


def test_each_non_contiguous_input_is_copied_once(rng):
    base = rng.standard_normal((16, 8))
    q = base[:, ::2]             # strided columns
    k = np.asfortranarray(base[:, :4])  # column-major
    v = rng.standard_normal((3, 16)).T  # a transposed view
    copies, out = copies_during(lambda: randattn.attention(q, k, v))
    assert copies == 3
    # A copy is only a change of layout: the result equals that of contiguous inputs.
    contiguous = [np.ascontiguousarray(a) for a in (q, k, v)]
    copies, same = copies_during(lambda: randattn.attention(*contiguous))
    assert copies == 0
    np.testing.assert_array_equal(out, same)
    # One non-contiguous input: one copy.
    copies, _ = copies_during(lambda: randattn.attention(q, contiguous[1], contiguous[2]))
    assert copies == 1


def test_other_byte_order_is_converted_once(rng):
    q = rng.standard_normal((6, 3))
    copies, out = copies_during(lambda: randattn.attention(q.astype(">f8"), q, q))
    assert copies == 1
    np.testing.assert_array_equal(out, randattn.attention(q, q, q))


def test_inputs_are_never_written(rng):
    q, k, v = (rng.standard_normal((32, 4)) for _ in range(3))
    saved = [a.copy() for a in (q, k, v)]
    for a in (q, k, v):
        a.flags.writeable = False  # a write through the buffer would fail
    for method in randattn.methods():
        keys = None if method == "lsh" else k
        for causal in (False, True):
            if method in ("oprf", "sderf") and causal:
                continue  # a fit on the sequence is not causal
            randattn.attention(q, keys, v, method=method, causal=causal, shared_qk=keys is None,
                               **OPTIONS.get(method, {}))
    for a, s in zip((q, k, v), saved):
        np.testing.assert_array_equal(a, s)


def test_results_do_not_alias_inputs(rng):
    q = rng.standard_normal((8, 4))
    out = randattn.attention(q, q, q)
    assert not np.shares_memory(out, q)


def test_torch_tensors_in_and_out_without_copies(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 3, 16, 4)).astype(np.float32)) for _ in range(3))
    copies, out = copies_during(lambda: randattn.attention(q, k, v, method="favor", features=32))
    assert copies == 0
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (2, 3, 16, 4)
    ref = randattn.attention(q.numpy(), k.numpy(), v.numpy(), method="favor", features=32)
    np.testing.assert_array_equal(out.numpy(), ref)
    # A transposed (batch, n, heads, d) -> (batch, heads, n, d) view is copied once.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    copies, out_t = copies_during(lambda: randattn.attention(qt, k, v, method="favor", features=32))
    assert copies == 1
    np.testing.assert_array_equal(out_t.numpy(), ref)


def test_2d_and_4d_layouts_agree(rng):
    q, k, v = (rng.standard_normal((1, 1, 20, 4)) for _ in range(3))
    for method in randattn.methods():
        keys = None if method == "lsh" else k
        options = dict(shared_qk=keys is None, **OPTIONS.get(method, {}))
        four = randattn.attention(q, keys, v, method=method, **options)
        two = randattn.attention(q[0, 0], None if keys is None else keys[0, 0], v[0, 0], method=method, **options)
        assert four.shape == (1, 1, 20, 4) and two.shape == (20, 4)
        np.testing.assert_array_equal(four[0, 0], two)


def test_the_gil_is_released_during_computation(rng):
    """While one thread is inside a long attention call, the main thread keeps running Python
    code. The worker notes the time just before and just after its call; the main thread
    notes the time of each of its loop iterations. If the call held the GIL, the main thread
    could not run between the call's start and end, so some gap between its iterations would
    cover most of the call; with the GIL released, gaps stay short. No absolute time limit is
    involved: only the ratio of the largest gap to the call's own duration."""
    n, d = 1536, 64
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # hand the GIL over quickly, so its holder is seen promptly
    started, finished = [], []

    def worker():
        for _ in range(2):
            started.append(time.perf_counter())
            randattn.attention(q, k, v, method="exact", threads=1)
            finished.append(time.perf_counter())

    thread = threading.Thread(target=worker)
    ticks = []
    try:
        thread.start()
        while thread.is_alive():
            ticks.append(time.perf_counter())
    finally:
        thread.join()
        sys.setswitchinterval(old_interval)
    ticks = np.array(ticks)
    for t0, t1 in zip(started, finished):
        inside = ticks[(ticks > t0) & (ticks < t1)]
        edges = np.concatenate([[t0], inside, [t1]])
        largest_gap = np.diff(edges).max()
        assert largest_gap < 0.5 * (t1 - t0), (largest_gap, t1 - t0, inside.size)


def test_threads_setting_is_restored(rng):
    q = rng.standard_normal((8, 4))
    before = _core.max_threads()
    randattn.attention(q, q, q, threads=1)
    assert _core.max_threads() == before
