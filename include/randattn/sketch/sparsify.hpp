#pragma once
// Entrywise tensor sparsification ("Effective Tensor Sketching via Sparsification", Algorithm 1).
//
// Algorithm 1 (scheme spa: keep large, sample moderate entries proportionally to a^2, sample
// small entries uniformly). For a tensor A with D entries and budget n, entry omega is kept
// independently with probability
//     p_omega = min(1, max(n a_omega^2 / ||A||_F^2, n / D))
// and stored as a_omega / p_omega, so E[A_hat] = A and E[nnz] = sum p_omega <= 2n. Entries with
// |a| >= ||A||_F / sqrt(n) are always kept; those with |a| <= ||A||_F / sqrt(D) are sampled at
// the uniform rate n / D.
//
// Baselines, each with its own parameter c chosen (by bisection on a sorted copy of the squared
// entries: O(D) extra memory) so that its expected nnz equals Algorithm 1's sum p_omega for
// budget n:
//   l2      pure a^2-sampling:  p = min(1, c a^2 / ||A||_F^2);
//   ndt     Nguyen–Drineas–Tran-style: as l2, but entries with
//           |a| < ||A||_F c^{-1/2} D^{-1/4} (ln D^{1/k})^{k/2} are zeroed (never kept). For a cubic
//           tensor this is their threshold s^{-1/2} d^{-k/4} log^{k/2}(d) ||A||_F at budget s = c;
//           rectangular tensors use the geometric-mean dimension D^{1/k}. Biased by construction.
//   uniform p = c (the same rate for every nonzero entry).
// Every scheme is one SamplingRule: p(a) = 0 if |a| < cutoff, else min(1, max(scale a^2, floor)).
//
// Draws (sketch/detail/keep_draws.hpp). Entry omega is kept when u_omega < p_omega for a uniform
// u_omega = (r_omega + v_omega) / 2^16: r_omega is a 16-bit half of a Philox word shared by a
// tile of 256 entries (32 blocks per tile), v_omega
// a 53-bit uniform of its own that is drawn only when r_omega = floor(2^16 p_omega), which
// happens for one entry in 2^16. Entries with p = 1 are kept, and those with p = 0 dropped,
// without looking at a draw; tiles without an entry 0 < p < 1 generate no draw at all.
// Unbiasedness and the expected nnz:
//   P(keep omega) = floor(2^16 p) / 2^16 + P(v < 2^16 p - floor(2^16 p)) / 2^16 = p + delta,
//   0 <= delta < 2^-69 (v's resolution is 2^-53; 2^16 p - floor(2^16 p) is exact in double),
// independently across entries (every r and v is a different Philox output), so
//   E[A_hat_omega] = P(keep) a / p = a (1 + delta / p), E[nnz] = sum P(keep) <= 2n + D 2^-69,
// exact up to a relative 2^-69 / p (a plain 53-bit uniform would be within 2^-53). The tile grid
// is fixed by the flat index, not by the traversal.
//
// Reproducibility. The draws are a pure function of (seed, stream, flat row-major index).
// ||A||_F^2 and sum p are summed in a fixed order (256 lanes by flat index within aligned
// chunks of kSketchChunk entries, then the chunk sums in order; sketch/detail/ordered_sum.hpp), so
// the in-memory call with any thread count and the streamed call with any block sizes return
// the identical sketch, bit for bit.
//
// Exact zeros are never stored (a kept zero would be a zero of A_hat): nnz and the expected
// nnz count nonzero entries only. An empty tensor (a zero dimension) gives an empty sketch.
// Errors (std::invalid_argument): budget not a positive finite number, order < 2, an all-zero
// tensor, a NaN or infinite entry, ||A||_F^2 overflowing double (|a| around 1e154 and above).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "../detail/vector_pool.hpp"
#include "../random/philox.hpp"
#include "detail/keep_draws.hpp"
#include "detail/ordered_sum.hpp"
#include "sparse_tensor.hpp"
#include "tensor_view.hpp"

namespace randattn {

enum class SparsifyScheme { spa, ndt, l2, uniform };

inline const char* scheme_name(SparsifyScheme s) {
  switch (s) {
    case SparsifyScheme::spa:
      return "spa";
    case SparsifyScheme::ndt:
      return "ndt";
    case SparsifyScheme::l2:
      return "l2";
    case SparsifyScheme::uniform:
      return "uniform";
  }
  return "?";
}

// Parses "spa", "ndt", "l2" or "uniform"; throws std::invalid_argument otherwise.
inline SparsifyScheme parse_scheme(const std::string& name) {
  for (SparsifyScheme s :
       {SparsifyScheme::spa, SparsifyScheme::ndt, SparsifyScheme::l2, SparsifyScheme::uniform}) {
    if (name == scheme_name(s)) return s;
  }
  detail::fail("parse_scheme", "unknown sparsification scheme '", name,
               "' (expected spa, ndt, l2 or uniform)");
}

struct SparsifyOptions {
  double budget = 0;  // n > 0: Algorithm 1's sampling parameter
  SparsifyScheme scheme = SparsifyScheme::spa;
  std::uint64_t seed = 0;
  std::uint32_t stream = 0;  // Philox stream of the keep/sample draws
};

// Keep probability of an entry as a function of its value.
struct SamplingRule {
  double scale = 0;   // coefficient of a^2
  double floor = 0;   // lower bound of p for eligible entries
  double cutoff = 0;  // entries with |a| < cutoff are never kept

  // Branch-free, so a loop over a tile of entries vectorises.
  double probability(double a) const {
    const double p = std::min(std::max(scale * (a * a), floor), 1.0);
    return ((a != 0) & (std::abs(a) >= cutoff)) ? p : 0.0;
  }

