// The .npy reader on arbitrary bytes: it either returns a well-formed array or throws NpyError.
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include <randattn/io/npy.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  try {
    const randattn::io::NpyArray a = randattn::io::read_npy(in, "fuzz.npy");
    std::int64_t count = 1;
    for (std::int64_t dim : a.shape) {
      if (dim < 0) std::abort();
      count *= dim;
    }
    if (count != static_cast<std::int64_t>(a.size())) std::abort();
  } catch (const randattn::io::NpyError&) {
  }
  return 0;
}
