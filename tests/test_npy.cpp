// Tests of include/randattn/io/npy.hpp: round trips, Fortran-order and big-endian files, and every
// class of malformed file.
#include <randattn/io/npy.hpp>

#include <catch2/catch.hpp>

#include "scalars.hpp"

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <streambuf>
#include <string>
#include <typeinfo>
#include <vector>

namespace fs = std::filesystem;
using randattn::io::NpyArray;
using randattn::io::NpyDtype;
using randattn::io::NpyError;
using randattn::io::read_npy;
using randattn::io::write_npy;

// The element types of .npy files: the scalars of the library, and float16 as Eigen::half.
#define NPY_TEST_TYPES RANDATTN_TEST_SCALARS, Eigen::half

namespace {

// The dtype a file of T holds, spelled out.
template <typename T>
NpyDtype expected_dtype() {
  if (std::is_same_v<T, float>) return NpyDtype::float32;
  if (std::is_same_v<T, double>) return NpyDtype::float64;
  return NpyDtype::float16;
}

// A fresh directory under the system temp dir, removed with its contents at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device rd;
    path = fs::temp_directory_path() /
           ("randattn_npy_test_" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path operator/(const std::string& name) const { return path / name; }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(path))
      names.push_back(e.path().filename().string());
    return names;
  }
};

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A .npy image with an arbitrary header dictionary (padded like NumPy) followed by `payload`.
std::string npy_image(const std::string& dict, const std::string& payload, int major = 1,
                      int minor = 0) {
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  std::string header = dict;
  const std::size_t unpadded = 8 + len_bytes + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(major);
  out += static_cast<char>(minor);
  for (std::size_t i = 0; i < len_bytes; ++i)
    out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + payload;
}

template <typename T>
std::string le_payload(const std::vector<T>& values) {
  std::string s(values.size() * sizeof(T), '\0');
  for (std::size_t i = 0; i < values.size(); ++i) {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &values[i], sizeof(T));
    if (!randattn::io::host_is_little_endian())
      for (std::size_t j = 0; j < sizeof(T) / 2; ++j) std::swap(b[j], b[sizeof(T) - 1 - j]);
    std::memcpy(&s[i * sizeof(T)], b, sizeof(T));
  }
  return s;
}

template <typename T>
std::vector<T> ramp(std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<T>(0.1) * static_cast<T>(i) - static_cast<T>(1.5);
  return v;
}

