"""randattn.KVCache: decoding over a key/value cache (exact, blocks, lsh-sample, lsf)."""

import threading

import numpy as np
import pytest

import randattn
from conftest import DTYPES, assert_close, softmax_attention

D, DV, KV_HEADS, Q_HEADS = 16, 8, 2, 4

# Small caches whose retrieval part is not empty: sinks + window < n.
MODES = {
    "exact": {},
    "blocks": dict(page_size=8, top_pages=3),
    "lsh-sample": dict(bits=4, tables=16, seed=7),
    "lsf": dict(filters=16, tables=3, alpha=0.6, seed=7),
}
SMALL = dict(sinks=2, window=8)


def tokens(rng, n, dtype=np.float64, kv_heads=KV_HEADS):
    k = rng.standard_normal((kv_heads, n, D)).astype(dtype)
    v = rng.standard_normal((kv_heads, n, DV)).astype(dtype)
    return k, v


def queries(rng, dtype=np.float64, q_heads=Q_HEADS):
    return (2.0 * rng.standard_normal((q_heads, D))).astype(dtype)


def filled(k, v, mode="exact", dtype="float64", options=None, **kw):
    """A cache of the tokens k, v with SMALL and the mode's options (or `options` instead)."""
    options = MODES[mode] if options is None else options
    cache = randattn.KVCache(head_dim=D, value_dim=DV, kv_heads=k.shape[0], mode=mode, dtype=dtype,
                             **{**SMALL, **options, **kw})
    cache.append(k, v)
    return cache


