// The option surface that randattn-cli and the Python package share: the method registry's
// option checks, settings and builders, driven by fuzzed method names, option names (registered
// ones and made-up ones), values of every type (extremes, NaN, infinities, wrong types, random
// text, small arrays), settings (scale, seed, causal, shared QK) and a small call on fuzzed
// inputs. Every call either throws std::invalid_argument (randattn::registry::OptionError and
// the library's argument errors) or std::bad_alloc (randattn::allocation_error), or returns an
// output that is finite when the inputs are bounded.
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include <randattn/registry/registry.hpp>

#include "fuzz_helpers.hpp"

namespace {

namespace reg = randattn::registry;
using randattn::Index;

// The largest integer drawn inside a range (sizes stay small).
constexpr std::int64_t kLargestSmall = 40;

// An integer near the interesting edges: small values (cheap calls), the bounds of the size
// options just outside their ranges, and the extremes of int64. Values inside a range are kept
// small so that one input never allocates gigabytes.
std::int64_t consume_integer(FuzzedDataProvider& in) {
  static const std::int64_t edges[] = {0,
                                       -1,
                                       reg::kMaxFeatures + 1,
                                       reg::kMaxLshBuckets + 1,
                                       reg::kMaxLshRounds + 1,
                                       reg::kMaxLsfFilters + 1,
                                       reg::kMaxLsfTables + 1,
                                       std::numeric_limits<std::int64_t>::max(),
                                       std::numeric_limits<std::int64_t>::min()};
  if (in.ConsumeBool()) return in.ConsumeIntegralInRange<std::int64_t>(-3, kLargestSmall);
  return edges[in.ConsumeIntegralInRange<std::size_t>(0, std::size(edges) - 1)];
}

double consume_real(FuzzedDataProvider& in) {
  static const double edges[] = {0.0,
                                 -0.0,
                                 1.0,
                                 -std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::quiet_NaN(),
                                 std::numeric_limits<double>::max(),
                                 std::numeric_limits<double>::denorm_min(),
                                 1e39,
                                 -1e39};
  switch (in.ConsumeIntegralInRange(0, 2)) {
    case 0:
      return in.ConsumeFloatingPointInRange<double>(-4, 4);
    case 1:
      return edges[in.ConsumeIntegralInRange<std::size_t>(0, std::size(edges) - 1)];
    default:
      return in.ConsumeFloatingPoint<double>();
  }
}

reg::ArrayValue consume_array(FuzzedDataProvider& in) {
  reg::ArrayValue a;
  const int ndim = in.ConsumeIntegralInRange(0, 3);
  std::size_t count = 1;
  for (int i = 0; i < ndim; ++i) {
    a.shape.push_back(in.ConsumeIntegralInRange<std::int64_t>(0, 5));
    count *= std::size_t(a.shape.back());
  }
  a.data.resize(count);
  for (double& x : a.data) x = in.ConsumeFloatingPointInRange<double>(-2, 2);
  a.source = "fuzz";
  return a;
}

reg::Value consume_value(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 5)) {
    case 0:
      return std::monostate{};
    case 1:
      return in.ConsumeBool();
    case 2:
      return consume_integer(in);
    case 3:
      return consume_real(in);
    case 4:
      return in.ConsumeRandomLengthString(12);
    default:
      return consume_array(in);
  }
}

template <typename Scalar>
void run(FuzzedDataProvider& in) {
  const auto& methods = reg::methods();
  const std::string name = in.ConsumeBool()
                               ? methods[in.ConsumeIntegralInRange<std::size_t>(
                                             0, methods.size() - 1)]
                                     ->name()
                               : in.ConsumeRandomLengthString(8);
  const std::vector<reg::OptionSpec> known = reg::all_options();
  std::map<std::string, reg::Value> given;
  const int count = in.ConsumeIntegralInRange(0, 6);
  for (int i = 0; i < count; ++i) {
    const std::string option =
        in.ConsumeBool() ? known[in.ConsumeIntegralInRange<std::size_t>(0, known.size() - 1)].name
                         : in.ConsumeRandomLengthString(10);
    given[option] = consume_value(in);
    // An edge of another option's range can lie inside this one's (2^23 + 1 filters is a valid
    // feature count), where it asks for gigabytes: inside an option's own range, only small values.
    if (auto* value = std::get_if<std::int64_t>(&given[option]); value && *value > kLargestSmall)
      for (const reg::OptionSpec& spec : known)
        if (spec.name == option && spec.max && double(*value) <= spec.max->value)
          *value = kLargestSmall;
  }
  randattn::BatchShape shape;
  shape.batch = in.ConsumeIntegralInRange<Index>(1, 2);
  shape.heads = in.ConsumeIntegralInRange<Index>(1, 2);
  shape.n_q = in.ConsumeIntegralInRange<Index>(0, 9);
  shape.n_k = in.ConsumeIntegralInRange<Index>(1, 9);
  shape.d = in.ConsumeIntegralInRange<Index>(1, 5);
  shape.dv = in.ConsumeIntegralInRange<Index>(1, 3);
  reg::Settings settings;
  settings.causal = in.ConsumeBool();
  settings.shared_qk = in.ConsumeBool();
  settings.seed = in.ConsumeIntegral<std::uint64_t>();
  settings.report = in.ConsumeBool();
  settings.compare = settings.report && in.ConsumeBool();
  const bool keys_given = !settings.shared_qk || in.ConsumeBool();
  const std::optional<double> scale =
      in.ConsumeBool() ? std::optional<double>(consume_real(in)) : std::nullopt;
  const bool bounded = in.ConsumeBool();
  const reg::Spelling spell{in.ConsumeBool()};
  fuzzing::context = "method '" + name + "', " + std::to_string(given.size()) + " options";
  if (settings.shared_qk) shape.n_k = shape.n_q;
  if (settings.causal) shape.n_k = shape.n_q;
  const Index slices = shape.slices();
  const auto inputs = [&](Index rows, Index cols) {
    return fuzzing::consume_matrix<Scalar>(in, slices * rows, cols, bounded ? 0 : 2);
  };
  const randattn::RowMatrix<Scalar> q = inputs(shape.n_q, shape.d), k = inputs(shape.n_k, shape.d),
                                    v = inputs(shape.n_k, shape.dv);
  randattn::RowMatrix<Scalar> out(slices * shape.n_q, shape.dv);
  try {
    const reg::Method& method = reg::find_method(name, spell);
    reg::check_keys(method, keys_given, settings.shared_qk, spell);
    settings.scale = reg::resolve_scale(scale, shape.d, spell);
    const reg::Call call = reg::make_call(method, given, settings, shape, spell);
    const reg::Job<Scalar> job = method.build(call, Scalar());
    job(q.data(), settings.shared_qk ? nullptr : k.data(), v.data(), out.data());
    if (bounded && shape.n_q > 0) FUZZ_REQUIRE(out.allFinite());
  } catch (const std::invalid_argument&) {
  } catch (const std::bad_alloc&) {
  }
}

}  // namespace

RANDATTN_FUZZ_FLOAT_AND_DOUBLE(run)
