#pragma once
// Reading and writing NumPy .npy files: an opt-in header, not included by <randattn/randattn.hpp>
// (the command line and the tests use it; include it yourself to exchange arrays with NumPy).
//
// Read: float16 ('f2', held as Eigen::half), float32 ('f4') and float64 ('f8') arrays with any
// number of dimensions, in either byte order ('<' little-endian, '>' big-endian, '=' and '|'
// native) and either memory order. Every reader returns the array in C (row-major) order with
// native byte order, whatever the file holds: the values np.ascontiguousarray(np.load(path)) has.
// A file with fortran_order: True (what np.save writes for a transposed array, a.T) is reordered
// on read, in one pass over the data (read_npy streams it in slices, so the peak is the result
// plus one slice of the file); a big-endian file is byte-swapped. Format versions 1.0, 2.0 and
// 3.0 are read (3.0 differs from 2.0 only by a UTF-8 header, which never matters for these
// dtypes). bfloat16 has no NumPy dtype of its own and is not read.
//
// Partial reads: read_npy_block (a block of indices of one axis) supports both orders and byte
// orders. read_npy_range (a range of the flattened C-order array) supports both byte orders but
// refuses a Fortran-order file of two or more non-trivial dimensions -- a flat C-order range is
// scattered all over such a file -- with a message saying to read the whole file with read_npy or
// to save it in C order (np.save(path, np.ascontiguousarray(a))). read_npy_header returns the
// header only; its fortran_order and little_endian fields say how the data that follows is laid
// out, for callers that read the data themselves.
//
// Write: always C order, little-endian ('<f2' / '<f4' / '<f8'), version 1.0 (2.0 if the header is
// too long). Writing goes to a temporary file in the destination directory which is renamed over
// the destination only when complete, so a failed write never leaves a partial file behind. An
// existing destination that is not a regular file (a symlink, FIFO, device or directory) is
// refused, never replaced.
//
// Every problem with a file (missing, bad magic, unsupported version or dtype, unparsable header,
// truncated data, overflowing shape, a failed write) throws randattn::io::NpyError, a
// randattn::invalid_argument (so a std::invalid_argument), with a one-line message
// "<file>: <problem>". Bytes after the data are ignored.

#include <randattn/detail/intrinsics.hpp>

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

#include "../core/invalid_argument.hpp"

namespace randattn::io {

// Error raised for any unreadable, malformed or unsupported .npy file and for failed writes: a
// bad argument of the I/O functions, hence a randattn::invalid_argument.
class NpyError : public randattn::invalid_argument {
 public:
  using randattn::invalid_argument::invalid_argument;
};

enum class NpyDtype { float32, float64, float16 };

namespace detail {
// Each dtype's NumPy name, type code in a header's descr (after the byte order) and element size,
// in the order of NpyDtype.
struct DtypeSpelling {
  NpyDtype dtype;
  const char* name;
  const char* code;
  std::size_t size;
};
inline constexpr DtypeSpelling kDtypes[] = {{NpyDtype::float32, "float32", "f4", 4},
                                            {NpyDtype::float64, "float64", "f8", 8},
                                            {NpyDtype::float16, "float16", "f2", 2}};
inline const DtypeSpelling& spelling(NpyDtype t) { return kDtypes[static_cast<int>(t)]; }
}  // namespace detail

// NumPy dtype name ("float32", "float64", "float16").
inline const char* dtype_name(NpyDtype t) { return detail::spelling(t).name; }

// Bytes per element.
inline std::size_t dtype_size(NpyDtype t) { return detail::spelling(t).size; }

// The dtype that holds Scalar (float, double or Eigen::half).
template <typename Scalar>
constexpr NpyDtype dtype_of() {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double> ||
                    std::is_same_v<Scalar, Eigen::half>,
                "npy arrays hold float, double or Eigen::half");
  return std::is_same_v<Scalar, float>    ? NpyDtype::float32
         : std::is_same_v<Scalar, double> ? NpyDtype::float64
                                          : NpyDtype::float16;
}

// f(Scalar()) with the element type of dtype t: float, double or Eigen::half.
template <typename F>
decltype(auto) with_element_type(NpyDtype t, F&& f) {
  if (t == NpyDtype::float32) return f(float());
  if (t == NpyDtype::float64) return f(double());
  return f(Eigen::half());
}

