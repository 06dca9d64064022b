#pragma once
// Reading and writing NumPy .npy files: an opt-in header, not included by <randattn/randattn.hpp>
// (the command line and the tests use it; include it yourself to exchange arrays with NumPy).
//
// Supported: little-endian float32 ('<f4') and float64 ('<f8') arrays in C order with any number of
// dimensions. '=' (native) and '|' (not applicable) byte-order characters are accepted on
// little-endian hosts. Format versions 1.0, 2.0 and 3.0 are read (3.0 differs from 2.0 only by a
// UTF-8 header, which never matters for these dtypes); files are written as version 1.0 (2.0 if the
// header is too long).
//
// Every problem with a file (missing, bad magic, unsupported version or dtype, Fortran order,
// unparsable header, truncated data, overflowing shape) throws randattn::io::NpyError with a
// one-line message "<file>: <problem>". Bytes after the data are ignored.
//
// Writing goes to a temporary file in the destination directory which is renamed over the
// destination only when complete, so a failed write never leaves a partial file behind.

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace randattn::io {

// Error raised for any unreadable, malformed or unsupported .npy file and for failed writes.
class NpyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class NpyDtype { float32, float64 };

// NumPy dtype name ("float32" / "float64").
inline const char* dtype_name(NpyDtype t) { return t == NpyDtype::float32 ? "float32" : "float64"; }

// An n-dimensional array in C (row-major) order; data holds product(shape) values.
struct NpyArray {
  std::vector<std::int64_t> shape;
  std::variant<std::vector<float>, std::vector<double>> data;

  NpyDtype dtype() const { return data.index() == 0 ? NpyDtype::float32 : NpyDtype::float64; }
  bool is_float32() const { return data.index() == 0; }
  bool is_float64() const { return data.index() == 1; }
  std::size_t ndim() const { return shape.size(); }
  std::size_t size() const {
    return std::visit([](const auto& v) { return v.size(); }, data);
  }

  // Typed access; throws NpyError if Scalar does not match the stored dtype.
  template <typename Scalar>
  const std::vector<Scalar>& values() const {
    static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                  "NpyArray holds float or double");
    if (const auto* p = std::get_if<std::vector<Scalar>>(&data)) return *p;
    throw NpyError(std::string("npy array holds ") + dtype_name(dtype()) + ", requested " +
                   (std::is_same_v<Scalar, float> ? "float32" : "float64"));
  }
  template <typename Scalar>
  std::vector<Scalar>& values() {
    return const_cast<std::vector<Scalar>&>(static_cast<const NpyArray&>(*this).values<Scalar>());
  }
};

// Parsed .npy header.
struct NpyHeader {
  int major_version = 1;
  int minor_version = 0;
  NpyDtype dtype = NpyDtype::float64;
  std::vector<std::int64_t> shape;
  std::size_t data_offset = 0;  // bytes from the start of the file to the first element
  std::size_t count = 1;        // number of elements
};

