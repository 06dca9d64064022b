#pragma once
// Reading integer and boolean .npy arrays (key lengths, padding masks, sequence offsets) as
// int64: dtypes bool ('|b1'), int8..int64 and uint8..uint64 in either byte order, C or Fortran
// order (Fortran up to 2-D). uint64 values above 2^63 - 1 are refused. Opt-in, as npy.hpp.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "npy.hpp"

namespace randattn::io {

struct NpyIndexArray {
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> data;  // C order
  bool boolean = false;            // stored as bool
};

inline NpyIndexArray read_npy_index(const std::filesystem::path& path) {
  const std::string name = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in)
    detail::fail(name,
                 std::filesystem::exists(path) ? "cannot open file for reading" : "no such file");
  unsigned char prefix[8];
  in.read(reinterpret_cast<char*>(prefix), 8);
  if (in.gcount() != 8 || std::memcmp(prefix, "\x93NUMPY", 6) != 0)
    detail::fail(name, "not a .npy file (bad magic string)");
  const int len_bytes = prefix[6] == 1 ? 2 : 4;
  if (prefix[6] < 1 || prefix[6] > 3 || prefix[7] != 0)
    detail::fail(name, "unsupported .npy format version");
  unsigned char len_buf[4];
  in.read(reinterpret_cast<char*>(len_buf), len_bytes);
  if (in.gcount() != len_bytes) detail::fail(name, "truncated header (missing header length)");
  const std::uint64_t header_len = detail::read_le(len_buf, len_bytes);
  if (header_len > (std::uint64_t{1} << 24)) detail::fail(name, "header length is implausible");
  std::string text(static_cast<std::size_t>(header_len), '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  if (static_cast<std::uint64_t>(in.gcount()) != header_len) detail::fail(name, "truncated header");

  std::string descr;
  bool fortran = false, have_descr = false, have_order = false, have_shape = false;
  NpyIndexArray a;
  for (const auto& [key, value] : detail::HeaderParser(text, name).parse_dict()) {
    if (key == "descr" && value.kind == detail::PyValue::Kind::string) {
      descr = value.str;
      have_descr = true;
    } else if (key == "fortran_order" && value.kind == detail::PyValue::Kind::boolean) {
      fortran = value.boolean;
      have_order = true;
    } else if (key == "shape" && value.kind == detail::PyValue::Kind::sequence) {
      for (const auto& dim : value.items) {
        if (dim.kind != detail::PyValue::Kind::integer)
          detail::fail(name, "unparsable header ('shape' has a non-integer entry)");
        a.shape.push_back(dim.integer);
      }
      have_shape = true;
    } else {
      detail::fail(name, "unparsable header (unexpected or malformed key '" + key + "')");
    }
  }
  if (!have_descr || !have_order || !have_shape) detail::fail(name, "unparsable header");
  const bool ok = descr.size() == 3 &&
                  (descr[0] == '<' || descr[0] == '>' || descr[0] == '|' || descr[0] == '=') &&
                  (descr[1] == 'b' || descr[1] == 'i' || descr[1] == 'u') &&
                  (descr[2] == '1' || descr[2] == '2' || descr[2] == '4' || descr[2] == '8') &&
                  (descr[1] != 'b' || descr[2] == '1');
  if (!ok)
    detail::fail(name, "unsupported dtype '" + detail::excerpt(descr) +
                           "'; expected an integer or boolean array");
  a.boolean = descr[1] == 'b';
  const std::size_t size = std::size_t(descr[2] - '0');
  const bool little = descr[0] == '<' || (descr[0] != '>' && detail::host_is_little_endian());
  if (fortran && a.shape.size() > 2)
    detail::fail(name, "Fortran order is supported up to 2-D here");
  std::uint64_t count = 1;
  for (std::int64_t dim : a.shape) {
    if (dim != 0 && count > (std::uint64_t{1} << 40) / std::uint64_t(dim))
      detail::fail(name, "shape is too large for an index array");
    count *= std::uint64_t(dim);
  }
  std::vector<unsigned char> bytes(static_cast<std::size_t>(count) * size);
  in.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(bytes.size()));
  if (static_cast<std::size_t>(in.gcount()) != bytes.size())
    detail::fail(name, "truncated data (expected " + std::to_string(bytes.size()) + " bytes)");
  std::vector<std::int64_t> values(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::uint64_t u = 0;
    for (std::size_t b = 0; b < size; ++b) {
      const std::size_t at = little ? size - 1 - b : b;  // most significant byte first
      u = (u << 8) | bytes[i * size + at];
    }
    if (descr[1] == 'i' && size < 8 && (u >> (8 * size - 1)))  // sign-extend
      u |= ~std::uint64_t(0) << (8 * size);
    if (descr[1] == 'u' && u > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
      detail::fail(name, "value " + std::to_string(u) + " exceeds the int64 range");
    values[i] = a.boolean ? std::int64_t(u != 0) : static_cast<std::int64_t>(u);
  }
  if (fortran && a.shape.size() == 2) {  // column-major storage: transpose to C order
    const std::int64_t rows = a.shape[0], cols = a.shape[1];
    a.data.resize(values.size());
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j)
        a.data[std::size_t(i * cols + j)] = values[std::size_t(j * rows + i)];
  } else {
    a.data = std::move(values);
  }
  return a;
}

}  // namespace randattn::io