// An n-dimensional array in C (row-major) order; data holds product(shape) values.
struct NpyArray {
  std::vector<std::int64_t> shape;
  std::variant<std::vector<float>, std::vector<double>, std::vector<Eigen::half>> data;

  NpyDtype dtype() const {
    return std::visit(
        [](const auto& v) { return dtype_of<typename std::decay_t<decltype(v)>::value_type>(); },
        data);
  }
  bool is_float32() const { return data.index() == 0; }
  bool is_float64() const { return data.index() == 1; }
  bool is_float16() const { return data.index() == 2; }
  std::size_t ndim() const { return shape.size(); }
  std::size_t size() const {
    return std::visit([](const auto& v) { return v.size(); }, data);
  }

  // Typed access; throws NpyError if Scalar does not match the stored dtype.
  template <typename Scalar>
  const std::vector<Scalar>& values() const {
    if (const auto* p = std::get_if<std::vector<Scalar>>(&data)) return *p;
    throw NpyError(std::string("npy array holds ") + dtype_name(dtype()) + ", requested " +
                   dtype_name(dtype_of<Scalar>()));
  }
  template <typename Scalar>
  std::vector<Scalar>& values() {
    return const_cast<std::vector<Scalar>&>(static_cast<const NpyArray&>(*this).values<Scalar>());
  }
};

// Parsed .npy header. fortran_order and little_endian describe the data as stored in the file;
// the arrays the readers return are always C order and native byte order.
struct NpyHeader {
  int major_version = 1;
  int minor_version = 0;
  NpyDtype dtype = NpyDtype::float64;
  std::vector<std::int64_t> shape;
  std::size_t data_offset = 0;  // bytes from the start of the file to the first element
  std::size_t count = 1;        // number of elements
  bool fortran_order = false;   // data stored column-major (first index fastest)
  bool little_endian = true;    // byte order of the stored values ('=' and '|': the host's)
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
  const bool known_order =
      d.size() == 3 && (d[0] == '<' || d[0] == '>' || d[0] == '=' || d[0] == '|');
  const DtypeSpelling* known = nullptr;
  for (const DtypeSpelling& t : kDtypes)
    if (known_order && d.compare(1, 2, t.code) == 0) known = &t;
  if (known) {
    h.dtype = known->dtype;
  } else {
    fail(name, "unsupported dtype '" + excerpt(d) +
                   "'; expected float16 ('<f2', '>f2'), float32 ('<f4', '>f4') or float64 "
                   "('<f8', '>f8')");
  }
  h.little_endian = d[0] == '<' || (d[0] != '>' && host_is_little_endian());

  if (fortran->kind != PyValue::Kind::boolean)
    fail(name, "unparsable header ('fortran_order' is not True/False)");
  h.fortran_order = fortran->boolean;

  if (shape->kind != PyValue::Kind::sequence)
    fail(name, "unparsable header ('shape' is not a tuple)");
  const std::size_t elem = dtype_size(h.dtype);
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

// Reverses the byte order of n values in place.
template <typename Scalar>
void swap_byte_order(Scalar* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    unsigned char b[sizeof(Scalar)];
    std::memcpy(b, p + i, sizeof(Scalar));
    std::reverse(b, b + sizeof(Scalar));
    std::memcpy(p + i, b, sizeof(Scalar));
  }
}

// Whether the stored values must be byte-swapped to the host's order.
inline bool needs_swap(const NpyHeader& h) { return h.little_endian != host_is_little_endian(); }

[[noreturn]] inline void truncated(const std::string& name, std::uint64_t expected,
                                   std::uint64_t found) {
  fail(name, "truncated data (expected " + std::to_string(expected) + " bytes, found " +
                 std::to_string(found) + ")");
}

// Checks that the stream holds at least nbytes after its position, when it can tell (a seekable
// stream), so a lying header never triggers a huge allocation; returns whether it could tell.
inline bool check_available(std::istream& in, const std::string& name, std::uint64_t nbytes) {
  const std::streampos here = in.tellg();
  if (here == std::streampos(-1)) return false;
  in.seekg(0, std::ios::end);
  const std::streampos end = in.tellg();
  in.seekg(here);
  const bool known = end != std::streampos(-1) && bool(in);
  in.clear();
  if (!known) return false;
  const auto remaining = static_cast<std::uint64_t>(end - here);
  if (remaining < nbytes) truncated(name, nbytes, remaining);
  return true;
}

