#pragma once
// Registered random-feature methods: favor (positive features), favor-hyp (hyperbolic positive
// features), trig, oprf (optimal positive features), sderf (symmetric dense-exponential
// features), hybrid (angular hybrid of hyperbolic and trig) and hybrid-gaussian (Gaussian-kernel
// hybrid of trig and positive). They share one family of options (features, projection, omega,
// lambda_features, bandwidth, fit, rho, calibration, calibration_q, calibration_k), each declared
// once in registry/feature_options.hpp and owned by the methods that use it. Every (batch, heads) slice uses the same
// projection ω, drawn once from the seed.
//
// oprf and sderf fit their parameters (OPRF's A, SDERF's second moment) either
//   - to the queries and keys (fit "queries+keys", the default): each (batch, head) slice gets
//     its own map, fitted to that slice's own rows (a 2-D input is one slice); or
//   - to given values (fit "given" with exactly one of):
//       rho                           the mean of scale·|q_i + k_j|^2 over pairs, every slice;
//       calibration                   sample rows used as both queries and keys;
//       calibration_q + calibration_k separate sample queries and sample keys (fit(q, k, c)).
//     A calibration array is (r, d) (one map for every slice) or (heads, r, d) (head h's rows fit
//     the map of every slice (b, h)); calibration_q and calibration_k have the same order, and
//     may have different r.
// Slices with their own maps run one by one through the 2-D computation, so each equals a 2-D
// call on that slice with the matching 2-D calibration (or, fitted to queries+keys, on the
// slice's own rows) bit for bit. The report's predicted_rel_mse is the mean over slices of each
// slice's predicted error under its own map. A fit on the sequence lets every output depend on
// every key, so causal attention requires fit "given".

#include <randattn/randattn.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../feature_options.hpp"
#include "../kept_forward.hpp"
#include "../method.hpp"

namespace randattn::registry {


namespace detail {

// The (batch, heads) slices of contiguous q and k buffers as matrices.
template <typename Scalar>
struct SliceView {
  const Scalar* q_data;
  const Scalar* k_data;
  BatchShape shape;
  ConstRowMatrixMap<Scalar> q(Index s) const {
    return {q_data + s * shape.n_q * shape.d, shape.n_q, shape.d};
  }
  ConstRowMatrixMap<Scalar> k(Index s) const {
    return {k_data + s * shape.n_k * shape.d, shape.n_k, shape.d};
  }
};

// An ArrayValue as a row-major matrix of Scalar (2-D arrays only).
template <typename Scalar>
RowMatrix<Scalar> as_matrix(const ArrayValue& a) {
  return Eigen::Map<const RowMatrix<double>>(a.data.data(), a.shape[0], a.shape[1])
      .template cast<Scalar>();
}

// Matrix h of an (n, r, d) ArrayValue, or the whole of an (r, d) one.
template <typename Scalar>
RowMatrix<Scalar> matrix_of(const ArrayValue& a, Index h) {
  if (a.shape.size() == 2) return as_matrix<Scalar>(a);
  const Index r = a.shape[1], d = a.shape[2];
  return Eigen::Map<const RowMatrix<double>>(a.data.data() + h * r * d, r, d)
      .template cast<Scalar>();
}

// The maps of one call: a single map for every slice, one per head (slice s = b·heads + h uses
// map h) or one per (batch, head) slice. All share the projection; only fitted values differ.
template <typename Map>
class SliceMaps {
 public:
  using MapType = Map;
  explicit SliceMaps(Map map) { maps_.push_back(std::move(map)); }
  // One map per head (at least one).
  explicit SliceMaps(std::vector<Map> maps) : maps_(std::move(maps)) {}
  // n copies of the first map, to be fitted one by one (n = heads or slices).
  void replicate(Index n) { maps_.resize(std::size_t(std::max<Index>(1, n)), maps_.front()); }
  Index size() const { return Index(maps_.size()); }
  Map& operator[](Index i) { return maps_[std::size_t(i)]; }
  const Map& front() const { return maps_.front(); }
  // The map of slice s (per head: s % heads, as slices are ordered (batch, heads)).
  const Map& of_slice(Index s) const { return maps_[std::size_t(s % size())]; }

