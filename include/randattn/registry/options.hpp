#pragma once
// Options of the registered attention methods: their declarations (name, type, default, allowed
// values, help) and the typed values a front end hands over. Front ends only convert their
// strings or objects to these values; every range and choice is checked here, once.

#include <randattn/core/invalid_argument.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace randattn::registry {

// Upper bounds of the size options, checked before anything is drawn or allocated (the lsf
// filter bound is the library's own).
inline constexpr std::int64_t kMaxFeatures = std::int64_t(1) << 24;    // features, lambda_features
inline constexpr std::int64_t kMaxLshBuckets = std::int64_t(1) << 24;  // buckets, chunk
inline constexpr std::int64_t kMaxLshRounds = 4096;
inline constexpr std::int64_t kMaxLsfFilters = std::int64_t(1) << 23;
inline constexpr std::int64_t kMaxLsfTables = 4096;
// OpenMP threads a front end accepts; more is refused rather than clamped.
inline constexpr std::int64_t kMaxThreads = 1024;

// An array-valued option (projections, rotations, calibration rows) in double: every float32 or
// float64 source converts to it exactly, and it converts back to either without a second
// rounding. `source` names where it came from (a file path) for the report.
struct ArrayValue {
  std::vector<std::int64_t> shape;
  std::vector<double> data;  // row-major
  std::string source;
};

enum class OptionType { flag, integer, real, text, array };

inline const char* type_name(OptionType t) {
  switch (t) {
    case OptionType::flag:
      return "flag";
    case OptionType::integer:
      return "integer";
    case OptionType::real:
      return "real";
    case OptionType::text:
      return "text";
    case OptionType::array:
      return "array";
  }
  return "?";
}

// monostate: unset (an option without a default, e.g. `buckets`, or an array not given).
using Value = std::variant<std::monostate, bool, std::int64_t, double, std::string, ArrayValue>;

// What the leading dimension of a per-head array option indexes (see OptionSpec).
enum class HeadAxis {
  none,         // not per head
  query_heads,  // entry h belongs to query head h
  kv_heads,     // entry h belongs to key/value head h: query head h' uses entry h' / group
};

// A numeric bound; `open` excludes the bound itself.
struct Bound {
  double value;
  bool open = false;
};

struct OptionSpec {
  OptionSpec(std::string name, OptionType type, Value fallback, std::string help)
      : name(std::move(name)), type(type), fallback(std::move(fallback)), help(std::move(help)) {}

  std::string name;  // snake_case: the Python keyword; the command line writes --kebab-case
  OptionType type;
  Value fallback;  // the default, monostate when there is none
  std::string help;
  std::optional<Bound> min, max;     // integer and real options
  bool finite = false;               // real options: reject NaN and infinities
  bool negative_infinity = false;    // with finite: -inf is accepted too
  std::vector<std::string> choices;  // text options; empty: any text
  // Arrays whose leading dimension may index heads: a value of rank head_entry_rank + 1 holds one
  // entry (of rank head_entry_rank) per query head or per key/value head, and a call cut into
  // sub-calls of one head (registry/layout.hpp) gives each sub-call its head's entry. A value of
  // rank head_entry_rank is one entry for every head.
  HeadAxis head_axis = HeadAxis::none;
  int head_entry_rank = 2;
};

// How a front end spells options and settings in its messages: "--rounds 3" on the command line,
// "rounds=3" in Python.
struct Spelling {
  bool command_line = false;

  static std::string kebab(std::string name) {
    for (char& c : name)
      if (c == '_') c = '-';
    return name;
  }
  // "--lambda-features" or "lambda_features".
  std::string option(const std::string& name) const {
    return command_line ? "--" + kebab(name) : name;
  }
  // "--rounds 3" or "rounds=3".
  std::string setting(const std::string& name, const std::string& value) const {
    return command_line ? option(name) + " " + value : name + "=" + value;
  }
  // "--method lsh" or "method 'lsh'".
  std::string method(const std::string& name) const {
    return command_line ? "--method " + name : "method '" + name + "'";
  }
  // How shared queries and keys are asked for.
  std::string shared_qk() const { return command_line ? "--shared-qk" : "shared_qk=True"; }
  // The keys argument.
  std::string keys() const { return command_line ? "--k" : "k"; }
  // How self-exclusion is asked for.
  std::string exclude_self() const { return command_line ? "--exclude-self" : "exclude_self=True"; }
};

// A bad option value or combination (ValueError in Python, exit code 2 on the command line).
class OptionError : public randattn::invalid_argument {
 public:
  using randattn::invalid_argument::invalid_argument;
};

namespace detail {

// "(2, 3)", "(2,)": Python's notation, in both front ends' messages.
inline std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  if (s.size() == 1) out += ",";
  return out + ")";
}

inline std::string number_text(double x) {
  if (std::isfinite(x) && x == std::floor(x) && std::abs(x) < 1e15)
    return std::to_string(static_cast<std::int64_t>(x));
  std::string s = std::to_string(x);
  return s;
}

inline bool within(double x, const std::optional<Bound>& lo, const std::optional<Bound>& hi) {
  if (lo && !(lo->open ? x > lo->value : x >= lo->value)) return false;
  if (hi && !(hi->open ? x < hi->value : x <= hi->value)) return false;
  return true;
}

