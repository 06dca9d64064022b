#pragma once
// Keyword options owned by an attention method or a feature-map kind: each owner declares its
// options with their defaults (the command line's), and a call's keywords are checked against
// that list before anything runs.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "arguments.hpp"

namespace randattn_python {

// A default: None, a flag, an integer, a real number or a string.
using OptionDefault = std::variant<std::monostate, bool, std::int64_t, double, std::string>;

struct OptionSpec {
  std::string name;
  OptionDefault fallback;
  std::string help;
};

inline py::object to_python(const OptionDefault& d) {
  return std::visit(
      [](const auto& x) -> py::object {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same<T, std::monostate>::value) {
          return py::none();
        } else {
          return py::cast(x);
        }
      },
      d);
}

// {name: default} of a list of specs.
inline py::dict defaults_of(const std::vector<OptionSpec>& specs) {
  py::dict d;
  for (const OptionSpec& s : specs) d[py::str(s.name)] = to_python(s.fallback);
  return d;
}

// The keywords of one call, each one of the owner's options (checked by the caller, see
// check_keywords). Values are converted on access, with messages naming the option.
class KeywordOptions {
 public:
  KeywordOptions(std::vector<OptionSpec> specs, py::dict given)
      : specs_(std::move(specs)), given_(std::move(given)) {}

  bool given(const std::string& name) const {
    return given_.contains(py::str(name)) && !value(name).is_none();
  }

  // The given value, or the default; None when neither is set.
  py::object value(const std::string& name) const {
    if (given_.contains(py::str(name))) return given_[py::str(name)];
    for (const OptionSpec& s : specs_)
      if (s.name == name) return to_python(s.fallback);
    return py::none();
  }

  std::int64_t integer(const std::string& name) const { return to_integer(value(name), name); }
  double real(const std::string& name) const { return to_real(value(name), name); }
  bool flag(const std::string& name) const { return to_flag(value(name), name); }
  std::string text(const std::string& name) const { return to_text(value(name), name); }

 private:
  std::vector<OptionSpec> specs_;
  py::dict given_;
};

// TypeError for a keyword that `specs` does not hold. `owner` ("method 'exact'") and
// `belongs_to(name)` (the owners of an option elsewhere, or "") make the message precise.
template <typename BelongsTo>
void check_keywords(const py::dict& given, const std::vector<OptionSpec>& specs,
                    const std::string& where, const std::string& owner, BelongsTo&& belongs_to) {
  for (const auto& item : given) {
    const std::string name = py::str(item.first);
    bool known = false;
    for (const OptionSpec& s : specs) known = known || s.name == name;
    if (known) continue;
    const std::string elsewhere = belongs_to(name);
    if (!elsewhere.empty())
      throw py::type_error(where + "() got option '" + name + "', which belongs to " + elsewhere +
                           ", not " + owner);
    throw py::type_error(where + "() got an unexpected keyword argument '" + name + "'");
  }
}

}  // namespace randattn_python