  // p[t] = probability(a[t]) for t < count; returns whether some 0 < p[t] < 1 (so draws are
  // needed). The same operations as probability(), eight lanes at a time where AVX-512 is on.
  bool probabilities(const double* a, double* p, Index count) const;

  // Keeps every nonzero entry (p = 1).
  static SamplingRule keep_all() { return SamplingRule{0, 1, 0}; }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__)
namespace detail {
// SamplingRule::probability of eight entries at once, in the same operations lane by lane (so
// the vector and scalar paths give the same bits).
struct RuleLanes {
  explicit RuleLanes(const SamplingRule& rule)
      : scale(_mm512_set1_pd(rule.scale)),
        floor(_mm512_set1_pd(rule.floor)),
        // |a| >= c keeps exactly the entries with a != 0 and |a| >= cutoff.
        cutoff(_mm512_set1_pd(rule.cutoff > 0 ? rule.cutoff
                                              : std::numeric_limits<double>::denorm_min())) {}
  // The probabilities of x, 0 in the lanes that are not `eligible` (set here).
  __m512d probability(__m512d x, __mmask8& eligible) const {
    eligible = _mm512_cmp_pd_mask(_mm512_abs_pd(x), cutoff, _CMP_GE_OQ);
    const __m512d q =
        _mm512_min_pd(_mm512_max_pd(_mm512_mul_pd(scale, _mm512_mul_pd(x, x)), floor), one);
    return _mm512_maskz_mov_pd(eligible, q);
  }
  __m512d scale, floor, cutoff, one = _mm512_set1_pd(1);
};
}  // namespace detail
#endif

inline bool SamplingRule::probabilities(const double* a, double* p, Index count) const {
  Index t = 0;
  unsigned moderate = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const detail::RuleLanes lanes(*this);
  for (; t + 8 <= count; t += 8) {
    __mmask8 eligible;
    const __m512d pv = lanes.probability(_mm512_loadu_pd(a + t), eligible);
    _mm512_storeu_pd(p + t, pv);
    moderate |= unsigned(_mm512_cmp_pd_mask(pv, _mm512_setzero_pd(), _CMP_GT_OQ) &
                         _mm512_cmp_pd_mask(pv, lanes.one, _CMP_LT_OQ));
  }
#endif
  for (; t < count; ++t) {
    p[t] = probability(a[t]);
    moderate |= unsigned(p[t] > 0) & unsigned(p[t] < 1);
  }
  return moderate != 0;
}

struct SketchStats {
  SparsifyScheme scheme = SparsifyScheme::spa;
  double budget = 0;
  double frobenius_norm = 0;  // ||A||_F
  double expected_nnz = 0;    // sum of p over the nonzero entries of A
  SamplingRule rule;

  // |a| >= keep_threshold() is always kept (infinite when nothing is certain).
  double keep_threshold() const {
    if (rule.floor >= 1) return rule.cutoff;
    return rule.scale > 0 ? std::max(rule.cutoff, 1 / std::sqrt(rule.scale))
                          : std::numeric_limits<double>::infinity();
  }
  // Entries with cutoff <= |a| <= uniform_threshold() are kept with the uniform rate `floor`.
  double uniform_threshold() const {
    if (rule.floor <= 0) return 0;
    return rule.scale > 0 ? std::sqrt(rule.floor / rule.scale)
                          : std::numeric_limits<double>::infinity();
  }
};

// A sparsified tensor with the parameters that produced it.
template <typename Scalar>
struct SparseSketch : SparseTensor<Scalar> {
  SparseSketch() = default;
  SparseSketch(SparseTensor<Scalar> t, SketchStats s)
      : SparseTensor<Scalar>(std::move(t)), stats(s) {}
  SketchStats stats;
};

namespace detail {

struct Identity {
  double operator()(double x) const { return x; }
};

// Adds term(x) (kSquare: its square, see OrderedSum::add_square) for the entries x = p[t *
// stride] of flat indices flat0 + t, t < len: one at a time up to a multiple of
// OrderedSum::kLanes, then kLanes at a time (vectorised), then the rest.
template <bool kSquare, typename Scalar, typename Term>
void add_terms(OrderedSum& sum, Index flat0, const Scalar* p, Index stride, Index len, Term term) {
  constexpr Index L = OrderedSum::kLanes;
  auto add_one = [&](Index t) {
    const double x = term(double(p[t * stride]));
    kSquare ? sum.add_square(flat0 + t, x) : sum.add(flat0 + t, x);
  };
  Index t = 0;
  for (; t < len && (flat0 + t) % L != 0; ++t) add_one(t);
  if constexpr (kSquare && std::is_same<Term, Identity>::value) {
    if (stride == 1) {  // the common case, without the copy
      for (; t + L <= len; t += L) sum.add_square_lanes(flat0 + t, p + t);
    }
  }
  double x[L];
  for (; t + L <= len; t += L) {
    for (Index l = 0; l < L; ++l) x[l] = term(double(p[(t + l) * stride]));
    kSquare ? sum.add_square_lanes(flat0 + t, x) : sum.add_lanes(flat0 + t, x);
  }
  for (; t < len; ++t) add_one(t);
}

// The sum of term(a) (kSquare: of its squares) over every entry a of the tensor, in the order of
// OrderedSum; chunks in parallel.
template <bool kSquare, typename Scalar, typename Term>
double ordered_sum(const TensorView<Scalar>& a, Term term) {
  const Index chunks = (a.size() + kSketchChunk - 1) / kSketchChunk;
  std::vector<OrderedSum> sums(static_cast<std::size_t>(chunks));
  parallel_for(chunks, [&](Index c) {
    for_each_run(a, c * kSketchChunk, std::min(a.size(), (c + 1) * kSketchChunk),
                 [&](Index flat0, const Scalar* p, Index stride, Index len) {
                   add_terms<kSquare>(sums[std::size_t(c)], flat0, p, stride, len, term);
                 });
  });
  OrderedSum total;
  for (const OrderedSum& s : sums) total.append(s);
  return total.value();
}

// Byte k of kSetBitPositions[m] is the position of the k-th set bit of the byte m (the other
// bytes are zero).
inline constexpr std::array<std::uint64_t, 256> kSetBitPositions = [] {
  std::array<std::uint64_t, 256> table{};
  for (unsigned m = 0; m < 256; ++m) {
    int k = 0;
    for (unsigned b = 0; b < 8; ++b)
      if ((m >> b) & 1u) table[m] |= std::uint64_t(b) << (8 * k++);
  }
  return table;
}();

// The entries kept by one stream of draws: the first `kept` of indices and values. Past them
// the vectors may hold room (make_room) that trim() cuts off.
template <typename Scalar>
struct SampleOutput {
  explicit SampleOutput(const Philox& rng) : draws(rng) {}
  TileDraws draws;
  std::vector<Index> indices;
  std::vector<Scalar> values;
  Index kept = 0;

