// randattn._core.FeatureMap and randattn._core.Decoder, and the map construction shared with the
// random-feature attention methods.

#include "feature_maps.hpp"

#include "bindings.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <randattn/registry/feature_options.hpp>

#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>

namespace randattn_python {

namespace {

// FeatureMap's options are the registry's (registry/feature_options.hpp): one declaration, the
// same names, defaults and help as the random-feature methods of randattn.attention. Ranges and
// choices are checked in map_spec below, with Python's messages.
OptionSpec from_registry(const randattn::registry::OptionSpec& spec) {
  OptionDefault fallback;
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same<T, randattn::registry::ArrayValue>::value) {
          fallback = std::monostate{};  // arrays have no default
        } else {
          fallback = x;
        }
      },
      spec.fallback);
  return {spec.name, fallback, spec.help};
}

OptionSpec features_option() {
  return from_registry(randattn::registry::feature_options::features());
}
OptionSpec projection_option() {
  return from_registry(randattn::registry::feature_options::projection());
}
OptionSpec omega_option() { return from_registry(randattn::registry::feature_options::omega()); }
OptionSpec lambda_features_option() {
  return from_registry(randattn::registry::feature_options::lambda_features());
}
OptionSpec bandwidth_option() {
  return from_registry(randattn::registry::feature_options::bandwidth());
}

bool owns(const MapKindInfo& info, const char* name) {
  for (const OptionSpec& s : info.options)
    if (s.name == name) return true;
  return false;
}

ProjectionKind parse_projection(const std::string& name) {
  if (name == "iid") return ProjectionKind::iid;
  if (name == "orthogonal") return ProjectionKind::orthogonal;
  if (name == "hadamard") return ProjectionKind::hadamard;
  throw py::value_error("projection must be 'iid', 'orthogonal' or 'hadamard', got '" + name + "'");
}

// ω as a double matrix: the i.i.d. and orthogonal draws are made in double by the library and
// rounded to Scalar, so drawing in Scalar directly gives the same numbers.
template <typename Scalar>
randattn::RowMatrix<Scalar> dense_omega(const MapSpec& s) {
  if (s.omega) return s.omega->cast<Scalar>();
  if (s.projection == ProjectionKind::iid)
    return randattn::GaussianProjection<Scalar>(s.features, s.dim, s.seed).matrix();
  return randattn::OrthogonalProjection<Scalar>(s.features, s.dim, s.seed).matrix();
}

template <template <typename, typename> class Map, typename Scalar>
AnyMap<Scalar> plain_map(const MapSpec& s) {
  if (s.projection == ProjectionKind::hadamard && !s.omega)
    return Map<Scalar, Hadamard<Scalar>>(Hadamard<Scalar>(s.features, s.dim, s.seed));
  return Map<Scalar, Dense<Scalar>>(Dense<Scalar>(dense_omega<Scalar>(s)));
}

// Hybrids draw their own projections of the selected kind.
template <typename Scalar, typename Projection>
randattn::HybridFeatures<Scalar> hybrid_map(const MapSpec& s) {
  if (s.kind == MapKind::angular_hybrid)
    return randattn::angular_hybrid<Scalar, Projection>(s.features, s.lambda_features, s.dim,
                                                        s.seed);
  return randattn::gaussian_hybrid<Scalar, Projection>(s.features, s.lambda_features, s.dim,
                                                       s.bandwidth, s.seed);
}

}  // namespace

const std::vector<MapKindInfo>& map_kinds() {
  static const std::vector<MapKindInfo> kinds = {
      {"positive", MapKind::positive, {features_option(), projection_option(), omega_option()}},
      {"hyperbolic", MapKind::hyperbolic, {features_option(), projection_option(), omega_option()}},
      {"trig", MapKind::trig, {features_option(), projection_option(), omega_option()}},
      {"hybrid",
       MapKind::angular_hybrid,
       {features_option(), projection_option(), lambda_features_option()}},
      {"hybrid-gaussian",
       MapKind::gaussian_hybrid,
       {features_option(), projection_option(), lambda_features_option(), bandwidth_option()}},
  };
  return kinds;
}

const MapKindInfo& map_kind(MapKind kind) {
  for (const MapKindInfo& info : map_kinds())
    if (info.kind == kind) return info;
  throw std::logic_error("unregistered feature-map kind");
}