// Reads n values to `out`, byte-swapped if `swap`; `before` of the `total` bytes expected were
// read before (for the truncation message).
template <typename Scalar>
void read_values(std::istream& in, const std::string& name, Scalar* out, std::size_t n, bool swap,
                 std::uint64_t before, std::uint64_t total) {
  static_assert(sizeof(float) == 4 && sizeof(double) == 8 && sizeof(Eigen::half) == 2,
                "IEEE-754 half/float/double required");
  in.read(reinterpret_cast<char*>(out), static_cast<std::streamsize>(n * sizeof(Scalar)));
  const auto got = static_cast<std::uint64_t>(in.gcount());
  if (got != n * sizeof(Scalar)) truncated(name, total, before + got);
  if (swap) swap_byte_order(out, n);
}

// Reads `count` consecutive stored values (in the file's order), byte-swapped if `swap`.
template <typename Scalar>
void read_data(std::istream& in, const std::string& name, std::size_t count,
               std::vector<Scalar>& out, bool swap) {
  const std::uint64_t nbytes = std::uint64_t(count) * sizeof(Scalar);
  check_available(in, name, nbytes);
  out.clear();
  // Grows by chunks, so a stream that cannot tell its size fails as truncated before a lying
  // header's count is allocated.
  constexpr std::size_t chunk = std::size_t{1} << 20;  // elements per read
  for (std::size_t done = 0; done < count;) {
    const std::size_t n = std::min(chunk, count - done);
    out.resize(done + n);
    read_values(in, name, out.data() + done, n, swap, done * sizeof(Scalar), nbytes);
    done += n;
  }
}

// A Fortran-order array seen for reordering to C order: its axes longer than 1 (axes of length 1
// change neither layout) with their strides in both orders. The file stores the array with its
// first axis fastest, i.e. the C layout of the array with reversed axes.
struct FortranLayout {
  std::vector<std::size_t> dims, file_stride, c_stride;
  std::size_t slice = 1;  // stored values per index of the last axis (its file stride)

  explicit FortranLayout(const std::vector<std::int64_t>& shape) {
    for (std::int64_t d : shape)
      if (d != 1) dims.push_back(static_cast<std::size_t>(d));
    file_stride.resize(dims.size());
    c_stride.resize(dims.size());
    std::size_t s = 1;
    for (std::size_t j = 0; j < dims.size(); ++j) {
      file_stride[j] = s;
      s *= dims[j];
    }
    s = 1;
    for (std::size_t j = dims.size(); j-- > 0;) {
      c_stride[j] = s;
      s *= dims[j];
    }
    if (!dims.empty()) slice = file_stride.back();
  }

  // Whether the stored order differs from C order: two or more axes longer than 1.
  bool reorders() const { return dims.size() >= 2; }
};

// Moves the stored values of the last axis' indices [first, first + n) -- n * L.slice values in
// file order at `part` -- to their C-order places in `out` (the whole array). Each value moves
// once; tiles over the first axis (fastest in the file) and the last axis (fastest in C order)
// keep both the reads and the writes in cache. Requires L.reorders().
template <typename Scalar>
void fortran_to_c(const FortranLayout& L, const Scalar* part, std::size_t first, std::size_t n,
                  Scalar* out) {
  constexpr std::size_t tile = 32;
  const std::size_t k = L.dims.size(), d0 = L.dims[0], c0 = L.c_stride[0], s_last = L.slice;
  std::vector<std::size_t> idx(k, 0);  // indices of the middle axes 1 .. k - 2
  std::size_t file_base = 0, c_base = first;
  for (;;) {
    for (std::size_t a = 0; a < d0; a += tile) {
      const std::size_t a_end = std::min(d0, a + tile);
      for (std::size_t b = 0; b < n; b += tile) {
        const std::size_t b_end = std::min(n, b + tile);
        for (std::size_t i = a; i < a_end; ++i) {
          const Scalar* src = part + file_base + i;
          Scalar* dst = out + c_base + i * c0;
          for (std::size_t j = b; j < b_end; ++j) dst[j] = src[j * s_last];
        }
      }
    }
    // Next index of the middle axes, axis 1 fastest.
    std::size_t j = 1;
    for (; j + 1 < k; ++j) {
      file_base += L.file_stride[j];
      c_base += L.c_stride[j];
      if (++idx[j] < L.dims[j]) break;
      file_base -= idx[j] * L.file_stride[j];
      c_base -= idx[j] * L.c_stride[j];
      idx[j] = 0;
    }
    if (j + 1 >= k) break;
  }
}