  // Storage for `capacity` kept entries: the vectors held (a sketch's, handed over for reuse),
  // else vectors from the calling thread's pool.
  void reserve(Index capacity) {
    if (indices.capacity() == 0) indices = VectorPool<Index>::take(std::size_t(capacity));
    if (values.capacity() == 0) values = VectorPool<Scalar>::take(std::size_t(capacity));
    indices.clear();
    values.clear();
    indices.reserve(std::size_t(capacity));
    values.reserve(std::size_t(capacity));
    kept = 0;
  }
  // Gives the storage back to the calling thread's pool.
  void recycle() {
    VectorPool<Index>::give(std::move(indices));
    VectorPool<Scalar>::give(std::move(values));
    indices = {};
    values = {};
    kept = 0;
  }

  // Makes room for `count` entries past the kept ones. Grows by steps within the reserved
  // capacity, so the room is written (zeroed) shortly before it is used.
  void make_room(Index count) {
    if (kept + count <= Index(indices.size())) return;
    constexpr Index kStep = 8192;
    indices.resize(std::size_t(kept + count + kStep));
    values.resize(std::size_t(kept + count + kStep));
  }
  void push(Index omega, Scalar value) {
    make_room(1);
    indices[std::size_t(kept)] = omega;
    values[std::size_t(kept)] = value;
    ++kept;
  }
  void trim() {
    indices.resize(std::size_t(kept));
    values.resize(std::size_t(kept));
  }
};

// Pass 2 over consecutive stretches of entries, a tile of kDrawTile entries (or the part of one
// that a stretch covers) at a time: one probability per entry, then an independent keep
// decision per stream of draws (several sketches in one pass over the data). Accumulates sum p
// and, on request, sum a^2 (which lets the streaming interface check that pass 2 saw the data of
// pass 1).
template <typename Scalar>
class Sampler {
 public:
  Sampler(const SamplingRule& rule, const Philox& rng, const std::vector<std::uint32_t>& streams,
          bool sum_squares)
      : rule_(rule), sum_squares_(sum_squares) {
    for (std::uint32_t s : streams) outputs_.emplace_back(rng.with_stream(s));
  }

  void set_rule(const SamplingRule& rule) { rule_ = rule; }
  double expected_nnz() const { return expected_nnz_.value(); }
  double sum_of_squares() const { return squares_.value(); }
  // The outputs, trimmed to their kept entries.
  std::vector<SampleOutput<Scalar>>& outputs() {
    for (SampleOutput<Scalar>& out : outputs_) out.trim();
    return outputs_;
  }

  void reserve(Index capacity) {
    for (SampleOutput<Scalar>& out : outputs_) out.reserve(capacity);
  }
  // Hands the storage of `sketch` to output i, to be filled by the next reserve() and run()s.
  void adopt(std::size_t i, SparseTensor<Scalar>&& sketch) {
    std::tie(outputs_[i].indices, outputs_[i].values) = std::move(sketch).take_storage();
  }
  // Joins the sampler of the entries that follow this one's, which must end at a chunk end.
  void append(Sampler& next) {
    expected_nnz_.append(next.expected_nnz_);
    squares_.append(next.squares_);
    for (std::size_t i = 0; i < outputs_.size(); ++i) {
      SampleOutput<Scalar>& out = outputs_[i];
      SampleOutput<Scalar>& more = next.outputs_[i];
      out.trim();
      more.trim();
      out.kept += more.kept;
      out.indices.insert(out.indices.end(), more.indices.begin(), more.indices.end());
      out.values.insert(out.values.end(), more.values.begin(), more.values.end());
      more.recycle();
    }
  }

  void run(Index flat0, const Scalar* data, Index stride, Index len) {
    for (Index done = 0; done < len;) {
      const Index omega = flat0 + done, o0 = omega % kDrawTile;
      const Index count = std::min(kDrawTile - o0, len - done);
      sample_tile(omega / kDrawTile, o0, o0 + count, data + done * stride, stride);
      done += count;
    }
  }