MapSpec map_spec(MapKind kind, Index dim, std::uint64_t seed, const KeywordOptions& o) {
  const MapKindInfo& info = map_kind(kind);
  MapSpec s;
  s.kind = kind;
  s.dim = dim;
  s.seed = seed;
  s.features = o.integer("features");
  if (s.features < 1 || s.features > randattn::registry::kMaxFeatures)
    throw py::value_error("features must be in [1, " +
                          std::to_string(randattn::registry::kMaxFeatures) + "], got " +
                          std::to_string(s.features));
  s.projection = parse_projection(o.text("projection"));
  if (owns(info, "omega") && o.given("omega")) {
    if (o.given("projection")) throw py::value_error("omega and projection cannot be combined");
    const py::array w = as_float_array(o.value("omega"), "omega");
    if (w.ndim() != 2 || w.shape(1) != dim || w.shape(0) < 1)
      throw py::value_error("omega: expected an (m, " + std::to_string(dim) +
                            ") array with m >= 1, got shape " + shape_str(shape_of(w)));
    if (o.given("features") && s.features != w.shape(0))
      throw py::value_error("features=" + std::to_string(s.features) + " disagrees with the " +
                            std::to_string(w.shape(0)) + " rows of omega");
    s.features = w.shape(0);
    const auto wd = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(w);
    s.omega = Eigen::Map<const randattn::RowMatrix<double>>(wd.data(), w.shape(0), w.shape(1));
  }
  if (owns(info, "lambda_features")) {
    s.lambda_features = o.integer("lambda_features");
    if (s.lambda_features < 1 || s.lambda_features > randattn::registry::kMaxFeatures)
      throw py::value_error("lambda_features must be in [1, " +
                            std::to_string(randattn::registry::kMaxFeatures) + "], got " +
                            std::to_string(s.lambda_features));
  }
  if (owns(info, "bandwidth")) {
    s.bandwidth = o.real("bandwidth");
    if (!(s.bandwidth > 0) || !std::isfinite(s.bandwidth))
      throw py::value_error("bandwidth must be positive and finite, got " +
                            std::to_string(s.bandwidth));
  }
  return s;
}

template <typename Scalar>
AnyMap<Scalar> build_map(const MapSpec& s) {
  switch (s.kind) {
    case MapKind::positive:
      return plain_map<randattn::PositiveFeatures, Scalar>(s);
    case MapKind::hyperbolic:
      return plain_map<randattn::HyperbolicFeatures, Scalar>(s);
    case MapKind::trig:
      return plain_map<randattn::TrigFeatures, Scalar>(s);
    case MapKind::angular_hybrid:
    case MapKind::gaussian_hybrid:
      switch (s.projection) {
        case ProjectionKind::iid:
          return hybrid_map<Scalar, randattn::GaussianProjection<Scalar>>(s);
        case ProjectionKind::hadamard:
          return hybrid_map<Scalar, randattn::HadamardProjection<Scalar>>(s);
        case ProjectionKind::orthogonal:
          return hybrid_map<Scalar, randattn::OrthogonalProjection<Scalar>>(s);
      }
  }
  throw std::logic_error("unhandled feature-map kind");
}

template AnyMap<float> build_map<float>(const MapSpec&);
template AnyMap<double> build_map<double>(const MapSpec&);

namespace {

MapKind parse_kind(const std::string& name) {
  std::string names;
  for (const MapKindInfo& info : map_kinds()) {
    if (name == info.name) return info.kind;
    names += std::string(names.empty() ? "" : ", ") + info.name;
  }
  throw py::value_error("unknown feature map kind '" + name + "' (available: " + names + ")");
}

randattn::FeatureSide parse_side(const std::string& side) {
  if (side == "query") return randattn::FeatureSide::query;
  if (side == "key") return randattn::FeatureSide::key;
  throw py::value_error("side must be 'query' or 'key', got '" + side + "'");
}

// A map of each scalar type, built together from one spec. Immutable: redraw() replaces it, so a
// computation running without the GIL keeps the maps it started with.
struct MapPair {
  explicit MapPair(const MapSpec& spec)
      : single(build_map<float>(spec)), dual(build_map<double>(spec)) {}
  AnyMap<float> single;
  AnyMap<double> dual;

