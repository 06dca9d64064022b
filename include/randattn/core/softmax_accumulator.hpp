#pragma once
// The shared core of every attention path: per query row an unnormalised pair
// (num_i, den_i) relative to a per-row log-scale c_i, i.e. the true pair is
// exp(c_i) * (num_i, den_i). Partial results for the same rows (key blocks, hash rounds,
// shards) merge exactly like online softmax.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include <Eigen/Core>

#include "../detail/fresh_matrix.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "types.hpp"

namespace randattn {

namespace detail {

// The online-softmax merge rule: dst (relative to exp(c_dst)) absorbs src (relative to
// exp(c_src)); a log-scale of -inf means "no weight yet". Serves accumulator rows and the
// carried key states of linear attention alike.
template <typename Dst, typename Src, typename Scalar>
void merge_scaled(Dst&& dst, Scalar& c_dst, const Src& src, Scalar c_src) {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  if (c_src == kNegInf) return;
  if (c_dst == kNegInf) {
    dst = src;
    c_dst = c_src;
  } else if (c_src <= c_dst) {
    dst += std::exp(c_src - c_dst) * src;
  } else {
    dst = std::exp(c_dst - c_src) * dst + src;
    c_dst = c_src;
  }
}

// The log-scale merge_scaled leaves in c_dst.
template <typename Scalar>
Scalar merged_log_scale(Scalar c_dst, Scalar c_src) {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  if (c_src == kNegInf) return c_dst;
  return c_dst == kNegInf ? c_src : std::max(c_dst, c_src);
}

}  // namespace detail

template <typename Scalar_>
class SoftmaxAccumulator {
 public:
  using Scalar = Scalar_;

  SoftmaxAccumulator() : SoftmaxAccumulator(0, 0) {}

  // Empty state: no weight on any row (den = 0, log-scale = -inf). The storage comes from the
  // calling thread's pool (detail/matrix_pool.hpp) and goes back to it with the accumulator.
  SoftmaxAccumulator(Index rows, Index value_dim) : value_dim_(value_dim) {
    detail::require(rows >= 0 && value_dim >= 0, "SoftmaxAccumulator",
                    "negative shape: rows = ", rows, ", value_dim = ", value_dim);
    nd_ = detail::MatrixPool<RowMatrix<Scalar>>::take(rows, value_dim + 1);
    log_scale_ = detail::MatrixPool<Vector<Scalar>>::take(rows);
    nd_.setZero();
    log_scale_.setConstant(-std::numeric_limits<Scalar>::infinity());
  }

  // Takes a complete [num | den] block (rows x (value_dim + 1)) with its per-row log-scales.
  SoftmaxAccumulator(RowMatrix<Scalar> numden, Vector<Scalar> log_scale)
      : value_dim_(numden.cols() - 1), nd_(std::move(numden)), log_scale_(std::move(log_scale)) {
    detail::require(nd_.cols() >= 1 && log_scale_.size() == nd_.rows(), "SoftmaxAccumulator",
                    "numden is ", nd_.rows(), "x", nd_.cols(), " but ", log_scale_.size(),
                    " log-scales were given");
  }

  SoftmaxAccumulator(const SoftmaxAccumulator&) = default;
  SoftmaxAccumulator(SoftmaxAccumulator&&) = default;
  SoftmaxAccumulator& operator=(const SoftmaxAccumulator&) = default;
  SoftmaxAccumulator& operator=(SoftmaxAccumulator&&) = default;
  ~SoftmaxAccumulator() {
    detail::MatrixPool<RowMatrix<Scalar>>::give(std::move(nd_));
    detail::MatrixPool<Vector<Scalar>>::give(std::move(log_scale_));
  }

  Index rows() const { return nd_.rows(); }
  Index value_dim() const { return value_dim_; }

  // [num | den]: rows x (value_dim + 1); the last column is the denominator.
  const RowMatrix<Scalar>& numden() const { return nd_; }
  auto numerator() const { return nd_.leftCols(value_dim_); }
  auto denominator() const { return nd_.col(value_dim_); }
  const Vector<Scalar>& log_scale() const { return log_scale_; }