 private:
  std::vector<Map> maps_;
};

// Attention over contiguous (batch, heads, n, ·) buffers with each slice's own map: every slice
// computed as the 2-D random_feature_attention computes it (every slice validated first). With
// `saved` (one per slice), each slice also keeps its features for the backward (the same bits).
template <typename Map>
void per_slice_feature_attention(const SliceMaps<Map>& maps, const typename Map::Scalar* q,
                                 const typename Map::Scalar* k, const typename Map::Scalar* v,
                                 typename Map::Scalar* out, const BatchShape& shape,
                                 const RandomFeatureOptions& opt,
                                 std::vector<SavedFeatures<typename Map::Scalar>>* saved =
                                     nullptr) {
  using Scalar = typename Map::Scalar;
  namespace rd = randattn::detail;
  const char* where = "random_feature_attention";
  const auto slice = [&](Index i) {
    return std::make_tuple(rd::slice_of(q, i, shape.n_q, shape.d),
                           rd::slice_of(k, i, shape.n_k, shape.d),
                           rd::slice_of(v, i, shape.n_k, shape.dv));
  };
  rd::for_each_slice(
      where, shape, q && k && v && out,
      [&](Index i) {
        const Map& map = maps.of_slice(i);
        const auto [qs, ks, vs] = slice(i);
        rd::check_feature_slice(where, map, qs, ks, vs,
                                rd::feature_attention_settings(where, map, opt), opt.check_finite);
      },
      [&](Index i) {
        const Map& map = maps.of_slice(i);
        const auto s = rd::feature_attention_settings(where, map, opt);
        const auto [qs, ks, vs] = slice(i);
        auto o = rd::slice_of(out, i, shape.n_q, shape.dv);
        (saved ? rd::feature_attention_saving_slice(where, map, qs, ks, vs, s,
                                                    (*saved)[std::size_t(i)])
               : rd::feature_attention_slice(where, map, qs, ks, vs, s, false))
            .finalize_into(o, static_cast<Scalar>(s.linear.denominator_epsilon));
      });
}

// Families that build their maps themselves (Family::maps<Scalar>(call), e.g. learned maps
// given as arrays) rather than on a projection the options select.
template <typename Family, typename = void>
struct has_own_maps : std::false_type {};
template <typename Family>
struct has_own_maps<
    Family, std::void_t<decltype(Family::template maps<double>(std::declval<const Call&>()))>>
    : std::true_type {};

// Maps whose bias gradient a backward collects through a copy (HedgehogFeatures).
template <typename Map, typename = void>
struct has_bias_gradient : std::false_type {};
template <typename Map>
struct has_bias_gradient<Map, std::void_t<decltype(std::declval<const Map&>().with_bias_gradient(
                                  std::declval<Vector<typename Map::Scalar>*>()))>>
    : std::true_type {};

// The parameters a projection family differentiates: the projection ω ("omega"), one for every
// map of the call.
struct OmegaParameters {
  static constexpr const char* weight_option = "omega";
  static constexpr const char* bias_option = nullptr;
  static constexpr bool parameters_per_map = false;
};

}  // namespace detail

// A random-feature method: Family supplies name, summary, the options it owns and either
// make<Scalar>(projection, options, seed, d), the map built on that projection (hybrids take only
// its kind), or maps<Scalar>(call), the call's maps (one, or one per head), with check(call) and
// report(call, report). Its differentiable parameters are weight_option (the gradient of the dense
// matrix the map's projection stands for) and bias_option (or null), for every map together or,
// with parameters_per_map, one entry per map (per head). The map's feature dimension is reported.
template <typename Family>
class FeatureMethod final : public TypedMethod<FeatureMethod<Family>> {
 public:
  const char* name() const override { return Family::name; }
  const char* summary() const override { return Family::summary; }
  std::vector<OptionSpec> options() const override { return Family::options(); }
  bool supports_exclude_self() const override { return true; }

  // The projection (m x d, drawn in double) and the query and key features (n x m) of a slice.
  double working_bytes(const Call& call, std::size_t scalar_bytes) const override {
    const Options& o = call.options;
    const double m = o.given("omega") ? double(o.array("omega").shape[0])
                     : o.has("features") ? double(o.integer("features"))
                                         : 0.0;
    const BatchShape& s = call.shape;
    return 8.0 * m * double(s.d) +
           double(scalar_bytes) * m * (double(s.n_q + s.n_k) + double(s.dv + 1));
  }