  template <typename Scalar>
  const AnyMap<Scalar>& get() const {
    if constexpr (std::is_same<Scalar, float>::value) {
      return single;
    } else {
      return dual;
    }
  }
};

class FeatureMap {
 public:
  FeatureMap(const std::string& kind, py::handle dim, py::handle seed, const py::dict& options) {
    const MapKindInfo& info = map_kind(parse_kind(kind));
    check_keywords(options, info.options, "FeatureMap", "kind '" + kind + "'",
                   [&](const std::string& name) {
                     for (const MapKindInfo& other : map_kinds())
                       if (owns(other, name.c_str()))
                         return std::string("kind '") + other.name + "'";
                     return std::string();
                   });
    const Index d = to_integer(dim, "d");
    if (d < 1) throw py::value_error("d must be at least 1, got " + std::to_string(d));
    spec_ = map_spec(info.kind, d, to_seed(seed, "seed"), KeywordOptions(info.options, options));
    maps_ = std::make_shared<const MapPair>(spec_);
  }

  // (values (n, M), log_scale (n,)): row i of x maps to exp(log_scale[i]) * values[i].
  py::tuple features(py::handle x_obj, py::handle normaliser_obj, const std::string& side_name,
                     py::handle check_finite_obj) const {
    const py::array x = as_float_array(x_obj, "x");
    const double normaliser = to_real(normaliser_obj, "normaliser");
    const bool check_finite = to_flag(check_finite_obj, "check_finite");
    if (!std::isfinite(normaliser))
      throw py::value_error("normaliser must be a finite number, got " +
                            std::string(py::str(normaliser_obj)));
    const randattn::FeatureSide side = parse_side(side_name);
    if (x.ndim() != 2 || x.shape(1) != spec_.dim)
      throw py::value_error("x: expected an (n, " + std::to_string(spec_.dim) +
                            ") array, got shape " + shape_str(shape_of(x)));
    return dtype_of(x) == Dtype::float32
               ? typed_features<float>(x, normaliser, side, check_finite)
               : typed_features<double>(x, normaliser, side, check_finite);
  }

  void redraw(py::handle seed) {
    if (spec_.omega)
      throw py::value_error(
          "FeatureMap.redraw: this map has a given omega, which cannot be redrawn");
    MapSpec next = spec_;
    next.seed = to_seed(seed, "seed");
    maps_ = std::make_shared<const MapPair>(next);
    spec_ = next;
  }

  const MapSpec& spec() const { return spec_; }
  std::shared_ptr<const MapPair> maps() const { return maps_; }
  std::string kind() const { return map_kind(spec_.kind).name; }
  Index feature_dim() const {
    return std::visit([](const auto& m) { return m.feature_dim(); }, maps_->dual);
  }

  // ±1 per feature: the kernel estimate is φ(q)ᵀ diag(signs) φ(k).
  py::array_t<double> signs() const {
    const randattn::Vector<double> s =
        std::visit([](const auto& m) { return randattn::Vector<double>(m.signs()); }, maps_->dual);
    py::array_t<double> out(feature_dim());
    for (Index i = 0; i < feature_dim(); ++i) out.mutable_at(i) = s.size() ? s(i) : 1.0;
    return out;
  }

  // The projections (float64): (m, d) for the plain kinds; for hybrids every part's stacked,
  // (lambda_features + 2m, d), the omega option of the hybrid attention methods.
  py::array_t<double> omega() const {
    const randattn::RowMatrix<double> w = std::visit(
        [](const auto& m) -> randattn::RowMatrix<double> {
          using Map = std::decay_t<decltype(m)>;
          if constexpr (std::is_same<Map, randattn::HybridFeatures<double>>::value)
            return m.projection_matrix();
          else
            return m.projection().matrix();
        },
        maps_->dual);
    py::array_t<double> out({w.rows(), w.cols()});
    std::copy(w.data(), w.data() + w.size(), out.mutable_data());
    return out;
  }

