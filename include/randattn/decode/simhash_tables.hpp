#pragma once
// SimHash tables for sampling keys as in MagicPIG (Chen et al., "MagicPIG: LSH Sampling for
// Efficient LLM Generation", arXiv 2410.16179), after Charikar's SimHash (STOC 2002).
//
// L tables of K sign bits: bit b of table t for a vector x is [r_{tK+b}·x > 0] with r ~ N(0, I_d)
// drawn from Philox (a pure function of seed, kv head, hyperplane and coordinate). For the angle
// θ between q and k, one table collides with probability c = (1 − θ/π)^K, independently across
// tables, so a key collides in at least two of the L tables with probability
//     p = P[Binomial(L, c) ≥ 2] = 1 − (1 − c)^L − L·c·(1 − c)^{L−1}.
// A zero vector has every bit 0 and collides like θ = π/2.
//
// Keys are hashed in blocks (O(L·K·d) per key, one matrix product per block, so the L·K x d
// hyperplanes are read once per block rather than once per key) and each key's index is
// appended to one bucket per table; a query looks up its L buckets.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/chunk_products.hpp"
#include "../detail/threshold_mask.hpp"
#include "../detail/validation.hpp"
#include "../random/fill.hpp"
#include "../random/philox.hpp"
#include "../random/streams.hpp"
#include "detail/bucket_lists.hpp"

namespace randattn {

// Collision probability of one table of `bits` SimHash bits at cosine cos_theta.
inline double simhash_collision_probability(double cos_theta, int bits) {
  const double c = std::clamp(cos_theta, -1.0, 1.0);
  constexpr double pi = 3.141592653589793238462643383279502884;
  const double base = 1.0 - std::acos(c) / pi;
  double power = 1.0;  // base^bits by multiplication (bits is small)
  for (int b = 0; b < bits; ++b) power *= base;
  return power;
}

// P[Binomial(tables, c) ≥ 2] for c = simhash_collision_probability(cos_theta, bits): the
// probability that a key at that cosine is sampled. Small probabilities are summed term by term
// (no cancellation), so the result keeps its relative accuracy down to the smallest doubles.
inline double simhash_sample_probability(double cos_theta, int bits, int tables) {
  if (tables < 2) return 0.0;
  const double c = simhash_collision_probability(cos_theta, bits);
  if (c >= 1.0) return 1.0;
  if (c <= 0.0) return 0.0;
  const double L = tables;
  const double log_miss = std::log1p(-c);
  if (L * c > 1.0) {
    // 1 − (1 − c)^L − L c (1 − c)^{L−1}, with one exponential.
    const double miss = std::exp((L - 1) * log_miss);
    return 1.0 - miss * (1.0 - c) - L * c * miss;
  }
  // Σ_{i ≥ 2} C(L, i) c^i (1 − c)^{L − i}, from term 2 by the ratio of consecutive terms.
  double term = 0.5 * L * (L - 1) * c * c * std::exp((L - 2) * log_miss);
  double sum = 0.0;
  const double odds = c / (1.0 - c);
  for (int i = 2; i <= tables && term > 0.0; ++i) {
    sum += term;
    if (term < 1e-17 * sum) break;
    term *= (L - i) / (i + 1.0) * odds;
  }
  return std::min(sum, 1.0);
}

namespace detail {

template <typename Scalar>
class SimHashTables {
 public:
  SimHashTables() = default;

  // Hyperplanes for kv head `head`: rows head·L·K .. (head + 1)·L·K − 1 of the Philox draw.
  SimHashTables(Index dim, int bits, int tables, std::uint64_t seed, Index head)
      : bits_(bits), tables_(tables), dim_(dim) {
    const Index planes = Index(bits) * tables;
    RowMatrix<Scalar> rows(planes, dim);
    fill_gaussian(Philox(seed, streams::kv_cache_simhash), rows, head * planes, 0);
    planes_t_ = rows.transpose();
    buckets_ = BucketLists(static_cast<std::size_t>(tables) << bits);
  }

  struct HashScratch {
    Vector<Scalar> x, proj;
    RowMatrix<Scalar> block_proj;
    std::vector<std::uint64_t> signs;
  };

  int bits() const { return bits_; }
  int tables() const { return tables_; }
  Index planes() const { return Index(bits_) * tables_; }

  // Codes of x − centre (centre may be null) into codes[0 .. tables). The projections are one
  // matrix-vector product of fixed shape on an aligned copy of x, so a vector's codes do not
  // depend on where it is stored or how many vectors were appended with it.
  void codes(const Scalar* x, const Scalar* centre, HashScratch& scratch,
             std::uint32_t* codes) const {
    scratch.x.resize(dim_);
    scratch.proj.resize(planes());
    for (Index c = 0; c < dim_; ++c) scratch.x(c) = centre ? x[c] - centre[c] : x[c];
    scratch.proj.noalias() = planes_t_.transpose() * scratch.x;
    codes_of(scratch.proj.data(), scratch, codes);
  }