 private:
  // Entries o0 <= o < o1 of tile `tile`, the first at `src`.
  void sample_tile(Index tile, Index o0, Index o1, const Scalar* src, Index stride) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    if (o0 == 0 && o1 == kDrawTile && stride == 1) return sample_full_tile(tile, src);
#endif
    const SamplingRule rule = rule_;
    const Index base = tile * kDrawTile;
    const bool full = o0 == 0 && o1 == kDrawTile;
    alignas(64) double a[kDrawTile], p[kDrawTile];
    if (stride == 1) {
      for (Index o = o0; o < o1; ++o) a[o] = double(src[o - o0]);
    } else {
      for (Index o = o0; o < o1; ++o) a[o] = double(src[(o - o0) * stride]);
    }
    const bool draw = rule.probabilities(a + o0, p + o0, o1 - o0);  // some entry has 0 < p < 1
    static_assert(OrderedSum::kLanes == kDrawTile, "a tile is one term per lane");
    if (full) {
      expected_nnz_.add_lanes(base, p);
      if (sum_squares_) squares_.add_square_lanes(base, a);
    } else {
      for (Index o = o0; o < o1; ++o) expected_nnz_.add(base + o, p[o]);
      if (sum_squares_) {
        for (Index o = o0; o < o1; ++o) squares_.add_square(base + o, a[o]);
      }
    }
    for (SampleOutput<Scalar>& out : outputs_) {
      if (draw) out.draws.load(tile);
      std::uint64_t keep_bits[4], tie_bits[4];
      tile_decisions(p, draw ? &out.draws : nullptr, o0, o1, keep_bits, tie_bits);
      for (int w = 0; w < 4; ++w) {
        for (std::uint64_t bits = keep_bits[w] | tie_bits[w]; bits != 0; bits &= bits - 1) {
          const Index o = 64 * w + Index(count_trailing_zeros(bits));
          if ((keep_bits[w] >> (o % 64)) & 1 || keep_tie(p[o], out.draws.fine(base + o)))
            keep(out, base + o, a[o], p[o]);
        }
      }
    }
  }

#if defined(__AVX512F__) && defined(__AVX512DQ__)
  // A whole contiguous tile, sixteen entries at a time with the probabilities in registers: the
  // same arithmetic and decisions as the general path above (tile_decisions, SamplingRule), so
  // the two give identical sketches. The sweep only records which lanes are kept (about one
  // group of sixteen in four keeps something, at random, so packing them group by group would
  // cost more than the decisions); the kept entries are then listed a byte of the mask at a time
  // and their values a / p formed eight at a time. A tile's draws are generated when its first
  // entry with 0 < p < 1 appears.
  void sample_full_tile(Index tile, const Scalar* src) {
    switch (outputs_.size()) {
      case 1:
        return sweep_tile<1>(tile, src, 0, true);
      case 2:
        return sweep_tile<2>(tile, src, 0, true);
      default:
        for (std::size_t i = 0; i < outputs_.size(); ++i) sweep_tile<1>(tile, src, i, i == 0);
    }
  }

  // The sweep of sample_full_tile for the N outputs from outputs_[first] on (the count fixed at
  // compile time, so their decisions stay in registers); sums: add to the expected nnz (and the
  // sum of squares), which one sweep per tile does.
  template <int N>
  void sweep_tile(Index tile, const Scalar* src, std::size_t first, bool sums) {
    const RuleLanes rule(rule_);
    const Index base = tile * kDrawTile;
    const __m512d levels = _mm512_set1_pd(kCoarseLevels);
    const __m512i all = _mm512_set1_epi32(int(kCoarseLevels)), low_half = _mm512_set1_epi32(0xFFFF);
    double* sum_p = expected_nnz_.lanes();
    double* sum_a2 = squares_.lanes();
    const bool squares = sums && sum_squares_;
    SampleOutput<Scalar>* out[N];
    for (int n = 0; n < N; ++n) out[n] = &outputs_[first + std::size_t(n)];
    std::uint64_t keep_bits[N][4] = {}, tie_bits[N][4] = {};
    bool drawn = false;
    for (int w = 0; w < 4; ++w) {
      for (int b = 0; b < 4; ++b) {  // entries 16 g .. 16 g + 15, bits 16 b .. 16 b + 15 of word w
        const int g = 4 * w + b;
        __m512d x[2], q[2];
        __m256i t[2];
        __mmask8 eligible[2];
        for (int h = 0; h < 2; ++h) {
          x[h] = load_lanes(src + 16 * g + 8 * h);
          q[h] = rule.probability(x[h], eligible[h]);
          if (sums) {
            double* lane = sum_p + 16 * g + 8 * h;  // q is +0 where not eligible: adds nothing
            _mm512_storeu_pd(lane, _mm512_add_pd(_mm512_loadu_pd(lane), q[h]));
          }
          if (squares) {
            double* lane2 = sum_a2 + 16 * g + 8 * h;
#if defined(__FMA__) || defined(__FP_FAST_FMA)
            _mm512_storeu_pd(lane2, _mm512_fmadd_pd(x[h], x[h], _mm512_loadu_pd(lane2)));
#else
            _mm512_storeu_pd(lane2,
                             _mm512_add_pd(_mm512_loadu_pd(lane2), _mm512_mul_pd(x[h], x[h])));
#endif
          }
          t[h] = _mm512_cvttpd_epi32(_mm512_mul_pd(q[h], levels));
        }
        const __m512i tt = _mm512_inserti64x4(_mm512_castsi256_si512(t[0]), t[1], 1);
        const __mmask16 e = __mmask16(eligible[0] | (unsigned(eligible[1]) << 8));
        if (!drawn && _mm512_mask_cmplt_epi32_mask(e, tt, all) != 0) {  // some 0 < p < 1
          for (int n = 0; n < N; ++n) out[n]->draws.load(tile);
          drawn = true;
        }
        for (int n = 0; n < N; ++n) {
          __mmask16 keep = e;  // without draws every eligible entry has p = 1
          if (drawn) {
            const __m512i r =
                _mm512_and_si512(_mm512_srli_epi32(_mm512_load_si512(out[n]->draws.group_words(g)),
                                                   unsigned(kCoarseBits * (g % 2))),
                                 low_half);
            keep = _mm512_mask_cmplt_epi32_mask(e, r, tt);
            tie_bits[n][w] |= std::uint64_t(_mm512_mask_cmpeq_epi32_mask(e, r, tt)) << (16 * b);
          }
          keep_bits[n][w] |= std::uint64_t(keep) << (16 * b);
        }
      }
    }
    if (sums) expected_nnz_.lanes_done(base);
    if (squares) squares_.lanes_done(base);
    for (int n = 0; n < N; ++n) keep_tile(*out[n], base, src, rule, keep_bits[n], tie_bits[n]);
  }

