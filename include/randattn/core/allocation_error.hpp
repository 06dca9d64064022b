#pragma once
// The library's out-of-memory error: a std::bad_alloc (so existing handlers and pybind11's
// MemoryError translation keep working) whose message names what was being allocated and about
// how many bytes it needs, instead of the bare "std::bad_alloc".

#include <cstdio>
#include <new>
#include <string>

namespace randattn {

class allocation_error : public std::bad_alloc {
 public:
  allocation_error(const std::string& what_for, double bytes)
      : message_(what_for + ": out of memory: needs about " + byte_text(bytes)) {}
  const char* what() const noexcept override { return message_.c_str(); }

  // "3.2 GB (3200000000 bytes)".
  static std::string byte_text(double bytes) {
    const char* units[] = {"bytes", "kB", "MB", "GB", "TB", "PB", "EB"};
    double x = bytes;
    int u = 0;
    while (x >= 1000 && u < 6) {
      x /= 1000;
      ++u;
    }
    char buf[64];
    if (u == 0)
      std::snprintf(buf, sizeof buf, "%.0f bytes", bytes);
    else
      std::snprintf(buf, sizeof buf, "%.1f %s (%.3g bytes)", x, units[u], bytes);
    return buf;
  }

 private:
  std::string message_;
};

}  // namespace randattn
