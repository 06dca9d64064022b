#pragma once
// Random-feature maps behind one run-time description: the kind (positive, hyperbolic, trig and
// the two hybrids), its options and a seed. The attention methods and the FeatureMap and
// Decoder classes all build their maps here, so a method and a FeatureMap given the same
// options hold the same ω.

#include <pybind11/pybind11.h>

#include <randattn/randattn.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "options.hpp"

namespace randattn_python {

enum class MapKind { positive, hyperbolic, trig, angular_hybrid, gaussian_hybrid };
enum class ProjectionKind { iid, orthogonal, hadamard };

// A map kind as Python names it, with the options it owns.
struct MapKindInfo {
  const char* name;
  MapKind kind;
  std::vector<OptionSpec> options;
};

// Every kind, in a fixed order.
const std::vector<MapKindInfo>& map_kinds();
const MapKindInfo& map_kind(MapKind kind);

// What a map is built from (plain C++ values: maps are built without the GIL).
struct MapSpec {
  MapKind kind = MapKind::positive;
  Index dim = 0;
  Index features = 256;
  ProjectionKind projection = ProjectionKind::orthogonal;
  std::uint64_t seed = 0;
  std::optional<randattn::RowMatrix<double>> omega;  // given projections (plain kinds only)
  Index lambda_features = 16;
  double bandwidth = 1.0;
};

// Reads a spec from a call's keywords (GIL held); ValueError for bad values.
MapSpec map_spec(MapKind kind, Index dim, std::uint64_t seed, const KeywordOptions& options);

// The maps as concrete types. The i.i.d. and orthogonal projections are drawn by the library's
// projection classes and kept as their dense ω, so they share one map type with a given ω (the
// product with ω is the same code for all three); Hadamard projections keep their fast form.
template <typename Scalar>
using Dense = randattn::UserProjection<Scalar>;
template <typename Scalar>
using Hadamard = randattn::HadamardProjection<Scalar>;

template <typename Scalar>
using AnyMap = std::variant<randattn::PositiveFeatures<Scalar, Dense<Scalar>>,
                            randattn::PositiveFeatures<Scalar, Hadamard<Scalar>>,
                            randattn::HyperbolicFeatures<Scalar, Dense<Scalar>>,
                            randattn::HyperbolicFeatures<Scalar, Hadamard<Scalar>>,
                            randattn::TrigFeatures<Scalar, Dense<Scalar>>,
                            randattn::TrigFeatures<Scalar, Hadamard<Scalar>>,
                            randattn::HybridFeatures<Scalar>>;

template <typename Scalar>
AnyMap<Scalar> build_map(const MapSpec& spec);

extern template AnyMap<float> build_map<float>(const MapSpec&);
extern template AnyMap<double> build_map<double>(const MapSpec&);

}  // namespace randattn_python