  static __m512d load_lanes(const Scalar* src) {
    if constexpr (std::is_same<Scalar, float>::value) {
      return _mm512_cvtps_pd(_mm256_loadu_ps(src));
    } else {
      return _mm512_loadu_pd(src);
    }
  }

  // Adds to `keep` the lanes of `tie` that their fine draws keep (one entry in 2^16 with
  // 0 < p < 1).
  void decide_ties(const SampleOutput<Scalar>& out, Index base, const Scalar* src,
                   const std::uint64_t (&tie)[4], std::uint64_t (&keep)[4]) const {
    for (int w = 0; w < 4; ++w) {
      for (std::uint64_t bits = tie[w]; bits != 0; bits &= bits - 1) {
        const int o = 64 * w + count_trailing_zeros(bits);
        if (keep_tie(rule_.probability(double(src[o])), out.draws.fine(base + o)))
          keep[w] |= std::uint64_t(1) << (o % 64);
      }
    }
  }

  // Appends the tile's kept entries (bit o of keep[o / 64] for offset o, ties still to decide;
  // the tile's entries at src) as keep() does, eight at a time: the same probability, division
  // and rounding, so the two paths store the same bits.
  void keep_tile(SampleOutput<Scalar>& out, Index base, const Scalar* src, const RuleLanes& rule,
                 std::uint64_t (&keep)[4], const std::uint64_t (&tie)[4]) const {
    if ((tie[0] | tie[1] | tie[2] | tie[3]) != 0) decide_ties(out, base, src, tie, keep);
    // The offsets of the kept bits in order, a byte of the mask at a time through a table (no
    // branch per bit: the kept entries fall at random), with room for one more 8-byte store.
    alignas(64) std::uint8_t offset[kDrawTile + 8];
    int count = 0;
    for (int w = 0; w < 4; ++w) {
      for (int b = 0; b < 8; ++b) {
        const unsigned m = unsigned(keep[w] >> (8 * b)) & 0xFFu;
        const std::uint64_t at =
            kSetBitPositions[m] + 0x0101010101010101ull * std::uint64_t(64 * w + 8 * b);
        std::memcpy(offset + count, &at, sizeof at);
        count += int(_mm_popcnt_u32(m));
      }
    }
    if (count == 0) return;
    out.make_room(count);
    Index* index = out.indices.data() + out.kept;
    Scalar* value = out.values.data() + out.kept;
    const __m512d big = _mm512_set1_pd(double(std::numeric_limits<Scalar>::max()));
    const __m512i first = _mm512_set1_epi64(base);
    for (int i = 0; i < count; i += 8) {
      const __mmask8 m = __mmask8(count - i >= 8 ? 0xFF : (1u << (count - i)) - 1);
      const __m512i o =
          _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(offset + i)));
      __m512d a;
      if constexpr (std::is_same<Scalar, float>::value) {
        a = _mm512_cvtps_pd(_mm512_mask_i64gather_ps(_mm256_setzero_ps(), m, o, src, 4));
      } else {
        a = _mm512_mask_i64gather_pd(_mm512_setzero_pd(), m, o, src, 8);
      }
      __mmask8 eligible;
      const __m512d v = _mm512_maskz_div_pd(m, a, rule.probability(a, eligible));
      if constexpr (std::is_same<Scalar, float>::value) {
        // a / p can leave float's range (|a| near its largest value, or a tiny p of a
        // baseline rule): keep() reports the entry.
        const __m256 vf = _mm512_cvtpd_ps(v);
        if (_mm256_mask_cmp_ps_mask(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), vf),
                                    _mm256_set1_ps(std::numeric_limits<float>::max()),
                                    _CMP_LE_OQ) != m)
          return keep_from(out, base, src, offset, count, i);
        _mm256_mask_storeu_ps(value + i, m, vf);
      } else {
        if (_mm512_mask_cmp_pd_mask(m, _mm512_abs_pd(v), big, _CMP_LE_OQ) != m)
          return keep_from(out, base, src, offset, count, i);
        _mm512_mask_storeu_pd(value + i, m, v);
      }
      _mm512_mask_storeu_epi64(index + i, m, _mm512_add_epi64(first, o));
    }
    out.kept += count;
  }

  // Appends the tile's kept entries from the i-th on one at a time (keep() reports the one whose
  // value overflows).
  void keep_from(SampleOutput<Scalar>& out, Index base, const Scalar* src,
                 const std::uint8_t* offset, int count, int i) const {
    out.kept += i;
    for (; i < count; ++i) {
      const double a = double(src[offset[i]]);
      keep(out, base + offset[i], a, rule_.probability(a));
    }
  }
#endif

  static void keep(SampleOutput<Scalar>& out, Index omega, double a, double p) {
    const Scalar value = static_cast<Scalar>(a / p);
    // a / p can leave the scalar type's range when |a| is near its largest value.
    require(std::abs(value) <= std::numeric_limits<Scalar>::max(), "sparsify", "the kept entry ", a,
            " / p = ", a / p, " overflows the scalar type; rescale the tensor");
    out.push(omega, value);
  }

  SamplingRule rule_;
  bool sum_squares_;
  OrderedSum expected_nnz_, squares_;
  std::vector<SampleOutput<Scalar>> outputs_;
};

// Gives the storage of a sketch that is no longer needed to the calling thread's pool.
template <typename Scalar>
void recycle(SparseTensor<Scalar>&& s) {
  auto storage = std::move(s).take_storage();
  VectorPool<Index>::give(std::move(storage.first));
  VectorPool<Scalar>::give(std::move(storage.second));
}

