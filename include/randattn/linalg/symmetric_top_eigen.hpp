#pragma once
// The few eigenvectors of a symmetric matrix with the largest eigenvalues, without computing the
// others: Householder tridiagonalisation A = Q T Q^T, the wanted eigenvalues of T alone by
// bisection (as LAPACK's dstebz), their eigenvectors of T by inverse iteration (as dstein), and
// Y -> Q Y. The full eigensolver also forms Q (another 4/3 d^3 flops) and runs implicit QR on all
// d eigenvalues with all d eigenvectors; here everything after the tridiagonalisation costs
// O(d^2 r).
//
// Precision: the tridiagonalisation and the back-transform run in the matrix's Scalar; the work
// on T (O(d r) per bisection step and per inverse iteration) runs in at least double, so for
// float inputs the eigenpairs of T are exact to float rounding and the accuracy is that of the
// tridiagonalisation, the same as the full solver's.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <Eigen/Householder>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "../random/philox.hpp"

namespace randattn::detail {

// Whether inverse iteration is the faster choice for r eigenvectors of a d x d matrix. Each
// eigenvector costs it O(d^2) more, while the full solver's cost does not depend on r. Measured
// on random matrices (Zen, -O3 -march=native), the two are even in float at r = 1 for d = 20,
// r ~ 4 for d = 40, r ~ 9 for d = 60, r ~ 23 for d = 100 and r ~ 60 for d = 200, and double
// gains more (r ~ 60 at d = 200 is 0.65x of the full solver); this rule keeps to those bounds.
constexpr bool inverse_iteration_is_faster(Index d, Index r) { return d >= 24 + 4 * r; }

// Scalar of the work on the tridiagonal matrix: at least double.
template <typename Scalar>
using TridiagonalScalar =
    std::conditional_t<(std::numeric_limits<Scalar>::digits < std::numeric_limits<double>::digits),
                       double, Scalar>;

// Eigenvectors are defined up to sign: the entry of largest magnitude is made positive, so the
// output is reproducible.
template <typename Derived>
void make_largest_entry_positive(Eigen::MatrixBase<Derived>&& v) {
  Index big = 0;
  v.cwiseAbs().maxCoeff(&big);
  if (v(big) < 0) v = -v;
}

// The full solver: all d eigenpairs, then the top r. The reference, the fallback, and the
// faster choice for small d or r close to d.
template <typename Scalar>
void top_eigenvectors_full(const RowMatrix<Scalar>& sym, Index r, RowMatrix<Scalar>& vectors,
                           Vector<Scalar>& values) {
  const Eigen::SelfAdjointEigenSolver<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>> eig(
      sym);
  require(eig.info() == Eigen::Success, "top_eigenvectors",
          "the eigensolver did not converge on a ", shape_of(sym), " matrix");
  const Index d = sym.rows();
  vectors.resize(d, r);
  values.resize(r);
  for (Index t = 0; t < r; ++t) {  // eigenvalues come in increasing order
    vectors.col(t) = eig.eigenvectors().col(d - 1 - t);
    make_largest_entry_positive(vectors.col(t));
    values(t) = eig.eigenvalues()(d - 1 - t);
  }
}

// LU factorisation with partial pivoting of T - shift I for an unreduced symmetric tridiagonal
// T (as LAPACK's dlagtf), and solves with it that perturb tiny pivots instead of dividing by
// them (as dlagts with job = -1): inverse iteration solves with a nearly singular matrix on
// purpose, and only the direction of the solution matters.
template <typename Real>
class ShiftedTridiagonalLU {
 public:
  using RealVector = Eigen::Matrix<Real, Eigen::Dynamic, 1>;

  // diag: n entries, offdiag: n - 1 nonzero entries; tiny_pivot > 0.
  void factor(const RealVector& diag, const RealVector& offdiag, Real shift, Real tiny_pivot) {
    const Index n = diag.size();
    u0_.resize(n);
    u1_.setZero(n);
    u2_.setZero(n);
    multiplier_.setZero(n);
    swapped_.assign(std::size_t(n), false);
    tiny_pivot_ = tiny_pivot;
    // The pending row i holds (pivot, above) on the diagonal and superdiagonal.
    Real pivot = diag(0) - shift, above = n > 1 ? offdiag(0) : Real(0);
    for (Index i = 0; i + 1 < n; ++i) {
      const Real below = offdiag(i), next_diag = diag(i + 1) - shift;
      const Real next_above = i + 2 < n ? offdiag(i + 1) : Real(0);
      if (std::abs(pivot) >= std::abs(below)) {
        multiplier_(i) = below / pivot;  // |below| > 0, so pivot != 0
        u0_(i) = pivot;
        u1_(i) = above;
        pivot = next_diag - multiplier_(i) * above;
        above = next_above;
      } else {  // row i + 1 becomes the pivot row
        swapped_[std::size_t(i)] = true;
        multiplier_(i) = pivot / below;
        u0_(i) = below;
        u1_(i) = next_diag;
        u2_(i) = next_above;
        pivot = above - multiplier_(i) * next_diag;
        above = -multiplier_(i) * next_above;
      }
    }
    u0_(n - 1) = pivot;
  }