 private:
  template <typename Scalar>
  // As the attention entry points: with check_finite, NaN or Inf in x is refused, and a
  // non-finite result of finite input is reported as overflow, never returned.
  py::tuple typed_features(const py::array& x, double normaliser, randattn::FeatureSide side,
                           bool check_finite) const {
    if (std::abs(normaliser) > double(std::numeric_limits<Scalar>::max()))
      throw py::value_error("normaliser = " + std::to_string(normaliser) +
                            " is not representable in " + dtype_name(dtype_of(x)));
    const RowMajorInput<Scalar> in(x);
    const Index n = x.shape(0), dim = feature_dim();
    py::array_t<Scalar> values({n, dim}), log_scale(n);
    Scalar* values_data = values.mutable_data();
    Scalar* log_scale_data = log_scale.mutable_data();
    const std::shared_ptr<const MapPair> maps = maps_;
    run_without_gil(std::nullopt, [&] {
      // Computed in Eigen's own (aligned) storage, then copied: vectorised loops peel a
      // different number of leading entries on differently aligned rows, which changes the
      // last bit of some entries, so results written straight into NumPy's buffer would depend
      // on where NumPy put it.
      const Eigen::Map<const randattn::RowMatrix<Scalar>> xm(in.data(), n, spec_.dim);
      const char* where = "FeatureMap.features";
      if (check_finite) randattn::check_finite_input(where, "x", xm);
      randattn::ScaledFeatures<Scalar> f{randattn::RowMatrix<Scalar>(n, dim),
                                         randattn::Vector<Scalar>(n)};
      std::visit(
          [&](const auto& m) {
            m.features_into(xm, static_cast<Scalar>(normaliser), f.values, f.log_scale, side);
          },
          maps->template get<Scalar>());
      if (check_finite) {
        randattn::check_finite_result(where, f.values);
        randattn::check_finite_result(where, f.log_scale);
      }
      std::copy(f.values.data(), f.values.data() + f.values.size(), values_data);
      std::copy(f.log_scale.data(), f.log_scale.data() + n, log_scale_data);
    });
    return py::make_tuple(values, log_scale);
  }

  MapSpec spec_;
  std::shared_ptr<const MapPair> maps_;
};

template <typename Variant>
struct DecodersOf;
template <typename... Maps>
struct DecodersOf<std::variant<Maps...>> {
  using type = std::variant<randattn::RandomFeatureDecoder<Maps>...>;
};

// RandomFeatureDecoder over any map of one scalar type.
template <typename Scalar>
class TypedDecoder {
 public:
  using RowVector = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

  TypedDecoder(const AnyMap<Scalar>& map, Index value_dim,
               const randattn::RandomFeatureOptions& opt)
      : decoder_(std::visit(
            [&](const auto& m) -> Any {
              return randattn::RandomFeatureDecoder<std::decay_t<decltype(m)>>(m, value_dim, opt);
            },
            map)) {}

  void append(const Scalar* k, Index dim, const Scalar* v, Index value_dim) {
    std::visit(
        [&](auto& d) {
          d.append(Eigen::Map<const RowVector>(k, dim), Eigen::Map<const RowVector>(v, value_dim));
        },
        decoder_);
  }
  void query(const Scalar* q, Index dim, Scalar* out, Index value_dim) {
    std::visit(
        [&](auto& d) {
          d.query_into(Eigen::Map<const RowVector>(q, dim), Eigen::Map<RowVector>(out, value_dim));
        },
        decoder_);
  }
  Index length() const {
    return std::visit([](const auto& d) { return d.length(); }, decoder_);
  }
  void reset() {
    std::visit([](auto& d) { d.reset(); }, decoder_);
  }

 private:
  using Any = typename DecodersOf<AnyMap<Scalar>>::type;
  Any decoder_;
};

class Decoder {
 public:
  Decoder(const FeatureMap& map, py::handle value_dim, const std::string& dtype, py::handle scale,
          py::handle denominator_epsilon, py::handle check_finite)
      : dim_(map.spec().dim), value_dim_(to_integer(value_dim, "value_dim")) {
    if (value_dim_ < 0)
      throw py::value_error("value_dim must be >= 0, got " + std::to_string(value_dim_));
    randattn::RandomFeatureOptions opt;
    opt.causal = true;
    if (!scale.is_none()) opt.scale = to_real(scale, "scale");
    if (!denominator_epsilon.is_none())
      opt.denominator_epsilon = to_real(denominator_epsilon, "denominator_epsilon");
    opt.check_finite = to_flag(check_finite, "check_finite");
    const auto maps = map.maps();
    if (dtype == "float32") {
      dtype_ = Dtype::float32;
      impl_.emplace<TypedDecoder<float>>(maps->single, value_dim_, opt);
    } else if (dtype == "float64") {
      dtype_ = Dtype::float64;
      impl_.emplace<TypedDecoder<double>>(maps->dual, value_dim_, opt);
    } else {
      throw py::type_error("dtype must be float32 or float64, got " + dtype);
    }
  }