  template <typename Scalar>
  Job<Scalar> make(const Call& call) const {
    check(call);
    return [call](const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) {
      const detail::SliceView<Scalar> data{q, k, call.shape};
      return with_map<Scalar>(call, &data, [&](const auto& maps, const RandomFeatureOptions& opt) {
        attend(maps, q, k, v, out, call.shape, opt);
      });
    };
  }

  // Every family's map has a vector–Jacobian product (features_vjp), also with respect to its
  // projections ("omega").
  bool differentiable() const override { return has_features_vjp<FamilyMap<double>>::value; }
  std::vector<std::string> differentiable_options() const override {
    if (!differentiable()) return {};
    std::vector<std::string> out{Family::weight_option};
    if (Family::bias_option) out.emplace_back(Family::bias_option);
    return out;
  }

  template <typename Scalar>
  GradientPtr<Scalar> make_gradient(const Call& call) const;

  // The forward of one call on its maps: one map for every slice, or each slice its own.
  template <typename Map>
  static void attend(const detail::SliceMaps<Map>& maps, const typename Map::Scalar* q,
                     const typename Map::Scalar* k, const typename Map::Scalar* v,
                     typename Map::Scalar* out, const BatchShape& shape,
                     const RandomFeatureOptions& opt) {
    if (maps.size() == 1)
      random_feature_attention_batched(maps.front(), q, k, v, out, shape, opt);
    else
      detail::per_slice_feature_attention(maps, q, k, v, out, shape, opt);
  }

  // Checks the options against the shape before anything runs.
  static void check(const Call& call) {
    const Options& o = call.options;
    const std::int64_t d = call.shape.d;
    if constexpr (detail::has_own_maps<Family>::value) {
      Family::check(call);
      return;
    } else if (o.given("omega")) {
      const ArrayValue& w = o.array("omega");
      if (o.given("projection"))
        throw OptionError(o.spelled("omega") + " and " + o.spelled("projection") +
                          " cannot be combined");
      if (w.shape.size() != 2 || w.shape[1] != d || w.shape[0] < 1)
        throw OptionError(o.spelled("omega") + ": expected an (r, " + std::to_string(d) +
                          ") array with r >= 1, got shape " + detail::shape_text(w.shape));
      const std::int64_t m = Family::omega_features(o, w.shape[0]);
      if (o.given("features") && m != o.integer("features"))
        throw OptionError(o.spelling().setting("features", std::to_string(o.integer("features"))) +
                          " disagrees with the " + std::to_string(w.shape[0]) + " rows of " +
                          o.spelled("omega") + " (" + std::to_string(m) + " features)");
    }
    if (!Family::fitted) return;
    const std::string pair = o.spelled("calibration_q") + " and " + o.spelled("calibration_k");
    if (o.given("calibration_q") != o.given("calibration_k"))
      throw OptionError(pair + " go together: " +
                        o.spelled(o.given("calibration_q") ? "calibration_k" : "calibration_q") +
                        " is missing");
    if (o.text("fit") == "queries+keys") {
      if (call.settings.causal)
        throw OptionError(o.spelling().setting("fit", "queries+keys") +
                          " would let every causal output depend on every key; use " +
                          o.spelling().setting("fit", "given") + " with " + given_choices(o));
      if (o.given("rho") || o.given("calibration") || o.given("calibration_q"))
        throw OptionError(o.spelled("rho") + ", " + o.spelled("calibration") + ", " + pair +
                          " need " + o.spelling().setting("fit", "given"));
      return;
    }
    if (int(o.given("rho")) + int(o.given("calibration")) + int(o.given("calibration_q")) != 1)
      throw OptionError(o.spelling().setting("fit", "given") + " needs exactly one of " +
                        given_choices(o));
    for (const char* name : {"calibration", "calibration_q", "calibration_k"}) {
      if (!o.given(name)) continue;
      const std::vector<std::int64_t>& s = o.array(name).shape;
      const std::string dim = std::to_string(d), heads = std::to_string(call.shape.heads);
      const bool ok = (s.size() == 2 || (s.size() == 3 && s[0] == call.shape.heads)) &&
                      s.back() == d && s[s.size() - 2] >= 1;
      if (!ok)
        throw OptionError(o.spelled(name) + ": expected an (r, " + dim + ") array or a per-head (" +
                          heads + ", r, " + dim + ") array (heads " + heads + ", d " + dim +
                          " as in the input) with r >= 1, got shape " + detail::shape_text(s));
    }
    if (o.given("calibration_q") &&
        o.array("calibration_q").shape.size() != o.array("calibration_k").shape.size())
      throw OptionError(pair + " must both be (r, d) or both per-head (heads, r, d), got shapes " +
                        detail::shape_text(o.array("calibration_q").shape) + " and " +
                        detail::shape_text(o.array("calibration_k").shape));
  }