// Reading `bytes` from a file must throw NpyError whose one-line message names the file and
// contains `phrase`.
void require_rejected(const TempDir& dir, const std::string& bytes, const std::string& phrase) {
  const fs::path p = dir / "bad.npy";
  write_bytes(p, bytes);
  try {
    (void)read_npy(p);
    FAIL("accepted a malformed file; expected an error containing '" << phrase << "'");
  } catch (const NpyError& e) {
    const std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.find(p.string()) == 0);
    CHECK(msg.find(phrase) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
}

const std::string kF8_2x2 = "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), }";

// The bytes of `values` in the given byte order, whatever the host's.
template <typename T>
std::string payload_in(const std::vector<T>& values, bool big_endian) {
  using Bits = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                                  std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
  std::string s(values.size() * sizeof(T), '\0');
  for (std::size_t i = 0; i < values.size(); ++i) {
    Bits bits;
    std::memcpy(&bits, &values[i], sizeof(T));
    for (std::size_t b = 0; b < sizeof(T); ++b)
      s[i * sizeof(T) + (big_endian ? sizeof(T) - 1 - b : b)] =
          static_cast<char>((bits >> (8 * b)) & 0xff);
  }
  return s;
}

std::size_t element_count(const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  for (std::int64_t d : shape) n *= static_cast<std::size_t>(d);
  return n;
}

// The values of a C-order array of `shape`, listed in Fortran order (first index fastest): what
// np.save writes for np.asfortranarray(a). Walks every multi-index; independent of the reader.
template <typename T>
std::vector<T> fortran_listing(const std::vector<T>& c, const std::vector<std::int64_t>& shape) {
  std::vector<T> f(c.size());
  std::vector<std::int64_t> idx(shape.size(), 0);
  for (std::size_t flat_c = 0; flat_c < c.size(); ++flat_c) {
    std::size_t flat_f = 0, stride = 1;
    for (std::size_t j = 0; j < shape.size(); ++j) {
      flat_f += static_cast<std::size_t>(idx[j]) * stride;
      stride *= static_cast<std::size_t>(shape[j]);
    }
    f[flat_f] = c[flat_c];
    for (std::size_t j = shape.size(); j-- > 0;) {
      if (++idx[j] < shape[j]) break;
      idx[j] = 0;
    }
  }
  return f;
}

// Block [first, first + count) of `axis` of a C-order array, in C order.
template <typename T>
std::vector<T> c_block(const std::vector<T>& c, const std::vector<std::int64_t>& shape,
                       std::size_t axis, std::int64_t first, std::int64_t count) {
  std::size_t outer = 1, inner = 1;
  for (std::size_t j = 0; j < axis; ++j) outer *= static_cast<std::size_t>(shape[j]);
  for (std::size_t j = axis + 1; j < shape.size(); ++j) inner *= static_cast<std::size_t>(shape[j]);
  std::vector<T> out;
  for (std::size_t o = 0; o < outer; ++o)
    for (std::int64_t i = first; i < first + count; ++i) {
      const auto at =
          c.begin() + std::ptrdiff_t((o * std::size_t(shape[axis]) + std::size_t(i)) * inner);
      out.insert(out.end(), at, at + std::ptrdiff_t(inner));
    }
  return out;
}

// A .npy image of the C-order array `c`, stored in Fortran or C order, big- or little-endian.
template <typename T>
std::string stored_image(const std::vector<T>& c, const std::vector<std::int64_t>& shape,
                         bool fortran, bool big_endian) {
  const std::string descr =
      std::string(big_endian ? ">" : "<") + (sizeof(T) == 2 ? "f2" : sizeof(T) == 4 ? "f4" : "f8");
  std::string tuple = "(";
  for (std::size_t i = 0; i < shape.size(); ++i)
    tuple += (i ? ", " : "") + std::to_string(shape[i]);
  tuple += shape.size() == 1 ? ",)" : ")";
  return npy_image("{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                       ", 'shape': " + tuple + ", }",
                   payload_in(fortran ? fortran_listing(c, shape) : c, big_endian));
}

// A stream buffer that can only be read forward (no seeking, no size): a pipe.
class ForwardOnlyBuf : public std::streambuf {
 public:
  explicit ForwardOnlyBuf(std::string bytes) : bytes_(std::move(bytes)) {}

 protected:
  int_type underflow() override {
    if (pos_ >= bytes_.size()) return traits_type::eof();
    const std::size_t n = std::min<std::size_t>(7, bytes_.size() - pos_);  // small, odd reads
    setg(&bytes_[pos_], &bytes_[pos_], &bytes_[pos_] + n);
    pos_ += n;
    return traits_type::to_int_type(*gptr());
  }

 private:
  std::string bytes_;
  std::size_t pos_ = 0;
};

}  // namespace

TEMPLATE_TEST_CASE("npy round trip preserves shape, dtype and bits", "[npy]", NPY_TEST_TYPES) {
  TempDir dir;
  const fs::path p = dir / "a.npy";
  for (const std::vector<std::int64_t>& shape :
       {std::vector<std::int64_t>{5, 3}, std::vector<std::int64_t>{2, 3, 4, 5},
        std::vector<std::int64_t>{7}, std::vector<std::int64_t>{}, std::vector<std::int64_t>{0, 4},
        std::vector<std::int64_t>{2, 0, 3, 1}}) {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    std::vector<TestType> values = ramp<TestType>(n);
    if (n > 2) {
      values[1] = std::numeric_limits<TestType>::denorm_min();
      values[2] = -std::numeric_limits<TestType>::max();
    }
    write_npy(p, values, shape);
    const NpyArray a = read_npy(p);
    CHECK(a.shape == shape);
    CHECK(a.dtype() == expected_dtype<TestType>());
    CHECK(a.size() == n);
    const std::vector<TestType>& back = a.values<TestType>();
    REQUIRE(back.size() == n);
    // memcmp must not see the null data() of an empty vector.
    CHECK((n == 0 || std::memcmp(back.data(), values.data(), n * sizeof(TestType)) == 0));
    CHECK(dir.entries() == std::vector<std::string>{"a.npy"});  // no temporary left behind
  }
}