  void append(py::handle k_obj, py::handle v_obj) {
    const py::array k = token(k_obj, "k", dim_), v = token(v_obj, "v", value_dim_);
    visit_typed([&](auto& d, auto tag) {
      using Scalar = decltype(tag);
      const RowMajorInput<Scalar> kin(k), vin(v);
      run_locked([&] { d.append(kin.data(), dim_, vin.data(), value_dim_); });
    });
  }

  // The output (value_dim,) for query q at the current position.
  py::array query(py::handle q_obj) {
    const py::array q = token(q_obj, "q", dim_);
    py::array out;
    visit_typed([&](auto& d, auto tag) {
      using Scalar = decltype(tag);
      const RowMajorInput<Scalar> qin(q);
      py::array_t<Scalar> o(value_dim_);
      Scalar* od = o.mutable_data();
      run_locked([&] { d.query(qin.data(), dim_, od, value_dim_); });
      out = o;
    });
    return out;
  }

  Index length() {
    Index n = 0;
    visit_typed([&](auto& d, auto) { run_locked([&] { n = d.length(); }); });
    return n;
  }
  void reset() {
    visit_typed([&](auto& d, auto) { run_locked([&] { d.reset(); }); });
  }
  std::string dtype() const { return dtype_name(dtype_); }

 private:
  // One token: a float array of the decoder's dtype with `size` entries, (size,) or (1, size).
  py::array token(py::handle obj, const std::string& name, Index size) const {
    const py::array a = as_float_array(obj, name);
    if (dtype_of(a) != dtype_)
      throw py::type_error(name + " has dtype " + dtype_name(dtype_of(a)) +
                           " but the decoder works in " + dtype_name(dtype_));
    const bool row = a.ndim() == 1 || (a.ndim() == 2 && a.shape(0) == 1);
    if (!row || a.size() != size)
      throw py::value_error(name + ": expected shape (" + std::to_string(size) + ",), got " +
                            shape_str(shape_of(a)));
    return a;
  }

  template <typename Fn>
  void visit_typed(Fn&& fn) {
    if (auto* f = std::get_if<TypedDecoder<float>>(&impl_)) {
      fn(*f, float());
    } else {
      fn(std::get<TypedDecoder<double>>(impl_), double());
    }
  }

  // Without the GIL, one call at a time (the GIL is released before the lock is taken).
  template <typename Fn>
  void run_locked(Fn&& fn) {
    run_without_gil(std::nullopt, [&] {
      std::lock_guard<std::mutex> lock(mutex_);
      fn();
    });
  }

  Index dim_, value_dim_;
  Dtype dtype_ = Dtype::float64;
  std::variant<std::monostate, TypedDecoder<float>, TypedDecoder<double>> impl_;
  mutable std::mutex mutex_;
};

}  // namespace

void bind_feature_maps(py::module_& m) {
  using namespace pybind11::literals;
  py::class_<FeatureMap>(m, "FeatureMap")
      .def(py::init<const std::string&, py::handle, py::handle, const py::dict&>(), "kind"_a, "d"_a,
           "seed"_a, "options"_a)
      .def("features", &FeatureMap::features, "x"_a, "normaliser"_a, "side"_a, "check_finite"_a)
      .def("redraw", &FeatureMap::redraw, "seed"_a)
      .def_property_readonly("kind", &FeatureMap::kind)
      .def_property_readonly("input_dim", [](const FeatureMap& f) { return f.spec().dim; })
      .def_property_readonly("feature_dim", &FeatureMap::feature_dim)
      .def_property_readonly("projections", [](const FeatureMap& f) { return f.spec().features; })
      .def_property_readonly("seed", [](const FeatureMap& f) { return f.spec().seed; })
      .def_property_readonly("signs", &FeatureMap::signs)
      .def_property_readonly("omega", &FeatureMap::omega);

  py::class_<Decoder>(m, "Decoder")
      .def(py::init<const FeatureMap&, py::handle, const std::string&, py::handle, py::handle,
                    py::handle>(),
           "map"_a, "value_dim"_a, "dtype"_a, "scale"_a, "denominator_epsilon"_a, "check_finite"_a)
      .def("append", &Decoder::append, "k"_a, "v"_a)
      .def("query", &Decoder::query, "q"_a)
      .def("reset", &Decoder::reset)
      .def_property_readonly("length", &Decoder::length)
      .def_property_readonly("dtype", &Decoder::dtype);

  py::dict kinds;
  for (const MapKindInfo& info : map_kinds()) kinds[py::str(info.name)] = defaults_of(info.options);
  m.attr("feature_map_kinds") = kinds;
}

}  // namespace randattn_python
