#pragma once
// Random projections ω ∈ R^{m×d} for random-feature maps. Every projection applies itself to a
// block of rows, out = X ωᵀ (n×m), and can be materialised with matrix().
//
//  - GaussianProjection: i.i.d. N(0, 1) entries.
//  - OrthogonalProjection: blocks of d rows, each the Q of a QR factorisation of a Gaussian d×d
//    matrix with the sign correction Q·diag(sign(diag R)) that makes Q Haar-distributed; rows
//    rescaled to χ(d)-distributed norms (default: each row is then marginally N(0, I_d), so the
//    feature maps stay unbiased) or to √d.
//  - HadamardProjection: blocks of p = next_power_of_two(d) rows of √p · p^{-3/2} H D₃ H D₂ H D₁
//    (H the unnormalised Walsh–Hadamard matrix, D random ±1 diagonals), applied to the input
//    zero-padded to length p with the fast transform, O(m log d) per row. Its rows are only
//    approximately Gaussian: feature maps built on it carry a small bias.
//  - UserProjection: a given ω (for example the projection buffer of a model trained elsewhere),
//    used as is.
//
// The random projections are pure functions of (seed, m, d): the draw does not depend on the
// scalar type (it is made in double and rounded), the thread count or the block size.
// redraw(seed) draws a new ω of the same kind and shape.

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstdint>
#include <utility>

#include <Eigen/Core>
#include <Eigen/QR>

#include "../core/types.hpp"
#include "../detail/gemm.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "../linalg/structured_rotation.hpp"
#include "../random/fill.hpp"
#include "../random/philox.hpp"
#include "../random/streams.hpp"

namespace randattn {

// Row norms of structured (orthogonal, Hadamard) projections.
enum class RowNorm {
  chi,     // independent χ-distributed norms, as the rows of an i.i.d. Gaussian matrix have
  sqrt_d,  // every row has norm √d (√p for Hadamard before restriction to d coordinates)
};

namespace detail {

inline void check_projection_shape(const char* where, Index m, Index d) {
  require(m >= 1 && d >= 1, where, "need features m >= 1 and input dimension d >= 1, got m = ", m,
          ", d = ", d);
}

// Norm of row r: √(Σ g²) over `dim` Gaussians of row r of the row-norm stream (a χ(dim)
// draw), or √dim.
inline double row_norm(const Philox& rng, RowNorm norm, Index r, Index dim) {
  if (norm == RowNorm::sqrt_d) return std::sqrt(double(dim));
  const Philox s = rng.with_stream(streams::projection_row_norm);
  double sum = 0;
  for (Index j = 0; j < dim; ++j) {
    const double g = s.gaussian(std::uint64_t(r), std::uint32_t(j));
    sum += g * g;
  }
  return std::sqrt(sum);
}

}  // namespace detail

// The base of the projections stored as a dense ω (m × d), applied with one matrix product.
template <typename Scalar_>
class DenseProjection {
 public:
  using Scalar = Scalar_;
  Index features() const { return omega_.rows(); }
  Index input_dim() const { return omega_.cols(); }
  const RowMatrix<Scalar>& matrix() const { return omega_; }

  // out = x ωᵀ; x is n×d, out n×m (any row-major block, e.g. half of a feature matrix).
  template <typename Out>
  void apply(const Eigen::Ref<const RowMatrix<Scalar>>& x, Out&& out) const {
    detail::gemm_fixed_depth(out, x, omega_.transpose(), false);
  }

 protected:
  DenseProjection() = default;
  explicit DenseProjection(RowMatrix<Scalar> omega) : omega_(std::move(omega)) {}
  RowMatrix<Scalar> omega_;
};

// ω with i.i.d. standard normal entries.
template <typename Scalar>
class GaussianProjection : public DenseProjection<Scalar> {
 public:
  GaussianProjection(Index m, Index d, std::uint64_t seed = 0) : m_(m), d_(d) {
    detail::check_projection_shape("GaussianProjection", m, d);
    redraw(seed);
  }

  void redraw(std::uint64_t seed) {
    seed_ = seed;
    this->omega_ = gaussian_matrix<double>(Philox(seed, streams::projection_iid), m_, d_)
                       .template cast<Scalar>();
  }
  std::uint64_t seed() const { return seed_; }

 private:
  Index m_, d_;
  std::uint64_t seed_ = 0;
};

// Block-orthogonal ω: within each block of d rows the rows are orthogonal.
template <typename Scalar>
class OrthogonalProjection : public DenseProjection<Scalar> {
 public:
  OrthogonalProjection(Index m, Index d, std::uint64_t seed = 0, RowNorm norm = RowNorm::chi)
      : m_(m), d_(d), norm_(norm) {
    detail::check_projection_shape("OrthogonalProjection", m, d);
    redraw(seed);
  }