namespace detail {

inline bool host_is_little_endian() {
  const std::uint16_t probe = 1;
  unsigned char first = 0;
  std::memcpy(&first, &probe, 1);
  return first == 1;
}

[[noreturn]] inline void fail(const std::string& name, const std::string& what) {
  throw NpyError(name + ": " + what);
}

// Printable excerpt of header text for error messages (single line, bounded length).
inline std::string excerpt(const std::string& s, std::size_t max_len = 60) {
  std::string out;
  for (char c : s.substr(0, max_len)) {
    const auto u = static_cast<unsigned char>(c);
    out += (u >= 0x20 && u < 0x7f) ? c : '?';
  }
  if (s.size() > max_len) out += "...";
  return out;
}

// A Python literal from the header dict: string, bool, non-negative integer or tuple/list.
struct PyValue {
  enum class Kind { string, boolean, integer, sequence } kind = Kind::string;
  std::string str;
  bool boolean = false;
  std::int64_t integer = 0;
  std::vector<PyValue> items;
};

// Minimal parser for the Python dict literal NumPy writes as the .npy header.
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& name) : s_(text), name_(name) {}

  std::vector<std::pair<std::string, PyValue>> parse_dict() {
    std::vector<std::pair<std::string, PyValue>> entries;
    skip_ws();
    expect('{');
    skip_ws();
    while (peek() != '}') {
      PyValue key = parse_value(0);
      if (key.kind != PyValue::Kind::string) error("dictionary key is not a string");
      skip_ws();
      expect(':');
      PyValue value = parse_value(0);
      for (const auto& e : entries)
        if (e.first == key.str) error("duplicate key '" + excerpt(key.str) + "'");
      entries.emplace_back(key.str, std::move(value));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        skip_ws();
      } else if (peek() != '}') {
        error("expected ',' or '}'");
      }
    }
    ++pos_;
    skip_ws();
    if (pos_ != s_.size()) error("unexpected text after the dictionary");
    return entries;
  }

 private:
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  void expect(char c) {
    if (peek() != c) error(std::string("expected '") + c + "'");
    ++pos_;
  }
  [[noreturn]] void error(const std::string& what) const {
    fail(name_, "unparsable header (" + what + " at offset " + std::to_string(pos_) + "): '" +
                    excerpt(s_) + "'");
  }

  PyValue parse_value(int depth) {
    if (depth > 8) error("nesting too deep");
    skip_ws();
    PyValue v;
    const char c = peek();
    if (c == '\'' || c == '"') {
      v.kind = PyValue::Kind::string;
      ++pos_;
      while (pos_ < s_.size() && s_[pos_] != c) {
        if (s_[pos_] == '\\' || s_[pos_] == '\n') error("unsupported character in string");
        v.str += s_[pos_++];
      }
      if (pos_ >= s_.size()) error("unterminated string");
      ++pos_;
    } else if (c == '(' || c == '[') {
      const char close = c == '(' ? ')' : ']';
      v.kind = PyValue::Kind::sequence;
      ++pos_;
      skip_ws();
      while (peek() != close) {
        v.items.push_back(parse_value(depth + 1));
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          skip_ws();
        } else if (peek() != close) {
          error(std::string("expected ',' or '") + close + "'");
        }
      }
      ++pos_;
    } else if (c >= '0' && c <= '9') {
      v.kind = PyValue::Kind::integer;
      std::int64_t x = 0;
      while (peek() >= '0' && peek() <= '9') {
        const int digit = peek() - '0';
        if (x > (std::numeric_limits<std::int64_t>::max() - digit) / 10) error("integer too large");
        x = x * 10 + digit;
        ++pos_;
      }
      if (peek() == 'L') ++pos_;  // Python 2 long suffix written by old NumPy versions
      v.integer = x;
    } else if (s_.compare(pos_, 4, "True") == 0) {
      v.kind = PyValue::Kind::boolean;
      v.boolean = true;
      pos_ += 4;
    } else if (s_.compare(pos_, 5, "False") == 0) {
      v.kind = PyValue::Kind::boolean;
      v.boolean = false;
      pos_ += 5;
    } else {
      error("unexpected character");
    }
    return v;
  }

  const std::string& s_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

inline std::uint64_t read_le(const unsigned char* p, int nbytes) {
  std::uint64_t x = 0;
  for (int i = nbytes - 1; i >= 0; --i) x = (x << 8) | p[i];
  return x;
}

