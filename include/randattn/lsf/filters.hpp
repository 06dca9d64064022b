#pragma once
// Locality-sensitive filters on the unit sphere: m filter directions a_1 … a_m per table, L
// independent tables. A vector x is seen through its normalised scores <a_i, x̂>, x̂ = x / |x|
// (a zero vector scores 0 everywhere). Keys are stored in one filter per table, the argmax of
// their scores (ties to the lowest index, so a zero key lands in filter 0); queries open every
// filter whose score reaches a threshold η (see lsf_attention.hpp).
//
// Filters, both scaled so that a score of a unit vector has variance 1 (the scale of the
// threshold formula below):
//   dense     a_i ~ N(0, I_d) i.i.d.; entry (t m + i, c) is Philox(seed, lsf_dense_filters)
//             .gaussian(t m + i, c). O(m d) per vector and table. Users may supply the matrix.
//   hadamard  the first m rows of √p · H D3 H D2 H D1 / p^{3/2} (the pseudo-random rotation of
//             Andoni et al., hashing/rotation.hpp), p = next power of two >= max(d, m), one
//             rotation per table: a unit vector's rotated coordinates have variance 1/p, so the √p
//             gain gives unit variance. O(p log p) per vector and table.
//
// Scores are computed for blocks of 64 rows aligned at row 0 of the input, so the scores of a
// row do not depend on the thread count or on which function asked for them.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/column_argmax.hpp"
#include "../detail/gemm.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "../hashing/detail/tiles.hpp"
#include "../hashing/hash_codes.hpp"
#include "../hashing/rotation.hpp"
#include "../hashing/unit_rows.hpp"
#include "../random/fill.hpp"
#include "../random/philox.hpp"
#include "../random/streams.hpp"

namespace randattn {

// The threshold η on normalised scores for a target cosine α between a query and the keys it
// should find, with m filters per table:
//   η = α √(2 ln m) − √(2 (1 − α²) ln ln m),
// the query threshold of the TensorTop-1 filters (Aumüller, Silvestri et al.; see the note "LSH
// applied to Transformer: The Reformer", last section), in the framework of Christiani, "A
// framework for similarity search with space-time tradeoffs using locality-sensitive filtering"
// (SODA 2017). A key's best score is about √(2 ln m); a query at cosine α from it scores about
// α times that on the key's filter. ln ln m is taken as 0 for m < 3 (where it is not positive).
inline double filter_threshold(double alpha, Index filters) {
  detail::require(std::isfinite(alpha) && alpha > 0 && alpha < 1, "filter_threshold",
                  "alpha must be in (0, 1), got ", alpha);
  detail::require(filters >= 1, "filter_threshold", "filters must be >= 1, got ", filters);
  const double ln_m = std::log(double(filters));
  const double lnln_m = filters >= 3 ? std::log(ln_m) : 0.0;
  return alpha * std::sqrt(2 * ln_m) - std::sqrt(2 * (1 - alpha * alpha) * lnln_m);
}

template <typename Scalar_>
class LocalitySensitiveFilters {
 public:
  using Scalar = Scalar_;
  static_assert(std::is_floating_point<Scalar>::value, "Scalar must be float or double");

  // m filters per table, L tables, drawn from `seed`.
  LocalitySensitiveFilters(RotationKind kind, Index dim, Index filters, Index tables,
                           std::uint64_t seed)
      : kind_(kind), dim_(dim), filters_(filters), tables_(tables) {
    check_shape(dim, filters, tables);
    if (kind == RotationKind::dense) {
      a_ = gaussian_matrix<Scalar>(Philox(seed, streams::lsf_dense_filters), tables * filters, dim);
    } else {
      // The rotation draws from its own stream; its seed is a draw of ours, so filters and LSH
      // rotations built from the same seed are independent.
      const Philox::Bits b = Philox(seed, streams::lsf_hadamard_filters).bits(0);
      const std::uint64_t rotation_seed = (std::uint64_t(b[1]) << 32) | b[0];
      rotation_ = HadamardRotation<Scalar>(dim, 2 * filters, tables, rotation_seed);
      gain_ = static_cast<Scalar>(std::sqrt(double(rotation_.padded_dim())));
    }
  }

  // User filters: a (tables * m) x d matrix whose row t m + i is filter i of table t, used as is
  // (the threshold formula assumes scores of unit variance, e.g. rows with norm about √d).
  LocalitySensitiveFilters(RowMatrix<Scalar> a, Index tables)
      : kind_(RotationKind::dense), a_(std::move(a)) {
    const char* where = "LocalitySensitiveFilters";
    detail::require(tables >= 1 && a_.rows() % tables == 0, where, "the filter matrix (",
                    detail::shape_of(a_), ") must have tables * m rows, tables = ", tables);
    check_shape(a_.cols(), a_.rows() / tables, tables);
    detail::require_finite(a_, where, "the filter matrix");
    dim_ = a_.cols();
    tables_ = tables;
    filters_ = a_.rows() / tables;
  }

  RotationKind kind() const { return kind_; }
  Index dim() const { return dim_; }
  Index filters() const { return filters_; }
  Index tables() const { return tables_; }

