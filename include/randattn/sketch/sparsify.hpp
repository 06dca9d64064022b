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
// Reproducibility. The keep/sample decision of entry omega uses the uniform
// u_omega = Philox(seed, stream) draw number omega (two 53-bit uniforms per Philox block:
// block omega / 2, words 2 (omega % 2) and 2 (omega % 2) + 1), a pure function of
// (seed, stream, flat row-major index). ||A||_F^2 and sum p are summed in a fixed order (in
// order within aligned chunks of kSketchChunk entries, then the chunk sums in order), so the
// in-memory call with any thread count and the streamed call with any block sizes return the
// identical sketch, bit for bit.
//
// Exact zeros are never stored (a kept zero would be a zero of A_hat): nnz and the expected
// nnz count nonzero entries only. An empty tensor (a zero dimension) gives an empty sketch.
// Errors (std::invalid_argument): budget not a positive finite number, order < 2, an all-zero
// tensor, a NaN or infinite entry, ||A||_F^2 overflowing double (|a| around 1e154 and above).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "../random/philox.hpp"
#include "sparse_tensor.hpp"
#include "tensor_view.hpp"

namespace randattn {

enum class SparsifyScheme { spa, ndt, l2, uniform };

inline const char* scheme_name(SparsifyScheme s) {
  switch (s) {
    case SparsifyScheme::spa: return "spa";
    case SparsifyScheme::ndt: return "ndt";
    case SparsifyScheme::l2: return "l2";
    case SparsifyScheme::uniform: return "uniform";
  }
  return "?";
}

// Parses "spa", "ndt", "l2" or "uniform"; throws std::invalid_argument otherwise.
inline SparsifyScheme parse_scheme(const std::string& name) {
  for (SparsifyScheme s : {SparsifyScheme::spa, SparsifyScheme::ndt, SparsifyScheme::l2,
                           SparsifyScheme::uniform}) {
    if (name == scheme_name(s)) return s;
  }
  detail::fail("parse_scheme", "unknown sparsification scheme '", name,
               "' (expected spa, ndt, l2 or uniform)");
}

struct SparsifyOptions {
  double budget = 0;                           // n > 0: Algorithm 1's sampling parameter
  SparsifyScheme scheme = SparsifyScheme::spa;
  std::uint64_t seed = 0;
  std::uint32_t stream = 0;                    // Philox stream of the keep/sample draws
};

// Keep probability of an entry as a function of its value.
struct SamplingRule {
  double scale = 0;   // coefficient of a^2
  double floor = 0;   // lower bound of p for eligible entries
  double cutoff = 0;  // entries with |a| < cutoff are never kept

  // Branch-free, so a loop over a tile of entries vectorises.
  double probability(double a) const {
    const double p = std::min(std::max(scale * (a * a), floor), 1.0);
    return (a != 0 && std::abs(a) >= cutoff) ? p : 0.0;
  }

  // Keeps every nonzero entry (p = 1).
  static SamplingRule keep_all() { return SamplingRule{0, 1, 0}; }
};

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
    return rule.scale > 0 ? std::sqrt(rule.floor / rule.scale) : std::numeric_limits<double>::infinity();
  }
};

// A sparsified tensor with the parameters that produced it.
template <typename Scalar>
struct SparseSketch : SparseTensor<Scalar> {
  SparseSketch() = default;
  SparseSketch(SparseTensor<Scalar> t, SketchStats s) : SparseTensor<Scalar>(std::move(t)), stats(s) {}
  SketchStats stats;
};