inline std::string shape_to_python(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

// Parses the magic string, version and header dictionary; leaves the stream at the first data byte.
inline NpyHeader read_header(std::istream& in, const std::string& name) {
  unsigned char prefix[8];
  in.read(reinterpret_cast<char*>(prefix), 8);
  if (in.gcount() < 6 || std::memcmp(prefix, "\x93NUMPY", 6) != 0)
    fail(name, "not a .npy file (bad magic string)");
  if (in.gcount() < 8) fail(name, "truncated header (missing format version)");

  NpyHeader h;
  h.major_version = prefix[6];
  h.minor_version = prefix[7];
  const int len_bytes = h.major_version == 1 ? 2 : 4;
  if (!((h.major_version >= 1 && h.major_version <= 3) && h.minor_version == 0))
    fail(name, "unsupported .npy format version " + std::to_string(h.major_version) + "." +
                   std::to_string(h.minor_version) + " (supported: 1.0, 2.0, 3.0)");

  unsigned char len_buf[4];
  in.read(reinterpret_cast<char*>(len_buf), len_bytes);
  if (in.gcount() != len_bytes) fail(name, "truncated header (missing header length)");
  const std::uint64_t header_len = read_le(len_buf, len_bytes);
  // NumPy refuses headers above 10000 bytes by default; allow generous room but never trust a
  // 4-byte length blindly.
  if (header_len > (std::uint64_t{1} << 24))
    fail(name, "header length " + std::to_string(header_len) + " is implausible");

  std::string text(static_cast<std::size_t>(header_len), '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  if (static_cast<std::uint64_t>(in.gcount()) != header_len)
    fail(name, "truncated header (expected " + std::to_string(header_len) + " bytes)");
  h.data_offset = 8 + static_cast<std::size_t>(len_bytes) + static_cast<std::size_t>(header_len);

  const auto entries = HeaderParser(text, name).parse_dict();
  const PyValue* descr = nullptr;
  const PyValue* fortran = nullptr;
  const PyValue* shape = nullptr;
  for (const auto& [key, value] : entries) {
    if (key == "descr")
      descr = &value;
    else if (key == "fortran_order")
      fortran = &value;
    else if (key == "shape")
      shape = &value;
    else
      fail(name, "unparsable header (unexpected key '" + excerpt(key) + "')");
  }
  if (!descr || !fortran || !shape)
    fail(name, std::string("unparsable header (missing key '") +
                   (!descr     ? "descr"
                    : !fortran ? "fortran_order"
                               : "shape") +
                   "')");

  if (descr->kind != PyValue::Kind::string)
    fail(name, "unsupported dtype (structured or non-string descr)");
  const std::string& d = descr->str;
  const bool native_ok = host_is_little_endian();
  const bool little = d.size() == 3 && (d[0] == '<' || ((d[0] == '=' || d[0] == '|') && native_ok));
  if (little && d.compare(1, 2, "f4") == 0) {
    h.dtype = NpyDtype::float32;
  } else if (little && d.compare(1, 2, "f8") == 0) {
    h.dtype = NpyDtype::float64;
  } else {
    std::string why = "unsupported dtype '" + excerpt(d) + "'";
    if (!d.empty() && d[0] == '>') why += " (big-endian)";
    fail(name, why + "; expected '<f4' (float32) or '<f8' (float64)");
  }

  if (fortran->kind != PyValue::Kind::boolean)
    fail(name, "unparsable header ('fortran_order' is not True/False)");
  if (fortran->boolean) fail(name, "fortran_order=True is not supported (C order only)");

  if (shape->kind != PyValue::Kind::sequence)
    fail(name, "unparsable header ('shape' is not a tuple)");
  const std::size_t elem = h.dtype == NpyDtype::float32 ? 4 : 8;
  std::uint64_t count = 1;
  bool empty = false;
  for (const PyValue& dim : shape->items) {
    if (dim.kind != PyValue::Kind::integer)
      fail(name, "unparsable header ('shape' has a non-integer entry)");
    h.shape.push_back(dim.integer);
    if (dim.integer == 0) empty = true;
  }
  if (!empty) {
    const std::uint64_t limit = std::min<std::uint64_t>(std::numeric_limits<std::size_t>::max(),
                                                        std::numeric_limits<std::int64_t>::max()) /
                                elem;
    for (std::int64_t dim : h.shape) {
      const auto u = static_cast<std::uint64_t>(dim);
      if (count > limit / u)
        fail(name, "shape " + shape_to_python(h.shape) + " overflows the element count");
      count *= u;
    }
  } else {
    count = 0;
  }
  h.count = static_cast<std::size_t>(count);
  return h;
}

template <typename Scalar>
void read_data(std::istream& in, const std::string& name, std::size_t count,
               std::vector<Scalar>& out) {
  static_assert(sizeof(float) == 4 && sizeof(double) == 8, "IEEE-754 float/double required");
  const std::size_t nbytes = count * sizeof(Scalar);
  auto truncated = [&](std::uint64_t have) {
    fail(name, "truncated data (expected " + std::to_string(nbytes) + " bytes, found " +
                   std::to_string(have) + ")");
  };
  // Check the remaining size first when the stream can tell, so a lying header never triggers a
  // huge allocation.
  const std::streampos here = in.tellg();
  if (here != std::streampos(-1)) {
    in.seekg(0, std::ios::end);
    const std::streampos end = in.tellg();
    in.seekg(here);
    if (end != std::streampos(-1) && in) {
      const auto remaining = static_cast<std::uint64_t>(end - here);
      if (remaining < nbytes) truncated(remaining);
    }
    in.clear();
  }
  out.clear();
  constexpr std::size_t chunk = std::size_t{1} << 20;  // elements per read
  std::size_t done = 0;
  while (done < count) {
    const std::size_t n = std::min(chunk, count - done);
    out.resize(done + n);
    in.read(reinterpret_cast<char*>(out.data() + done),
            static_cast<std::streamsize>(n * sizeof(Scalar)));
    const auto got = static_cast<std::size_t>(in.gcount());
    if (got != n * sizeof(Scalar)) truncated(done * sizeof(Scalar) + got);
    done += n;
  }
  if (!host_is_little_endian()) {
    for (Scalar& x : out) {
      unsigned char b[sizeof(Scalar)];
      std::memcpy(b, &x, sizeof(Scalar));
      for (std::size_t i = 0; i < sizeof(Scalar) / 2; ++i)
        std::swap(b[i], b[sizeof(Scalar) - 1 - i]);
      std::memcpy(&x, b, sizeof(Scalar));
    }
  }
}

// Complete file image (header + data) of a little-endian C-order array.
template <typename Scalar>
std::string header_bytes(const std::vector<std::int64_t>& shape) {
  std::string dict = std::string("{'descr': '") + (std::is_same_v<Scalar, float> ? "<f4" : "<f8") +
                     "', 'fortran_order': False, 'shape': " + shape_to_python(shape) + ", }";
  // Total header (magic + version + length + dict + padding + '\n') is a multiple of 64 bytes.
  int major = 1;
  std::size_t prefix = 10;
  if (dict.size() + 1 + 64 > 65535) {
    major = 2;
    prefix = 12;
  }
  const std::size_t unpadded = prefix + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(major);
  out += '\0';
  const std::uint64_t len = dict.size();
  for (std::size_t i = 0; i < prefix - 8; ++i) out += static_cast<char>((len >> (8 * i)) & 0xff);
  return out + dict;
}

inline std::filesystem::path temporary_sibling(const std::filesystem::path& target) {
  static std::atomic<unsigned> counter{0};
  std::random_device rd;
  const std::uint64_t tag =
      (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^ (counter++ * 0x9e3779b97f4a7c15ull);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(tag));
  std::filesystem::path tmp = target;
  tmp += std::string(".tmp-") + hex;
  return tmp;
}

}  // namespace detail

// Reads only the header of a .npy stream; `name` is used in error messages.
inline NpyHeader read_npy_header(std::istream& in, const std::string& name = "<stream>") {
  return detail::read_header(in, name);
}

// Reads a .npy array from a binary stream; `name` is used in error messages.
inline NpyArray read_npy(std::istream& in, const std::string& name = "<stream>") {
  const NpyHeader h = detail::read_header(in, name);
  NpyArray a;
  a.shape = h.shape;
  if (h.dtype == NpyDtype::float32) {
    std::vector<float> v;
    detail::read_data(in, name, h.count, v);
    a.data = std::move(v);
  } else {
    std::vector<double> v;
    detail::read_data(in, name, h.count, v);
    a.data = std::move(v);
  }
  return a;
}

// Reads a .npy file.
inline NpyArray read_npy(const std::filesystem::path& path) {
  const std::string name = path.string();
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) detail::fail(name, "is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    detail::fail(
        name, std::filesystem::exists(path, ec) ? "cannot open file for reading" : "no such file");
  }
  return read_npy(in, name);
}

