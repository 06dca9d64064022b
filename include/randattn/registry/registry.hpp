#pragma once
// The registry of attention methods behind randattn-cli and the Python package: every method's
// name, summary, options (with defaults, ranges and choices), shared-QK support and builder.
// Front ends convert their arguments to typed values, then rely on the functions below for every
// check; a method reached from either front end with the same values gives the same bits.
//
// Not included by randattn.hpp. The methods themselves are listed in method_table.hpp.

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "method.hpp"
#include "method_list.hpp"
#include "options.hpp"

namespace randattn::registry {

// "exact, favor, ...".
inline std::string method_names() {
  std::string names;
  for (const auto& m : methods()) names += std::string(names.empty() ? "" : ", ") + m->name();
  return names;
}

inline const Method& find_method(const std::string& name, const Spelling& spell) {
  for (const auto& m : methods())
    if (name == m->name()) return *m;
  throw OptionError("unknown " + (spell.command_line ? std::string("--method") : "method") + " '" +
                    name + "' (available: " + method_names() + ")");
}

inline bool owns(const Method& method, const std::string& option) {
  for (const OptionSpec& s : method.options())
    if (s.name == option) return true;
  return false;
}

// True when a call of `method` may give `option` (see Method::accepted_options()).
inline bool accepts(const Method& method, const std::string& option) {
  for (const OptionSpec& s : method.accepted_options())
    if (s.name == option) return true;
  return false;
}

// The methods owning `option`, in registry order.
inline std::vector<const Method*> owners(const std::string& option) {
  std::vector<const Method*> out;
  for (const auto& m : methods())
    if (owns(*m, option)) out.push_back(m.get());
  return out;
}

// Every option of every method, each once (its first declaration), in registry order.
inline std::vector<OptionSpec> all_options() {
  std::vector<OptionSpec> out;
  for (const auto& m : methods())
    for (const OptionSpec& s : m->options()) {
      bool seen = false;
      for (const OptionSpec& o : out) seen = seen || o.name == s.name;
      if (!seen) out.push_back(s);
    }
  return out;
}

// Checks how the keys are given: separate keys, or shared QK on request for the methods that
// support it.
inline void check_keys(const Method& method, bool keys_given, bool shared_qk,
                       const Spelling& spell) {
  std::string sharing;  // the methods that support shared QK
  for (const auto& m : methods())
    if (m->supports_shared_qk()) sharing += (sharing.empty() ? "" : ", ") + spell.method(m->name());
  if (shared_qk && !method.supports_shared_qk())
    throw OptionError(spell.method(method.name()) + " does not support " + spell.shared_qk() +
                      " (only " + sharing + ")");
  if (shared_qk && keys_given)
    throw OptionError(spell.keys() + " and " + spell.shared_qk() +
                      " exclude each other (shared QK uses the normalised queries as keys)");
  if (!shared_qk && !keys_given) {
    if (method.supports_shared_qk())
      throw OptionError(spell.keys() + " is required for " + spell.method(method.name()) + ", or " +
                        spell.shared_qk() + " for keys := normalised queries");
    throw OptionError(spell.keys() + " is required for " + spell.method(method.name()) + " (" +
                      spell.shared_qk() + " is only for " + sharing + ")");
  }
}

// The logit scale: the given one (finite), or default_scale(d).
inline double resolve_scale(const std::optional<double>& given, std::int64_t d,
                            const Spelling& spell) {
  if (!given) return default_scale(d);
  if (!std::isfinite(*given)) throw OptionError(spell.option("scale") + " must be a finite number");
  return *given;
}

// The call of `method` with the given option values (checked) over its defaults.
inline Call make_call(const Method& method, std::map<std::string, Value> given,
                      const Settings& settings, const BatchShape& shape, const Spelling& spell) {
  return Call{Options(method.accepted_options(), std::move(given), spell), settings, shape, 0};
}

}  // namespace randattn::registry

#ifndef RANDATTN_REGISTRY_SEPARATE_TABLE
#include "method_table.hpp"
#endif