TEST_CASE("npy writer emits NumPy's version 1.0 layout", "[npy]") {
  TempDir dir;
  const fs::path p = dir / "f.npy";
  write_npy(p, ramp<float>(6), {2, 3});
  const std::string bytes = read_bytes(p);
  REQUIRE(bytes.size() == 128 + 6 * 4);
  CHECK(bytes.compare(0, 8, std::string("\x93NUMPY\x01\x00", 8)) == 0);
  const std::size_t header_len =
      static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
  CHECK(header_len == 118);
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  CHECK(bytes.compare(10, dict.size(), dict) == 0);
  CHECK(bytes[127] == '\n');
  CHECK(bytes.substr(10 + dict.size(), 127 - 10 - dict.size()) ==
        std::string(127 - 10 - dict.size(), ' '));

  write_npy(p, ramp<double>(3), {3});
  const std::string one_d = read_bytes(p);
  CHECK(one_d.find("'shape': (3,), }") != std::string::npos);
  CHECK(one_d.find("'descr': '<f8'") != std::string::npos);

  write_npy(p, ramp<Eigen::half>(5), {5});
  const std::string halves = read_bytes(p);
  CHECK(halves.size() == 128 + 5 * 2);
  CHECK(halves.find("'descr': '<f2'") != std::string::npos);
  // -1.5 is 0xBE00 in binary16, stored little-endian.
  CHECK(halves.compare(128, 2, std::string("\x00\xbe", 2)) == 0);
}

TEST_CASE("npy Eigen helpers", "[npy]") {
  TempDir dir;
  const fs::path p = dir / "m.npy";
  Eigen::MatrixXd m(3, 2);  // column-major on purpose: the file must still be C order
  m << 1, 2, 3, 4, 5, 6;
  write_npy(p, m);
  const NpyArray a = read_npy(p);
  CHECK(a.shape == std::vector<std::int64_t>{3, 2});
  CHECK(a.values<double>() == std::vector<double>{1, 2, 3, 4, 5, 6});
  const auto view = randattn::io::as_matrix<double>(a);
  CHECK(view == m);
  CHECK_THROWS_AS(randattn::io::as_matrix<float>(a), NpyError);
  CHECK_THROWS_AS(a.values<float>(), NpyError);

  NpyArray three_d;
  three_d.shape = {1, 1, 1};
  three_d.data = std::vector<float>{1.0f};
  CHECK_THROWS_AS(randattn::io::as_matrix<float>(three_d), NpyError);
}