namespace detail {

// Opens a .npy file and reads its header; checks that the file holds all the data the header
// announces (so every reader of a part of it reports a truncated file alike).
inline NpyHeader open_npy(const std::filesystem::path& path, std::ifstream& in) {
  const std::string name = path.string();
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail(name, "is a directory");
  in.open(path, std::ios::binary);
  if (!in)
    fail(name, std::filesystem::exists(path, ec) ? "cannot open file for reading" : "no such file");
  const NpyHeader h = read_header(in, name);
  const std::uint64_t need = std::uint64_t(h.count) * (h.dtype == NpyDtype::float32 ? 4 : 8);
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  if (!ec && size - std::min<std::uint64_t>(size, h.data_offset) < need)
    fail(name, "truncated data (expected " + std::to_string(need) + " bytes, found " +
                   std::to_string(size - std::min<std::uint64_t>(size, h.data_offset)) + ")");
  return h;
}

// Block [first, first + count) of `axis`, or (flat) of the flattened array.
inline NpyArray read_npy_runs(const std::filesystem::path& path, std::size_t axis,
                              std::int64_t first, std::int64_t count, bool flat) {
  std::ifstream in;
  const NpyHeader h = open_npy(path, in);
  const std::string name = path.string();
  const std::vector<std::int64_t> shape =
      flat ? std::vector<std::int64_t>{std::int64_t(h.count)} : h.shape;
  if (axis >= shape.size() || first < 0 || count < 0 || first + count > shape[axis])
    fail(name, "block [" + std::to_string(first) + ", " + std::to_string(first + count) +
                   ") of axis " + std::to_string(axis) + " is outside the shape " +
                   shape_to_python(shape));
  std::int64_t outer = 1, inner = 1;
  for (std::size_t j = 0; j < axis; ++j) outer *= shape[j];
  for (std::size_t j = axis + 1; j < shape.size(); ++j) inner *= shape[j];
  NpyArray a;
  a.shape = shape;
  a.shape[axis] = count;
  const auto read = [&](auto tag) {
    using Scalar = decltype(tag);
    std::vector<Scalar> all, run;
    all.reserve(std::size_t(outer * count * inner));
    for (std::int64_t o = 0; o < outer && count > 0; ++o) {
      in.seekg(std::streamoff(h.data_offset +
                              std::size_t((o * shape[axis] + first) * inner) * sizeof(Scalar)));
      read_data(in, name, std::size_t(count * inner), run);
      all.insert(all.end(), run.begin(), run.end());
    }
    a.data = std::move(all);
  };
  if (h.dtype == NpyDtype::float32)
    read(float());
  else
    read(double());
  return a;
}

}  // namespace detail

