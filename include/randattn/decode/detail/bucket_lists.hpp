#pragma once
// Many append-only lists of key indices (the buckets of a hash index) in one pool of 8 MiB pages.
//
// A bucket is a chain of chunks of 16, 32, .., 1024 ints, each about as large as the bucket was
// when the chunk was made (so the chain is short, as a vector's doubling would leave it) and
// ending with the address of the next chunk. Chunks are cut from the current page in
// order, so a growing bucket never calls the allocator or copies its entries: with one
// std::vector per bucket, the reallocations of the buckets that outgrew their share took about
// a quarter of an append (n = 32768, 80 tables). The pages are left in 4 KiB pages: advised into
// 2 MiB pages, appends at n = 131072 took 4.7 instead of 3.6 µs per key and kv head on average
// (Zen 5 virtual machine, eight runs each).
//
// Addresses are in 64-byte lines (32 bits: up to 256 GiB of entries); the chunk sizes are a
// function of the bucket's size when each chunk was cut, so a reader walks the chain with
// nothing stored but the first address and the size.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "../../core/allocation_error.hpp"
#include "../../core/types.hpp"

namespace randattn::detail {

class BucketLists {
 public:
  BucketLists() = default;
  explicit BucketLists(std::size_t lists) : heads_(lists) {}

  BucketLists(const BucketLists& other) : heads_(other.heads_), free_line_(other.free_line_) {
    const std::size_t used = free_line_ * kLineInts;
    for (std::size_t p = 0; p < other.pages_.size(); ++p) {
      add_page();
      const std::size_t begin = p * kPageInts;
      if (used > begin)
        std::memcpy(page(p), other.page(p),
                    std::min(kPageInts, used - begin) * sizeof(std::int32_t));
    }
  }
  BucketLists& operator=(const BucketLists& other) {
    if (this != &other) *this = BucketLists(other);
    return *this;
  }
  BucketLists(BucketLists&&) noexcept = default;
  BucketLists& operator=(BucketLists&&) noexcept = default;

  Index size(std::size_t list) const { return heads_[list].size; }

  void push_back(std::size_t list, std::int32_t value) {
    Head& h = heads_[list];
    const std::uint32_t capacity = chunk_ints(h.tail_start) - 1;
    if (h.size == 0 || h.size - h.tail_start == capacity) {
      const std::uint32_t line = cut_chunk(chunk_ints(h.size));
      if (h.size == 0) {
        h.first = line;
      } else {
        *slot(h.tail, capacity) = std::int32_t(line);  // the old tail's link
      }
      h.tail = line;
      h.tail_start = h.size;
    }
    *slot(h.tail, h.size - h.tail_start) = value;
    ++h.size;
  }

  // Requests, for a push_back soon: the bucket's header; its next slot (headers already read).
  void prefetch_head(std::size_t list) const { __builtin_prefetch(&heads_[list], 1); }
  void prefetch_next_slot(std::size_t list) const {
    const Head& h = heads_[list];
    if (h.size > 0) __builtin_prefetch(slot(h.tail, h.size - h.tail_start), 1);
  }

  // A run of consecutive entries of one bucket (one chunk's worth).
  struct Run {
    const std::int32_t* entries;
    Index count;
  };

  // Where a walk along one bucket's chain stands.
  struct Cursor {
    std::uint32_t line, start, size;
  };

  // Appends to `runs` the runs of the buckets list_of(0), .., list_of(count − 1). The chains
  // are walked side by side, one chunk of every bucket per step, so that the reads of the
  // buckets' chunks overlap instead of waiting for one link after another. Each bucket's runs
  // stay in order; the buckets' runs are interleaved.
  template <typename ListOf>
  void collect_runs(Index count, ListOf list_of, std::vector<Run>& runs,
                    std::vector<Cursor>& walking) const {
    walking.clear();
    for (Index i = 0; i < count; ++i) {
      const Head& h = heads_[list_of(i)];
      if (h.size > 0) walking.push_back({h.first, 0, h.size});
    }
    while (!walking.empty()) {
      std::size_t kept = 0;
      for (Cursor c : walking) {
        const std::uint32_t capacity = chunk_ints(c.start) - 1;
        const std::int32_t* entries = slot(c.line, 0);
        const std::uint32_t taken = std::min(capacity, c.size - c.start);
        runs.push_back({entries, Index(taken)});
        c.start += taken;
        if (c.start < c.size) {
          c.line = std::uint32_t(entries[capacity]);
          __builtin_prefetch(slot(c.line, 0));
          walking[kept++] = c;
        }
      }
      walking.resize(kept);
    }
  }

  // Allocates and touches pages for `entries` more entries spread over the buckets, so that
  // pushing them cuts chunks from memory already mapped. A bound, not a promise: a bucket's
  // chunks hold at most twice its entries, plus one chunk of 16 ints per bucket.
  void reserve(std::size_t entries) {
    const std::size_t ints = 2 * entries + kLineInts * heads_.size();
    const std::size_t need =
        (std::size_t(free_line_) * kLineInts + ints + kPageInts - 1) / kPageInts;
    while (pages_.size() < need) {
      add_page();
      std::memset(page(pages_.size() - 1), 0, kPageInts * sizeof(std::int32_t));
    }
  }

  std::size_t bytes() const {
    return heads_.size() * sizeof(Head) + pages_.size() * kPageInts * sizeof(std::int32_t);
  }

 private:
  struct Head {
    std::uint32_t first = 0;       // line of the first chunk
    std::uint32_t tail = 0;        // line of the last chunk
    std::uint32_t size = 0;        // entries
    std::uint32_t tail_start = 0;  // entries before the last chunk
  };
  static_assert(sizeof(Head) == 16);

  static constexpr std::size_t kLineInts = 16;        // 64 bytes
  static constexpr std::size_t kPageInts = 1u << 21;  // 8 MiB
  static constexpr std::uint32_t kMaxChunkInts = 1024;

  // A chunk cut when its bucket holds `size` entries: the power of two just above it, within
  // [16, 1024] ints (one of which links to the next chunk).
  static std::uint32_t chunk_ints(std::uint32_t size) {
    std::uint32_t ints = kLineInts;
    while (ints <= size && ints < kMaxChunkInts) ints *= 2;
    return ints;
  }

  std::int32_t* slot(std::uint32_t line, std::uint32_t i) const {
    const std::size_t at = std::size_t(line) * kLineInts + i;
    return page(at / kPageInts) + at % kPageInts;
  }

  // The line of a fresh chunk of `ints` ints; a chunk never crosses a page (the rest of the page
  // is left unused, at most 1023 ints of 2^21).
  std::uint32_t cut_chunk(std::uint32_t ints) {
    const std::size_t lines = ints / kLineInts, page_lines = kPageInts / kLineInts;
    std::size_t line = free_line_;
    if (line % page_lines + lines > page_lines) line += page_lines - line % page_lines;
    if (line + lines > kMaxLines)
      throw allocation_error("randattn: hash index (more than 2^32 lines of bucket entries)",
                             double(line + lines) * kLineInts * sizeof(std::int32_t));
    while (pages_.size() * page_lines < line + lines) add_page();
    free_line_ = line + lines;
    return std::uint32_t(line);
  }

  void add_page() { pages_.emplace_back(new std::int32_t[kPageInts]); }
  std::int32_t* page(std::size_t p) const { return pages_[p].get(); }

  static constexpr std::size_t kMaxLines = std::size_t(1) << 32;
  std::vector<Head> heads_;
  std::vector<std::unique_ptr<std::int32_t[]>> pages_;
  std::size_t free_line_ = 0;
};

}  // namespace randattn::detail