namespace detail {

constexpr Index kSketchChunk = Index(1) << 15;

// Sum of a sequence given in flat order, rounded in a fixed way: sequentially inside aligned
// chunks of kSketchChunk terms, then the chunk sums sequentially. Any split of the sequence
// into consecutive pieces, or per-chunk sums combined with add_chunk(), gives the same bits.
class OrderedSum {
 public:
  void add(double x) {
    partial_ += x;
    if (++count_ == kSketchChunk) add_chunk(take_partial());
  }
  // partial += a^2 with one rounding where the target has FMA. Spelling the fused operation
  // out keeps the compiler from fusing some call sites and not others, which would make the
  // in-memory and streamed norms differ in the last bit.
  void add_square(double a) {
#if defined(__FMA__) || defined(__FP_FAST_FMA)
    partial_ = std::fma(a, a, partial_);
    if (++count_ == kSketchChunk) add_chunk(take_partial());
#else
    add(a * a);
#endif
  }
  void add_chunk(double chunk_sum) { total_ += chunk_sum; }
  double value() const { return total_ + partial_; }

 private:
  double take_partial() {
    const double p = partial_;
    partial_ = 0;
    count_ = 0;
    return p;
  }
  double total_ = 0, partial_ = 0;
  Index count_ = 0;
};

// add(sum, a) called on every entry a of the tensor, in the order of OrderedSum; chunks in
// parallel.
template <typename Scalar, typename Add>
double ordered_sum(const TensorView<Scalar>& a, Add add) {
  const Index chunks = (a.size() + kSketchChunk - 1) / kSketchChunk;
  std::vector<double> sums(std::size_t(chunks), 0.0);
  parallel_for(chunks, [&](Index c) {
    OrderedSum s;
    for_each_run(a, c * kSketchChunk, std::min(a.size(), (c + 1) * kSketchChunk),
                 [&](Index, const Scalar* p, Index stride, Index len) {
                   for (Index t = 0; t < len; ++t) add(s, double(p[t * stride]));
                 });
    sums[std::size_t(c)] = s.value();
  });
  OrderedSum total;
  for (double s : sums) total.add_chunk(s);
  return total.value();
}

// The uniforms of entries omega (see the header comment), a tile at a time: the Philox blocks
// of a tile are independent, so computing them in one loop overlaps their latencies.
class EntryUniforms {
 public:
  static constexpr Index kTile = 64;  // entries per tile, even

  explicit EntryUniforms(const Philox& rng) : rng_(rng) {}

  // u[t] = uniform of entry omega0 + t for t < count, 1 <= count <= kTile.
  void fill(Index omega0, Index count, double* u) const {
    const std::uint64_t first = std::uint64_t(omega0) >> 1;
    const std::uint64_t blocks = ((std::uint64_t(omega0 + count - 1)) >> 1) - first + 1;
    std::uint64_t words[kTile + 2];  // two 64-bit words per block
    for (std::uint64_t b = 0; b < blocks; ++b) {
      const Philox::Bits bits = rng_.bits(first + b);
      words[2 * b] = (std::uint64_t(bits[1]) << 32) | bits[0];
      words[2 * b + 1] = (std::uint64_t(bits[3]) << 32) | bits[2];
    }
    const std::uint64_t skip = std::uint64_t(omega0) & 1;  // an odd start uses the second word
    for (Index t = 0; t < count; ++t) u[t] = double(words[skip + std::uint64_t(t)] >> 11) * 0x1.0p-53;
  }

 private:
  Philox rng_;
};

// The entries kept by one stream of draws.
template <typename Scalar>
struct SampleOutput {
  explicit SampleOutput(const Philox& rng) : uniforms(rng) {}
  EntryUniforms uniforms;
  std::vector<Index> indices;
  std::vector<Scalar> values;
};

// Pass 2 over consecutive stretches of entries: one probability per entry, then an independent
// keep decision per stream of draws (several sketches in one pass over the data). Accumulates
// sum p and, on request, sum a^2 (which lets the streaming interface check that pass 2 saw the
// data of pass 1).
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
  std::vector<SampleOutput<Scalar>>& outputs() { return outputs_; }