// Reads only the block of indices [first, first + count) along `axis` of a .npy file (every
// index of the other axes): the rows a shard of a distributed computation owns. The result has
// the file's shape with shape[axis] = count. Seeks to each run; never reads the rest.
inline NpyArray read_npy_block(const std::filesystem::path& path, std::size_t axis,
                               std::int64_t first, std::int64_t count) {
  return detail::read_npy_runs(path, axis, first, count, false);
}

// Reads only the entries [first, first + count) in flat C order of a .npy file (a shard of a
// flattened tensor); the result is 1-D and keeps the dtype.
inline NpyArray read_npy_range(const std::filesystem::path& path, std::int64_t first,
                               std::int64_t count) {
  return detail::read_npy_runs(path, 0, first, count, true);
}

// Writes a C-order array of shape `shape` (product(shape) values at `data`) to `path`,
// atomically: the file appears complete or not at all.
template <typename Scalar>
void write_npy(const std::filesystem::path& path, const Scalar* data,
               const std::vector<std::int64_t>& shape) {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "write_npy supports float and double");
  const std::string name = path.string();
  std::uint64_t count = 1;
  for (std::int64_t d : shape) {
    if (d < 0) detail::fail(name, "negative dimension in shape " + detail::shape_to_python(shape));
    if (d != 0 && count > std::numeric_limits<std::uint64_t>::max() / sizeof(Scalar) /
                              static_cast<std::uint64_t>(d))
      detail::fail(name,
                   "shape " + detail::shape_to_python(shape) + " overflows the element count");
    count *= static_cast<std::uint64_t>(d);
  }
  if (count > 0 && data == nullptr) detail::fail(name, "null data pointer");

  const std::string header = detail::header_bytes<Scalar>(shape);
  const std::filesystem::path tmp = detail::temporary_sibling(path);
  // "x": exclusive creation, so an existing file is never clobbered by the temporary.
  std::FILE* f = std::fopen(tmp.string().c_str(), "wbx");
  if (!f) detail::fail(name, std::string("cannot create output file: ") + std::strerror(errno));
  errno = 0;
  bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size();
  if (ok && count > 0) {
    if (detail::host_is_little_endian()) {
      ok = std::fwrite(data, sizeof(Scalar), static_cast<std::size_t>(count), f) == count;
    } else {
      for (std::uint64_t i = 0; ok && i < count; ++i) {
        unsigned char b[sizeof(Scalar)];
        std::memcpy(b, data + i, sizeof(Scalar));
        for (std::size_t j = 0; j < sizeof(Scalar) / 2; ++j)
          std::swap(b[j], b[sizeof(Scalar) - 1 - j]);
        ok = std::fwrite(b, 1, sizeof b, f) == sizeof b;
      }
    }
  }
  const int write_errno = errno;
  ok = (std::fflush(f) == 0) && ok;
  ok = (std::fclose(f) == 0) && ok;
  std::error_code ec;
  if (!ok) {
    std::filesystem::remove(tmp, ec);
    detail::fail(name,
                 std::string("write failed: ") + std::strerror(write_errno ? write_errno : errno));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    detail::fail(name, "cannot replace output file: " + ec.message());
  }
}

