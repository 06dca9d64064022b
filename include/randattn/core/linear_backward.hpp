#pragma once
// Backward of linear attention (core/linear_attention.hpp). With O_i = N_i / d_i, N_i = φ(q_i)ᵀS,
// d_i = φ(q_i)ᵀz, and the incoming gradient dO, let g_i = dO_i / d_i and h_i = −(dO_i · O_i) / d_i:
//
//   dφ(q_i) = S g_i + z h_i,   dφ(k_j) = σ ∘ Σ_i φ(q_i) (g_i · v_j + h_i),
//   dv_j = Σ_i (φ(q_i)ᵀ diag(σ) φ(k_j)) g_i,
//
// the sums over j ≤ i (causal) or all pairs. Everything is computed in the forward's log-scaled
// form: a row's g and h use its denominator relative to the row's log-scale, and the feature
// cotangents come out relative to each row's own log-scale (exp(ℓ_i) · ∂L/∂φ_i, of order one),
// so the backward is as stable as the forward.
//
// Bidirectional: S is recomputed (the forward's key_state), U = Σ_i φ̂(q_i) [ĝ_i | ĥ_i]ᵀ is summed
// over query panels, and the key side reads U: all products of the forward's shapes.
// Causal (chunks of C rows, as the forward): a forward pass recomputes the prefix state chunk by
// chunk (transposed, for the products' operand order) for dφ(q) = prefix state plus the masked
// in-chunk part; a reversed pass carries the suffix sums Ū = Σ_{i in later chunks} φ̂(q_i)[ĝ_i|ĥ_i]ᵀ
// for dφ(k) and dv. Suffix sums are relative to the running key maximum at the chunk boundary,
// so every factor is at most one. Memory: two states per thread, [ĝ | ĥ] (n × (dv + 1)) and the
// chunks' masked weight blocks (n × C twice); never n·M·dv. On several threads both passes cut
// the chunks into runs that first replay the state updates before them (the forward's scheme,
// mirrored for the reversed pass): the result does not depend on the thread count.
//
// The denominator guard den' = den + 2ε·[|den| ≤ ε] acts on den relative to the row's log-scale
// r_i = ℓ(q_i) + max over the row's keys of ℓ(k_j). Where it is active the output depends on r_i
// itself; that derivative is returned as an additional log-scale cotangent of q_i and of the key
// holding the maximum (j ≤ i under causal). Rows whose guarded denominator is zero (output zeros)
// have zero gradient.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../detail/chunk_products.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "linear_attention.hpp"
#include "scaled_features.hpp"
#include "softmax_accumulator.hpp"
#include "types.hpp"