// The whole array of a stream positioned at its data, in C order and native byte order.
template <typename Scalar>
std::vector<Scalar> read_array(std::istream& in, const std::string& name, const NpyHeader& h) {
  const bool swap = needs_swap(h);
  const FortranLayout L(h.shape);
  std::vector<Scalar> out;
  if (!h.fortran_order || !L.reorders() || h.count == 0) {
    read_data(in, name, h.count, out, swap);
    return out;
  }
  const std::uint64_t nbytes = std::uint64_t(h.count) * sizeof(Scalar);
  const std::size_t last = L.dims.back();
  if (!check_available(in, name, nbytes)) {
    // A stream that cannot tell its size: read everything first (a lying header fails as
    // truncated before the result is allocated), then reorder.
    std::vector<Scalar> stored;
    read_data(in, name, h.count, stored, swap);
    out.resize(h.count);
    fortran_to_c(L, stored.data(), 0, last, out.data());
    return out;
  }
  // Slices of the last axis (contiguous in the file), about 2^20 values at a time.
  out.resize(h.count);
  const std::size_t per =
      std::max<std::size_t>(1, std::min(last, (std::size_t{1} << 20) / L.slice));
  std::vector<Scalar> part;
  for (std::size_t first = 0; first < last; first += per) {
    const std::size_t n = std::min(per, last - first);
    part.resize(n * L.slice);
    read_values(in, name, part.data(), part.size(), swap, first * L.slice * sizeof(Scalar), nbytes);
    fortran_to_c(L, part.data(), first, n, out.data());
  }
  return out;
}

// The header bytes (magic, version, length, dict, padding) of a little-endian C-order array.
template <typename Scalar>
std::string header_bytes(const std::vector<std::int64_t>& shape) {
  std::string dict = std::string("{'descr': '<") + spelling(dtype_of<Scalar>()).code +
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

// An output path may name a new file or an existing regular file; anything else that exists (a
// symlink, FIFO, device, socket or directory) is refused rather than replaced by a regular file.
inline void require_replaceable(const std::filesystem::path& target) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::symlink_status(target, ec);
  if (ec || !std::filesystem::exists(st) || std::filesystem::is_regular_file(st)) return;
  const char* kind = std::filesystem::is_symlink(st)     ? "a symbolic link"
                     : std::filesystem::is_directory(st) ? "a directory"
                     : std::filesystem::is_fifo(st)      ? "a FIFO"
                     : std::filesystem::is_socket(st)    ? "a socket"
                                                         : "a device or special file";
  fail(target.string(), std::string("exists and is ") + kind +
                            ", not a regular file; refusing to replace it");
}

}  // namespace detail

// Reads only the header of a .npy stream; `name` is used in error messages. The data that follows
// is stored as the header says: h.fortran_order (first index fastest) and h.little_endian (byte
// order); a caller reading it directly must honour both (or use the readers below, which do).
inline NpyHeader read_npy_header(std::istream& in, const std::string& name = "<stream>") {
  return detail::read_header(in, name);
}

// Reads a .npy array from a binary stream (C order, native byte order, whatever the stream holds);
// `name` is used in error messages.
inline NpyArray read_npy(std::istream& in, const std::string& name = "<stream>") {
  const NpyHeader h = detail::read_header(in, name);
  NpyArray a;
  a.shape = h.shape;
  with_element_type(h.dtype, [&](auto tag) {
    a.data = detail::read_array<decltype(tag)>(in, name, h);
  });
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
  const std::uint64_t need = std::uint64_t(h.count) * dtype_size(h.dtype);
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  if (!ec && size - std::min<std::uint64_t>(size, h.data_offset) < need)
    fail(name, "truncated data (expected " + std::to_string(need) + " bytes, found " +
                   std::to_string(size - std::min<std::uint64_t>(size, h.data_offset)) + ")");
  return h;
}