TEST_CASE("npy reader accepts the header variants NumPy and other writers produce", "[npy]") {
  TempDir dir;
  const fs::path p = dir / "v.npy";
  const std::vector<double> d4 = {1.0, -2.0, 3.5, 4.25};
  const std::vector<float> f4 = {1.0f, -2.0f, 3.5f, 4.25f};

  SECTION("version 2.0 and 3.0") {
    for (int major : {2, 3}) {
      write_bytes(p, npy_image(kF8_2x2, le_payload(d4), major));
      const NpyArray a = read_npy(p);
      CHECK(a.shape == std::vector<std::int64_t>{2, 2});
      CHECK(a.values<double>() == d4);
    }
  }
  SECTION("double quotes, other key order, no trailing comma, extra spaces, Python 2 long suffix") {
    write_bytes(p, npy_image("{ \"shape\" : (2L,2L) ,\"fortran_order\":False, \"descr\":\"<f4\"}",
                             le_payload(f4)));
    const NpyArray a = read_npy(p);
    CHECK(a.shape == std::vector<std::int64_t>{2, 2});
    CHECK(a.values<float>() == f4);
  }
  SECTION("native and not-applicable byte-order characters") {
    if (randattn::io::host_is_little_endian()) {
      for (const char* descr : {"=f4", "|f4"}) {
        write_bytes(p, npy_image(std::string("{'descr': '") + descr +
                                     "', 'fortran_order': False, 'shape': (4,), }",
                                 le_payload(f4)));
        CHECK(read_npy(p).values<float>() == f4);
      }
    }
  }
  SECTION("trailing bytes after the data are ignored") {
    write_bytes(p, npy_image(kF8_2x2, le_payload(d4) + "garbage"));
    CHECK(read_npy(p).values<double>() == d4);
  }
  SECTION("zero-dimensional array holds one value") {
    write_bytes(p, npy_image("{'descr': '<f8', 'fortran_order': False, 'shape': (), }",
                             le_payload(std::vector<double>{7.0})));
    const NpyArray a = read_npy(p);
    CHECK(a.shape.empty());
    CHECK(a.values<double>() == std::vector<double>{7.0});
  }
  SECTION("streams") {
    std::istringstream in(npy_image(kF8_2x2, le_payload(d4)));
    CHECK(read_npy(in, "mem").values<double>() == d4);
    std::istringstream header_only(npy_image(kF8_2x2, ""));
    const auto h = randattn::io::read_npy_header(header_only, "mem");
    CHECK(h.count == 4);
    CHECK(h.data_offset == 128);
    CHECK(h.dtype == NpyDtype::float64);
  }
}