  // Calls fn(map, options) with the map the options select, fitted (oprf, sderf) to the rows of
  // `data` or to the given statistic, and returns the report. data == nullptr: the rows are
  // elsewhere (sharded across processes), so only a given statistic fits and no predicted error
  // is computed.
  template <typename Scalar, typename Fn>
  static Report with_map(const Call& call, const detail::SliceView<Scalar>* data, Fn&& fn) {
    const Options& o = call.options;
    const std::int64_t d = call.shape.d;
    RandomFeatureOptions opt;
    opt.causal = call.settings.causal;
    opt.scale = call.settings.scale;
    opt.check_finite = call.settings.check_finite;
    opt.exclude_self = call.settings.exclude_self;
    const double normaliser = std::sqrt(call.settings.scale);
    const std::uint64_t seed = call.settings.seed;
    Report report;
    std::int64_t feature_dim = 0;
    std::optional<double> predicted;
    auto run = [&](auto maps) {
      using Map = typename decltype(maps)::MapType;
      if constexpr (is_fitted<Map>::value) fit_maps(maps, call, data, normaliser);
      feature_dim = maps.front().feature_dim();
      if constexpr (has_closed_form_mse<Map>::value)
        if (data && call.settings.report && data->shape.slices() > 0 && data->shape.n_q > 0)
          predicted = predicted_rel_mse(maps, *data, normaliser);
      fn(std::as_const(maps), opt);
    };
    if constexpr (detail::has_own_maps<Family>::value) {
      run(Family::template maps<Scalar>(call));
      Family::report(call, report);
    } else {
      const auto on = [&](auto projection) {
        using Map = decltype(Family::template make<Scalar>(std::move(projection), o, seed, d));
        run(detail::SliceMaps<Map>(
            Family::template make<Scalar>(std::move(projection), o, seed, d)));
      };
      const std::string& projection = o.text("projection");
      if (o.given("omega"))
        on(UserProjection<Scalar>(detail::as_matrix<double>(o.array("omega"))));
      else if (projection == "iid")
        on(GaussianProjection<Scalar>(o.integer("features"), d, seed));
      else if (projection == "hadamard")
        on(HadamardProjection<Scalar>(o.integer("features"), d, seed));
      else
        on(OrthogonalProjection<Scalar>(o.integer("features"), d, seed));

      if (o.given("omega"))
        report = {{"features", Family::omega_features(o, o.array("omega").shape[0])},
                  {"projection", std::string("user")},
                  {"omega", o.array("omega").source}};
      else
        report = {{"features", o.integer("features")},
                  {"projection", projection},
                  {"seed", std::uint64_t(seed)}};
      Family::report(o, report);
    }
    if (feature_dim > 0) report.emplace_back("feature_dim", feature_dim);
    if (predicted) report.emplace_back("predicted_rel_mse", *predicted);
    return report;
  }

 private:
  // The map type a family builds (on an orthogonal projection; hybrids draw their own).
  template <typename Scalar, typename F = Family, typename = void>
  struct family_map {
    using type = decltype(F::template make<Scalar>(std::declval<OrthogonalProjection<Scalar>>(),
                                                   std::declval<const Options&>(), std::uint64_t(),
                                                   std::int64_t()));
  };
  template <typename Scalar, typename F>
  struct family_map<Scalar, F, std::enable_if_t<detail::has_own_maps<F>::value>> {
    using type = typename decltype(F::template maps<Scalar>(std::declval<const Call&>()))::MapType;
  };
  template <typename Scalar>
  using FamilyMap = typename family_map<Scalar>::type;

