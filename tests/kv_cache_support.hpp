#pragma once
// Inputs of the key/value cache's tests, shared by test_kv_cache.cpp and the thread tests
// (test_threads.cpp): tokens in the cache's head-major layout, peaked queries, filled caches.

#include <cstdint>

#include <randattn/decode/kv_cache.hpp>

#include "support.hpp"

namespace testing {

using randattn::DecodeMode;
using randattn::KvCache;
using randattn::KvCacheOptions;

// Keys and values of kv_heads heads in the cache's head-major block layout: rows
// [h·n, (h + 1)·n) are head h. Keys share a mean offset and cluster, so attention is peaked.
template <typename Scalar>
struct Tokens {
  RowMatrix<Scalar> k, v;
  Index n, kv_heads;
  Tokens(std::uint64_t seed, Index n_, Index kv_heads_, Index d, Index dv)
      : n(n_), kv_heads(kv_heads_) {
    k = clustered<Scalar>(seed, n * kv_heads, d, 7, 0.5);
    k.rowwise() += gaussian<Scalar>(seed + 2, 1, d, 1.0).row(0);
    v = gaussian<Scalar>(seed + 3, n * kv_heads, dv);
  }
  // Tokens [i0, i0 + t) of every head, head-major.
  RowMatrix<Scalar> keys(Index i0, Index t) const { return slice(k, i0, t); }
  RowMatrix<Scalar> values(Index i0, Index t) const { return slice(v, i0, t); }
  RowMatrix<Scalar> head_keys(Index h) const { return k.middleRows(h * n, n); }
  RowMatrix<Scalar> head_values(Index h) const { return v.middleRows(h * n, n); }

 private:
  RowMatrix<Scalar> slice(const RowMatrix<Scalar>& m, Index i0, Index t) const {
    RowMatrix<Scalar> out(kv_heads * t, m.cols());
    for (Index h = 0; h < kv_heads; ++h) out.middleRows(h * t, t) = m.middleRows(h * n + i0, t);
    return out;
  }
};

// Queries that point at a few keys of their kv head (peaked attention).
template <typename Scalar>
RowMatrix<Scalar> needle_queries(const Tokens<Scalar>& tok, Index q_heads, std::uint64_t seed,
                                 double strength) {
  const Index d = tok.k.cols(), group = q_heads / tok.kv_heads;
  RowMatrix<Scalar> q = gaussian<Scalar>(seed, q_heads, d, 0.3);
  for (Index i = 0; i < q_heads; ++i) {
    const Index h = i / group;
    const Index j = (i * 7919 + 13) % tok.n;
    q.row(i) += Scalar(strength) * tok.k.row(h * tok.n + j) / tok.k.row(h * tok.n + j).norm();
  }
  return q;
}

template <typename Scalar>
KvCache<Scalar> filled(const Tokens<Scalar>& tok, const KvCacheOptions& opt) {
  KvCache<Scalar> cache(tok.k.cols(), tok.v.cols(), tok.kv_heads, opt);
  cache.append(tok.k, tok.v);
  return cache;
}

inline KvCacheOptions clusters_options(Index clusters, Index probe, Index sinks = 4, Index window = 32) {
  KvCacheOptions o;
  o.mode = DecodeMode::clusters;
  o.clusters = clusters;
  o.probe = probe;
  o.sinks = sinks;
  o.window = window;
  o.seed = 11;
  return o;
}

inline // Tokens whose second half of keys is a tight blob away from the first half's: the cluster
// nearest to it receives every new key, outgrows the limit and splits, again and again.
Tokens<float> drifting_tokens(std::uint64_t seed, Index n, Index kv_heads, Index d, Index dv) {
  Tokens<float> tok(seed, n, kv_heads, d, dv);
  const RowMatrix<float> away = gaussian<float>(seed + 5, kv_heads, d, 3.0);
  for (Index h = 0; h < kv_heads; ++h)
    for (Index j = n / 2; j < n; ++j)
      tok.k.row(h * n + j) = 0.2f * tok.k.row(h * n + j) + away.row(h);
  return tok;
}

}  // namespace testing