// Block [first, first + count) of `axis`, or (flat) of the flattened array, in C order and native
// byte order. A Fortran-order file stores the C layout of the array with reversed axes: the block
// is read from it as the block of the reversed axis, then reordered.
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
  const bool fortran = h.fortran_order && FortranLayout(h.shape).reorders();
  if (fortran && flat)
    fail(name,
         "fortran_order=True: a range of the flattened array cannot be read from a Fortran-order "
         "file; read the whole file (read_npy) or save the array in C order "
         "(np.save(path, np.ascontiguousarray(a)))");
  const std::vector<std::int64_t> stored =
      fortran ? std::vector<std::int64_t>(shape.rbegin(), shape.rend()) : shape;
  const std::size_t stored_axis = fortran ? shape.size() - 1 - axis : axis;
  std::int64_t outer = 1, inner = 1;
  for (std::size_t j = 0; j < stored_axis; ++j) outer *= stored[j];
  for (std::size_t j = stored_axis + 1; j < stored.size(); ++j) inner *= stored[j];
  NpyArray a;
  a.shape = shape;
  a.shape[axis] = count;
  const bool swap = needs_swap(h);
  const auto read = [&](auto tag) {
    using Scalar = decltype(tag);
    std::vector<Scalar> all, run;
    all.reserve(std::size_t(outer * count * inner));
    for (std::int64_t o = 0; o < outer && count > 0; ++o) {
      in.seekg(std::streamoff(
          h.data_offset + std::size_t((o * stored[stored_axis] + first) * inner) * sizeof(Scalar)));
      read_data(in, name, std::size_t(count * inner), run, swap);
      all.insert(all.end(), run.begin(), run.end());
    }
    const FortranLayout block(a.shape);
    if (fortran && block.reorders() && !all.empty()) {
      std::vector<Scalar> c_order(all.size());
      fortran_to_c(block, all.data(), 0, block.dims.back(), c_order.data());
      all.swap(c_order);
    }
    a.data = std::move(all);
  };
  with_element_type(h.dtype, read);
  return a;
}

}  // namespace detail

// Reads only the header of a .npy file, and checks that the file holds all the data the header
// announces (a truncated file throws NpyError here rather than at the first read of a part).
inline NpyHeader read_npy_header(const std::filesystem::path& path) {
  std::ifstream in;
  return detail::open_npy(path, in);
}

// The header of a little-endian C-order .npy file of this dtype and shape (what write_npy writes
// before the values): for writers that place the values themselves, e.g. one shard per process.
template <typename Scalar>
std::string npy_header_bytes(const std::vector<std::int64_t>& shape) {
  return detail::header_bytes<Scalar>(shape);
}

// Whether this host stores numbers little-endian (the byte order npy_header_bytes announces).
inline bool host_is_little_endian() { return detail::host_is_little_endian(); }

// A fresh path beside `target` (target + ".tmp-" + 16 random hex digits): write there, then
// rename onto target, so that target appears complete or not at all.
inline std::filesystem::path temporary_path_beside(const std::filesystem::path& target) {
  return detail::temporary_sibling(target);
}

// Throws NpyError unless `target` is absent or a regular file: an output never replaces a
// symbolic link, FIFO, device, socket or directory by a regular file.
inline void require_replaceable(const std::filesystem::path& target) {
  detail::require_replaceable(target);
}

// Reads only the block of indices [first, first + count) along `axis` of a .npy file (every
// index of the other axes): the rows a shard of a distributed computation owns. The result has
// the file's shape with shape[axis] = count, in C order. Seeks to each run; never reads the rest.
// Either memory order and byte order (a Fortran-order block is reordered after reading).
inline NpyArray read_npy_block(const std::filesystem::path& path, std::size_t axis,
                               std::int64_t first, std::int64_t count) {
  return detail::read_npy_runs(path, axis, first, count, false);
}

// Reads only the entries [first, first + count) in flat C order of a .npy file (a shard of a
// flattened tensor); the result is 1-D and keeps the dtype. Either byte order; a Fortran-order
// file (two or more axes longer than 1) throws NpyError: read it whole with read_npy, or save it
// in C order.
inline NpyArray read_npy_range(const std::filesystem::path& path, std::int64_t first,
                               std::int64_t count) {
  return detail::read_npy_runs(path, 0, first, count, true);
}

// Writes a C-order array of shape `shape` (product(shape) values at `data`) to `path`,
// atomically: the file appears complete or not at all.
template <typename Scalar>
void write_npy(const std::filesystem::path& path, const Scalar* data,
               const std::vector<std::int64_t>& shape) {
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
  detail::require_replaceable(path);

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

// Writes a float, double or Eigen::half matrix as a 2-D C-order array (rows, cols).
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