// "at least 1", "in (0, 1)", "positive".
inline std::string range_text(const OptionSpec& s) {
  if (s.min && !s.max) {
    if (s.min->open)
      return s.min->value == 0 ? "positive" : "greater than " + number_text(s.min->value);
    return s.min->value == 0 ? "non-negative" : "at least " + number_text(s.min->value);
  }
  if (s.max && !s.min) return (s.max->open ? "less than " : "at most ") + number_text(s.max->value);
  return std::string("in ") + (s.min->open ? "(" : "[") + number_text(s.min->value) + ", " +
         number_text(s.max->value) + (s.max->open ? ")" : "]");
}

}  // namespace detail

// Checks one given value against its declaration.
inline void check_value(const OptionSpec& s, const Value& v, const Spelling& spell) {
  if (std::holds_alternative<std::monostate>(v)) return;
  const std::string name = spell.option(s.name);
  const bool type_ok = (s.type == OptionType::flag && std::holds_alternative<bool>(v)) ||
                       (s.type == OptionType::integer && std::holds_alternative<std::int64_t>(v)) ||
                       (s.type == OptionType::real && std::holds_alternative<double>(v)) ||
                       (s.type == OptionType::text && std::holds_alternative<std::string>(v)) ||
                       (s.type == OptionType::array && std::holds_alternative<ArrayValue>(v));
  if (!type_ok) throw OptionError(name + " must be of type " + type_name(s.type));
  if (s.type == OptionType::integer || s.type == OptionType::real) {
    const double x =
        s.type == OptionType::integer ? double(std::get<std::int64_t>(v)) : std::get<double>(v);
    const std::string text = s.type == OptionType::integer
                                 ? std::to_string(std::get<std::int64_t>(v))
                                 : detail::number_text(x);
    if (s.finite && !std::isfinite(x) && !(s.negative_infinity && x < 0 && std::isinf(x)))
      throw OptionError(name + " must be a finite number" +
                        (s.negative_infinity ? " or -inf" : "") + ", got " + text);
    if ((s.min || s.max) && !detail::within(x, s.min, s.max))
      throw OptionError(name + " must be " + detail::range_text(s) + ", got " + text);
  }
  if (s.type == OptionType::text && !s.choices.empty()) {
    const std::string& t = std::get<std::string>(v);
    std::string list;
    for (const std::string& c : s.choices) {
      if (c == t) return;
      list += (list.empty() ? "" : ", ") + c;
    }
    throw OptionError(name + " must be one of " + list + ", got '" + t + "'");
  }
}

// The thread count a front end was given: in [1, kMaxThreads].
inline int checked_threads(std::int64_t threads, const Spelling& spell) {
  if (threads < 1 || threads > kMaxThreads)
    throw OptionError(spell.option("threads") + " must be in [1, " + std::to_string(kMaxThreads) +
                      "], got " + std::to_string(threads));
  return static_cast<int>(threads);
}

// The options of one call: the given values (checked) over the method's defaults.
class Options {
 public:
  Options() = default;
  Options(std::vector<OptionSpec> specs, std::map<std::string, Value> given, Spelling spelling)
      : specs_(std::move(specs)), given_(std::move(given)), spelling_(spelling) {
    for (auto it = given_.begin(); it != given_.end();) {
      if (std::holds_alternative<std::monostate>(it->second))
        it = given_.erase(it);  // None: as if not given
      else
        ++it;
    }
    for (const auto& [name, value] : given_) {
      bool declared = false;
      for (const OptionSpec& s : specs_) declared = declared || s.name == name;
      // Front ends refuse unknown names first, with their own wording; this is the backstop.
      if (!declared) throw OptionError("unknown option '" + spelling_.option(name) + "'");
      check_value(spec(name), value, spelling_);
    }
  }

  const Spelling& spelling() const { return spelling_; }
  bool given(const std::string& name) const { return given_.count(name) > 0; }

  // The given value or the default (monostate when neither).
  const Value& value(const std::string& name) const {
    auto found = given_.find(name);
    return found != given_.end() ? found->second : spec(name).fallback;
  }
  bool has(const std::string& name) const {
    return !std::holds_alternative<std::monostate>(value(name));
  }
  bool flag(const std::string& name) const { return std::get<bool>(value(name)); }
  std::int64_t integer(const std::string& name) const {
    return std::get<std::int64_t>(value(name));
  }
  double real(const std::string& name) const { return std::get<double>(value(name)); }
  const std::string& text(const std::string& name) const {
    return std::get<std::string>(value(name));
  }
  const ArrayValue& array(const std::string& name) const {
    return std::get<ArrayValue>(value(name));
  }
  // A copy with `name` given as `value` (checked).
  Options with(const std::string& name, Value value) const {
    check_value(spec(name), value, spelling_);
    Options o = *this;
    o.given_[name] = std::move(value);
    return o;
  }
  // Spelled for messages: "--rounds", "rounds".
  std::string spelled(const std::string& name) const { return spelling_.option(name); }

  const OptionSpec& spec(const std::string& name) const {
    for (const OptionSpec& s : specs_)
      if (s.name == name) return s;
    throw std::logic_error("randattn::registry: undeclared option '" + name + "'");
  }

 private:
  std::vector<OptionSpec> specs_;
  std::map<std::string, Value> given_;
  Spelling spelling_;
};

}  // namespace randattn::registry