namespace randattn {

// Gradient of a loss with respect to one side's scaled features (row i standing for
// exp(log_scale_i) · values_i): values = ∂L/∂values at fixed log-scales (= exp(log_scale_i) ·
// ∂L/∂φ_i) and log_scale = ∂L/∂log_scale at fixed values.
template <typename Scalar>
struct ScaledFeatureGradient {
  RowMatrix<Scalar> values;
  Vector<Scalar> log_scale;
};

namespace detail {

// The cotangents the backward hands to each side: d_values as in ScaledFeatureGradient and the
// guard's log-scale cotangent at fixed φ (the "d_log_scale" of a feature map's features_vjp).
template <typename Scalar>
struct LinearCotangents {
  Eigen::Ref<RowMatrix<Scalar>> dq, dk, dv;
  Eigen::Ref<Vector<Scalar>> q_log, k_log;
};

// Checks grad_out (and out, when given) against the forward's output shape and, with check_finite,
// their values; before anything is written.
template <typename Scalar>
void check_linear_grad_out(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& out,
                           const Eigen::Ref<const RowMatrix<Scalar>>& grad_out, Index rows,
                           Index cols, bool check_finite) {
  require(grad_out.rows() == rows && grad_out.cols() == cols, where, "grad_out is ",
          shape_of(grad_out), ", expected the output's shape ", rows, "x", cols);
  require(out.rows() == rows && out.cols() == cols, where, "out is ", shape_of(out),
          ", expected ", rows, "x", cols);
  require_finite(grad_out, where, "grad_out");
  require_finite(out, where, "out", check_finite);
}

// Rows [ĝ_i | ĥ_i] = [dO_i / den'_i | −(dO_i · O_i) / den'_i] from the rows' relative
// denominators `den`, and rho_i = ∂L/∂r_i (r_i the row's log-scale), non-zero only where the guard
// is active: o = ñ / (d̃ + 2ε) with ñ, d̃ ∝ exp(−r) gives ∂o/∂r = −o · 2ε / den'.
template <typename Scalar, typename GH>
void output_cotangents(const Eigen::Ref<const RowMatrix<Scalar>>& out,
                       const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                       const Eigen::Ref<const Vector<Scalar>>& den, Scalar eps, GH&& gh,
                       Eigen::Ref<Vector<Scalar>> rho) {
  const Index dv = out.cols();
  for (Index i = 0; i < den.size(); ++i) {
    const Scalar guarded = SoftmaxAccumulator<Scalar>::guarded_denominator(den(i), eps);
    if (guarded == Scalar(0)) {
      gh.row(i).head(dv + 1).setZero();
      rho(i) = 0;
      continue;
    }
    const Scalar inv = 1 / guarded;
    gh.row(i).head(dv) = grad_out.row(i) * inv;
    const Scalar h = -grad_out.row(i).dot(out.row(i)) * inv;
    gh(i, dv) = h;
    rho(i) = eps > 0 && std::abs(den(i)) <= eps ? 2 * eps * h : Scalar(0);
  }
}

// [V | 1] of rows [j0, j0 + len) into `values` (len × (dv + 1), unit column stride).
template <typename In, typename Values>
void values_with_ones(const In& in, Index j0, Index len, Values&& values) {
  const Index dv = in.v.cols();
  values.leftCols(dv) = in.v.middleRows(j0, len);
  values.col(dv).setOnes();
}

// The guard's log-scale cotangents rho of the query rows, also owed to the key holding each
// row's maximum log-scale (the first one; keys j ≤ i when causal).
template <typename Scalar>
void guard_key_cotangents(const Eigen::Ref<const Vector<Scalar>>& rho,
                          const Eigen::Ref<const Vector<Scalar>>& k_log, bool causal,
                          Eigen::Ref<Vector<Scalar>> key_rho) {
  key_rho.setZero();
  if ((rho.array() == Scalar(0)).all() || k_log.size() == 0) return;
  Index best = 0;
  if (!causal) k_log.maxCoeff(&best);
  for (Index i = 0; i < rho.size(); ++i) {
    if (causal && k_log(i) > k_log(best)) best = i;
    key_rho(best) += rho(i);
  }
}

// Bidirectional backward: see the header comment. rho receives the query rows' guard cotangents.
template <typename In>
void linear_bidirectional_backward(const In& in,
                                   const Eigen::Ref<const RowMatrix<typename In::Scalar>>& out,
                                   const Eigen::Ref<const RowMatrix<typename In::Scalar>>& grad_out,
                                   typename In::Scalar eps,
                                   LinearCotangents<typename In::Scalar> d) {
  using Scalar = typename In::Scalar;
  const Index n_q = in.q.rows(), n_k = in.k.rows(), m = in.features(), w = in.width();
  const Index dv = in.v.cols(), chunk = in.chunk;
  Scalar c;
  const auto state = key_state(in, c);  // S relative to exp(c), c the largest key log-scale

  // Query panels: dφ̂(q) = [ĝ | ĥ] Sᵀ and U = Σ φ̂(q_i)[ĝ_i | ĥ_i]ᵀ, summed kKeyGroup panels at a
  // time in panel order (as key_state sums S). U is kept transposed (w × M): the key side's
  // dφ̂(k) = [V | 1] Uᵀ is then a product over the short depth w with rows of M read in place.
  struct QueryWork {
    FeatureBlock<Scalar> features;
    Scratch<RowMatrix<Scalar>> gh;
    Scratch<Vector<Scalar>> den;
    QueryWork(Index rows, Index m, Index w)
        : features(rows, m), gh(rows, line_padded<Scalar>(w)), den(rows) {}
  };
  const Index panels = (n_q + chunk - 1) / chunk;
  Scratch<RowMatrix<Scalar>> parts(std::min(panels, kKeyGroup) * w, m), u(w, m);
  u.setZero();
  for (Index first = 0; first < panels; first += kKeyGroup) {
    const Index group = std::min(kKeyGroup, panels - first);
    parallel_for_with(
        group, [&] { return QueryWork(chunk, m, w); },
        [&](Index t, QueryWork& s) {
          const Index i0 = (first + t) * chunk, len = std::min(chunk, n_q - i0);
          const auto qf = in.q.view(i0, len, s.features);
          auto den = s.den.head(len);
          den.noalias() = qf * state.col(dv);
          auto gh = s.gh.topLeftCorner(len, w);
          output_cotangents<Scalar>(out.middleRows(i0, len), grad_out.middleRows(i0, len), den, eps,
                                    gh, d.q_log.segment(i0, len));
          d.dq.middleRows(i0, len).noalias() = gh * state.transpose();
          row_panel_product(parts.middleRows(t * w, w), gh.transpose(), qf, false);
        });
    constexpr Index kRowsPerTask = 16;  // U's rows are M wide
    parallel_for((w + kRowsPerTask - 1) / kRowsPerTask, [&](Index b) {
      const Index r0 = b * kRowsPerTask, rows = std::min(kRowsPerTask, w - r0);
      for (Index t = 0; t < group; ++t)
        u.middleRows(r0, rows) += parts.middleRows(t * w + r0, rows);
    });
  }

  // Key panels: with β_j = exp(ℓ(k_j) − c), dφ̂(k_j) = β_j σ ∘ U [v_j; 1] and
  // dv_j = β_j Ûᵀ (σ ∘ φ̂(k_j)), Û the first dv columns of U.
  struct KeyWork {
    FeatureBlock<Scalar> features;
    Scratch<RowMatrix<Scalar>> values;
    Scratch<Vector<Scalar>> beta;
    KeyWork(Index rows, Index m, Index w)
        : features(rows, m), values(rows, line_padded<Scalar>(w)), beta(rows) {}
  };
  parallel_for_with(
      (n_k + chunk - 1) / chunk, [&] { return KeyWork(chunk, m, w); },
      [&](Index b, KeyWork& s) {
        const Index j0 = b * chunk, len = std::min(chunk, n_k - j0);
        const auto keys = signed_keys(in, j0, len, s.features);
        auto beta = s.beta.head(len);
        beta = (s.features.log_scale.head(len).array() - c).exp().matrix();
        auto dvb = d.dv.middleRows(j0, len);
        row_dots(dvb, keys, u.topRows(dv));
        dvb.array().colwise() *= beta.array();
        auto values = s.values.topLeftCorner(len, w);
        values_with_ones(in, j0, len, values);
        auto dkb = d.dk.middleRows(j0, len);
        row_panel_product(dkb, values, u, false);
        dkb.array().colwise() *= beta.array();
        if (in.signs.size() > 0) dkb.array().rowwise() *= in.signs.transpose().array();
      });
}

// Causal backward: see the header comment. k_log holds every key's log-scale (empty: zeros).
template <typename In>
void linear_causal_backward(const In& in,
                            const Eigen::Ref<const RowMatrix<typename In::Scalar>>& out,
                            const Eigen::Ref<const RowMatrix<typename In::Scalar>>& grad_out,
                            typename In::Scalar eps,
                            LinearCotangents<typename In::Scalar> d) {
  using Scalar = typename In::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index n = in.q.rows(), m = in.features(), w = in.width(), dv = in.v.cols();
  const Index chunk = in.chunk, chunks = (n + chunk - 1) / chunk;
  // Kept between the passes: [ĝ | ĥ], each row's largest key log-scale R_i (its log-scale minus
  // the query's), and per chunk the masked weights W_ij = φ̂(q_i)·σφ̂(k_j) e^{ℓ(k_j) − R_i} and
  // M_ij = [ĝ_i | ĥ_i]·[v_j | 1] e^{ℓ(k_j) − R_i} (rows of chunk t at rows t·C of n × C blocks).
  Scratch<RowMatrix<Scalar>> gh(n, line_padded<Scalar>(w)), weights(n, chunk), mixed(n, chunk);
  Scratch<Vector<Scalar>> row_max(n);
  const Index segments = std::max<Index>(1, std::min(available_threads(), chunks));

  struct Work {
    FeatureBlock<Scalar> q_rows, k_rows;
    Scratch<RowMatrix<Scalar>> state, values, scaled, products;
    Scratch<Vector<Scalar>> den, factor;
    Work(Index chunk, Index m, Index w)
        : q_rows(chunk, m),
          k_rows(chunk, m),
          state(w, m),
          values(chunk, line_padded<Scalar>(w)),
          scaled(chunk, line_padded<Scalar>(w)),
          products(chunk, chunk),
          den(chunk),
          factor(chunk) {}
  };

  // Forward pass: the prefix state, transposed (w × M) so that [ĝ | ĥ] Sᵀ reads it row by row.
  parallel_for(segments, [&](Index segment) {
    const Index begin = causal_segment_start(chunks, segments, segment),
                end = causal_segment_start(chunks, segments, segment + 1);
    if (begin == end) return;
    Work s(chunk, m, w);
    auto& state = s.state;  // relative to exp(state_log)
    Scalar state_log = kNegInf;
    for (Index t = 0; t < end; ++t) {
      const Index i0 = t * chunk, len = std::min(chunk, n - i0);
      const auto keys = signed_keys(in, i0, len, s.k_rows);
      const auto k_log = s.k_rows.log_scale.head(len);
      if (t >= begin) {
        const auto queries = in.q.view(i0, len, s.q_rows);
        auto r = row_max.segment(i0, len);
        auto wt = weights.block(i0, 0, len, len);
        auto mt = mixed.block(i0, 0, len, len);
        auto values = s.values.topLeftCorner(len, w);
        values_with_ones(in, i0, len, values);
        auto g = gh.block(i0, 0, len, w);
        row_dots(wt, queries, keys, true);
        Scalar prefix = kNegInf;
        for (Index i = 0; i < len; ++i) {
          prefix = std::max(prefix, k_log(i));
          r(i) = std::max(prefix, state_log);
          auto e = mt.row(i).head(i + 1);  // e^{ℓ(k_j) − R_i}, then M's row
          e = (k_log.head(i + 1).array() - r(i)).exp().matrix().transpose();
          wt.row(i).head(i + 1).array() *= e.array();
          wt.row(i).tail(len - i - 1).setZero();
        }
        auto den = s.den.head(len);
        auto alpha = s.factor.head(len);
        const bool has_state = state_log != kNegInf;
        den = wt.rowwise().sum();
        if (has_state) {
          alpha = (state_log - r.array()).exp().matrix();
          den.array() += alpha.array() * (queries * state.row(dv).transpose()).array();
        }
        output_cotangents<Scalar>(out.middleRows(i0, len), grad_out.middleRows(i0, len), den, eps,
                                  g, d.q_log.segment(i0, len));
        // M = ([ĝ | ĥ] [V | 1]ᵀ) ∘ e^{ℓ(k_j) − R_i}, lower triangle.
        auto p = s.products.topLeftCorner(len, len);
        row_dots(p, g, values, true);
        for (Index i = 0; i < len; ++i) {
          mt.row(i).head(i + 1).array() *= p.row(i).head(i + 1).array();
          mt.row(i).tail(len - i - 1).setZero();
        }
        auto dq = d.dq.middleRows(i0, len);
        if (has_state) {
          auto scaled = s.scaled.topLeftCorner(len, w);
          scaled = alpha.asDiagonal() * g;
          row_panel_product(dq, scaled, state, false);
        }
        row_panel_product(dq, mt, keys, has_state, Triangle::lower);
      }
      if (t + 1 == end) break;  // no later chunk of this run reads the state
      auto weighted = s.values.topLeftCorner(len, w);
      const Scalar c = weigh_values(in, i0, k_log, state_log, weighted);
      advance_state(state, state_log, weighted.transpose(), keys, c, state);
      state_log = c;
    }
  });

  // Reversed pass: Ū holds Σ_{i in chunks after t} φ̂(q_i)[ĝ_i | ĥ_i]ᵀ e^{E_t − R_i}, E_t = R at
  // the last row of chunk t (every later R_i is at least E_t), transposed (w × M, as the forward
  // pass's state): dφ̂(k) = [V | 1] Ūᵀ is then a product over the short depth w with rows of M
  // read in place, and dv = φ̂(k) Û (Û the first dv columns of Ū) dot products over M. Runs mirror
  // the forward pass's: run s covers the chunks the forward's run s would cover counted from the
  // end.
  parallel_for(segments, [&](Index segment) {
    const Index hi = chunks - causal_segment_start(chunks, segments, segment),
                lo = chunks - causal_segment_start(chunks, segments, segment + 1);
    if (lo == hi) return;
    Work s(chunk, m, w);
    auto& suffix = s.state;
    bool has_suffix = false;
    for (Index t = chunks - 1; t >= lo; --t) {
      const Index i0 = t * chunk, len = std::min(chunk, n - i0);
      const Scalar e_t = row_max(i0 + len - 1);
      const auto queries = in.q.view(i0, len, s.q_rows);
      const auto g = gh.block(i0, 0, len, w);
      if (t < hi) {
        const auto keys = signed_keys(in, i0, len, s.k_rows);
        const auto k_log = s.k_rows.log_scale.head(len);
        auto beta = s.factor.head(len);
        beta = (k_log.array() - e_t).exp().matrix();
        auto dvt = d.dv.middleRows(i0, len);
        auto dkt = d.dk.middleRows(i0, len);
        if (has_suffix) {
          row_dots(dvt, keys, suffix.topRows(dv));
          dvt.array().colwise() *= beta.array();
          auto values = s.values.topLeftCorner(len, w);
          values_with_ones(in, i0, len, values);
          row_panel_product(dkt, values, suffix, false);
          dkt.array().colwise() *= beta.array();
        }
        const auto wt = weights.block(i0, 0, len, len);
        const auto mt = mixed.block(i0, 0, len, len);
        row_panel_product(dvt, wt.transpose(), g.leftCols(dv), has_suffix, Triangle::upper);
        row_panel_product(dkt, mt.transpose(), queries, has_suffix, Triangle::upper);
        if (in.signs.size() > 0) dkt.array().rowwise() *= in.signs.transpose().array();
      }
      if (t == lo || t == 0) break;  // no earlier chunk of this run reads the suffix
      // Ū relative to E_{t−1}: e^{E_{t−1} − E_t} Ū + φ̂(Q_t)ᵀ diag(e^{E_{t−1} − R_i}) [Ĝ | Ĥ]_t.
      const Scalar e_prev = row_max(i0 - 1);
      auto scaled = s.scaled.topLeftCorner(len, w);
      scaled = (e_prev - row_max.segment(i0, len).array()).exp().matrix().asDiagonal() * g;
      if (has_suffix) {
        row_panel_product_onto(suffix, suffix, std::exp(e_prev - e_t), scaled.transpose(), queries);
      } else {
        row_panel_product(suffix, scaled.transpose(), queries, false);
      }
      has_suffix = true;
    }
  });
}

// The backward of linear_attention_accumulate + finalize for given features: writes the
// cotangents d (see LinearCotangents) after checking every argument.
template <typename Scalar>
void linear_backward_impl(const Eigen::Ref<const RowMatrix<Scalar>>& qf,
                          const Eigen::Ref<const Vector<Scalar>>& q_log,
                          const Eigen::Ref<const RowMatrix<Scalar>>& kf,
                          const Eigen::Ref<const Vector<Scalar>>& k_log,
                          const Eigen::Ref<const RowMatrix<Scalar>>& v,
                          const Eigen::Ref<const Vector<Scalar>>& signs,
                          const Eigen::Ref<const RowMatrix<Scalar>>& out,
                          const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                          const LinearOptions& opt, LinearCotangents<Scalar> d) {
  if (qf.rows() == 0) {
    d.dk.setZero();
    d.dv.setZero();
    d.k_log.setZero();
    return;
  }
  const GivenFeatureRows<Scalar> q(qf, q_log), k(kf, k_log);
  const LinearOperands<GivenFeatureRows<Scalar>, GivenFeatureRows<Scalar>> in{
      q, k, v, signs, linear_chunk(opt)};
  const Scalar eps = static_cast<Scalar>(opt.denominator_epsilon);
  if (opt.causal) {
    linear_causal_backward(in, out, grad_out, eps, d);
  } else {
    linear_bidirectional_backward(in, out, grad_out, eps, d);
  }
  const Vector<Scalar> zeros = Vector<Scalar>::Zero(k_log.size() ? 0 : kf.rows());
  guard_key_cotangents<Scalar>(d.q_log, k_log.size() ? Eigen::Ref<const Vector<Scalar>>(k_log)
                                                       : Eigen::Ref<const Vector<Scalar>>(zeros),
                               opt.causal, d.k_log);
}

// Checks the arguments of a linear backward before anything is written.
template <typename Scalar>
void check_linear_backward(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& qf,
                           const Eigen::Ref<const Vector<Scalar>>& q_log,
                           const Eigen::Ref<const RowMatrix<Scalar>>& kf,
                           const Eigen::Ref<const Vector<Scalar>>& k_log,
                           const Eigen::Ref<const RowMatrix<Scalar>>& v,
                           const Eigen::Ref<const Vector<Scalar>>& signs,
                           const Eigen::Ref<const RowMatrix<Scalar>>& out,
                           const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                           const LinearOptions& opt) {
  check_linear_inputs<Scalar>(where, qf, q_log, kf, k_log, v, signs, opt);
  check_linear_grad_out<Scalar>(where, out, grad_out, qf.rows(), v.cols(), opt.check_finite);
  if (opt.check_finite) {
    require_finite(qf, where, "q_features");
    require_finite(kf, where, "k_features");
    require_finite(v, where, "v");
  }
}

template <typename Derived>
Derived& writable(const Eigen::MatrixBase<Derived>& m) {
  return const_cast<Derived&>(m.derived());
}

}  // namespace detail

// Gradients of <grad_out, out> for out = linear_attention(q, k, v, opt, signs) (out: that forward's
// result, passed in so it is not recomputed): dq and dk with respect to the scaled features (see
// ScaledFeatureGradient; an empty log-scale input gets the gradient of a zero log-scale) and dv.
template <typename Scalar, typename DV, typename DO, typename DG, typename DDV>
void linear_attention_backward(const ScaledFeatures<Scalar>& q, const ScaledFeatures<Scalar>& k,
                               const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
                               const Eigen::MatrixBase<DG>& grad_out,
                               ScaledFeatureGradient<Scalar>& dq, ScaledFeatureGradient<Scalar>& dk,
                               const Eigen::MatrixBase<DDV>& dv, const LinearOptions& opt = {},
                               const Vector<Scalar>& signs = Vector<Scalar>()) {
  const char* where = "linear_attention_backward";
  const Eigen::Ref<const RowMatrix<Scalar>> vr(v), outr(out), gr(grad_out);
  detail::check_linear_backward<Scalar>(where, q.values, q.log_scale, k.values, k.log_scale, vr,
                                        signs, outr, gr, opt);
  auto& dvw = detail::writable(dv);
  detail::require(dvw.rows() == vr.rows() && dvw.cols() == vr.cols(), where, "dv is ",
                  detail::shape_of(dvw), ", expected ", detail::shape_of(vr));
  dq.values.resize(q.values.rows(), q.values.cols());
  dk.values.resize(k.values.rows(), k.values.cols());
  dq.log_scale.resize(q.values.rows());
  dk.log_scale.resize(k.values.rows());
  RowMatrix<Scalar> dv_rows(vr.rows(), vr.cols());
  detail::linear_backward_impl<Scalar>(q.values, q.log_scale, k.values, k.log_scale, vr,
                                       signs, outr, gr, opt,
                                       {dq.values, dk.values, dv_rows, dq.log_scale, dk.log_scale});
  dvw = dv_rows;
  // ∂L/∂log_scale at fixed values: the path through φ = e^ℓ · values plus the guard's.
  dq.log_scale += (dq.values.array() * q.values.array()).rowwise().sum().matrix();
  dk.log_scale += (dk.values.array() * k.values.array()).rowwise().sum().matrix();
}

// Gradients of <grad_out, out> for plain feature matrices (no log-scales, no signs):
// out = linear_attention(q_features, k_features, v, opt).
template <typename DQ, typename DK, typename DV, typename DO, typename DG, typename GQ,
          typename GK, typename GV>
void linear_attention_backward(const Eigen::MatrixBase<DQ>& q_features,
                               const Eigen::MatrixBase<DK>& k_features,
                               const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
                               const Eigen::MatrixBase<DG>& grad_out,
                               const Eigen::MatrixBase<GQ>& dq_features,
                               const Eigen::MatrixBase<GK>& dk_features,
                               const Eigen::MatrixBase<GV>& dv, const LinearOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  const char* where = "linear_attention_backward";
  const Eigen::Ref<const RowMatrix<Scalar>> qr(q_features), kr(k_features), vr(v), outr(out),
      gr(grad_out);
  const Vector<Scalar> none;
  detail::check_linear_backward<Scalar>(where, qr, none, kr, none, vr, none, outr, gr, opt);
  auto &gq = detail::writable(dq_features), &gk = detail::writable(dk_features);
  auto& gv = detail::writable(dv);
  detail::require(gq.rows() == qr.rows() && gq.cols() == qr.cols() && gk.rows() == kr.rows() &&
                      gk.cols() == kr.cols() && gv.rows() == vr.rows() && gv.cols() == vr.cols(),
                  where, "dq_features (", detail::shape_of(gq), "), dk_features (",
                  detail::shape_of(gk), ") and dv (", detail::shape_of(gv),
                  ") must have the shapes of q_features, k_features and v");
  RowMatrix<Scalar> dqf(qr.rows(), qr.cols()), dkf(kr.rows(), kr.cols()), dvr(vr.rows(), vr.cols());
  Vector<Scalar> q_log(qr.rows()), k_log(kr.rows());
  detail::linear_backward_impl<Scalar>(qr, none, kr, none, vr, none, outr, gr, opt,
                                       {dqf, dkf, dvr, q_log, k_log});
  gq = dqf;
  gk = dkf;
  gv = dvr;
}

}  // namespace randattn