  // Hands over [num | den] and the log-scales without copying them (to rescale or correct them
  // and build a new accumulator); this one is left with no rows.
  std::pair<RowMatrix<Scalar>, Vector<Scalar>> release() && {
    std::pair<RowMatrix<Scalar>, Vector<Scalar>> parts(std::move(nd_), std::move(log_scale_));
    nd_.resize(0, value_dim_ + 1);
    log_scale_.resize(0);
    return parts;
  }

  // Merges a partial [num | den] block for rows [row0, row0 + nd.rows()), given relative to
  // the per-row log-scales `log_scale`. A row with log-scale -inf carries no weight.
  // Rows are independent, so disjoint row ranges may be merged from different threads.
  template <typename DerivedND, typename DerivedC>
  void merge_rows(Index row0, const Eigen::MatrixBase<DerivedND>& nd,
                  const Eigen::MatrixBase<DerivedC>& log_scale) {
    detail::require(nd.cols() == value_dim_ + 1 && log_scale.size() == nd.rows() && row0 >= 0 &&
                        row0 + nd.rows() <= rows(),
                    "SoftmaxAccumulator::merge_rows", "block ", nd.rows(), "x", nd.cols(), " with ",
                    log_scale.size(), " log-scales at row ", row0,
                    " does not fit an accumulator of ", rows(), "x", value_dim_ + 1);
    for (Index r = 0; r < nd.rows(); ++r) merge_row(row0 + r, nd.row(r), Scalar(log_scale(r)));
  }

  // Merges row t of a partial [num | den] block into row rows[t], for gathered rows (hash
  // buckets, filters). Rows are independent: disjoint row sets may be merged from different
  // threads.
  template <typename DerivedND, typename DerivedC>
  void merge_gathered(const std::int32_t* rows, const Eigen::MatrixBase<DerivedND>& nd,
                      const Eigen::MatrixBase<DerivedC>& log_scale) {
    detail::require(nd.cols() == value_dim_ + 1 && log_scale.size() == nd.rows(),
                    "SoftmaxAccumulator::merge_gathered", "block ", nd.rows(), "x", nd.cols(),
                    " with ", log_scale.size(), " log-scales does not fit an accumulator of ",
                    this->rows(), "x", value_dim_ + 1);
    for (Index t = 0; t < nd.rows(); ++t) {
      detail::require(rows[t] >= 0 && rows[t] < this->rows(), "SoftmaxAccumulator::merge_gathered",
                      "row ", rows[t], " is outside [0, ", this->rows(), ")");
      merge_row(rows[t], nd.row(t), Scalar(log_scale(t)));
    }
  }

  // Merges another accumulator over the same rows.
  void merge(const SoftmaxAccumulator& other) {
    detail::require(other.rows() == rows() && other.value_dim() == value_dim_,
                    "SoftmaxAccumulator::merge", "shapes differ: ", rows(), "x", value_dim_, " vs ",
                    other.rows(), "x", other.value_dim());
    merge_rows(0, other.nd_, other.log_scale_);
  }

  // o_i = num_i / den'_i with the denominator guard den' = den + 2*eps*[|den| <= eps]
  // (the rule of the Performer reference code). With eps > 0 every |den'| >= eps, so signed
  // or trigonometric estimates whose denominator is near zero give large but finite output.
  // A row whose guarded denominator is zero or subnormal (eps = 0 and no weight, or weights that
  // underflowed) outputs zeros.
  RowMatrix<Scalar> finalize(Scalar epsilon = 0) const {
    auto out = detail::fresh_matrix<RowMatrix<Scalar>>(rows(), value_dim_);
    finalize_into(out, epsilon);
    return out;
  }