// Room for the kept entries of a sketch with budget n: E[nnz] <= 2n, plus six standard
// deviations (nnz is a sum of independent Bernoulli variables, variance <= E[nnz]). Reserved
// memory that is never written costs no physical pages; a sketch that needs more grows.
inline Index nnz_capacity(double budget) {
  const double bound = 2 * budget + 6 * std::sqrt(2 * budget) + 1024;
  return bound < 1e15 ? Index(bound) : Index(1e15);
}

inline void check_budget(double budget, const char* where) {
  require(std::isfinite(budget) && budget > 0, where,
          "budget must be a positive finite number, got ", budget);
}

// Validates ||A||_F^2 from pass 1; locate(flat) finds the first non-finite entry for the message.
template <typename Locate>
void check_squared_norm(double fro2, const std::vector<Index>& dims, const char* where,
                        Locate&& locate) {
  if (!std::isfinite(fro2)) {
    const Index bad = locate();
    require(bad < 0, where, "the tensor of shape ", dims_str(dims), " has a non-finite entry at ",
            index_str(dims, bad));
    fail(where, "||A||_F^2 overflows double for the tensor of shape ", dims_str(dims),
         "; rescale the input");
  }
  require(fro2 > 0, where, "the tensor of shape ", dims_str(dims),
          " is all zero: there is nothing to sparsify");
}

// Algorithm 1's rule for budget n on D entries with squared norm fro2.
inline SamplingRule spa_rule(double fro2, double budget, Index size) {
  return SamplingRule{budget / fro2, budget / double(size), 0};
}

template <typename Scalar>
class InMemorySparsifier {
 public:
  InMemorySparsifier(const TensorView<Scalar>& a, const SparsifyOptions& opt, const char* where)
      : a_(a), opt_(opt) {
    check_budget(opt.budget, where);
    stats_.scheme = opt.scheme;
    stats_.budget = opt.budget;
    if (a.size() == 0) return;
    const double fro2 = ordered_sum<true>(a, Identity{});
    check_squared_norm(fro2, a.dims(), where, [&] {
      for (Index i = 0; i < a.size(); ++i)
        if (!std::isfinite(a[i])) return i;
      return Index(-1);
    });
    stats_.frobenius_norm = std::sqrt(fro2);
    stats_.rule = spa_rule(fro2, opt.budget, a.size());
    if (opt.scheme != SparsifyScheme::spa) stats_.rule = matched_rule(fro2);
  }

  const SketchStats& stats() const { return stats_; }

  // One sketch per stream of draws (independent sketches with the same rule), in one pass. The
  // tensor is cut into one range of whole chunks per thread; the ranges' outputs are joined in
  // order, so the result does not depend on the thread count. The sketches of `reuse` (one per
  // stream, when given) lend their storage; other storage comes from the calling thread's pool
  // (all of it taken and given back on this thread, so the pool serves the next call).
  std::vector<SparseSketch<Scalar>> sample(
      const std::vector<std::uint32_t>& streams,
      std::vector<SparseSketch<Scalar>>* reuse = nullptr) const {
    SketchStats stats = stats_;
    const Index chunks = (a_.size() + kSketchChunk - 1) / kSketchChunk;
    // One part per thread that will run them (results never depend on the count).
    const Index parts = std::max<Index>(1, std::min(chunks, available_threads()));
    std::vector<Sampler<Scalar>> samplers(
        std::size_t(parts), Sampler<Scalar>(stats.rule, Philox(opt_.seed), streams, false));
    if (reuse != nullptr) {
      for (std::size_t i = 0; i < std::min(reuse->size(), streams.size()); ++i)
        samplers.front().adopt(i, std::move((*reuse)[i]));
    }
    auto range = [&](Index part) {
      return std::make_pair(std::min(a_.size(), part * chunks / parts * kSketchChunk),
                            std::min(a_.size(), (part + 1) * chunks / parts * kSketchChunk));
    };
    for (Index part = 0; part < parts; ++part) {
      const auto [begin, end] = range(part);
      samplers[std::size_t(part)].reserve(std::min(end - begin, nnz_capacity(opt_.budget)));
    }
    parallel_for(parts, [&](Index part) {
      const auto [begin, end] = range(part);
      for_each_run(a_, begin, end, [&](Index flat0, const Scalar* p, Index stride, Index len) {
        samplers[std::size_t(part)].run(flat0, p, stride, len);
      });
    });
    Sampler<Scalar>& first = samplers.front();
    for (Index part = 1; part < parts; ++part) first.append(samplers[std::size_t(part)]);
    stats.expected_nnz = first.expected_nnz();
    std::vector<SparseSketch<Scalar>> sketches;
    for (SampleOutput<Scalar>& out : first.outputs()) {
      sketches.emplace_back(
          SparseTensor<Scalar>(a_.dims(), std::move(out.indices), std::move(out.values)), stats);
    }
    return sketches;
  }

