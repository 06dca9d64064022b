#pragma once
// Shared helpers of randattn-cli: the error type, input loading, shape formatting and a tiny JSON
// writer.

#include <randattn/io/npy.hpp>

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace randattn_cli {

// Any user-facing failure; main() prints "randattn-cli: error: <what>" and exits with code 2.
class CliError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Shape = std::vector<std::int64_t>;

// Reads the .npy file given with `flag`; any failure becomes a CliError naming the flag.
inline randattn::io::NpyArray read_input(const char* flag, const std::string& path) {
  try {
    return randattn::io::read_npy(path);
  } catch (const std::bad_alloc&) {
    throw CliError(std::string(flag) + ": " + path + ": out of memory while reading");
  } catch (const std::exception& e) {
    throw CliError(std::string(flag) + ": " + e.what());
  }
}

// A seed as the command line takes it: decimal digits only, in [0, 2^64) (no sign, no
// wrap-around), as Python's seed= takes it.
inline std::uint64_t parse_seed(const std::string& text) {
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = digits ? std::strtoull(text.c_str(), &end, 10) : 0;
  if (!digits || errno == ERANGE || *end != '\0')
    throw CLI::ValidationError("--seed", "must be an integer in [0, 2^64), got '" + text + "'");
  return v;
}

inline CLI::Option* add_seed_option(CLI::App* cmd, std::uint64_t& seed, const std::string& help) {
  return cmd->add_option_function<std::string>(
      "--seed", [&seed](const std::string& text) { seed = parse_seed(text); }, help);
}

// "(2, 3)" — Python tuple notation, as NumPy users read shapes.
inline std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  if (s.size() == 1) out += ",";
  return out + ")";
}

// One JSON object on one line, built key by key.
class JsonObject {
 public:
  JsonObject& add(const std::string& key, const std::string& value) {
    return raw(key, quote(value));
  }
  JsonObject& add(const std::string& key, const char* value) {
    return add(key, std::string(value));
  }
  JsonObject& add(const std::string& key, bool value) { return raw(key, value ? "true" : "false"); }
  JsonObject& add(const std::string& key, int value) { return raw(key, std::to_string(value)); }
  JsonObject& add(const std::string& key, std::int64_t value) {
    return raw(key, std::to_string(value));
  }
  JsonObject& add(const std::string& key, std::uint64_t value) {
    return raw(key, std::to_string(value));
  }
  JsonObject& add(const std::string& key, double value) {
    if (!std::isfinite(value)) return raw(key, "null");
    // Shortest "%g" representation that reads back as the same double.
    char buf[32];
    for (int prec = 1; prec <= 17; ++prec) {
      std::snprintf(buf, sizeof buf, "%.*g", prec, value);
      if (std::strtod(buf, nullptr) == value) break;
    }
    return raw(key, buf);
  }
  JsonObject& add(const std::string& key, const Shape& shape) {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
    return raw(key, s + "]");
  }
  std::string str() const { return "{" + body_ + "}"; }

 private:
  JsonObject& raw(const std::string& key, const std::string& value) {
    if (!body_.empty()) body_ += ",";
    body_ += quote(key) + ":" + value;
    return *this;
  }
  static std::string quote(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
      const auto u = static_cast<unsigned char>(c);
      if (c == '"' || c == '\\') {
        out += '\\';
        out += c;
      } else if (u < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", u);
        out += buf;
      } else {
        out += c;
      }
    }
    return out + "\"";
  }
  std::string body_;
};

}  // namespace randattn_cli