  void run(Index flat0, const Scalar* data, Index stride, Index len) {
    constexpr Index kTile = EntryUniforms::kTile;
    const SamplingRule rule = rule_;
    // Local copies of the sums: the pushes below could alias members, which would keep the sums
    // in memory instead of registers.
    OrderedSum sum_p = expected_nnz_, sum_a2 = squares_;
    double a[kTile], p[kTile], u[kTile];
    bool keep[kTile];
    for (Index t0 = 0; t0 < len; t0 += kTile) {
      const Index tile = std::min(kTile, len - t0);
      for (Index t = 0; t < tile; ++t) a[t] = double(data[(t0 + t) * stride]);
      for (Index t = 0; t < tile; ++t) p[t] = rule.probability(a[t]);
      for (Index t = 0; t < tile; ++t) sum_p.add(p[t]);
      if (sum_squares_) {
        for (Index t = 0; t < tile; ++t) sum_a2.add_square(a[t]);
      }
      const Index omega0 = flat0 + t0;
      for (SampleOutput<Scalar>& out : outputs_) {
        out.uniforms.fill(omega0, tile, u);
        // u < 1 always, so p = 1 keeps and p = 0 drops without a separate test.
        for (Index t = 0; t < tile; ++t) keep[t] = u[t] < p[t];
        for (Index t = 0; t < tile; ++t) {
          if (keep[t]) {
            const Scalar value = static_cast<Scalar>(a[t] / p[t]);
            // a / p can leave the scalar type's range when |a| is near its largest value.
            require(std::abs(value) <= std::numeric_limits<Scalar>::max(), "sparsify",
                    "the kept entry ", a[t], " / p = ", a[t] / p[t],
                    " overflows the scalar type; rescale the tensor");
            out.indices.push_back(omega0 + t);
            out.values.push_back(value);
          }
        }
      }
    }
    expected_nnz_ = sum_p;
    squares_ = sum_a2;
  }

 private:
  SamplingRule rule_;
  bool sum_squares_;
  OrderedSum expected_nnz_, squares_;
  std::vector<SampleOutput<Scalar>> outputs_;
};