  // The baseline's rule whose sum of p over the nonzero entries equals Algorithm 1's. Its own
  // parameter c (l2, ndt: its budget; uniform: its rate) is found on a sorted copy of the squared
  // entries, where the expected nnz of any c costs two binary searches. The expected nnz is
  // nondecreasing in c and reaches the number of nonzero entries as c -> infinity, which is at
  // least Algorithm 1's sum.
  SamplingRule matched_rule(double fro2) const {
    const SamplingRule spa = stats_.rule;
    const double target = ordered_sum<false>(a_, [&](double x) { return spa.probability(x); });
    std::vector<double> squares;  // of the nonzero entries, decreasing
    for_each_run(a_, 0, a_.size(), [&](Index, const Scalar* p, Index stride, Index len) {
      for (Index t = 0; t < len; ++t) {
        const double x = double(p[t * stride]);
        if (x != 0) squares.push_back(x * x);
      }
    });
    std::sort(squares.begin(), squares.end(), std::greater<double>());
    const Index count = Index(squares.size());
    if (double(count) <= target) return SamplingRule::keep_all();  // so does Algorithm 1
    if (opt_.scheme == SparsifyScheme::uniform) return SamplingRule{0, target / double(count), 0};

    std::vector<double> tail(std::size_t(count) + 1,
                             0.0);  // tail[i] = sum of squares[i..], small first
    for (Index i = count; i-- > 0;)
      tail[std::size_t(i)] = tail[std::size_t(i) + 1] + squares[std::size_t(i)];
    auto at_least = [&](double v) {  // number of squares >= v
      return Index(
          std::partition_point(squares.begin(), squares.end(), [&](double x) { return x >= v; }) -
          squares.begin());
    };
    const double k = double(a_.order()), size = double(a_.size());
    // NDT's cutoff n^{-1/2} D^{-1/4} (ln D^{1/k})^{k/2} ||A||_F, at budget c.
    const double ndt_factor =
        std::sqrt(fro2) * std::pow(size, -0.25) * std::pow(std::log(size) / k, k / 2);
    const bool ndt = opt_.scheme == SparsifyScheme::ndt;
    auto rule = [&](double c) {
      return SamplingRule{c / fro2, 0, ndt ? ndt_factor / std::sqrt(c) : 0};
    };
    auto expected = [&](double c) {  // sum over eligible entries of min(1, c a^2 / fro2)
      const SamplingRule r = rule(c);
      const Index eligible = at_least(r.cutoff * r.cutoff),
                  certain = std::min(eligible, at_least(1 / r.scale));
      return double(certain) + r.scale * (tail[std::size_t(certain)] - tail[std::size_t(eligible)]);
    };
    // c = n never exceeds the target (the baseline's p is at most Algorithm 1's): bracket, then
    // bisect geometrically.
    double lo = opt_.budget, hi = opt_.budget;
    while (expected(hi) < target) {
      lo = hi;
      hi *= 256;
    }
    for (int it = 0; it < 200 && hi > lo * (1 + 1e-15); ++it) {
      const double mid = std::sqrt(lo) * std::sqrt(hi);
      (expected(mid) < target ? lo : hi) = mid;
    }
    return rule(hi);
  }

  TensorView<Scalar> a_;
  SparsifyOptions opt_;
  SketchStats stats_;
};

}  // namespace detail

// Frees the storage the sketches keep for reuse (detail/vector_pool.hpp: kept entries and the
// HOSVD's partial mode products) in the calling thread and, when OpenMP is on, in every thread of a
// team of the current maximum size. Later calls allocate afresh; results do not change.
inline void release_sketch_storage() {
  auto release = [] {
    detail::VectorPool<Index>::release_held();
    detail::VectorPool<std::int32_t>::release_held();
    detail::VectorPool<float>::release_held();
    detail::VectorPool<double>::release_held();
  };
  release();
#if defined(_OPENMP)
#pragma omp parallel if (!omp_in_parallel())
  release();
#endif
}

// Entries per chunk of the ordered sums behind ||A||_F^2 and the expected nnz: each chunk of
// sparsify_chunk_size consecutive flat indices is summed on its own, then the chunk sums are
// added in order, so any split of A at chunk boundaries (threads, streamed blocks, the shards of
// a sharded tensor) gives the same bits.
constexpr Index sparsify_chunk_size = detail::kSketchChunk;

// The arguments of a scheme-spa sparsifier that sees A in parts (streamed blocks, shards): order
// k >= 2, a size that fits, a positive finite budget, scheme spa (`what` names the sparsifier in
// that message). Returns the number of entries D.
inline Index check_spa_arguments(const char* where, const std::vector<Index>& dims,
                                 const SparsifyOptions& opt, const char* what) {
  detail::require(dims.size() >= 2, where, "a tensor of order k >= 2 is needed, got shape ",
                  detail::dims_str(dims));
  const Index size = detail::checked_size(dims, where);
  detail::check_budget(opt.budget, where);
  detail::require(opt.scheme == SparsifyScheme::spa, where, what, " supports scheme spa only, got ",
                  scheme_name(opt.scheme));
  return size;
}

// The sums of squares of the `count` entries p[0..count) of flat indices first, first + 1, ...
// (first a multiple of sparsify_chunk_size), one per chunk, in chunk order, each summed as the
// whole-tensor sum sums it.
template <typename Scalar>
std::vector<double> squared_chunk_sums(Index first, const Scalar* p, Index count) {
  detail::require(first % sparsify_chunk_size == 0 && count >= 0, "squared_chunk_sums", "first (",
                  first, ") must be a multiple of ", sparsify_chunk_size, " and count (", count,
                  ") >= 0");
  const Index chunks = (count + sparsify_chunk_size - 1) / sparsify_chunk_size;
  std::vector<double> sums(static_cast<std::size_t>(chunks), 0.0);
  for (Index c = 0; c < chunks; ++c) {
    detail::OrderedSum s;
    const Index t0 = c * sparsify_chunk_size,
                len = std::min(count, (c + 1) * sparsify_chunk_size) - t0;
    detail::add_terms<true>(s, first + t0, p + t0, 1, len, detail::Identity{});
    sums[static_cast<std::size_t>(c)] = s.value();
  }
  return sums;
}

// Sparsifies a tensor given as anything tensor_view() accepts (TensorView, Eigen::Tensor or
// TensorMap of any order >= 2, a dense Eigen matrix). Parallel over chunks when OpenMP is on;
// the result does not depend on the thread count.
template <typename T>
auto sparsify(const T& tensor, const SparsifyOptions& opt) {
  const auto a = tensor_view(tensor);
  using Scalar = typename std::decay_t<decltype(a)>::Scalar;
  return std::move(
      detail::InMemorySparsifier<Scalar>(a, opt, "sparsify").sample({opt.stream}).front());
}