  // Maps with a fit(q, k, normaliser) step (oprf, sderf).
  template <typename Map, typename = void>
  struct is_fitted : std::false_type {};
  template <typename Map>
  struct is_fitted<Map, std::void_t<decltype(&Map::fit)>> : std::true_type {};
  // Maps with a closed-form kernel MSE (features/kernel_variance.hpp).
  template <typename Map, typename = void>
  struct has_closed_form_mse : std::false_type {};
  template <typename Map>
  struct has_closed_form_mse<
      Map, std::void_t<decltype(kernel_relative_mse(std::declval<const Map&>(), Eigen::VectorXd(),
                                                    Eigen::VectorXd()))>> : std::true_type {};

  // "--rho, --calibration, or --calibration-q with --calibration-k".
  static std::string given_choices(const Options& o) {
    return o.spelled("rho") + ", " + o.spelled("calibration") + ", or " +
           o.spelled("calibration_q") + " with " + o.spelled("calibration_k");
  }

  // Fits each slice's map to its own queries and keys, each head's map to its calibration rows,
  // or the one map to the given statistic or calibration rows (see the header comment).
  template <typename Map>
  static void fit_maps(detail::SliceMaps<Map>& maps, const Call& call,
                       const detail::SliceView<typename Map::Scalar>* sequence, double normaliser) {
    using Scalar = typename Map::Scalar;
    const Options& o = call.options;
    if (o.text("fit") == "queries+keys") {
      if (!sequence)
        throw OptionError(o.spelling().setting("fit", "queries+keys") +
                          " needs every query and key in one process; use " +
                          o.spelling().setting("fit", "given") + " with " + given_choices(o));
      const detail::SliceView<Scalar>& data = *sequence;
      if (data.shape.slices() == 0 || data.shape.n_q == 0) return;  // no output rows
      maps.replicate(data.shape.slices());
      for (Index s = 0; s < data.shape.slices(); ++s) maps[s].fit(data.q(s), data.k(s), normaliser);
      return;
    }
    if (o.given("rho")) {
      Family::set_rho(maps[0], o.real("rho"));
      return;
    }
    const bool pair = o.given("calibration_q");
    const ArrayValue& qa = o.array(pair ? "calibration_q" : "calibration");
    const ArrayValue& ka = o.array(pair ? "calibration_k" : "calibration");
    const Index heads = qa.shape.size() == 3 ? Index(qa.shape[0]) : 1;
    if (qa.shape.size() == 3) maps.replicate(heads);
    for (Index h = 0; h < heads; ++h) {
      const RowMatrix<Scalar> q_rows = detail::matrix_of<Scalar>(qa, h);
      try {
        if (pair)
          maps[h].fit(q_rows, detail::matrix_of<Scalar>(ka, h), normaliser);
        else
          maps[h].fit(q_rows, q_rows, normaliser);
      } catch (const std::invalid_argument& e) {
        throw OptionError((pair ? o.spelled("calibration_q") + ", " + o.spelled("calibration_k")
                                : o.spelled("calibration")) +
                          ": " + e.what());
      }
    }
  }

  // Mean closed-form relative kernel MSE over 1024 sampled pairs of each slice under the slice's
  // own map, averaged over the slices.
  template <typename Map>
  static double predicted_rel_mse(const detail::SliceMaps<Map>& maps,
                                  const detail::SliceView<typename Map::Scalar>& data,
                                  double normaliser) {
    double sum = 0;
    for (Index s = 0; s < data.shape.slices(); ++s)
      sum += mean_kernel_relative_mse(maps.of_slice(s), data.q(s), data.k(s), normaliser);
    return sum / double(std::max<Index>(1, data.shape.slices()));
  }
};

namespace detail {

// The gradient of a feature-method call. The forward builds the call's maps exactly as its job
// does (drawn from the seed, fitted maps fitted to this call's rows) and keeps them, with each
// slice's query and key features (SavedFeatures: the same output, no second mapping); the backward
// differentiates each slice with its map held fixed (attention/random_feature_backward.hpp), so
// a fitted map's parameters count as constants. The gradients of the family's parameters (ω; a
// learned map's weight and bias) are summed over the slices in slice order, independent of the
// thread count: into one gradient for every map, or with parameters_per_map into each map's
// entry (slice s uses map s % maps, see SliceMaps).
template <typename Family, typename Scalar>
class FeatureGradient final : public Gradient<Scalar> {
  using Method = FeatureMethod<Family>;