  void redraw(std::uint64_t seed) {
    seed_ = seed;
    const Philox rng(seed);
    RowMatrix<double> omega(m_, d_);
    const Index blocks = (m_ + d_ - 1) / d_;
    detail::parallel_for(blocks, [&](Index b) {
      const Index r0 = b * d_, rows = std::min(d_, m_ - r0);
      Eigen::MatrixXd g(d_, d_);
      fill_gaussian(rng.with_stream(streams::projection_orthogonal), g, r0, 0);
      const Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
      Eigen::MatrixXd q = qr.householderQ();
      // Q diag(sign(diag R)) is Haar-distributed; Householder QR alone is not.
      for (Index j = 0; j < d_; ++j)
        if (qr.matrixQR()(j, j) < 0) q.col(j) = -q.col(j);
      for (Index r = 0; r < rows; ++r)
        omega.row(r0 + r) = detail::row_norm(rng, norm_, r0 + r, d_) * q.row(r);
    });
    this->omega_ = omega.template cast<Scalar>();
  }
  std::uint64_t seed() const { return seed_; }
  RowNorm row_norm() const { return norm_; }

 private:
  Index m_, d_;
  RowNorm norm_;
  std::uint64_t seed_ = 0;
};

// A user-supplied ω (m×d), used as given.
template <typename Scalar>
class UserProjection : public DenseProjection<Scalar> {
 public:
  template <typename Derived>
  explicit UserProjection(const Eigen::MatrixBase<Derived>& omega)
      : DenseProjection<Scalar>(omega.template cast<Scalar>()) {
    detail::check_projection_shape("UserProjection", omega.rows(), omega.cols());
    detail::require_finite(this->omega_, "UserProjection", "omega");
  }
};

// Structured ω: blocks of p = next_power_of_two(d) rows of H D₃ H D₂ H D₁ (a StructuredRotation,
// linalg/structured_rotation.hpp, with diagonals indexed by block). Row r of block b is
// norm_r · p^{-3/2} (H D₃ H D₂ H D₁)_r restricted to the first d coordinates (the input is
// zero-padded), with norm_r ~ χ(p) or √p, so that E‖ω_r‖² = d as for a Gaussian row.
template <typename Scalar_>
class HadamardProjection {
 public:
  using Scalar = Scalar_;
  HadamardProjection(Index m, Index d, std::uint64_t seed = 0, RowNorm norm = RowNorm::chi)
      : m_(m), d_(d), norm_(norm) {
    detail::check_projection_shape("HadamardProjection", m, d);
    redraw(seed);
  }

  Index features() const { return m_; }
  Index input_dim() const { return d_; }
  std::uint64_t seed() const { return seed_; }
  RowNorm row_norm() const { return norm_; }
  const StructuredRotation<Scalar>& rotation() const { return rotation_; }

  void redraw(std::uint64_t seed) {
    seed_ = seed;
    const Index p = next_power_of_two(d_), blocks = (m_ + p - 1) / p;
    rotation_ = StructuredRotation<Scalar>(d_, blocks, Philox(seed, streams::projection_hadamard),
                                           SignIndexing::by_block);
    const double unit = std::pow(double(p), -1.5);
    out_scale_.resize(m_);
    const Philox rng(seed);
    for (Index r = 0; r < m_; ++r)
      out_scale_(r) = Scalar(unit * detail::row_norm(rng, norm_, r, p));
  }

  // out = x ωᵀ in O(n m log p), tiles of rows transformed together.
  template <typename Out>
  void apply(const Eigen::Ref<const RowMatrix<Scalar>>& x, Out&& out) const {
    detail::require(x.cols() == d_ && out.rows() == x.rows() && out.cols() == m_,
                    "HadamardProjection::apply", "x is ", detail::shape_of(x), " and out ",
                    detail::shape_of(out), ", expected n x ", d_, " and n x ", m_);
    rotation_.apply(x, out_scale_, out);
  }

  RowMatrix<Scalar> matrix() const {
    RowMatrix<Scalar> omega_t(d_, m_);
    apply(RowMatrix<Scalar>::Identity(d_, d_), omega_t);
    return omega_t.transpose();
  }

 private:
  Index m_, d_;
  RowNorm norm_;
  std::uint64_t seed_ = 0;
  StructuredRotation<Scalar> rotation_;
  Vector<Scalar> out_scale_;  // m: norm_r · p^{-3/2}
};

}  // namespace randattn