TEST_CASE("npy reader rejects malformed files with a one-line error naming the file", "[npy]") {
  TempDir dir;
  const std::string payload = le_payload(std::vector<double>{1, 2, 3, 4});

  SECTION("the error is a randattn::invalid_argument, hence a std::invalid_argument") {
    write_bytes(dir / "bad.npy", "not a .npy file");
    CHECK_THROWS_AS(read_npy(dir / "bad.npy"), randattn::invalid_argument);
    CHECK_THROWS_AS(read_npy(dir / "bad.npy"), std::invalid_argument);
  }
  SECTION("missing file and directory") {
    try {
      (void)read_npy(dir / "absent.npy");
      FAIL("no error for a missing file");
    } catch (const NpyError& e) {
      CHECK(std::string(e.what()) == (dir / "absent.npy").string() + ": no such file");
    }
    CHECK_THROWS_AS(read_npy(dir.path), NpyError);
  }
  SECTION("bad magic") {
    require_rejected(dir, "", "bad magic");
    require_rejected(dir, "\x93NUM", "bad magic");
    require_rejected(dir, "PK\x03\x04 this is a zip file", "bad magic");
    require_rejected(dir, "\x93numpy" + npy_image(kF8_2x2, payload).substr(6), "bad magic");
  }
  SECTION("unsupported version") {
    require_rejected(dir, npy_image(kF8_2x2, payload, 4, 0), "unsupported .npy format version 4.0");
    require_rejected(dir, npy_image(kF8_2x2, payload, 1, 1), "unsupported .npy format version 1.1");
    require_rejected(dir, npy_image(kF8_2x2, payload, 0, 0), "unsupported .npy format version 0.0");
  }
  SECTION("truncated header") {
    require_rejected(dir, std::string("\x93NUMPY\x01", 7), "truncated header");
    require_rejected(dir, std::string("\x93NUMPY\x01\x00\x50", 9), "truncated header");
    require_rejected(dir, npy_image(kF8_2x2, "").substr(0, 40), "truncated header");
  }
  SECTION("unparsable header dictionary") {
    for (const std::string& dict :
         {std::string("descr: <f8"),
          std::string("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2)"),
          std::string("{'descr': '<f8', 'fortran_order': False}"),
          std::string("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), 'extra': 1}"),
          std::string("{'descr': '<f8', 'fortran_order': 0, 'shape': (2, 2)}"),
          std::string("{'descr': '<f8', 'fortran_order': False, 'shape': 4}"),
          std::string("{'descr': '<f8', 'fortran_order': False, 'shape': (2, -2)}"),
          std::string("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 'a')}"),
          std::string("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2)} x"),
          std::string("{'descr': '<f8, 'fortran_order': False, 'shape': (2, 2)}"),
          std::string("{'descr': '<f8', 'descr': '<f8', 'fortran_order': False, 'shape': (2, 2)}"),
          std::string("{'descr': '<f8', 'fortran_order': Fals, 'shape': (2, 2)}"),
          std::string("{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999999999,)}"),
          std::string("{1: '<f8'}")}) {
      INFO("header: " << dict);
      require_rejected(dir, npy_image(dict, payload), "unparsable header");
    }
  }
  SECTION("unsupported dtype") {
    for (const char* descr :
         {"<i4", ">i4", "<f1", "<e", "<c16", "|u1", "<f16", ">f16", "O", "<f"}) {
      INFO("descr: " << descr);
      require_rejected(dir,
                       npy_image(std::string("{'descr': '") + descr +
                                     "', 'fortran_order': False, 'shape': (2, 2), }",
                                 payload),
                       std::string("unsupported dtype '") + descr + "'");
    }
    require_rejected(
        dir,
        npy_image("{'descr': [('a', '<f8')], 'fortran_order': False, 'shape': (2,), }", payload),
        "unsupported dtype");
  }
  SECTION("fortran_order is not a bool") {
    require_rejected(
        dir, npy_image("{'descr': '<f8', 'fortran_order': 'True', 'shape': (2, 2), }", payload),
        "'fortran_order' is not True/False");
  }
  SECTION("truncated data") {
    require_rejected(dir, npy_image(kF8_2x2, payload.substr(0, 31)),
                     "truncated data (expected 32 bytes, found 31)");
    require_rejected(dir, npy_image(kF8_2x2, ""), "truncated data");
    // A huge shape with a tiny file is reported as truncated without allocating the claimed size.
    require_rejected(
        dir,
        npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000), }",
                  payload),
        "truncated data");
  }
  SECTION("shape product overflow") {
    require_rejected(
        dir,
        npy_image(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296, 16), }",
            payload),
        "overflows");
    require_rejected(
        dir,
        npy_image("{'descr': '<f4', 'fortran_order': False, 'shape': (9223372036854775807, 2), }",
                  payload),
        "overflows");
  }
}

TEMPLATE_TEST_CASE("npy reader returns Fortran-order and big-endian files in C order, native bytes",
                   "[npy]", NPY_TEST_TYPES) {
  using T = TestType;
  TempDir dir;
  const fs::path p = dir / "a.npy";
  const std::vector<std::vector<std::int64_t>> shapes = {
      {3, 5},         {5, 3},    {1, 4},       {4, 1},       {70, 45},
      {2, 3, 4},      {4, 1, 3}, {2, 3, 4, 5}, {3, 1, 4, 2}, {1, 2, 1, 3, 1},
      {33, 2, 3, 35}, {7},       {},           {0, 3},       {3, 0, 2}};
  for (const auto& shape : shapes) {
    const std::vector<T> c = ramp<T>(element_count(shape));
    for (const bool fortran : {false, true})
      for (const bool big : {false, true}) {
        INFO("shape rank " << shape.size() << " size " << c.size() << ", fortran " << fortran
                           << ", big-endian " << big);
        const std::string image = stored_image(c, shape, fortran, big);
        write_bytes(p, image);
        const NpyArray a = read_npy(p);
        CHECK(a.shape == shape);
        REQUIRE(a.values<T>().size() == c.size());
        for (std::size_t i = 0; i < c.size(); ++i) {
          INFO("flat C index " << i);
          REQUIRE(a.values<T>()[i] == c[i]);
        }
        // The same from a seekable stream and from a forward-only one.
        std::istringstream seekable(image);
        CHECK(read_npy(seekable, "mem").values<T>() == c);
        ForwardOnlyBuf buf(image);
        std::istream forward(&buf);
        CHECK(read_npy(forward, "pipe").values<T>() == c);
      }
  }
}

