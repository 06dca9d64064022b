#pragma once
// Kernels over rows listed by index (a retrieval support in a key/value cache): the dot product
// of each listed row with one query, and the weighted sum of the listed rows. Rows may hold a
// storage type other than the compute type (packet_load.hpp); each packet is converted as it is
// loaded. The rows are read in list order with a software prefetch a few rows ahead, since a
// support is scattered over the cache and each row would otherwise wait one memory latency.
//
// The arithmetic is that of the contiguous kernels (chunk_products.hpp): a dot product is one
// chain of multiply-adds over whole packets in depth order, one horizontal sum, then the depth
// past the last packet; the weighted sum adds one row after the other, each with one multiply-add
// per packet. So a row's contribution does not depend on how the rows around it were listed.

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "chunk_products.hpp"
#include "packet_load.hpp"
#include "unroll.hpp"

namespace randattn::detail {

// Requests the cache lines of row[0, count) into the first-level cache (prefetcht0): with
// requests to the second level (prefetcht2) exact decoding read K and V at 0.49–0.54 of a plain
// read on a Zen 5, with these at 0.56–0.60.
template <typename T>
inline void prefetch_row(const T* row, Index count) {
#if defined(__GNUC__) || defined(__clang__)
  const char* p = reinterpret_cast<const char*>(row);
  const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(count);
  for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
#else
  (void)row;
  (void)count;
#endif
}

namespace gathered {

// Rows ahead of the one being read whose lines are requested.
constexpr Index kPrefetchAhead = 6;

// out[u + r] = row(idx[u + r]) · q for r < R.
template <int R, typename Scalar, typename T>
inline void dots(Scalar* out, const T* base, Index stride, const std::int32_t* idx, const Scalar* q,
                 Index d) {
  using P_t = row_panel::Packet<Scalar>;
  constexpr Index ps = row_panel::packet_size<Scalar>;
  const Index whole = d / ps * ps;
  const T* row[R];
  P_t c[R];
  RANDATTN_UNROLL
  for (int r = 0; r < R; ++r) {
    row[r] = base + Index(idx[r]) * stride;
    c[r] = Eigen::internal::pset1<P_t>(Scalar(0));
  }
  for (Index k = 0; k < whole; k += ps) {
    P_t qk = Eigen::internal::ploadu<P_t>(q + k);
    row_panel::in_register(qk);
    RANDATTN_UNROLL
    for (int r = 0; r < R; ++r)
      c[r] = Eigen::internal::pmadd(load_packet<P_t>(row[r] + k), qk, c[r]);
  }
  RANDATTN_UNROLL
  for (int r = 0; r < R; ++r) {
    Scalar sum = Eigen::internal::predux(c[r]);
    for (Index k = whole; k < d; ++k) sum += widen<Scalar>(row[r][k]) * q[k];
    out[r] = sum;
  }
}

// num[P packets] += Σ_u w[u] · row(idx[u])[P packets] over u in [0, m); base points at the
// panel's first column, and `rest` entries of each row start there (the span prefetched).
template <int P, typename Scalar, typename T>
inline void weighted_panel(Scalar* num, const Scalar* w, const T* base, Index stride,
                           const std::int32_t* idx, Index m, Index rest) {
  using P_t = row_panel::Packet<Scalar>;
  constexpr Index ps = row_panel::packet_size<Scalar>;
  P_t c[P];
  RANDATTN_UNROLL
  for (int p = 0; p < P; ++p) c[p] = Eigen::internal::ploadu<P_t>(num + p * ps);
  for (Index u = 0; u < m; ++u) {
    if (u + kPrefetchAhead < m) prefetch_row(base + Index(idx[u + kPrefetchAhead]) * stride, rest);
    const T* row = base + Index(idx[u]) * stride;
    const P_t wu = Eigen::internal::pset1<P_t>(w[u]);
    RANDATTN_UNROLL
    for (int p = 0; p < P; ++p)
      c[p] = Eigen::internal::pmadd(wu, load_packet<P_t>(row + p * ps), c[p]);
  }
  RANDATTN_UNROLL
  for (int p = 0; p < P; ++p) Eigen::internal::pstoreu(num + p * ps, c[p]);
}

}  // namespace gathered

// out[u] = row(idx[u]) · q for u in [0, m), row(j) = base + j·stride holding d entries of type T.
template <typename Scalar, typename T>
void gathered_dots(Scalar* out, const T* base, Index stride, const std::int32_t* idx, Index m,
                   const Scalar* q, Index d) {
  // Four rows at a time: four independent chains of multiply-adds, one load of q per packet.
  constexpr int R = 4;
  Index u = 0;
  for (; u + R <= m; u += R) {
    RANDATTN_UNROLL
    for (int r = 0; r < R; ++r) {
      if (u + r + gathered::kPrefetchAhead < m)
        prefetch_row(base + Index(idx[u + r + gathered::kPrefetchAhead]) * stride, d);
    }
    gathered::dots<R>(out + u, base, stride, idx + u, q, d);
  }
  for (; u < m; ++u) gathered::dots<1>(out + u, base, stride, idx + u, q, d);
}

// num[0, width) += Σ_u w[u] · row(idx[u]) over u in [0, m), in list order, row(j) = base +
// j·stride holding `width` entries of type T.
template <typename Scalar, typename T>
void gathered_weighted_sum(Scalar* num, const Scalar* w, const T* base, Index stride,
                           const std::int32_t* idx, Index m, Index width) {
  constexpr Index ps = row_panel::packet_size<Scalar>;
  // Eight packets of accumulators cover a head of 128 floats with AVX-512 in one pass over the
  // rows; each packet is used as soon as it is loaded, so 16 registers hold them too.
  Index j = 0;
  for (; j + 8 * ps <= width; j += 8 * ps)
    gathered::weighted_panel<8>(num + j, w, base + j, stride, idx, m, width - j);
  if (j + 4 * ps <= width) {
    gathered::weighted_panel<4>(num + j, w, base + j, stride, idx, m, width - j);
    j += 4 * ps;
  }
  for (; j + ps <= width; j += ps)
    gathered::weighted_panel<1>(num + j, w, base + j, stride, idx, m, width - j);
  for (; j < width; ++j) {  // past the last whole packet: entry by entry, rows in order
    Scalar sum = num[j];
    for (Index u = 0; u < m; ++u) sum += w[u] * widen<Scalar>(base[Index(idx[u]) * stride + j]);
    num[j] = sum;
  }
}

}  // namespace randattn::detail