// sparsify() into `out`, whose storage holds the kept entries (a loop that sparsifies tensor
// after tensor reuses one sketch's memory instead of faulting fresh pages in each time). The
// result is the same, bit for bit. A bad tensor or budget throws before `out` is touched; if
// sampling itself throws (a kept value overflows the scalar type), `out` is left empty.
template <typename T, typename Scalar>
void sparsify_into(const T& tensor, const SparsifyOptions& opt, SparseSketch<Scalar>& out) {
  const auto a = tensor_view(tensor);
  static_assert(std::is_same<typename std::decay_t<decltype(a)>::Scalar, Scalar>::value,
                "sparsify_into: the sketch's scalar type must be the tensor's");
  const detail::InMemorySparsifier<Scalar> sparsifier(a, opt, "sparsify_into");
  std::vector<SparseSketch<Scalar>> reuse;
  reuse.push_back(std::move(out));
  out = SparseSketch<Scalar>();
  out = std::move(sparsifier.sample({opt.stream}, &reuse).front());
}

// Two-pass sparsification of a tensor streamed in blocks (Algorithm 1 only: the baselines need
// more passes to match the expected nnz). Feed the entries in flat row-major order, in
// consecutive blocks of any sizes, twice:
//     StreamingSparsifier<float> s(dims, opt);
//     for (block : data) s.add_norm_block(block.data(), block.size());    // pass 1: ||A||_F
//     for (block : data) s.add_sample_block(block.data(), block.size());  // pass 2: sample
//     SparseSketch<float> sketch = s.finish();
// The result is identical to sparsify(tensor, opt) for the same seed and stream. Memory: the
// sketch (O(nnz)) plus the caller's block. Pass 2 recomputes ||A||_F^2 and finish() throws if
// it differs from pass 1 (the data changed between passes).
template <typename Scalar_>
class StreamingSparsifier {
 public:
  using Scalar = Scalar_;

  StreamingSparsifier(std::vector<Index> dims, const SparsifyOptions& opt)
      : dims_(std::move(dims)),
        opt_(opt),
        sampler_(SamplingRule{}, Philox(opt.seed), {opt.stream}, true) {
    size_ = check_spa_arguments("StreamingSparsifier", dims_, opt, "streaming");
    stats_.scheme = opt.scheme;
    stats_.budget = opt.budget;
    if (size_ == 0) start_sampling();
  }

  Index size() const { return size_; }
  // Entries consumed so far in the current pass.
  Index position() const { return pos_; }
  bool sampling() const { return sampling_; }

  // Pass 1: the next `count` entries in flat row-major order.
  void add_norm_block(const Scalar* block, Index count) {
    check_block(block, count, false, "add_norm_block");
    detail::add_terms<true>(norm_, pos_, block, 1, count, detail::Identity{});
    // A non-finite entry makes the sum non-finite from its block on (so does overflow, after
    // which the blocks are searched until one holds a non-finite entry).
    if (first_bad_ < 0 && !std::isfinite(norm_.value())) {
      for (Index t = 0; t < count && first_bad_ < 0; ++t)
        if (!std::isfinite(block[t])) first_bad_ = pos_ + t;
    }
    pos_ += count;
    if (pos_ == size_) start_sampling();
  }

  // Pass 2: the same entries again, in the same order.
  void add_sample_block(const Scalar* block, Index count) {
    check_block(block, count, true, "add_sample_block");
    sampler_.run(pos_, block, 1, count);
    pos_ += count;
  }

  // The sketch, after both passes are complete.
  SparseSketch<Scalar> finish() {
    const char* where = "StreamingSparsifier::finish";
    detail::require(sampling_ && pos_ == size_, where, "both passes must be complete (",
                    sampling_ ? "pass 2" : "pass 1", " has seen ", pos_, " of ", size_,
                    " entries)");
    stats_.expected_nnz = sampler_.expected_nnz();
    detail::require(sampler_.sum_of_squares() == norm_.value(), where,
                    "pass 2 saw different data than pass 1 (||A||_F^2 = ",
                    sampler_.sum_of_squares(), " vs ", norm_.value(), ")");
    detail::SampleOutput<Scalar>& out = sampler_.outputs().front();
    SparseTensor<Scalar> t(dims_, std::move(out.indices), std::move(out.values));
    return {std::move(t), stats_};
  }

 private:
  void check_block(const Scalar* block, Index count, bool pass2, const char* where) const {
    detail::require(count >= 0 && (count == 0 || block != nullptr), where, "invalid block (", count,
                    " entries at ", static_cast<const void*>(block), ")");
    detail::require(sampling_ == pass2, where,
                    pass2 ? "pass 1 is not complete (" : "pass 1 is complete (", pos_, " of ",
                    size_, " entries seen)");
    detail::require(count <= size_ - pos_, where, "block of ", count, " entries at position ", pos_,
                    " runs past the end of the tensor (", size_, " entries)");
  }

  void start_sampling() {
    sampling_ = true;
    pos_ = 0;
    if (size_ == 0) return;
    const double fro2 = norm_.value();
    detail::check_squared_norm(fro2, dims_, "StreamingSparsifier", [&] { return first_bad_; });
    stats_.frobenius_norm = std::sqrt(fro2);
    stats_.rule = detail::spa_rule(fro2, opt_.budget, size_);
    sampler_.set_rule(stats_.rule);
    sampler_.reserve(std::min(size_, detail::nnz_capacity(opt_.budget)));
  }

  std::vector<Index> dims_;
  SparsifyOptions opt_;
  Index size_ = 0, pos_ = 0, first_bad_ = -1;
  bool sampling_ = false;
  detail::OrderedSum norm_;
  detail::Sampler<Scalar> sampler_;
  SketchStats stats_;
};

}  // namespace randattn