  // The last pivot: small when the shift is close to an eigenvalue.
  Real last_pivot() const { return u0_(u0_.size() - 1); }

  // x <- (T - shift I)^{-1} x.
  void solve(RealVector& x) const {
    const Index n = x.size();
    for (Index i = 0; i + 1 < n; ++i) {
      if (swapped_[std::size_t(i)]) std::swap(x(i), x(i + 1));
      x(i + 1) -= multiplier_(i) * x(i);
    }
    for (Index i = n - 1; i >= 0; --i) {
      Real s = x(i);
      if (i + 1 < n) s -= u1_(i) * x(i + 1);
      if (i + 2 < n) s -= u2_(i) * x(i + 2);
      x(i) = s / safe_pivot(u0_(i));
    }
  }

 private:
  Real safe_pivot(Real u) const {
    if (std::abs(u) >= tiny_pivot_) return u;
    return u < 0 ? -tiny_pivot_ : tiny_pivot_;
  }

  RealVector u0_, u1_, u2_, multiplier_;  // U's three diagonals, L's multipliers
  std::vector<bool> swapped_;
  Real tiny_pivot_ = 0;
};

// The m largest eigenvalues of the symmetric tridiagonal block (diag, offdiag), in decreasing
// order, by bisection on Sturm counts (as LAPACK's dstebz) to within
// max(relative_tolerance ||T||, 2 eps |lambda|); false if that did not converge. All m
// bisections advance in one pass over T per step (independent chains, so the divisions
// overlap), and every count narrows the interval of each eigenvalue whose interval holds its
// shift. Implicit QR would find all d eigenvalues, at O(d^2) square roots: at d = 200 that
// costs more than the tridiagonalisation itself.
template <typename Real>
bool top_tridiagonal_eigenvalues(const Eigen::Matrix<Real, Eigen::Dynamic, 1>& diag,
                                 const Eigen::Matrix<Real, Eigen::Dynamic, 1>& offdiag, Index m,
                                 Real relative_tolerance, std::vector<Real>& out) {
  using RealArray = Eigen::Array<Real, Eigen::Dynamic, 1>;
  const Real eps = std::numeric_limits<Real>::epsilon();
  const Index n = diag.size();
  if (n == 1 || m == 0) {  // exact (a zero matrix splits into 1 x 1 blocks)
    out.assign(std::size_t(m), diag(0));
    return true;
  }
  const RealArray offdiag_sq = offdiag.array().square();
  // Smallest pivot allowed in the count's recurrence (dstebz's pivmin): keeps it finite.
  const Real min_pivot =
      std::numeric_limits<Real>::min() * std::max(Real(1), offdiag_sq.maxCoeff());
  // Gershgorin interval, widened as dstebz does against rounding in the counts.
  Real lower = diag(0), upper = diag(0);
  for (Index i = 0; i < n; ++i) {
    const Real radius =
        (i > 0 ? std::abs(offdiag(i - 1)) : 0) + (i + 1 < n ? std::abs(offdiag(i)) : 0);
    lower = std::min(lower, diag(i) - radius);
    upper = std::max(upper, diag(i) + radius);
  }
  const Real widening =
      Real(2.1) * (std::max(std::abs(lower), std::abs(upper)) * eps * Real(n) + 2 * min_pivot);
  const Real tolerance = relative_tolerance * std::max(std::abs(lower), std::abs(upper));
  RealArray low = RealArray::Constant(m, lower - widening);
  RealArray high = RealArray::Constant(m, upper + widening);
  // Several shifts per eigenvalue and pass while m is small (multisection): the passes are
  // bound by the latency of the division chain, and up to ~10 independent shifts cost no more
  // than one, so 8 shifts cut a lone eigenvalue's interval 9-fold per pass instead of 2-fold.
  const Index per = std::max<Index>(1, (8 + m - 1) / m), shifts = m * per;
  RealArray shift(shifts), pivot(shifts);
  Eigen::Array<Index, Eigen::Dynamic, 1> below(shifts);  // eigenvalues below each shift
  const RealArray neg_min_pivot = RealArray::Constant(shifts, -min_pivot);
  // Each step cuts every interval at least in half, from the Gershgorin width down to 2 eps of it.
  const int max_steps = 2 * std::numeric_limits<Real>::digits + 16;
  for (int step = 0;; ++step) {
    const RealArray allowed =
        (Real(2) * eps * low.abs().max(high.abs())).max(RealArray::Constant(m, tolerance));
    if (((high - low) <= allowed).all()) break;
    if (step == max_steps) return false;
    for (Index j = 0; j < m; ++j)
      for (Index q = 0; q < per; ++q)
        shift(j * per + q) = low(j) + (high(j) - low(j)) * Real(q + 1) / Real(per + 1);
    pivot = diag(0) - shift;
    pivot = (pivot.abs() < min_pivot).select(neg_min_pivot, pivot);
    below = (pivot < 0).template cast<Index>();
    for (Index i = 1; i < n; ++i) {
      pivot = (diag(i) - shift) - offdiag_sq(i - 1) / pivot;
      pivot = (pivot.abs() < min_pivot).select(neg_min_pivot, pivot);
      below += (pivot < 0).template cast<Index>();
    }
    // Eigenvalue j (decreasing) has n - 1 - j eigenvalues below it.
    for (Index k = 0; k < shifts; ++k)
      for (Index j = 0; j < m; ++j)
        if (shift(k) > low(j) && shift(k) < high(j)) {
          if (below(k) <= n - 1 - j)
            low(j) = shift(k);
          else
            high(j) = shift(k);
        }
  }
  out.resize(std::size_t(m));
  for (Index j = 0; j < m; ++j) out[std::size_t(j)] = Real(0.5) * (low(j) + high(j));
  return true;
}

// Eigenvectors of the unreduced symmetric tridiagonal block (diag, offdiag) for its eigenvalues
// `lambdas` (in decreasing order), as the columns of `out`; false if one did not converge.
// Inverse iteration as LAPACK's dstein: each eigenvalue is moved at least 10 eps |lambda| away
// from the previous one, so that close eigenvalues give different shifted matrices; the start
// vector is random; an iteration is accepted once the solve amplifies the scaled start vector
// past sqrt(0.1 / n), and two more follow it. Each iterate is re-orthogonalised (modified
// Gram-Schmidt) against all the block's earlier vectors, where dstein takes only those within
// 1e-3 ||T||: its vectors for eigenvalues just outside that are orthogonal only to about
// eps ||T|| / gap = 1000 eps, and for r << d the extra O(n r^2) is negligible.
template <typename Real>
bool tridiagonal_inverse_iteration(const Eigen::Matrix<Real, Eigen::Dynamic, 1>& diag,
                                   const Eigen::Matrix<Real, Eigen::Dynamic, 1>& offdiag,
                                   const std::vector<Real>& lambdas,
                                   Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic>& out,
                                   const Philox& start_vectors) {
  using RealVector = Eigen::Matrix<Real, Eigen::Dynamic, 1>;
  constexpr int kMaxIterations = 5, kExtraIterations = 2;
  const Real eps = std::numeric_limits<Real>::epsilon();
  const Index n = diag.size(), count = Index(lambdas.size());
  out.resize(n, count);
  if (n == 1) {
    out.setOnes();
    return true;
  }
  Real one_norm = 0;  // max row sum = ||T||_1 = ||T||_inf
  for (Index i = 0; i < n; ++i)
    one_norm = std::max(one_norm, std::abs(diag(i)) + (i > 0 ? std::abs(offdiag(i - 1)) : 0) +
                                      (i + 1 < n ? std::abs(offdiag(i)) : 0));
  const Real accepted_growth = std::sqrt(Real(0.1) / Real(n));
  ShiftedTridiagonalLU<Real> lu;
  RealVector x(n);
  Real previous_shift = 0;
  for (Index k = 0; k < count; ++k) {
    Real shift = lambdas[std::size_t(k)];
    if (k > 0) {
      const Real min_separation = 10 * eps * std::abs(shift);
      if (previous_shift - shift < min_separation) shift = previous_shift - min_separation;
    }
    previous_shift = shift;
    lu.factor(diag, offdiag, shift, eps * one_norm);
    for (Index i = 0; i < n; i += 4) {  // uniform on (-1, 1), four draws per Philox block
      const Philox::Bits bits = start_vectors.bits(std::uint64_t(i / 4), std::uint32_t(k));
      for (Index b = 0; b < 4 && i + b < n; ++b)
        x(i + b) = Real(bits[std::size_t(b)]) * Real(0x1p-31) - Real(1);
    }
    bool converged = false;
    for (int iteration = 0, accepted = 0; iteration < kMaxIterations; ++iteration) {
      // The right-hand side is scaled so that the solve's growth measures how close the shift
      // is to an eigenvalue, and cannot overflow.
      x *= Real(n) * one_norm * std::max(eps, std::abs(lu.last_pivot())) / x.template lpNorm<1>();
      lu.solve(x);
      // Twice: after the solve x can lie mostly in the span of earlier vectors of a cluster,
      // and one pass leaves it orthogonal to them only to eps times that cancellation.
      for (int pass = 0; pass < 2; ++pass)
        for (Index j = 0; j < k; ++j) x -= x.dot(out.col(j)) * out.col(j);
      if (x.template lpNorm<Eigen::Infinity>() < accepted_growth) continue;
      if (++accepted > kExtraIterations) {
        converged = true;
        break;
      }
    }
    if (!converged || !x.allFinite()) return false;
    out.col(k) = x / x.norm();
  }
  return true;
}

// top_eigenvectors by tridiagonalisation, bisection and inverse iteration, for any d >= 1 and
// 0 <= r <= d (the tests run it beyond the range where it is the faster choice). The lower
// triangle of `sym` is read and must be finite. False if bisection or inverse iteration did not
// converge.
template <typename Scalar>
bool top_eigenvectors_by_inverse_iteration(const RowMatrix<Scalar>& sym, Index r,
                                           RowMatrix<Scalar>& vectors, Vector<Scalar>& values) {
  using ColMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
  using Real = TridiagonalScalar<Scalar>;
  using RealVector = Eigen::Matrix<Real, Eigen::Dynamic, 1>;
  using RealMatrix = Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic>;
  const Index d = sym.rows();
  if (r == 0) {  // nothing to compute (and no blocks of empty storage to take)
    vectors.resize(d, 0);
    values.resize(0);
    return true;
  }

  // Scaled to entries in [-1, 1] (as the full solver), so that neither T nor the squares in
  // the Householder vectors overflow or underflow for matrices of huge or tiny scale.
  ColMatrix reflectors = sym.template triangularView<Eigen::Lower>();
  Scalar scale = reflectors.cwiseAbs().maxCoeff();
  if (scale == 0) scale = 1;
  reflectors.template triangularView<Eigen::Lower>() /= scale;
  Vector<Scalar> reflector_coeffs(d - 1);
  Eigen::internal::tridiagonalization_inplace(reflectors, reflector_coeffs);
  const RealVector diag = reflectors.diagonal().template cast<Real>();
  const RealVector offdiag = reflectors.template diagonal<-1>().template cast<Real>();

  // T splits into unreduced blocks where an off-diagonal entry is negligible against ||T||
  // (a perturbation of Scalar's eps ||T||, within the backward error of the tridiagonalisation);
  // each block's eigenvalues are computed alone, and its eigenvectors are zero outside it.
  // Repeated eigenvalues (the identity) come out this way as separate blocks, with exactly
  // orthogonal eigenvectors.
  const Real eps = std::numeric_limits<Scalar>::epsilon();
  Real t_norm = 0;
  for (Index i = 0; i < d; ++i)
    t_norm = std::max(t_norm, std::abs(diag(i)) + (i > 0 ? std::abs(offdiag(i - 1)) : 0) +
                                  (i + 1 < d ? std::abs(offdiag(i)) : 0));
  std::vector<Index> block_start{0};
  for (Index i = 0; i + 1 < d; ++i)
    if (std::abs(offdiag(i)) <= eps * t_norm) block_start.push_back(i + 1);
  block_start.push_back(d);
  const Index blocks = Index(block_start.size()) - 1;
  const auto block_diag = [&](Index b) {
    return diag.segment(block_start[std::size_t(b)],
                        block_start[std::size_t(b) + 1] - block_start[std::size_t(b)]);
  };
  const auto block_offdiag = [&](Index b) {
    return offdiag.segment(block_start[std::size_t(b)],
                           block_start[std::size_t(b) + 1] - block_start[std::size_t(b)] - 1);
  };

  // Eigenvalues to the accuracy of the input: Scalar's eps against the block's norm.
  struct Eigenvalue {
    Real value;
    Index block;
  };
  std::vector<Eigenvalue> eigenvalues;
  std::vector<Real> block_top;
  for (Index b = 0; b < blocks; ++b) {
    const RealVector block_d = block_diag(b), block_e = block_offdiag(b);
    if (!top_tridiagonal_eigenvalues<Real>(block_d, block_e, std::min(r, block_d.size()),
                                           std::numeric_limits<Real>::epsilon(), block_top))
      return false;
    for (Real value : block_top) eigenvalues.push_back({value, b});
  }
  // The top r, in decreasing order (ties by block, so the order is reproducible).
  std::partial_sort(eigenvalues.begin(), eigenvalues.begin() + r, eigenvalues.end(),
                    [](const Eigenvalue& a, const Eigenvalue& b) {
                      return a.value > b.value || (a.value == b.value && a.block < b.block);
                    });

  ColMatrix eigenvectors = ColMatrix::Zero(d, r);  // of T, then of A
  const Philox start_vectors(0x5e1fad101e757a7eULL);
  std::vector<Real> block_lambdas;
  std::vector<Index> block_columns;
  RealMatrix block_vectors;
  for (Index b = 0; b < blocks; ++b) {
    block_lambdas.clear();
    block_columns.clear();
    for (Index t = 0; t < r; ++t)
      if (eigenvalues[std::size_t(t)].block == b) {
        block_lambdas.push_back(eigenvalues[std::size_t(t)].value);
        block_columns.push_back(t);
      }
    if (block_lambdas.empty()) continue;
    if (!tridiagonal_inverse_iteration<Real>(block_diag(b), block_offdiag(b), block_lambdas,
                                             block_vectors,
                                             start_vectors.with_stream(std::uint32_t(b))))
      return false;
    for (std::size_t k = 0; k < block_columns.size(); ++k)
      eigenvectors.col(block_columns[k])
          .segment(block_start[std::size_t(b)], block_vectors.rows()) =
          block_vectors.col(Index(k)).template cast<Scalar>();
  }

  // Back to A's basis: v = Q y with Q = H_0 ... H_{d-2}, reflector k acting on rows k+1.. with
  // its essential part below the subdiagonal of column k (Eigen's packed storage). One reflector
  // at a time: for the few columns of y, Eigen's blocked application (HouseholderSequence) spends
  // more on forming its triangular factors than on the product (2.5x slower at r = 5, d = 200).
  Eigen::Matrix<Scalar, 1, Eigen::Dynamic> workspace(r);
  for (Index k = d - 2; k >= 0; --k)
    eigenvectors.bottomRows(d - 1 - k).applyHouseholderOnTheLeft(
        reflectors.col(k).tail(d - 2 - k), reflector_coeffs(k), workspace.data());
  vectors = eigenvectors;
  values.resize(r);
  for (Index t = 0; t < r; ++t) {
    make_largest_entry_positive(vectors.col(t));
    values(t) = Scalar(eigenvalues[std::size_t(t)].value * Real(scale));
  }
  return true;
}

// The r eigenvectors of the symmetric matrix `sym` (its lower triangle is read) with the largest
// eigenvalues, as columns in decreasing order of eigenvalue, each signed so that its entry of
// largest magnitude is positive, and their eigenvalues. By tridiagonalisation and inverse
// iteration where that is faster (r much smaller than d), otherwise, or if bisection or inverse
// iteration does not converge, by the full solver (which throws if it does not converge).
template <typename Scalar>
void top_eigenvectors(const RowMatrix<Scalar>& sym, Index r, RowMatrix<Scalar>& vectors,
                      Vector<Scalar>& values) {
  const Index d = sym.rows();
  // The shape as parts of the message, not shape_of: that formats a string on every call.
  require(sym.cols() == d && r >= 0 && r <= d, "top_eigenvectors", r, " eigenvectors of a ", d, "x",
          sym.cols(), " matrix");
  bool finite = true;
  for (Index i = 0; i < d; ++i) finite = finite && sym.row(i).head(i + 1).allFinite();
  require(finite, "top_eigenvectors", "a ", d, "x", d, " matrix with non-finite entries");
  if (!inverse_iteration_is_faster(d, r) ||
      !top_eigenvectors_by_inverse_iteration(sym, r, vectors, values))
    top_eigenvectors_full(sym, r, vectors, values);
}

}  // namespace randattn::detail
