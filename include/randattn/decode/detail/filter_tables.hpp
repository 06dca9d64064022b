#pragma once
// Locality-sensitive filters for a key/value cache (Christiani, "A framework for similarity search
// with space-time tradeoffs using locality-sensitive filtering", SODA 2017), the asymmetric
// alternative to shared-QK LSH: keys are stored, queries probe, so Q and K need not be shared.
// The threshold is lsf/filters.hpp's filter_threshold.
//
// L tables of m filters a_1 … a_m ~ N(0, I_d) (Philox: a pure function of seed, kv head, filter,
// coordinate). On append a key is stored in one filter per table, argmax_i ⟨a_i, k − k̄⟩ (the
// direction of the centred key; normalising does not change the argmax). A query opens, per
// table, the filters with ⟨a_i, q̂⟩ ≥ η, and at least `min_probes` of its best filters; the keys
// found form a support attended exactly (no weights). With η = −∞ every filter opens.
//   η = α·√(2 ln m) − √(2 (1 − α²) ln ln m)  for a target cosine α.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include <Eigen/Core>

#include "../../core/types.hpp"
#include "../../lsf/filters.hpp"
#include "../../random/fill.hpp"
#include "../../random/philox.hpp"
#include "../../random/streams.hpp"

namespace randattn {

namespace detail {

template <typename Scalar>
class FilterTables {
 public:
  struct Scratch {
    Vector<Scalar> x, proj;
    std::vector<std::int32_t> order;
  };

  FilterTables() = default;

  FilterTables(Index dim, Index filters, int tables, std::uint64_t seed, Index head)
      : filters_(filters), tables_(tables), dim_(dim) {
    const Index rows = filters * tables;
    planes_.resize(rows, dim);
    fill_gaussian(Philox(seed, streams::kv_cache_filters), planes_, head * rows, 0);
    buckets_.resize(static_cast<std::size_t>(rows));
  }

  Index filters() const { return filters_; }
  int tables() const { return tables_; }

  // Projections of x − centre (centre may be null) on every filter into scratch.proj: one
  // matrix-vector product of fixed shape on an aligned copy, so stored filters do not depend on
  // how the keys were appended.
  void project(const Scalar* x, const Scalar* centre, Scratch& s) const {
    s.x.resize(dim_);
    for (Index c = 0; c < dim_; ++c) s.x(c) = centre ? x[c] - centre[c] : x[c];
    s.proj.resize(planes_.rows());
    s.proj.noalias() = planes_ * s.x;
  }

  // Stores key j in its best filter of every table (the lowest index among ties).
  void insert(std::int32_t j, const Scalar* key, const Scalar* centre, Scratch& s) {
    project(key, centre, s);
    for (int t = 0; t < tables_; ++t) {
      Index best = 0;
      s.proj.segment(t * filters_, filters_).maxCoeff(&best);
      buckets_[static_cast<std::size_t>(t * filters_ + best)].push_back(j);
    }
  }

  // Calls visit(bucket) for every filter the query opens; returns the number opened.
  template <typename Visit>
  Index probe(const Scalar* q, Scalar threshold, Index min_probes, Scratch& s, Visit visit) const {
    project(q, nullptr, s);
    const Scalar norm = s.x.norm();
    const Scalar bar = threshold == -std::numeric_limits<Scalar>::infinity()
                           ? threshold
                           : threshold * norm;  // ⟨a_i, q⟩ ≥ η‖q‖ ⇔ ⟨a_i, q̂⟩ ≥ η
    Index opened = 0;
    const Index must = std::min(min_probes, filters_);
    for (int t = 0; t < tables_; ++t) {
      const auto score = s.proj.segment(t * filters_, filters_);
      // Every filter whose cosine with q reaches the threshold ...
      for (Index i = 0; i < filters_; ++i) {
        if (score(i) >= bar) {
          visit(buckets_[static_cast<std::size_t>(t * filters_ + i)]);
          ++opened;
        }
      }
      // ... and the `must` best (ties by index), if below it.
      if (must > 0) {
        s.order.resize(static_cast<std::size_t>(filters_));
        std::iota(s.order.begin(), s.order.end(), 0);
        const auto better = [&](std::int32_t a, std::int32_t b) {
          return score(a) > score(b) || (score(a) == score(b) && a < b);
        };
        std::nth_element(s.order.begin(), s.order.begin() + (must - 1), s.order.end(), better);
        for (Index u = 0; u < must; ++u) {
          const Index i = s.order[u];
          if (score(i) >= bar) continue;  // already opened
          visit(buckets_[static_cast<std::size_t>(t * filters_ + i)]);
          ++opened;
        }
      }
    }
    return opened;
  }

  void reserve_buckets(std::size_t per_bucket) {
    for (auto& b : buckets_) b.reserve(per_bucket);
  }

  std::size_t bytes() const {
    std::size_t b = sizeof(Scalar) * static_cast<std::size_t>(planes_.size());
    for (const auto& v : buckets_) b += v.capacity() * sizeof(std::int32_t) + sizeof(v);
    return b;
  }

 private:
  Index filters_ = 0;
  int tables_ = 0;
  Index dim_ = 0;
  RowMatrix<Scalar> planes_;  // table t owns rows [t·m, (t + 1)·m)
  std::vector<std::vector<std::int32_t>> buckets_;
};

}  // namespace detail
}  // namespace randattn
