#pragma once
// Key layouts of a registered method's call beyond one dense (batch, heads, n, d) grid, for every
// method at once: key padding (per batch item, keys that take no part), packed variable-length
// sequences (offsets along n, each sequence attends within itself) and grouped-query heads (k, v
// with kv_heads dividing heads; query head h reads key head h / (heads / kv_heads)).
//
// A call with a layout runs as sub-calls of the plain method on contiguous pieces of the inputs:
//   - each (batch, query head, sequence) is one slice against its key head's slice (no copy);
//   - bidirectional: all of the slice's queries against its valid keys (a prefix of the keys is
//     read in place; other masks gather the valid keys and values once per key slice);
//   - causal or self-excluding (n_q == n_k): the queries at valid positions attend to the valid
//     keys (the gathered sequence) causally or without their own key, and each run of queries
//     at padded positions attends, bidirectionally, to the valid keys before it (causal) or to
//     all of them;
//   - a query with no valid key gets a zero output row.
// Masked keys are never read, so their values cannot change any output. Every sub-call draws its
// randomness from the call's seed, as a separate call on the piece would: one seed for every
// sequence, head and batch item (random features draw one omega; lsh/lsf draw hashes or filters
// for the piece's key count when their defaults depend on it). Each sub-call thus equals the
// plain method on the cut or gathered inputs bit for bit.
//
// A method added to the registry gets every layout with no code of its own: front ends build jobs
// with build_job(), never Method::build() directly.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "method.hpp"
#include "options.hpp"

namespace randattn::registry {

struct Layout {
  std::int64_t kv_heads = 0;              // heads of k and v; 0: as many as the queries
  std::vector<std::uint8_t> key_padding;  // (batch, n_k) row-major, nonzero = padding; empty: none
  std::vector<std::int64_t> cu_seqlens;   // sequence offsets along n, 0 first and n last

  bool plain(const BatchShape& shape) const {
    return (kv_heads == 0 || kv_heads == shape.heads) && key_padding.empty() && cu_seqlens.empty();
  }
};

// The padding mask of key lengths: key j of batch item b is padding when j >= lengths[b].
inline std::vector<std::uint8_t> padding_of_lengths(const std::vector<std::int64_t>& lengths,
                                                    std::int64_t n_k, const Spelling& spell) {
  std::vector<std::uint8_t> mask;
  mask.reserve(lengths.size() * std::size_t(std::max<std::int64_t>(0, n_k)));
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0 || lengths[b] > n_k)
      throw OptionError(spell.option("key_lengths") + "[" + std::to_string(b) +
                        "] must be in [0, " + std::to_string(n_k) + "] (n_k), got " +
                        std::to_string(lengths[b]));
    for (std::int64_t j = 0; j < n_k; ++j) mask.push_back(j >= lengths[b] ? 1 : 0);
  }
  return mask;
}

// Checks a layout and Settings::exclude_self against the method, the call's query shape
// (shape.heads are the query heads) and settings.
inline void check_layout(const Method& method, const Layout& layout, const BatchShape& shape,
                         const Settings& settings, const Spelling& spell) {
  if (settings.exclude_self) {
    if (!method.supports_exclude_self())
      throw OptionError(spell.method(method.name()) + " does not support " + spell.exclude_self());
    if (shape.n_q != shape.n_k)
      throw OptionError(spell.exclude_self() +
                        " needs queries and keys at the same positions (n_q == n_k), got n_q " +
                        std::to_string(shape.n_q) + " and n_k " + std::to_string(shape.n_k));
  }
  if (layout.kv_heads != 0) {
    if (layout.kv_heads < 1 || shape.heads % layout.kv_heads != 0)
      throw OptionError("key and value heads (" + std::to_string(layout.kv_heads) +
                        ") must divide the query heads (" + std::to_string(shape.heads) + ")");
    if (settings.shared_qk && layout.kv_heads != shape.heads)
      throw OptionError(spell.shared_qk() + " takes its keys from the queries: no grouped heads");
  }
  if (!layout.key_padding.empty()) {
    if (std::int64_t(layout.key_padding.size()) != shape.batch * shape.n_k)
      throw OptionError(spell.option("key_padding_mask") + " must have shape (batch, n_k) = (" +
                        std::to_string(shape.batch) + ", " + std::to_string(shape.n_k) + ")");
    if (settings.shared_qk)
      throw OptionError("key padding and " + spell.shared_qk() +
                        " exclude each other (the keys are the queries)");
    if (!layout.cu_seqlens.empty())
      throw OptionError("key padding and " + spell.option("cu_seqlens") +
                        " exclude each other (packed sequences have no padding)");
  }
  if (!layout.cu_seqlens.empty()) {
    const std::vector<std::int64_t>& c = layout.cu_seqlens;
    const std::string name = spell.option("cu_seqlens");
    if (shape.n_q != shape.n_k)
      throw OptionError(name + " needs as many queries as keys (packed sequences), got n_q " +
                        std::to_string(shape.n_q) + " and n_k " + std::to_string(shape.n_k));
    if (c.size() < 2 || c.front() != 0 || c.back() != shape.n_q)
      throw OptionError(name + " must start at 0 and end at n = " + std::to_string(shape.n_q) +
                        " (at least two offsets)");
    for (std::size_t i = 1; i < c.size(); ++i)
      if (c[i] <= c[i - 1])
        throw OptionError(name + " must be strictly increasing, got " + std::to_string(c[i - 1]) +
                          " then " + std::to_string(c[i]) + " at position " + std::to_string(i));
  }
}