TEST_CASE("npy reader reorders a large Fortran-order file slice by slice", "[npy]") {
  // 1.05 M values: read_npy streams the last axis in two slices of about 2^20 values.
  TempDir dir;
  const std::vector<std::int64_t> shape = {3, 700, 500};
  const std::vector<float> c = ramp<float>(element_count(shape));
  for (const bool big : {false, true}) {
    INFO("big-endian " << big);
    write_bytes(dir / "big.npy", stored_image(c, shape, true, big));
    const NpyArray a = read_npy(dir / "big.npy");
    CHECK(a.shape == shape);
    CHECK(a.values<float>() == c);
  }
}

TEST_CASE("npy header reports the stored order and byte order", "[npy]") {
  const std::vector<double> c = ramp<double>(6);
  for (const bool fortran : {false, true})
    for (const bool big : {false, true}) {
      std::istringstream in(stored_image(c, {2, 3}, fortran, big));
      const auto h = randattn::io::read_npy_header(in, "mem");
      CHECK(h.fortran_order == fortran);
      CHECK(h.little_endian == !big);
      CHECK(h.shape == std::vector<std::int64_t>{2, 3});
      CHECK(h.count == 6);
    }
  // '=' and '|' mean the host's byte order.
  std::istringstream native(npy_image("{'descr': '=f8', 'fortran_order': False, 'shape': (2,), }",
                                      le_payload(std::vector<double>{1, 2})));
  CHECK(randattn::io::read_npy_header(native, "mem").little_endian ==
        randattn::io::host_is_little_endian());
}

TEMPLATE_TEST_CASE("npy partial readers on Fortran-order and big-endian files", "[npy]", NPY_TEST_TYPES) {
  using T = TestType;
  TempDir dir;
  const fs::path p = dir / "a.npy";
  for (const std::vector<std::int64_t>& shape :
       std::vector<std::vector<std::int64_t>>{{6, 5}, {2, 3, 7, 4}, {3, 1, 5}, {40, 37}}) {
    const std::vector<T> c = ramp<T>(element_count(shape));
    for (const bool fortran : {false, true})
      for (const bool big : {false, true}) {
        INFO("shape rank " << shape.size() << " size " << c.size() << ", fortran " << fortran
                           << ", big-endian " << big);
        write_bytes(p, stored_image(c, shape, fortran, big));
        for (std::size_t axis = 0; axis < shape.size(); ++axis)
          for (std::int64_t first = 0; first < shape[axis]; first += 2)
            for (const std::int64_t count : {std::int64_t(0), std::int64_t(1), std::int64_t(3)}) {
              if (first + count > shape[axis]) continue;
              INFO("axis " << axis << " block [" << first << ", " << first + count << ")");
              const NpyArray a = randattn::io::read_npy_block(p, axis, first, count);
              std::vector<std::int64_t> want_shape = shape;
              want_shape[axis] = count;
              CHECK(a.shape == want_shape);
              CHECK(a.values<T>() == c_block(c, shape, axis, first, count));
            }
        if (!fortran) {
          const NpyArray r = randattn::io::read_npy_range(p, 3, 11);
          CHECK(r.shape == std::vector<std::int64_t>{11});
          CHECK(r.values<T>() == std::vector<T>(c.begin() + 3, c.begin() + 14));
        } else {
          try {
            (void)randattn::io::read_npy_range(p, 3, 11);
            FAIL("read a flat range of a Fortran-order file");
          } catch (const NpyError& e) {
            const std::string msg = e.what();
            CHECK(msg.find(p.string() + ": fortran_order=True") == 0);
            CHECK(msg.find("np.ascontiguousarray") != std::string::npos);
            CHECK(msg.find('\n') == std::string::npos);
          }
        }
      }
  }
  // With one axis longer than 1, Fortran and C order coincide: the flat range is readable.
  const std::vector<T> c = ramp<T>(8);
  write_bytes(p, stored_image(c, {1, 8, 1}, true, true));
  CHECK(randattn::io::read_npy_range(p, 2, 5).values<T>() ==
        std::vector<T>(c.begin() + 2, c.begin() + 7));
}

