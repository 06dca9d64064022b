#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdlib>

// Declared in support.hpp (not included here: main.cpp stays free of the library).
namespace testing {
bool allocations_counted();
void start_counting_allocations();
long stop_counting_allocations();
long counted_bytes();
}  // namespace testing

// Heap allocations are counted by replacing malloc, calloc, realloc and the aligned forms with
// glibc's own entry points plus a counter (Eigen allocates through std::malloc, the standard
// library's operator new through malloc). Not under a sanitizer, which owns malloc itself, and
// not off glibc.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define RANDATTN_TEST_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RANDATTN_TEST_SANITIZED 1
#endif

#if defined(__GLIBC__) && !defined(RANDATTN_TEST_SANITIZED)

// Named apart from the test files' own helpers: unity builds compile main.cpp with some of them.
namespace {
std::atomic<bool> heap_counting_on{false};
std::atomic<long> heap_allocations{0};
std::atomic<long> heap_bytes{0};

void count_allocation(std::size_t bytes) {
  if (heap_counting_on.load(std::memory_order_relaxed)) {
    heap_allocations.fetch_add(1, std::memory_order_relaxed);
    heap_bytes.fetch_add(long(bytes), std::memory_order_relaxed);
  }
}

bool valid_alignment(std::size_t alignment) {
  return alignment >= sizeof(void*) && (alignment & (alignment - 1)) == 0;
}
}  // namespace

extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);

void* malloc(std::size_t size) noexcept {
  count_allocation(size);
  return __libc_malloc(size);
}
void* calloc(std::size_t count, std::size_t size) noexcept {
  count_allocation(count * size);
  return __libc_calloc(count, size);
}
void* realloc(void* p, std::size_t size) noexcept {
  count_allocation(size);
  return __libc_realloc(p, size);
}
void* memalign(std::size_t alignment, std::size_t size) noexcept {
  count_allocation(size);
  return __libc_memalign(alignment, size);
}
void* aligned_alloc(std::size_t alignment, std::size_t size) noexcept {
  count_allocation(size);
  return __libc_memalign(alignment, size);
}
int posix_memalign(void** out, std::size_t alignment, std::size_t size) noexcept {
  if (!valid_alignment(alignment)) return EINVAL;
  count_allocation(size);
  void* p = __libc_memalign(alignment, size);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
}

namespace testing {
bool allocations_counted() { return true; }
void start_counting_allocations() {
  heap_allocations.store(0);
  heap_bytes.store(0);
  heap_counting_on.store(true);
}
long stop_counting_allocations() {
  heap_counting_on.store(false);
  return heap_allocations.load();
}
long counted_bytes() { return heap_bytes.load(); }
}  // namespace testing
#else

namespace testing {
bool allocations_counted() { return false; }
void start_counting_allocations() {}
long stop_counting_allocations() { return 0; }
long counted_bytes() { return 0; }
}  // namespace testing
#endif