template <typename Scalar>
void write_npy(const std::filesystem::path& path, const std::vector<Scalar>& data,
               const std::vector<std::int64_t>& shape) {
  std::uint64_t count = 1;
  for (std::int64_t d : shape) count *= static_cast<std::uint64_t>(d < 0 ? 0 : d);
  if (count != data.size())
    detail::fail(path.string(), "data has " + std::to_string(data.size()) + " values but shape " +
                                    detail::shape_to_python(shape) + " needs " +
                                    std::to_string(count));
  write_npy(path, data.data(), shape);
}

inline void write_npy(const std::filesystem::path& path, const NpyArray& a) {
  std::visit([&](const auto& v) { write_npy(path, v, a.shape); }, a.data);
}

// Writes a float/double Eigen matrix as a 2-D C-order array (rows, cols).
template <typename Derived>
void write_npy(const std::filesystem::path& path, const Eigen::DenseBase<Derived>& m) {
  using Scalar = typename Derived::Scalar;
  const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rm = m;
  write_npy(path, rm.data(),
            {static_cast<std::int64_t>(rm.rows()), static_cast<std::int64_t>(rm.cols())});
}

// Views a 2-D array as a row-major Eigen matrix (no copy); throws NpyError on rank or dtype
// mismatch.
template <typename Scalar>
Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> as_matrix(
    const NpyArray& a) {
  if (a.ndim() != 2)
    throw NpyError("npy array has " + std::to_string(a.ndim()) + " dimensions, expected 2");
  const std::vector<Scalar>& v = a.values<Scalar>();
  return {v.data(), static_cast<Eigen::Index>(a.shape[0]), static_cast<Eigen::Index>(a.shape[1])};
}

}  // namespace randattn::io