TEST_CASE("npy reader still checks the data size of Fortran-order and big-endian files", "[npy]") {
  TempDir dir;
  const std::vector<double> c = ramp<double>(12);
  for (const bool big : {false, true}) {
    INFO("big-endian " << big);
    const std::string image = stored_image(c, {3, 4}, true, big);
    require_rejected(dir, image.substr(0, image.size() - 1),
                     "truncated data (expected 96 bytes, found 95)");
    require_rejected(dir,
                     npy_image(std::string("{'descr': '") + (big ? ">" : "<") +
                                   "f4', 'fortran_order': True, 'shape': (1000000000, 1000), }",
                               le_payload(c)),
                     "truncated data");
    require_rejected(
        dir,
        npy_image(std::string("{'descr': '") + (big ? ">" : "<") +
                      "f8', 'fortran_order': True, 'shape': (4294967296, 4294967296, 16), }",
                  le_payload(c)),
        "overflows");
    // A stream that cannot tell its size: truncation is found while reading.
    ForwardOnlyBuf buf(image.substr(0, image.size() - 9));
    std::istream forward(&buf);
    CHECK_THROWS_WITH(read_npy(forward, "pipe"),
                      "pipe: truncated data (expected 96 bytes, found 87)");
  }
  // Partial reads of a truncated Fortran-order file fail alike.
  const std::string image = stored_image(c, {3, 4}, true, false);
  write_bytes(dir / "cut.npy", image.substr(0, image.size() - 8));
  CHECK_THROWS_WITH(randattn::io::read_npy_block(dir / "cut.npy", 0, 0, 1),
                    Catch::Contains("truncated data"));
}

TEST_CASE("npy writes are atomic", "[npy]") {
  TempDir dir;
  const std::vector<float> first = ramp<float>(6), second = ramp<float>(12);

  SECTION("replacing an existing file") {
    const fs::path p = dir / "out.npy";
    write_npy(p, first, {2, 3});
    write_npy(p, second, {3, 4});
    const NpyArray a = read_npy(p);
    CHECK(a.shape == std::vector<std::int64_t>{3, 4});
    CHECK(a.values<float>() == second);
    CHECK(dir.entries() == std::vector<std::string>{"out.npy"});
  }
  SECTION("missing directory: error, nothing created") {
    const fs::path p = dir / "no_such_dir" / "out.npy";
    try {
      write_npy(p, first, {2, 3});
      FAIL("no error");
    } catch (const NpyError& e) {
      const std::string msg = e.what();
      CHECK(msg.find(p.string()) == 0);
      CHECK(msg.find('\n') == std::string::npos);
    }
    CHECK(dir.entries().empty());
  }
  SECTION("destination is a directory: error, directory intact, no temporary left") {
    const fs::path p = dir / "taken";
    fs::create_directory(p);
    write_bytes(p / "keep.txt", "x");
    CHECK_THROWS_AS(write_npy(p, first, {2, 3}), NpyError);
    CHECK(fs::is_directory(p));
    CHECK(fs::exists(p / "keep.txt"));
    CHECK(dir.entries() == std::vector<std::string>{"taken"});
  }
  SECTION("data and shape disagree: error, nothing created") {
    CHECK_THROWS_AS(write_npy(dir / "bad.npy", first, {4, 2}), NpyError);
    CHECK_THROWS_AS(write_npy(dir / "bad.npy", first, {-1, 6}), NpyError);
    CHECK(dir.entries().empty());
  }
}