def identical(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_mode_equals_softmax_attention_with_grouped_heads(rng, dtype):
    n = 70
    k, v = tokens(rng, n, dtype)
    q = queries(rng, dtype)
    cache = filled(k, v, dtype=np.dtype(dtype).name)
    out, report = cache.attend(q, report=True)
    assert out.dtype == dtype and out.shape == (Q_HEADS, DV)
    group = Q_HEADS // KV_HEADS
    for i in range(Q_HEADS):
        h = i // group
        ref = softmax_attention(q[i:i + 1].astype(np.float64), k[h].astype(np.float64), v[h].astype(np.float64))
        assert_close(out[i:i + 1], ref, dtype, n + D)
        lib = randattn.attention(q[i:i + 1], k[h], v[h])
        assert_close(out[i:i + 1], lib, dtype, n + D)
    assert report["keys_scored"] == report["exact_keys"] == Q_HEADS * n
    assert report["retrieved_keys"] == 0 and report["size"] == n and report["mode"] == "exact"


@pytest.mark.parametrize("mode,everything", [
    ("blocks", dict(page_size=8, top_pages=100)),
    ("lsh-sample", dict(bits=0, tables=4)),
    ("lsf", dict(filters=16, tables=2, eta=float("-inf"))),
])
def test_retrieving_every_key_is_exact_decoding(rng, mode, everything):
    n = 90
    k, v = tokens(rng, n, np.float32)
    q = queries(rng, np.float32)
    exact = filled(k, v, dtype="float32").attend(q)
    out, report = filled(k, v, mode, dtype="float32", options=everything).attend(q, report=True)
    assert report["keys_scored"] == Q_HEADS * n
    candidates_end = n - SMALL["window"]
    if mode == "lsh-sample":  # keys are hashed in blocks of 64; the open block is exact
        candidates_end = min(candidates_end, n // 64 * 64)
    assert report["retrieved_keys"] == Q_HEADS * (candidates_end - SMALL["sinks"])
    assert_close(out, exact, np.float32, n + D)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_token_by_token_equals_one_block_bit_for_bit(rng, mode, dtype):
    n = 61
    k, v = tokens(rng, n, dtype)
    q = queries(rng, dtype)
    block = filled(k, v, mode, dtype)
    single = randattn.KVCache(D, DV, KV_HEADS, mode, dtype=dtype, **SMALL, **MODES[mode])
    mixed = randattn.KVCache(D, DV, KV_HEADS, mode, dtype=dtype, **SMALL, **MODES[mode])
    for t in range(n):
        single.append(k[:, t], v[:, t])  # (kv_heads, d): one token
    for a, b in [(0, 5), (5, 6), (6, 40), (40, n)]:
        mixed.append(k[:, a:b], v[:, a:b])
    assert len(single) == len(mixed) == len(block) == n
    ref = block.attend(q)
    assert identical(single.attend(q), ref)
    assert identical(mixed.attend(q), ref)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_save_load_round_trip_is_bit_identical(rng, tmp_path, mode, dtype):
    k, v = tokens(rng, 75, dtype)
    q = queries(rng, dtype)
    cache = filled(k, v, mode, dtype, centre_tokens=20) if mode != "exact" else filled(k, v, mode, dtype)
    path = tmp_path / "layer.kvc"
    cache.save(path)
    loaded = randattn.KVCache.load(path)
    assert (len(loaded), loaded.mode, loaded.dtype, loaded.scale) == (75, mode, dtype, cache.scale)
    assert loaded.options == cache.options
    a, ra = loaded.attend(q, report=True)
    b, rb = cache.attend(q, report=True)
    assert identical(a, b) and ra == rb
    # Both keep growing alike.
    k2, v2 = tokens(rng, 9, dtype)
    loaded.append(k2, v2)
    cache.append(k2, v2)
    assert identical(loaded.attend(q), cache.attend(q))


def test_saved_options_survive(tmp_path):
    cache = randattn.KVCache(D, DV, KV_HEADS, "lsf", sinks=3, window=5, scale=0.5, dtype="float64",
                             filters=32, tables=2, eta=0.25, min_probes=2, seed=11)
    cache.save(str(tmp_path / "c.kvc"))
    loaded = randattn.KVCache.load(str(tmp_path / "c.kvc"))
    assert loaded.options == cache.options
    assert loaded.options["eta"] == 0.25 and loaded.options["tables"] == 2 and loaded.scale == 0.5


@pytest.mark.parametrize("mode", ["exact", "blocks"])
def test_grouped_query_heads_equal_repeated_kv_heads(rng, mode):
    # blocks chooses pages by deterministic bounds, so repeating a kv head repeats its choice;
    # the hashing modes draw hyperplanes per kv head and are left out.
    n = 80
    k, v = tokens(rng, n)
    q = queries(rng, q_heads=6)  # 3 query heads per kv head
    gqa = filled(k, v, mode)
    mha = filled(np.repeat(k, 3, axis=0), np.repeat(v, 3, axis=0), mode)
    assert_close(gqa.attend(q), mha.attend(q), np.float64, n + D)


def test_dtype_is_the_caches_and_other_inputs_are_converted(rng):
    k, v = tokens(rng, 30)
    q = queries(rng)
    cache32 = randattn.KVCache(D, DV, KV_HEADS)  # float32 by default
    assert cache32.dtype == "float32"
    cache32.append(k, v)  # float64 input, rounded to float32
    out = cache32.attend(q)
    assert out.dtype == np.float32
    twin = filled(k.astype(np.float32), v.astype(np.float32), dtype="float32")
    assert identical(out, twin.attend(q.astype(np.float32)))
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16 or bfloat16, got int32"):
        randattn.KVCache(D, DV, KV_HEADS, dtype="int32")
    with pytest.raises(TypeError, match="dtype"):
        cache32.append(k.astype(np.int64), v)


def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    k, v = tokens(rng, 40, np.float32)
    q = queries(rng, np.float32)
    cache = randattn.KVCache(D, DV, KV_HEADS)
    cache.append(torch.from_numpy(k), torch.from_numpy(v))
    out = cache.attend(torch.from_numpy(q))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert identical(out.numpy(), filled(k, v, dtype="float32").attend(q))
    with pytest.raises(ValueError, match="requires grad"):
        cache.attend(torch.from_numpy(q).requires_grad_())


def test_threads_attend_concurrently_and_equal_serial(rng):
    n = 3000
    k, v = tokens(rng, n, np.float32)
    cache = filled(k, v, "lsh-sample", "float32", window=64)
    qs = [queries(rng, np.float32) for _ in range(8)]
    serial = [cache.attend(q) for q in qs]
    results = [[None] * len(qs) for _ in range(4)]
    errors = []

    def work(w):
        try:
            for r in range(3):
                for i in range(len(qs)):
                    results[w][i] = cache.attend(qs[(i + w + r) % len(qs)]), (i + w + r) % len(qs)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for w in range(4):
        for out, i in results[w]:
            assert identical(out, serial[i])


def test_appends_and_attends_from_threads(rng):
    # An append waits for running attends; every attend sees a whole number of appends.
    k, v = tokens(rng, 400, np.float32)
    q = queries(rng, np.float32)
    cache = randattn.KVCache(D, DV, KV_HEADS, dtype="float32")
    cache.append(k[:, :1], v[:, :1])
    expected = {t: filled(k[:, :t], v[:, :t], dtype="float32").attend(q) for t in range(1, 401, 21)}
    seen = []

    def reader():
        while len(cache) < 400:
            out, report = cache.attend(q, report=True)
            seen.append((report["size"], out))

    thread = threading.Thread(target=reader)
    thread.start()
    for t in range(1, 400, 21):
        cache.append(k[:, t:t + 21], v[:, t:t + 21])
    thread.join()
    assert len(cache) == 400
    for size, out in seen:
        if size in expected:
            assert identical(out, expected[size])


def unchanged(cache, q, before):
    return identical(cache.attend(q), before)


@pytest.mark.parametrize("mode", list(MODES))
def test_bad_input_raises_and_leaves_the_cache_unchanged(rng, mode):
    k, v = tokens(rng, 40)
    q = queries(rng)
    cache = filled(k, v, mode)
    before = cache.attend(q)
    kn, vn = tokens(rng, 3)
    bad_appends = [
        (kn[:, :, :D - 1], vn, "must be"),               # wrong head_dim
        (kn, vn[:, :, :DV + 0][:, :, :-1], "must be"),   # wrong value_dim
        (kn[:1], vn[:1], "must be"),                     # wrong kv_heads
        (kn, vn[:, :2], "tokens"),                       # t differs
        (kn.reshape(-1), vn, "must be"),                 # 1-D
    ]
    for kb, vb, message in bad_appends:
        with pytest.raises(ValueError, match=message):
            cache.append(kb, vb)
    knan = kn.copy()
    knan[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite|NaN"):
        cache.append(knan, vn)
    vinf = vn.copy()
    vinf[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite|Inf"):
        cache.append(kn, vinf)
    assert len(cache) == 40 and unchanged(cache, q, before)

    with pytest.raises(ValueError, match="multiple of kv_heads"):
        cache.attend(q[:3])
    with pytest.raises(ValueError, match="q must be"):
        cache.attend(q[:, :D - 1])
    with pytest.raises(ValueError, match="q must be"):
        cache.attend(q[0])
    qnan = q.copy()
    qnan[2, 1] = np.nan
    with pytest.raises(ValueError, match="non-finite|NaN"):
        cache.attend(qnan)
    assert len(cache) == 40 and unchanged(cache, q, before)


def test_corrupt_truncated_and_missing_files(rng, tmp_path):
    k, v = tokens(rng, 20)
    q = queries(rng)
    cache = filled(k, v, "blocks")
    path = tmp_path / "c.kvc"
    cache.save(path)
    data = path.read_bytes()
    cases = {
        "truncated": data[:-9],
        "header only": data[:40],
        "flipped": data[:200] + bytes([data[200] ^ 1]) + data[201:],
        "padded": data + b"\0" * 8,
        "not a cache": b"hello world, not a cache file at all",
        "empty": b"",
    }
    for name, content in cases.items():
        bad = tmp_path / f"{name}.kvc"
        bad.write_bytes(content)
        with pytest.raises(ValueError):
            randattn.KVCache.load(bad)
    with pytest.raises(FileNotFoundError):
        randattn.KVCache.load(tmp_path / "missing.kvc")
    with pytest.raises(ValueError, match="cannot open"):
        cache.save(tmp_path / "no such directory" / "c.kvc")
    assert identical(randattn.KVCache.load(path).attend(q), cache.attend(q))


def test_options_belong_to_their_modes():
    with pytest.raises(ValueError, match="'bits' belongs to mode 'lsh-sample', not to mode 'blocks'"):
        randattn.KVCache(D, DV, KV_HEADS, mode="blocks", bits=8)
    with pytest.raises(ValueError, match="'seed' belongs to mode 'lsh-sample' and 'lsf' and 'clusters', not to mode 'exact'"):
        randattn.KVCache(D, DV, KV_HEADS, seed=1)
    with pytest.raises(ValueError, match="'page_size'.*not to mode 'lsf'"):
        randattn.KVCache(D, DV, KV_HEADS, mode="lsf", page_size=8)
    with pytest.raises(ValueError, match="'centre_tokens'.*not to mode 'exact'"):
        randattn.KVCache(D, DV, KV_HEADS, centre_tokens=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'pages'"):
        randattn.KVCache(D, DV, KV_HEADS, mode="blocks", pages=8)
    with pytest.raises(ValueError, match="unknown mode 'lsh'"):
        randattn.KVCache(D, DV, KV_HEADS, mode="lsh")
    with pytest.raises(ValueError, match="bits must be in"):
        randattn.KVCache(D, DV, KV_HEADS, mode="lsh-sample", bits=17)
    with pytest.raises(ValueError, match="eta or alpha"):
        randattn.KVCache(D, DV, KV_HEADS, mode="lsf", eta=0.5, alpha=0.5)
    with pytest.raises(ValueError, match="head_dim"):
        randattn.KVCache(0, DV, KV_HEADS)
    with pytest.raises(ValueError, match="sinks"):
        randattn.KVCache(D, DV, KV_HEADS, sinks=-1)
    with pytest.raises(TypeError, match="integer"):
        randattn.KVCache(D, DV, KV_HEADS, mode="blocks", page_size=2.5)
    modes = randattn.KVCache.modes()
    assert set(modes) == {"exact", "blocks", "lsh-sample", "lsf", "clusters"}
    assert set(modes["clusters"]) == {"clusters", "probe", "margin", "samples", "seed", "centre_tokens",
                                      "key_centre"}
    assert set(modes["lsh-sample"]) == {"bits", "tables", "hash_block", "seed", "centre_tokens", "key_centre"}
    for block in (0, 4097):
        with pytest.raises(ValueError, match=r"hash_block must be in \[1, 4096\]"):
            randattn.KVCache(D, DV, KV_HEADS, mode="lsh-sample", hash_block=block)


@pytest.mark.parametrize("block", [16, 128])
def test_lsh_sample_hashes_whole_blocks_only(rng, block):
    """Keys are hashed hash_block at a time; the open block is attended exactly, so with no
    complete block the cache decodes exactly."""
    n = 90
    k, v = tokens(rng, n, np.float32)
    q = queries(rng, np.float32)
    exact = filled(k, v, dtype="float32").attend(q)
    everything = dict(bits=0, tables=4, hash_block=block)  # every hashed key is retrieved
    out, report = filled(k, v, "lsh-sample", dtype="float32", options=everything).attend(q, report=True)
    candidates_end = min(n - SMALL["window"], n // block * block)
    assert report["retrieved_keys"] == Q_HEADS * max(candidates_end - SMALL["sinks"], 0)
    assert report["keys_scored"] == Q_HEADS * n
    assert_close(out, exact, np.float32, n + D)


def test_empty_cache_and_one_token(rng):
    cache = randattn.KVCache(D, DV, KV_HEADS, mode="lsh-sample", dtype="float64")
    q = queries(rng)
    with pytest.raises(ValueError, match="empty"):
        cache.attend(q)
    assert len(cache) == 0
    k, v = tokens(rng, 1)
    cache.append(k, v)
    out = cache.attend(q)  # one key: its value, whatever the query
    np.testing.assert_array_equal(out, np.repeat(v[:, 0], Q_HEADS // KV_HEADS, axis=0))


def test_key_centre_given(rng):
    k, v = tokens(rng, 50)
    k += 5.0  # a large shared offset, as trained keys have
    q = queries(rng)
    exact = filled(k, v).attend(q)
    centre = k.reshape(-1, D).mean(axis=0)
    out = filled(k, v, "lsh-sample", bits=0, tables=2, key_centre=centre).attend(q)
    assert_close(out, exact, np.float64, 50 + D)
    with pytest.raises(ValueError, match="key_centre"):
        filled(k, v, "blocks", key_centre=np.zeros(D + 1))


def _clustered_tokens(seed, kv_heads, n, d, dv):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(kv_heads, 6, d)).astype(np.float32) * 3
    k = centres[:, rng.integers(0, 6, size=n)] + rng.normal(size=(kv_heads, n, d)).astype(np.float32) * 0.3
    v = rng.normal(size=(kv_heads, n, dv)).astype(np.float32)
    return k.astype(np.float32), v


def test_clusters_kwargs_report_and_probe_equal_to_clusters_is_exact():
    k, v = _clustered_tokens(3, 2, 400, 16, 8)
    q = np.random.default_rng(4).normal(size=(4, 16)).astype(np.float32)
    cache = randattn.KVCache(16, 8, 2, mode="clusters", sinks=2, window=16, clusters=8, probe=3, seed=5)
    assert cache.options["clusters"] == 8 and cache.options["probe"] == 3
    assert randattn.KVCache.modes()["clusters"]["clusters"] == 64
    cache.append(k, v)
    out, rep = cache.attend(q, report=True)
    assert rep["clusters_opened"] >= 4 * 3
    assert rep["keys_scored"] == rep["exact_keys"] + rep["retrieved_keys"]
    every = randattn.KVCache(16, 8, 2, mode="clusters", sinks=2, window=16, clusters=8, probe=8)
    exact = randattn.KVCache(16, 8, 2)
    every.append(k, v)
    exact.append(k, v)
    assert np.array_equal(every.attend(q), exact.attend(q))  # bit for bit


@pytest.mark.parametrize("options", [dict(clusters=0), dict(probe=0), dict(clusters=4, probe=5),
                                     dict(margin=float("nan")), dict(samples=-1)])
def test_clusters_bad_options_raise_value_error(options):
    with pytest.raises(ValueError):
        randattn.KVCache(16, 8, 2, mode="clusters", **options)


def test_clusters_options_of_other_modes_are_refused():
    with pytest.raises(ValueError):
        randattn.KVCache(16, 8, 2, mode="blocks", probe=2)
    with pytest.raises(ValueError):
        randattn.KVCache(16, 8, 2, mode="clusters", top_pages=2)


def test_clusters_save_load_bit_identical_and_truncated_file(tmp_path):
    k, v = _clustered_tokens(6, 2, 500, 16, 8)
    q = np.random.default_rng(7).normal(size=(4, 16)).astype(np.float32)
    # A fixed budget (only the probed clusters) and keys drawn from the others.
    cache = randattn.KVCache(16, 8, 2, mode="clusters", sinks=2, window=16, clusters=6, probe=2, seed=1,
                             margin=float("-inf"), samples=10)
    assert cache.options["margin"] == float("-inf") and cache.options["samples"] == 10
    cache.append(k, v)
    path = tmp_path / "clusters.kvc"
    cache.save(path)
    loaded = randattn.KVCache.load(path)
    assert loaded.mode == "clusters" and loaded.options == cache.options
    a, ra = loaded.attend(q, report=True)
    b, rb = cache.attend(q, report=True)
    assert np.array_equal(a, b) and ra == rb
    assert rb["clusters_opened"] == 4 * 2  # the probed clusters alone
    data = path.read_bytes()
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError):
        randattn.KVCache.load(cut)


STORAGES = ["float32", "float64", "bfloat16", "float16", "int8"]


def stored(x, storage):
    """x (kv_heads, n, cols) as each storage type holds it, from the definitions (NumPy)."""
    x = np.asarray(x, np.float64)
    if storage in ("float32", "float64"):
        return x.astype(storage).astype(np.float64)
    if storage == "float16":
        return x.astype(np.float16).astype(np.float64)
    if storage == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(x).to(torch.bfloat16).to(torch.float64).numpy()
    s = np.abs(x).max(axis=-1, keepdims=True) / 127
    return s * np.rint(x / np.where(s > 0, s, 1))


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("mode", ["exact", "blocks", "lsf", "clusters"])
def test_storage_types_attend_over_the_rounded_rows(rng, tmp_path, storage, mode):
    n = 90
    k, v = tokens(rng, n)
    q = queries(rng)
    options = dict(MODES.get(mode, {}), **(dict(clusters=4, probe=2) if mode == "clusters" else {}))
    cache = filled(k, v, mode, dtype="float64", options=options, storage=storage)
    assert cache.storage == storage
    entry = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int8": 1}[storage]
    scales = 2 * 8 if storage == "int8" else 0
    assert cache.bytes_per_token == KV_HEADS * ((D + DV) * entry + scales)
    assert cache.memory_bytes >= n * cache.bytes_per_token
    out, report = cache.attend(q, report=True)
    assert report["bytes_per_token"] == cache.bytes_per_token
    # The same mode over float64 rows that are the stored ones: only the accumulation differs.
    ref = filled(stored(k, storage), stored(v, storage), mode, dtype="float64", options=options)
    assert_close(out, ref.attend(q), np.float64, n + D)
    # save/load keeps the storage and the rows: bit-identical.
    cache.save(tmp_path / "c.bin")
    loaded = randattn.KVCache.load(tmp_path / "c.bin")
    assert loaded.storage == storage
    assert identical(loaded.attend(q), out)


def test_storage_names_dtypes_and_bad_storage(rng):
    k, v = tokens(rng, 20, np.float32)
    assert filled(k, v, dtype="float32").storage == "float32"
    assert filled(k, v, dtype="float64").storage == "float64"
    assert filled(k, v, dtype="float32", storage=np.float16).storage == "float16"
    assert filled(k, v, dtype="float32", storage=np.int8).storage == "int8"
    torch = pytest.importorskip("torch")
    assert filled(k, v, dtype="float32", storage=torch.bfloat16).storage == "bfloat16"
    with pytest.raises(ValueError, match="unknown storage 'float8'"):
        filled(k, v, storage="float8")
    with pytest.raises(ValueError, match="unknown storage 'int32'"):
        filled(k, v, storage=np.int32)


@pytest.mark.parametrize("check_finite", [True, False])
def test_int8_refuses_non_finite_and_float16_refuses_overflow(rng, check_finite):
    k, v = tokens(rng, 12)
    q = queries(rng)
    for storage, bad in [("int8", np.nan), ("int8", np.inf), ("float16", 7e4)]:
        cache = filled(k, v, storage=storage, check_finite=check_finite)
        before = cache.attend(q)
        k1, v1 = tokens(rng, 1)
        k1[1, 0, 3] = bad
        with pytest.raises(ValueError, match="int8|range"):
            cache.append(k1, v1)
        assert len(cache) == 12
        assert identical(cache.attend(q), before)


def test_half_precision_queries_and_caches(rng):
    torch = pytest.importorskip("torch")
    k, v = tokens(rng, 40, np.float32)
    q = queries(rng, np.float32)
    for half, np_half in [(torch.bfloat16, None), (torch.float16, np.float16)]:
        name = str(half)[len("torch."):]
        cache = randattn.KVCache(head_dim=D, value_dim=DV, kv_heads=KV_HEADS, dtype=half, **SMALL)
        assert cache.dtype == "float32" and cache.storage == name
        kt, vt, qt = (torch.from_numpy(x).to(half) for x in (k, v, q))
        cache.append(kt, vt)
        out = cache.attend(qt)
        assert out.dtype == half
        # The float32 result over the same (exactly widened) inputs, rounded once.
        ref = filled(kt.float().numpy(), vt.float().numpy(), dtype="float32", storage=name)
        expected = torch.from_numpy(ref.attend(qt.float().numpy())).to(half)
        assert torch.equal(out, expected)
        if np_half is not None:  # NumPy float16 in, float16 out
            got = cache.attend(q.astype(np_half))
            assert got.dtype == np.float16
            assert identical(got, ref.attend(q.astype(np_half).astype(np.float32)).astype(np.float16))
    # A float16 result beyond 65504 is refused.
    big = randattn.KVCache(head_dim=D, value_dim=DV, kv_heads=KV_HEADS, **SMALL)
    big.append(k, 1e5 * np.ones_like(v))
    with pytest.raises(ValueError, match="range of float16"):
        big.attend(q.astype(np.float16))


def test_blocks_page_boxes_in_principal_axes(rng, tmp_path):
    n = 120
    k, v = tokens(rng, n)
    k *= np.linspace(4.0, 0.25, D)  # keys that vary along few directions
    q = queries(rng)
    options = dict(page_size=8, top_pages=3, axes=40)
    cache = filled(k, v, "blocks", options=options)
    assert cache.options["axes"] == 40 and randattn.KVCache.modes()["blocks"]["axes"] == 0
    cache.save(tmp_path / "c.bin")
    loaded = randattn.KVCache.load(tmp_path / "c.bin")
    assert loaded.options["axes"] == 40 and identical(loaded.attend(q), cache.attend(q))
    # Every page attended: exact decoding, whatever basis bounds the pages.
    every = filled(k, v, "blocks", options=dict(options, top_pages=n))
    assert_close(every.attend(q), filled(k, v).attend(q), np.float64, n + D)
    # Until `axes` keys are cached the pages are bounded in the keys' own coordinates.
    assert identical(filled(k[:, :39], v[:, :39], "blocks", options=options).attend(q),
                     filled(k[:, :39], v[:, :39], "blocks", options=dict(options, axes=0)).attend(q))
    with pytest.raises(ValueError, match="axes must be in"):
        filled(k, v, "blocks", options=dict(options, axes=-1))