 public:
  explicit FeatureGradient(const Call& call)
      : call_(call),
        want_weight_(wanted(call, Family::weight_option)),
        want_bias_(wanted(call, Family::bias_option)) {}

  Report forward(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) override {
    const BatchShape& shape = call_.shape;
    const SliceView<Scalar> data{q, k, shape};
    return Method::template with_map<Scalar>(
        call_, &data, [&](const auto& maps, const RandomFeatureOptions& opt) {
          std::vector<SavedFeatures<Scalar>> saved(std::size_t(shape.slices()));
          detail::per_slice_feature_attention(maps, q, k, v, out, call_.shape, opt, &saved);
          // The caller's out may change before the backward: keep a copy.
          std::vector<Scalar> kept(out, out + shape.slices() * shape.n_q * shape.dv);
          backward_ = [this, maps, opt, q, k, v, kept = std::move(kept),
                       saved = std::move(saved)](const Scalar* grad_out, Scalar* dq, Scalar* dk,
                                                 Scalar* dv) {
            run_backward(maps, opt, q, k, v, kept.data(), saved, grad_out, dq, dk, dv);
          };
        });
  }

  void backward(const Scalar* grad_out, Scalar* dq, Scalar* dk, Scalar* dv) override {
    if (!backward_)
      throw std::logic_error("randattn::registry: Gradient::backward() before forward()");
    backward_(grad_out, dq, dk, dv);
  }

  std::vector<std::pair<std::string, std::vector<double>>> option_gradients() const override {
    std::vector<std::pair<std::string, std::vector<double>>> out;
    if (want_weight_) out.emplace_back(Family::weight_option, d_weight_);
    if (want_bias_) out.emplace_back(Family::bias_option, d_bias_);
    return out;
  }

 private:
  static bool wanted(const Call& call, const char* option) {
    const std::vector<std::string>& names = call.settings.option_gradients;
    return option && std::find(names.begin(), names.end(), option) != names.end();
  }

  template <typename Map>
  void run_backward(const SliceMaps<Map>& maps, const RandomFeatureOptions& opt, const Scalar* q,
                    const Scalar* k, const Scalar* v, const Scalar* out,
                    const std::vector<SavedFeatures<Scalar>>& saved, const Scalar* grad_out,
                    Scalar* dq, Scalar* dk, Scalar* dv) {
    namespace rd = randattn::detail;
    const char* where = "random_feature_attention_backward";
    const BatchShape& s = call_.shape;
    const auto slice = [&](auto* base, Index i, Index rows, Index cols) {
      return rd::slice_of(base, i, rows, cols);
    };
    const Index m = maps.front().projections();  // a hybrid: every part's
    std::vector<RowMatrix<Scalar>> d_weight(want_weight_ ? std::size_t(s.slices()) : 0,
                                            RowMatrix<Scalar>::Zero(m, s.d));
    std::vector<Vector<Scalar>> d_bias(want_bias_ ? std::size_t(s.slices()) : 0,
                                       Vector<Scalar>::Zero(m));
    detail::clear_key_gradients_without_queries(s, dk, dv);
    rd::for_each_slice(
        where, s, grad_out && dq && dk && dv,
        [&](Index i) {
          const Map& map = maps.of_slice(i);
          rd::check_feature_backward_slice(
              where, map, slice(q, i, s.n_q, s.d), slice(k, i, s.n_k, s.d),
              slice(v, i, s.n_k, s.dv), slice(out, i, s.n_q, s.dv),
              slice(grad_out, i, s.n_q, s.dv), rd::feature_attention_settings(where, map, opt),
              opt.check_finite, &saved[std::size_t(i)]);
        },
        [&](Index i) {
          const auto run = [&](const Map& map) {
            rd::feature_attention_backward_slice(
                where, map, slice(q, i, s.n_q, s.d), slice(k, i, s.n_k, s.d),
                slice(v, i, s.n_k, s.dv), slice(out, i, s.n_q, s.dv),
                slice(grad_out, i, s.n_q, s.dv), rd::feature_attention_settings(where, map, opt),
                slice(dq, i, s.n_q, s.d), slice(dk, i, s.n_k, s.d), slice(dv, i, s.n_k, s.dv),
                want_weight_ ? &d_weight[std::size_t(i)] : nullptr, &saved[std::size_t(i)]);
          };
          if constexpr (has_bias_gradient<Map>::value)
            if (want_bias_)
              return run(maps.of_slice(i).with_bias_gradient(&d_bias[std::size_t(i)]));
          run(maps.of_slice(i));
        });
    // Each slice's part into its map's entry (or the one gradient), in slice order.
    const Index entries = Family::parameters_per_map ? maps.size() : 1;
    if (want_weight_) {
      RowMatrix<double> total = RowMatrix<double>::Zero(entries * m, s.d);
      for (Index i = 0; i < s.slices(); ++i)
        total.middleRows((i % entries) * m, m) += d_weight[std::size_t(i)].template cast<double>();
      d_weight_.assign(total.data(), total.data() + total.size());
    }
    if (want_bias_) {
      Eigen::VectorXd total = Eigen::VectorXd::Zero(entries * m);
      for (Index i = 0; i < s.slices(); ++i)
        total.segment((i % entries) * m, m) += d_bias[std::size_t(i)].template cast<double>();
      d_bias_.assign(total.data(), total.data() + total.size());
    }
  }