inline void check_budget(double budget, const char* where) {
  require(std::isfinite(budget) && budget > 0, where, "budget must be a positive finite number, got ",
          budget);
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
    const double fro2 = ordered_sum(a, [](OrderedSum& s, double x) { s.add_square(x); });
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

  // One sketch per stream of draws (independent sketches with the same rule), in one pass.
  std::vector<SparseSketch<Scalar>> sample(const std::vector<std::uint32_t>& streams) const {
    SketchStats stats = stats_;
    const Philox rng(opt_.seed);
    const Index chunks = (a_.size() + kSketchChunk - 1) / kSketchChunk;
    std::vector<Sampler<Scalar>> parts(std::size_t(chunks), Sampler<Scalar>(stats.rule, rng, streams, false));
    parallel_for(chunks, [&](Index c) {
      Sampler<Scalar>& s = parts[std::size_t(c)];
      for_each_run(a_, c * kSketchChunk, std::min(a_.size(), (c + 1) * kSketchChunk),
                   [&](Index flat0, const Scalar* p, Index stride, Index len) { s.run(flat0, p, stride, len); });
    });
    OrderedSum expected;
    for (const auto& s : parts) expected.add_chunk(s.expected_nnz());
    stats.expected_nnz = expected.value();
    std::vector<SparseSketch<Scalar>> sketches;
    for (std::size_t i = 0; i < streams.size(); ++i) {
      std::size_t nnz = 0;
      for (auto& s : parts) nnz += s.outputs()[i].indices.size();
      std::vector<Index> indices;
      std::vector<Scalar> values;
      indices.reserve(nnz);
      values.reserve(nnz);
      for (auto& s : parts) {
        SampleOutput<Scalar>& out = s.outputs()[i];
        indices.insert(indices.end(), out.indices.begin(), out.indices.end());
        values.insert(values.end(), out.values.begin(), out.values.end());
        out.indices = {};  // release memory early
        out.values = {};
      }
      sketches.emplace_back(SparseTensor<Scalar>(a_.dims(), std::move(indices), std::move(values)), stats);
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
    const double target = ordered_sum(a_, [&](OrderedSum& s, double x) { s.add(spa.probability(x)); });
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

    std::vector<double> tail(std::size_t(count) + 1, 0.0);  // tail[i] = sum of squares[i..], small first
    for (Index i = count; i-- > 0;) tail[std::size_t(i)] = tail[std::size_t(i) + 1] + squares[std::size_t(i)];
    auto at_least = [&](double v) {  // number of squares >= v
      return Index(std::partition_point(squares.begin(), squares.end(), [&](double x) { return x >= v; }) -
                   squares.begin());
    };
    const double k = double(a_.order()), size = double(a_.size());
    // NDT's cutoff n^{-1/2} D^{-1/4} (ln D^{1/k})^{k/2} ||A||_F, at budget c.
    const double ndt_factor = std::sqrt(fro2) * std::pow(size, -0.25) * std::pow(std::log(size) / k, k / 2);
    const bool ndt = opt_.scheme == SparsifyScheme::ndt;
    auto rule = [&](double c) { return SamplingRule{c / fro2, 0, ndt ? ndt_factor / std::sqrt(c) : 0}; };
    auto expected = [&](double c) {  // sum over eligible entries of min(1, c a^2 / fro2)
      const SamplingRule r = rule(c);
      const Index eligible = at_least(r.cutoff * r.cutoff), certain = std::min(eligible, at_least(1 / r.scale));
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

// Sparsifies a tensor given as anything tensor_view() accepts (TensorView, Eigen::Tensor or
// TensorMap of any order >= 2, a dense Eigen matrix). Parallel over chunks when OpenMP is on;
// the result does not depend on the thread count.
template <typename T>
auto sparsify(const T& tensor, const SparsifyOptions& opt) {
  const auto a = tensor_view(tensor);
  using Scalar = typename std::decay_t<decltype(a)>::Scalar;
  return std::move(detail::InMemorySparsifier<Scalar>(a, opt, "sparsify").sample({opt.stream}).front());
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
      : dims_(std::move(dims)), opt_(opt), sampler_(SamplingRule{}, Philox(opt.seed), {opt.stream}, true) {
    const char* where = "StreamingSparsifier";
    detail::require(dims_.size() >= 2, where, "a tensor of order k >= 2 is needed, got shape ",
                    detail::dims_str(dims_));
    size_ = detail::checked_size(dims_, where);
    detail::check_budget(opt.budget, where);
    detail::require(opt.scheme == SparsifyScheme::spa, where,
                    "streaming supports scheme spa only, got ", scheme_name(opt.scheme));
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
    for (Index t = 0; t < count; ++t) {
      const double a = double(block[t]);
      if (first_bad_ < 0 && !std::isfinite(a)) first_bad_ = pos_ + t;
      norm_.add_square(a);
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
                    sampling_ ? "pass 2" : "pass 1", " has seen ", pos_, " of ", size_, " entries)");
    stats_.expected_nnz = sampler_.expected_nnz();
    detail::require(sampler_.sum_of_squares() == norm_.value(), where,
                    "pass 2 saw different data than pass 1 (||A||_F^2 = ", sampler_.sum_of_squares(),
                    " vs ", norm_.value(), ")");
    detail::SampleOutput<Scalar>& out = sampler_.outputs().front();
    SparseTensor<Scalar> t(dims_, std::move(out.indices), std::move(out.values));
    return {std::move(t), stats_};
  }

 private:
  void check_block(const Scalar* block, Index count, bool pass2, const char* where) const {
    detail::require(count >= 0 && (count == 0 || block != nullptr), where, "invalid block (",
                    count, " entries at ", static_cast<const void*>(block), ")");
    detail::require(sampling_ == pass2, where, pass2 ? "pass 1 is not complete (" : "pass 1 is complete (",
                    pos_, " of ", size_, " entries seen)");
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