  // Codes of the rows of x (rows x dim, already centred) into codes[r·tables + t]: one product
  // x·planesᵀ. Its rounding depends on the shapes only (register tiles over the whole depth),
  // so a block's codes do not depend on how its rows were appended or on the thread count.
  template <typename Rows>
  void codes_block(const Rows& x, HashScratch& scratch, std::uint32_t* codes) const {
    scratch.block_proj.resize(x.rows(), planes());
    row_panel_product(scratch.block_proj, x, planes_t_, false);
    for (Index r = 0; r < x.rows(); ++r)
      codes_of(scratch.block_proj.row(r).data(), scratch, codes + r * tables_);
  }

  // Room for `keys` more keys in every table.
  void reserve_keys(std::size_t keys) { buckets_.reserve(keys * std::size_t(tables_)); }

  // Files keys first, first + 1, .., first + count − 1, whose codes are codes[r·tables + t]:
  // every bucket keeps its keys in increasing order, as key-by-key filing would leave it.
  // Each key lands in a bucket of its own per table, a cache miss apiece (the buckets span tens
  // of MB), so the misses are made to overlap: for up to kBatch keys, one table at a time, the
  // buckets' headers are requested a table ahead and their next slots before any key is
  // written. One miss after another cost 1.5× as much (Zen 3).
  void insert_block(std::int32_t first, Index count, const std::uint32_t* codes) {
    for (Index r0 = 0; r0 < count; r0 += kBatch) {
      const Index rows = std::min(kBatch, count - r0);
      const std::uint32_t* c = codes + r0 * tables_;
      const auto target = [&](int t, Index r) { return list(t, c[r * tables_ + t]); };
      for (Index r = 0; r < rows; ++r) buckets_.prefetch_head(target(0, r));
      for (int t = 0; t < tables_; ++t) {
        for (Index r = 0; r < rows; ++r) buckets_.prefetch_next_slot(target(t, r));
        if (t + 1 < tables_)
          for (Index r = 0; r < rows; ++r) buckets_.prefetch_head(target(t + 1, r));
        for (Index r = 0; r < rows; ++r)
          buckets_.push_back(target(t, r), first + std::int32_t(r0 + r));
      }
    }
  }

  using Run = BucketLists::Run;
  using Cursor = BucketLists::Cursor;

  // The keys filed under codes[t] in every table t, as runs appended to `runs`.
  void collect_buckets(const std::uint32_t* codes, std::vector<Run>& runs,
                       std::vector<Cursor>& walking) const {
    buckets_.collect_runs(
        tables_, [&](Index t) { return list(int(t), codes[t]); }, runs, walking);
  }

  std::size_t bytes() const {
    return sizeof(Scalar) * static_cast<std::size_t>(planes_t_.size()) + buckets_.bytes();
  }

 private:
  // The L codes of one projected vector (bit b of table t: proj[tK + b] > 0). The signs are
  // packed 64 to a word first (8 or 16 at a time with AVX compares), then each table's K bits
  // are one shifted read of that bit string: a few operations per table instead of K.
  void codes_of(const Scalar* proj, HashScratch& scratch, std::uint32_t* codes) const {
    const Index n = planes(), words = (n + 63) / 64;
    scratch.signs.resize(std::size_t(words) + 1);  // + 1: a code may read past the last word
    scratch.signs.back() = 0;
    for (Index w = 0; w < words; ++w) {
      const Index first = w * 64;
      scratch.signs[std::size_t(w)] =
          threshold_mask<true>(proj + first, std::min<Index>(64, n - first), Scalar(0));
    }
    const std::uint64_t mask = (std::uint64_t(1) << bits_) - 1;
    for (int t = 0; t < tables_; ++t) {
      const Index first = Index(t) * bits_, shift = first % 64;
      const std::uint64_t* word = scratch.signs.data() + first / 64;
      std::uint64_t code = word[0] >> shift;
      if (shift + bits_ > 64) code |= word[1] << (64 - shift);
      codes[t] = std::uint32_t(code & mask);
    }
  }

  std::size_t list(int table, std::uint32_t code) const {
    return (static_cast<std::size_t>(table) << bits_) + code;
  }

  static constexpr Index kBatch = 64;
  int bits_ = 0, tables_ = 0;
  Index dim_ = 0;
  // One hyperplane per column, table t owning columns [t·K, (t + 1)·K): stored d x L·K so that
  // a block's product runs in the library's row-panel tiles (detail/chunk_products.hpp).
  RowMatrix<Scalar> planes_t_;
  BucketLists buckets_;  // bucket (t, code) is list t·2^K + code
};

}  // namespace detail
}  // namespace randattn
