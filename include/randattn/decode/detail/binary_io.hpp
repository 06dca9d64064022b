#pragma once
// Portable binary files: explicit little-endian, fixed-width fields, and a 64-bit FNV-1a
// checksum of every byte before it, whatever the host's byte order. Used by KvCache::save/load.

#include <cstdint>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../detail/validation.hpp"

namespace randattn::detail {

constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr std::uint64_t kFnvPrime = 0x100000001b3ull;

inline std::uint64_t fnv1a(const unsigned char* p, std::size_t n, std::uint64_t h = kFnvOffset) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

template <typename UInt>
void store_le(unsigned char* b, UInt x) {
  for (std::size_t i = 0; i < sizeof(UInt); ++i) b[i] = static_cast<unsigned char>(x >> (8 * i));
}

template <typename UInt>
UInt load_le(const unsigned char* b) {
  UInt x = 0;
  for (std::size_t i = 0; i < sizeof(UInt); ++i) x |= static_cast<UInt>(b[i]) << (8 * i);
  return x;
}

// Bit pattern of a 16-, 32- or 64-bit value as the unsigned integer of the same width.
template <typename Real>
using bits_of = std::conditional_t<sizeof(Real) == 2, std::uint16_t,
                                   std::conditional_t<sizeof(Real) == 4, std::uint32_t, std::uint64_t>>;

class LittleEndianWriter {
 public:
  LittleEndianWriter(const std::string& path, const char* where)
      : where_(where), path_(path), out_(path, std::ios::binary | std::ios::trunc) {
    // An unwritable path is a bad argument, as for the .npy writers.
    if (!out_) throw randattn::invalid_argument(std::string("randattn::") + where +
                                                ": cannot open '" + path + "' for writing");
  }

  void u8(std::uint8_t x) { put(&x, 1); }
  void u32(std::uint32_t x) { unsigned char b[4]; store_le(b, x); put(b, 4); }
  void u64(std::uint64_t x) { unsigned char b[8]; store_le(b, x); put(b, 8); }
  void f64(double x) { std::uint64_t u; std::memcpy(&u, &x, 8); u64(u); }
  void raw(const void* p, std::size_t n) { put(static_cast<const unsigned char*>(p), n); }

  template <typename Real>
  void reals(const Real* p, std::size_t count) {
    using U = bits_of<Real>;
    unsigned char buf[4096];
    std::size_t used = 0;
    for (std::size_t i = 0; i < count; ++i) {
      U u;
      std::memcpy(&u, p + i, sizeof(U));
      store_le(buf + used, u);
      used += sizeof(U);
      if (used == sizeof(buf)) { put(buf, used); used = 0; }
    }
    if (used) put(buf, used);
  }

  // Appends the checksum of everything written so far and closes the file.
  void finish() {
    unsigned char b[8];
    store_le(b, hash_);
    out_.write(reinterpret_cast<const char*>(b), 8);
    out_.close();
    if (!out_) throw randattn::invalid_argument(std::string("randattn::") + where_ +
                                                ": writing '" + path_ + "' failed");
  }

 private:
  void put(const unsigned char* b, std::size_t n) {
    hash_ = fnv1a(b, n, hash_);
    out_.write(reinterpret_cast<const char*>(b), static_cast<std::streamsize>(n));
  }

  const char* where_;
  std::string path_;
  std::ofstream out_;
  std::uint64_t hash_ = kFnvOffset;
};

// Reads a whole file, checks its trailing checksum, then hands out fields; any read past the
// end throws std::invalid_argument naming the file and the field.
class LittleEndianReader {
 public:
  LittleEndianReader(const std::string& path, const char* where) : where_(where), path_(path) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    require(bool(in), where, "cannot open '", path, "'");
    const std::streamoff size = in.tellg();
    require(size >= 8, where, "'", path, "' is truncated (", size, " bytes)");
    data_.resize(static_cast<std::size_t>(size));
    in.seekg(0);
    in.read(reinterpret_cast<char*>(data_.data()), size);
    require(bool(in), where, "reading '", path, "' failed");
    end_ = data_.size() - 8;
  }

  std::size_t size() const { return data_.size(); }
  std::size_t remaining() const { return end_ - pos_; }

  // The checksum over [0, size − 8) against the stored one.
  bool checksum_ok() const {
    return fnv1a(data_.data(), end_) == load_le<std::uint64_t>(data_.data() + end_);
  }

  const unsigned char* take(std::size_t n, const char* field) {
    require(n <= remaining(), where_, "'", path_, "' is truncated: ", field, " needs ", n,
            " bytes, ", remaining(), " remain");
    const unsigned char* p = data_.data() + pos_;
    pos_ += n;
    return p;
  }
  std::uint8_t u8(const char* f) { return *take(1, f); }
  std::uint32_t u32(const char* f) { return load_le<std::uint32_t>(take(4, f)); }
  std::uint64_t u64(const char* f) { return load_le<std::uint64_t>(take(8, f)); }
  double f64(const char* f) {
    const std::uint64_t u = u64(f);
    double x;
    std::memcpy(&x, &u, 8);
    return x;
  }
  template <typename Real>
  void reals(Real* out, std::size_t count, const char* field) {
    using U = bits_of<Real>;
    require(count <= remaining() / sizeof(U), where_, "'", path_, "' is truncated: ", field,
            " needs ", count * sizeof(U), " bytes, ", remaining(), " remain");
    const unsigned char* p = take(count * sizeof(U), field);
    for (std::size_t i = 0; i < count; ++i) {
      const U u = load_le<U>(p + i * sizeof(U));
      std::memcpy(out + i, &u, sizeof(U));
    }
  }

 private:
  const char* where_;
  std::string path_;
  std::vector<unsigned char> data_;
  std::size_t pos_ = 0, end_ = 0;
};

}  // namespace randattn::detail