  template <typename Derived>
  void finalize_into(const Eigen::MatrixBase<Derived>& out_, Scalar epsilon = 0) const {
    auto& out = const_cast<Eigen::MatrixBase<Derived>&>(out_);
    detail::require(out.rows() == rows() && out.cols() == value_dim_,
                    "SoftmaxAccumulator::finalize_into", "output is ", out.rows(), "x", out.cols(),
                    ", expected ", rows(), "x", value_dim_);
    detail::require(epsilon >= 0, "SoftmaxAccumulator::finalize", "epsilon must be >= 0, got ",
                    epsilon);
    // Rows in pieces of about 2^16 entries, in parallel for a long sequence.
    const Index piece = std::max<Index>(1, (Index(1) << 16) / std::max<Index>(1, value_dim_));
    detail::parallel_for((rows() + piece - 1) / piece, [&](Index t) {
      for (Index i = t * piece; i < std::min(rows(), (t + 1) * piece); ++i) {
        const Scalar den = guarded_denominator(nd_(i, value_dim_), epsilon);
        if (den == Scalar(0)) {
          out.row(i).setZero();
        } else {
          out.row(i) = nd_.row(i).head(value_dim_) / den;
        }
      }
    });
  }

  // The row log-sum-exps L_i = c_i + log den_i of an accumulator of softmax weights (den >= 0),
  // written into lse (rows entries): the log of each row's true denominator, what a backward pass
  // needs to recompute the weights exp(s_ij − L_i). A row that finalize() outputs as zeros (den 0
  // or subnormal) has L_i = −inf.
  template <typename Derived>
  void log_sum_exp_into(const Eigen::MatrixBase<Derived>& lse_) const {
    auto& lse = const_cast<Eigen::MatrixBase<Derived>&>(lse_);
    detail::require(lse.size() == rows(), "SoftmaxAccumulator::log_sum_exp_into", "lse has ",
                    lse.size(), " entries, expected ", rows());
    for (Index i = 0; i < rows(); ++i) {
      const Scalar den = guarded_denominator(nd_(i, value_dim_), Scalar(0));
      lse(i) = den > Scalar(0) ? log_scale_(i) + std::log(den)
                               : -std::numeric_limits<Scalar>::infinity();
    }
  }

  // The guarded denominator, or 0 when it is 0 or subnormal: a sum of weights that underflowed
  // into the subnormal range has lost its relative precision, and dividing by it would leave
  // the hull of the values.
  static Scalar guarded_denominator(Scalar den, Scalar epsilon) {
    const Scalar guarded = std::abs(den) <= epsilon ? den + 2 * epsilon : den;
    return std::abs(guarded) < std::numeric_limits<Scalar>::min() ? Scalar(0) : guarded;
  }

 private:
  template <typename Row>
  void merge_row(Index i, const Row& incoming, Scalar c_in) {
    detail::merge_scaled(nd_.row(i), log_scale_(i), incoming, c_in);
  }

  Index value_dim_;
  RowMatrix<Scalar> nd_;
  Vector<Scalar> log_scale_;
};

namespace detail {

// The post-condition of a softmax path whose inputs were checked (or whose check is off, then
// nothing is scanned): a non-finite numerator, denominator or log-scale means the logits left
// the floating-point range, and so does a row whose logits all overflowed to -inf when every
// row has a key. Reported as overflow (check_result_finite), never returned as NaN or an empty
// row. The one check of the single-slice and batched forms of every attention path.
// empty_rows_allowed: a path whose rows may hold no weight at all (an empty sparse support with
// no remainder; zero output) accepts a log-scale of -inf; NaN and +inf still mean overflow.
template <typename Scalar, typename ScanInputs>
void check_accumulator_finite(const char* where, const SoftmaxAccumulator<Scalar>& acc,
                              bool check, ScanInputs&& scan_inputs,
                              bool empty_rows_allowed = false) {
  check_result_finite(where, acc.numden(), check, scan_inputs);
  const auto log_scale = acc.log_scale().array();
  if (empty_rows_allowed) {
    const Scalar none = -std::numeric_limits<Scalar>::infinity();
    check_result_finite(where, (log_scale == none).select(Scalar(0), log_scale), check,
                        scan_inputs);
  } else {
    check_result_finite(where, log_scale, check, scan_inputs);
  }
}

template <typename Scalar>
void check_accumulator_finite(const char* where, const SoftmaxAccumulator<Scalar>& acc,
                              bool check) {
  check_accumulator_finite(where, acc, check, [] {});
}

}  // namespace detail

}  // namespace randattn