  // The filters as rows: (tables * m) x d, row t m + i is a_i of table t (materialised from the
  // rotation for the Hadamard kind).
  RowMatrix<Scalar> matrix() const {
    if (kind_ == RotationKind::dense) return a_;
    RowMatrix<Scalar> a(tables_ * filters_, dim_), work;
    const RowMatrix<Scalar> identity = RowMatrix<Scalar>::Identity(dim_, dim_);
    for (Index t = 0; t < tables_; ++t) {
      // Column c of the scores of the unit vectors e_c: the c-th coordinate of every filter.
      score_block(identity, t, a.middleRows(t * filters_, filters_), work);
    }
    return a;
  }

  // Normalised scores <a_i, x̂> of the rows of x in table `table`: n x m.
  RowMatrix<Scalar> scores(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index table,
                           bool check_finite = true) const {
    const char* where = "LocalitySensitiveFilters::scores";
    check_input(where, x, check_finite);
    detail::require(table >= 0 && table < tables_, where, "table ", table, " is outside [0, ",
                    tables_, ")");
    RowMatrix<Scalar> out(x.rows(), filters_);
    const RowMatrix<Scalar> unit = unit_rows<Scalar>(x);
    for_each_block(unit,
                   [&](Index i0, const auto& block, RowMatrix<Scalar>& s, RowMatrix<Scalar>& work) {
                     score_block(block, table, s, work);
                     out.middleRows(i0, block.rows()) = s.transpose();
                   });
    return out;
  }

  // The filter each row of x is stored in, per table (argmax of its scores): n x tables.
  HashCodes assign(const Eigen::Ref<const RowMatrix<Scalar>>& x, bool check_finite = true) const {
    check_input("LocalitySensitiveFilters::assign", x, check_finite);
    return assign_unit(unit_rows<Scalar>(x));
  }

  // --- For the attention kernels: rows already normalised (unit_rows). -------------

  // Scores of a block of B unit rows in table t, filter-major: out(f, u) = <a_f, row u>, out
  // m x B (for_each_block hands out scores of that shape). Filter
  // by filter the B scores are contiguous, which is how the consumers scan them (thresholds,
  // running maxima) and how the Hadamard rotation leaves its coordinates.
  template <typename X, typename Out>
  void score_block(const Eigen::MatrixBase<X>& unit_block, Index t, Out&& out,
                   RowMatrix<Scalar>& work) const {
    eigen_assert(out.rows() == filters_ && out.cols() == unit_block.rows());
    if (kind_ == RotationKind::dense) {
      detail::gemm_fixed_depth(out, a_.middleRows(t * filters_, filters_), unit_block.transpose(),
                               false);
    } else {
      out = gain_ * rotation_.project_round(unit_block, t, work);
    }
  }

  // Runs fn(first_row, block, scores, work) on the aligned 64-row blocks of `unit`, in parallel.
  // scores and work come sized for the block from the thread's pool (detail/matrix_pool.hpp).
  template <typename Fn>
  void for_each_block(const RowMatrix<Scalar>& unit, Fn&& fn) const {
    const Index n = unit.rows(), blocks = (n + detail::kHashTile - 1) / detail::kHashTile;
    detail::parallel_for(blocks, [&](Index b) {
      const Index i0 = b * detail::kHashTile, rows = std::min(detail::kHashTile, n - i0);
      detail::Scratch<RowMatrix<Scalar>> s(filters_, rows);  // filter-major (score_block)
      detail::Scratch<RowMatrix<Scalar>> work(
          kind_ == RotationKind::dense ? 0 : rotation_.padded_dim(), rows);
      fn(i0, unit.middleRows(i0, rows), s, work);
    });
  }

  HashCodes assign_unit(const RowMatrix<Scalar>& unit) const {
    HashCodes codes(unit.rows(), tables_);
    assign_unit_into(unit, codes);
    return codes;
  }

  // The same into `codes` (unit.rows() x tables()).
  void assign_unit_into(const RowMatrix<Scalar>& unit, HashCodes& codes) const {
    for_each_block(unit,
                   [&](Index i0, const auto& block, RowMatrix<Scalar>& s, RowMatrix<Scalar>& work) {
                     for (Index t = 0; t < tables_; ++t) {
                       score_block(block, t, s, work);
                       // The first maximum of every column: ties keep the lower filter.
                       detail::column_argmax<false>(s.data(), s.outerStride(), filters_,
                                                    block.rows(), Scalar(1), &codes(i0, t),
                                                    codes.outerStride());
                     }
                   });
  }

 private:
  static void check_shape(Index dim, Index filters, Index tables) {
    const char* where = "LocalitySensitiveFilters";
    detail::require(dim >= 1, where, "dim must be >= 1, got ", dim);
    detail::require(filters >= 1 && filters <= (Index(1) << 23), where,
                    "filters m must be in [1, 2^23], got ", filters);
    detail::require(
        tables >= 1 && tables * filters <= Index(std::numeric_limits<std::int32_t>::max()), where,
        "tables L must be >= 1 with L * m < 2^31, got L = ", tables, ", m = ", filters);
  }

  void check_input(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& x,
                   bool check_finite) const {
    detail::require(x.rows() == 0 || x.cols() == dim_, where, "x is ", detail::shape_of(x),
                    " but the filters were built for dimension ", dim_);
    detail::require_finite(x, where, "x", check_finite);
  }

  RotationKind kind_;
  Index dim_ = 0, filters_ = 0, tables_ = 0;
  RowMatrix<Scalar> a_;                // dense: (tables * m) x d
  HadamardRotation<Scalar> rotation_;  // hadamard: one round per table
  Scalar gain_ = 1;                    // hadamard: √p
};

}  // namespace randattn