namespace detail {

// One sub-call: rows of queries against rows of keys, by pointers into the inputs or gathered
// buffers; `out` receives n_q rows.
template <typename Scalar>
struct Piece {
  const Scalar* q;
  const Scalar* k;  // null under shared QK
  const Scalar* v;
  Scalar* out;
  Index n_q, n_k;
  bool causal;
  bool exclude_self;  // the queries are the first n_q of the keys' positions
};

// Runs a layout call piece by piece, one plain job per distinct (n_q, n_k, causal,
// exclude_self) and, with per-head array options, per query head.
template <typename Scalar>
class LayoutRunner {
 public:
  LayoutRunner(const Method& method, const Call& call, const Layout& layout)
      : method_(&method), call_(call), layout_(layout) {
    for (const OptionSpec& spec : method.options())
      if (spec.per_head && call.options.given(spec.name) &&
          call.options.array(spec.name).shape.size() == 3)
        per_head_.push_back(spec.name);
  }

  Report operator()(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) {
    const BatchShape& s = call_.shape;
    const Index kv_heads = layout_.kv_heads ? layout_.kv_heads : s.heads;
    const Index group = s.heads / kv_heads;
    std::vector<std::pair<Index, Index>> sequences;  // [begin, end) along n
    if (layout_.cu_seqlens.empty())
      sequences.push_back({0, -1});
    else
      for (std::size_t i = 0; i + 1 < layout_.cu_seqlens.size(); ++i)
        sequences.push_back({layout_.cu_seqlens[i], layout_.cu_seqlens[i + 1]});
    for (Index b = 0; b < s.batch; ++b) {
      const std::uint8_t* padding =
          layout_.key_padding.empty() ? nullptr : layout_.key_padding.data() + b * s.n_k;
      for (Index kh = 0; kh < kv_heads; ++kh) {
        const Index ks = b * kv_heads + kh;  // the key slice
        for (const auto& [begin, end_or_all] : sequences) {
          const bool whole = end_or_all < 0;
          const Index q0 = whole ? 0 : begin, nq = whole ? s.n_q : end_or_all - begin;
          const Index k0 = whole ? 0 : begin, nk = whole ? s.n_k : end_or_all - begin;
          const Scalar* kp = k ? k + (ks * s.n_k + k0) * s.d : nullptr;
          const Scalar* vp = v + (ks * s.n_k + k0) * s.dv;
          const Keys keys = valid_keys(padding, nk, kp, vp);
          for (Index g = 0; g < group; ++g) {
            const Index qs = b * s.heads + kh * group + g;  // the query slice
            head_ = kh * group + g;
            run_slice(q + (qs * s.n_q + q0) * s.d, out + (qs * s.n_q + q0) * s.dv, nq, keys,
                      padding);
          }
        }
      }
    }
    return report();
  }

 private:
  // The valid keys of one key slice: in place when they are a prefix, else gathered.
  struct Keys {
    const Scalar* k;
    const Scalar* v;
    Index count;
    bool prefix;
    std::shared_ptr<std::vector<Scalar>> k_rows, v_rows;  // gathered rows
  };

  Keys valid_keys(const std::uint8_t* padding, Index n_k, const Scalar* k, const Scalar* v) const {
    const BatchShape& s = call_.shape;
    if (!padding) return {k, v, n_k, true, nullptr, nullptr};
    Index count = 0;
    while (count < n_k && !padding[count]) ++count;
    Index valid = count;
    for (Index j = count; j < n_k; ++j) valid += padding[j] ? 0 : 1;
    if (valid == count) return {k, v, count, true, nullptr, nullptr};
    auto kr = std::make_shared<std::vector<Scalar>>(std::size_t(valid * s.d));
    auto vr = std::make_shared<std::vector<Scalar>>(std::size_t(valid * s.dv));
    for (Index j = 0, t = 0; j < n_k; ++j) {
      if (padding[j]) continue;
      std::copy(k + j * s.d, k + (j + 1) * s.d, kr->data() + t * s.d);
      std::copy(v + j * s.dv, v + (j + 1) * s.dv, vr->data() + t * s.dv);
      ++t;
    }
    return {kr->data(), vr->data(), valid, false, kr, vr};
  }