  Call call_;
  bool want_weight_, want_bias_;
  std::function<void(const Scalar*, Scalar*, Scalar*, Scalar*)> backward_;
  std::vector<double> d_weight_, d_bias_;
};

}  // namespace detail

template <typename Family>
template <typename Scalar>
GradientPtr<Scalar> FeatureMethod<Family>::make_gradient(const Call& call) const {
  check(call);
  const Options& o = call.options;
  if (call.settings.exclude_self)
    throw OptionError(std::string("method '") + Family::name +
                      "' has no backward pass with exclude_self");
  for (const std::string& option : call.settings.option_gradients)
    if (!o.given(option))
      throw OptionError("the gradient of " + o.spelled(option) + " needs " + o.spelled(option) +
                        " given");
  return std::make_unique<detail::FeatureGradient<Family, Scalar>>(call);
}

// One map on the given projection.
template <template <typename, typename> class Map>
struct SingleMap : detail::OmegaParameters {
  static constexpr bool fitted = false;
  static std::vector<OptionSpec> options() {
    namespace f = feature_options;
    return {f::features(), f::projection(), f::omega()};
  }
  // The features m of a given omega of `rows` rows: one projection per row.
  static std::int64_t omega_features(const Options&, std::int64_t rows) { return rows; }
  template <typename Scalar, typename Projection>
  static Map<Scalar, Projection> make(Projection projection, const Options&, std::uint64_t,
                                      std::int64_t) {
    return Map<Scalar, Projection>(std::move(projection));
  }
  static void report(const Options&, Report&) {}
};

struct FavorFamily : SingleMap<PositiveFeatures> {
  static constexpr const char* name = "favor";
  static constexpr const char* summary = "FAVOR+ positive random features (m features)";
};

struct FavorHypFamily : SingleMap<HyperbolicFeatures> {
  static constexpr const char* name = "favor-hyp";
  static constexpr const char* summary = "hyperbolic positive random features (2m features)";
};

struct TrigFamily : SingleMap<TrigFeatures> {
  static constexpr const char* name = "trig";
  static constexpr const char* summary =
      "trigonometric random features (2m features, guarded denominator)";
};

// Maps fitted to the queries and keys or to given values (see the header comment).
template <template <typename, typename> class Map>
struct FittedMap : SingleMap<Map> {
  static constexpr bool fitted = true;
  static std::vector<OptionSpec> options() {
    namespace f = feature_options;
    return {f::features(), f::projection(),  f::omega(),         f::fit(),
            f::rho(),      f::calibration(), f::calibration_q(), f::calibration_k()};
  }
  static void report(const Options& o, Report& r) {
    r.emplace_back("fit", o.text("fit"));
    if (o.given("rho")) r.emplace_back("rho", o.real("rho"));
    for (const char* name : {"calibration", "calibration_q", "calibration_k"})
      if (o.given(name)) r.emplace_back(name, o.array(name).source);
  }
};

struct OprfFamily : FittedMap<OptimalPositiveFeatures> {
  static constexpr const char* name = "oprf";
  static constexpr const char* summary =
      "optimal positive random features, A fitted to the data (m features)";
  template <typename Map>
  static void set_rho(Map& map, double rho) {
    map.set_rho(rho);
  }
};

struct SderfFamily : FittedMap<DenseExponentialFeatures> {
  static constexpr const char* name = "sderf";
  static constexpr const char* summary =
      "symmetric dense-exponential random features, fitted to the data's second moment (m "
      "features)";
  template <typename Map>
  static void set_rho(Map& map, double rho) {
    const Index d = map.input_dim();
    map.set_moment(Eigen::MatrixXd::Identity(d, d) * (rho / double(d)));
  }
};

// Hybrids draw their own projections of the selected kind, or take them all stacked in omega:
// τ of the weight estimator (lambda_features rows), then each base's ω (m rows each), as
// HybridFeatures::projection_matrix() stacks them and its features_vjp differentiates them.
struct HybridProjections : detail::OmegaParameters {
  static std::int64_t omega_features(const Options& o, std::int64_t rows) {
    const std::int64_t lambda = o.integer("lambda_features");
    if (rows <= lambda || (rows - lambda) % 2 != 0)
      throw OptionError(o.spelled("omega") + ": a hybrid's omega stacks the " +
                        o.spelled("lambda_features") + " = " + std::to_string(lambda) +
                        " rows of its weight estimator and the m rows of each of its two bases (" +
                        std::to_string(lambda) + " + 2m rows, m >= 1), got " +
                        std::to_string(rows) + " rows");
    return (rows - lambda) / 2;
  }
};

struct HybridFamily : HybridProjections {
  static constexpr const char* name = "hybrid";
  static constexpr const char* summary =
      "angular hybrid lambda*hyperbolic + (1-lambda)*trig, lambda = angle/pi (guarded denominator)";
  static constexpr bool fitted = false;
  static std::vector<OptionSpec> options() {
    namespace f = feature_options;
    return {f::features(), f::projection(), f::lambda_features(), f::omega()};
  }
  template <typename Scalar, typename Projection>
  static HybridFeatures<Scalar> make(Projection projection, const Options& o, std::uint64_t seed,
                                     std::int64_t d) {
    if constexpr (std::is_same<Projection, UserProjection<Scalar>>::value)
      return angular_hybrid_on<Scalar>(projection.matrix(), o.integer("lambda_features"));
    else
      return angular_hybrid<Scalar, Projection>(o.integer("features"),
                                                o.integer("lambda_features"), d, seed);
  }
  static void report(const Options& o, Report& r) {
    r.emplace_back("lambda_features", o.integer("lambda_features"));
  }
};

struct HybridGaussianFamily : HybridProjections {
  static constexpr const char* name = "hybrid-gaussian";
  static constexpr const char* summary =
      "Gaussian hybrid lambda*trig + (1-lambda)*positive, lambda = exp(-s^2|x-y|^2/2) (guarded "
      "denominator)";
  static constexpr bool fitted = false;
  static std::vector<OptionSpec> options() {
    namespace f = feature_options;
    return {f::features(), f::projection(), f::lambda_features(), f::bandwidth(), f::omega()};
  }
  template <typename Scalar, typename Projection>
  static HybridFeatures<Scalar> make(Projection projection, const Options& o, std::uint64_t seed,
                                     std::int64_t d) {
    if constexpr (std::is_same<Projection, UserProjection<Scalar>>::value)
      return gaussian_hybrid_on<Scalar>(projection.matrix(), o.integer("lambda_features"),
                                        o.real("bandwidth"));
    else
      return gaussian_hybrid<Scalar, Projection>(o.integer("features"),
                                                 o.integer("lambda_features"), d,
                                                 o.real("bandwidth"), seed);
  }
  static void report(const Options& o, Report& r) {
    r.emplace_back("lambda_features", o.integer("lambda_features"));
    r.emplace_back("bandwidth", o.real("bandwidth"));
  }
};

}  // namespace randattn::registry