  // One query slice of nq rows against its keys.
  void run_slice(const Scalar* q, Scalar* out, Index nq, const Keys& keys,
                 const std::uint8_t* padding) {
    const BatchShape& s = call_.shape;
    const bool causal = call_.settings.causal, self = call_.settings.exclude_self;
    if (!padding || (!causal && !self)) {
      run({q, keys.k, keys.v, out, nq, keys.count, causal, self});
      return;
    }
    // Queries and keys share positions: the queries at valid positions attend to the valid keys
    // (causally, or excluding their own); a padded position's own key is already masked.
    if (keys.prefix) {  // valid positions [0, L); the rest sees all L keys
      const Index L = keys.count;
      run({q, keys.k, keys.v, out, L, L, causal, self});
      run({q + L * s.d, keys.k, keys.v, out + L * s.dv, nq - L, L, false, false});
      return;
    }
    // Queries at valid positions: gathered, run against the gathered keys, scattered back.
    std::vector<Scalar> q_rows(std::size_t(keys.count * s.d)),
        o_rows(std::size_t(keys.count * s.dv));
    for (Index i = 0, t = 0; i < nq; ++i)
      if (!padding[i]) std::copy(q + i * s.d, q + (i + 1) * s.d, q_rows.data() + (t++) * s.d);
    run({q_rows.data(), keys.k, keys.v, o_rows.data(), keys.count, keys.count, causal, self});
    for (Index i = 0, t = 0; i < nq; ++i)
      if (!padding[i])
        std::copy(o_rows.data() + t * s.dv, o_rows.data() + (t + 1) * s.dv, out + i * s.dv), ++t;
    // Each run of padded positions [a, e) sees the valid keys before a (causal), or all of them.
    Index before = 0;
    for (Index a = 0; a < nq;) {
      if (!padding[a]) {
        ++before, ++a;
        continue;
      }
      Index e = a;
      while (e < nq && padding[e]) ++e;
      run({q + a * s.d, keys.k, keys.v, out + a * s.dv, e - a, causal ? before : keys.count, false,
           false});
      a = e;
    }
  }

  void run(const Piece<Scalar>& p) {
    const BatchShape& s = call_.shape;
    if (p.n_q == 0) return;
    if (p.n_k == 0) {  // no valid key: zeros, documented
      std::fill(p.out, p.out + p.n_q * s.dv, Scalar(0));
      return;
    }
    // Per-head arrays make one job per query head, each with its head's entry.
    const auto key =
        std::make_tuple(p.n_q, p.n_k, p.causal, p.exclude_self, per_head_.empty() ? -1 : head_);
    auto found = jobs_.find(key);
    if (found == jobs_.end()) {
      Call sub = call_;
      sub.shape = BatchShape{1, 1, p.n_q, p.n_k, s.d, s.dv};
      sub.settings.causal = p.causal;
      sub.settings.exclude_self = p.exclude_self;
      sub.settings.compare = false;  // front ends compare the whole call
      for (const std::string& name : per_head_)
        sub.options = sub.options.with(name, head_entry(call_.options.array(name), head_));
      found = jobs_.emplace(key, method_->build(sub, Scalar())).first;
    }
    Report r = found->second(p.q, p.k, p.v, p.out);
    const double pairs = double(p.n_q) * double(p.n_k);
    if (reports_ == 0) first_ = r;
    for (const auto& [name, value] : r)
      if (const double* x = std::get_if<double>(&value)) sums_[name] += pairs * *x;
    weight_ += pairs;
    ++reports_;
  }

  // The first sub-call's fields, real ones averaged over the sub-calls weighted by their
  // (query, key) pairs (so pairs_scored is the fraction of all valid pairs scored).
  Report report() const {
    Report r = first_;
    for (auto& [name, value] : r)
      if (std::holds_alternative<double>(value) && weight_ > 0) value = sums_.at(name) / weight_;
    r.emplace_back("sub_calls", std::int64_t(reports_));
    return r;
  }

  // Entry h of a (heads, r, c) array as an (r, c) array.
  static ArrayValue head_entry(const ArrayValue& a, Index h) {
    ArrayValue e;
    e.shape = {a.shape[1], a.shape[2]};
    const std::size_t size = std::size_t(a.shape[1] * a.shape[2]);
    e.data.assign(a.data.begin() + std::ptrdiff_t(h * Index(size)),
                  a.data.begin() + std::ptrdiff_t((h + 1) * Index(size)));
    e.source = a.source;
    return e;
  }

  const Method* method_;
  Call call_;
  std::vector<std::string> per_head_;  // given per-head array options
  Index head_ = 0;                     // the query head being run
  Layout layout_;
  std::map<std::tuple<Index, Index, bool, bool, Index>, Job<Scalar>> jobs_;
  Report first_;
  std::map<std::string, double> sums_;
  double weight_ = 0;
  std::int64_t reports_ = 0;
};

}  // namespace detail

// The job of `method` for `call` under `layout` (checked with check_layout()): the method's own
// job when the layout is plain, else the sub-calls described above.
template <typename Scalar>
Job<Scalar> build_job(const Method& method, const Call& call, const Layout& layout) {
  if (layout.plain(call.shape)) return method.build(call, Scalar());
  // The whole call's job checks every option against the whole shape before anything runs.
  (void)method.build(call, Scalar());
  return [&method, call, layout](const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) {
    detail::LayoutRunner<Scalar> runner(method, call, layout);
    return runner(q, k, v, out);
  };
}

}  // namespace randattn::registry
