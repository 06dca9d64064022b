#pragma once
// Key layouts of a registered method's call beyond one dense (batch, heads, n, d) grid, for every
// method at once: key padding (per batch item, keys that take no part), packed variable-length
// sequences (offsets along n, each sequence attends within itself), grouped-query heads (k, v
// with kv_heads dividing heads; query head h reads key head h / (heads / kv_heads)) and
// self-exclusion.
//
// The layout inputs are declared once (layout_inputs()): each front end offers one argument per
// entry, spelled as it spells options (the Python keyword, the command line's --kebab-case flag),
// converts what it was given to IndexArray values, and hands them to make_layout(), which checks
// them against the call's shape (call_shape()) with messages in the front end's spelling.
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
// plain method on the cut or gathered inputs bit for bit. An array option given per head
// (OptionSpec::head_axis, e.g. a calibration per query head, a learned map per key/value head) is
// cut too: each sub-call gets the entry of its query head, or of the key/value head it reads.
//
// The slices run in parallel (OpenMP, one slice per thread at a time, its sub-calls in order);
// nothing a sub-call computes depends on the thread that runs it or on the other slices, so the
// result is the same bits for every thread count. With fewer slices than threads they run one
// after the other and each sub-call uses the threads itself.
//
// A method added to the registry gets every layout with no code of its own: front ends build jobs
// with build_job(), never Method::build() directly, and differentiable calls with
// build_gradient(), never Method::build_gradient(). A layout's backward runs each piece's own
// backward: a query row's gradient comes from the one piece that read it, and a key's (and its
// value's) gradients are the sum over the pieces and query heads that read it, summed per key
// slice in slice order (the same bits for every thread count); masked keys get zero gradients.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../detail/parallel.hpp"
#include "half_precision.hpp"
#include "method.hpp"
#include "options.hpp"

namespace randattn::registry {

// --- The layout inputs --------------------------------------------------------------------------

enum class LayoutInputType { flag, integers, booleans };

struct LayoutInputSpec {
  std::string name;  // snake_case: the Python keyword; the command line writes --kebab-case
  LayoutInputType type;
  // Arrays: the dimensions, each a name of the call's shape ("batch", "n_k") or free ("S + 1").
  std::vector<std::string> shape;
  std::string help;
};

// Every layout input, in the order front ends list them.
inline const std::vector<LayoutInputSpec>& layout_inputs() {
  static const std::vector<LayoutInputSpec> specs = {
      {"key_lengths", LayoutInputType::integers, {"batch"},
       "keys j >= L[b] of batch item b take no part (0 <= L[b] <= n_k)"},
      {"key_padding_mask", LayoutInputType::booleans, {"batch", "n_k"},
       "true = padding: those keys take no part (as torch.nn.MultiheadAttention)"},
      {"cu_seqlens", LayoutInputType::integers, {"S + 1"},
       "packed sequences [C[s], C[s+1]) along n, each attending within itself (0 first, n last, "
       "strictly increasing)"},
      {"exclude_self", LayoutInputType::flag, {},
       "queries and keys are the same positions: query i never attends to key i unless it has "
       "no other valid key (needs n_q == n_k)"},
  };
  return specs;
}

inline const LayoutInputSpec& layout_input(const std::string& name) {
  for (const LayoutInputSpec& s : layout_inputs())
    if (s.name == name) return s;
  throw std::logic_error("randattn::registry: undeclared layout input '" + name + "'");
}

// "an integer array", "a boolean array", "a flag".
inline const char* layout_type_text(LayoutInputType t) {
  switch (t) {
    case LayoutInputType::flag:
      return "a flag";
    case LayoutInputType::integers:
      return "an integer array";
    case LayoutInputType::booleans:
      return "a boolean array";
  }
  return "?";
}

// "(batch, n_k)".
inline std::string shape_rule(const LayoutInputSpec& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.shape.size(); ++i) out += (i ? ", " : "") + s.shape[i];
  return out + (s.shape.size() == 1 ? ",)" : ")");
}

// The message of a layout array of the wrong type ("got dtype float64", "got a boolean array").
inline std::string layout_type_message(const LayoutInputSpec& s, const std::string& got,
                                       const Spelling& spell) {
  return spell.option(s.name) + " must be " + layout_type_text(s.type) + ", got " + got;
}

// Sets the setting of a flag layout input.
inline void set_layout_flag(Settings& settings, const std::string& name, bool value) {
  if (name != "exclude_self")
    throw std::logic_error("randattn::registry: '" + name + "' is not a flag layout input");
  settings.exclude_self = value;
}

// An integer or boolean array as a front end read it (booleans as 0 and 1), row-major.
struct IndexArray {
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> data;
  bool boolean = false;
};

// --- The call's shape ---------------------------------------------------------------------------

// The shape of a call and its key and value heads.
struct CallShape {
  BatchShape shape;          // shape.heads: the query heads
  std::int64_t kv_heads = 0;  // heads of k and v (4-D separate keys); 0: as many as the queries
};

// Checks the shapes of q, k (null under shared QK: the keys are the queries) and v: 2-D (n, d)
// or 4-D (batch, heads, n, d), with k and v holding kv_heads heads that divide the query heads.
inline CallShape call_shape(const std::vector<std::int64_t>& q, const std::vector<std::int64_t>* k,
                            const std::vector<std::int64_t>& v, const Spelling& spell) {
  using detail::shape_text;
  const std::string nq = spell.option("q"), nk = spell.option("k"), nv = spell.option("v");
  const struct {
    const std::string& name;
    const std::vector<std::int64_t>* shape;
  } inputs[] = {{nq, &q}, {nk, k}, {nv, &v}};
  for (const auto& in : inputs)
    if (in.shape && in.shape->size() != 2 && in.shape->size() != 4)
      throw OptionError(in.name +
                        ": expected a 2-D (n, d) or 4-D (batch, heads, n, d) array, got shape " +
                        shape_text(*in.shape));
  const std::vector<std::int64_t>& kk = k ? *k : q;
  const std::string shapes = "q " + shape_text(q) + (k ? ", k " + shape_text(*k) : "") + ", v " +
                             shape_text(v);
  if (q.size() != kk.size() || q.size() != v.size())
    throw OptionError(nq + ", " + nk + " and " + nv +
                      " must have the same number of dimensions, got " + shapes);
  const std::size_t r = q.size() - 2;  // the token axis
  CallShape c;
  BatchShape& s = c.shape;
  if (r == 2) {
    if (kk[0] != q[0] || v[0] != q[0] || kk[1] != v[1])
      throw OptionError("batch dimensions of " + nq + ", " + nk + " and " + nv +
                        ", or head dimensions of " + nk + " and " + nv + ", differ: " + shapes);
    s.batch = q[0];
    s.heads = q[1];
    if (kk[1] != q[1] && (kk[1] == 0 || q[1] % kk[1] != 0))
      throw OptionError("the heads of " + nk + " and " + nv + " (" + std::to_string(kk[1]) +
                        ") must divide the heads of " + nq + " (" + std::to_string(q[1]) +
                        "): " + shapes);
    if (k) c.kv_heads = kk[1];
  }
  s.n_q = q[r];
  s.d = q[r + 1];
  s.n_k = kk[r];
  s.dv = v[r + 1];
  if (kk[r + 1] != s.d)
    throw OptionError(nq + " and " + nk + " must have the same feature dimension d: " + shapes);
  if (v[r] != s.n_k)
    throw OptionError(nk + " and " + nv + " must have the same number of tokens n_k: " + shapes);
  if (s.d == 0) throw OptionError("feature dimension d must be positive: " + shapes);
  if (s.n_k == 0) throw OptionError("at least one key is needed: " + shapes);
  if (s.dv == 0) throw OptionError("value dimension dv must be positive: " + shapes);
  return c;
}

// --- The layout ---------------------------------------------------------------------------------

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

// The layout of a call from the given layout arrays (by name; a front end refuses other types
// first, in its own way), checked against the method, the call's shape and its settings.
inline Layout make_layout(const Method& method, const std::map<std::string, IndexArray>& given,
                          const CallShape& call, const Settings& settings, const Spelling& spell) {
  const BatchShape& shape = call.shape;
  for (const auto& [name, a] : given) {
    const LayoutInputSpec& spec = layout_input(name);
    if (spec.type == LayoutInputType::flag || a.boolean != (spec.type == LayoutInputType::booleans))
      throw OptionError(layout_type_message(
          spec, a.boolean ? "a boolean array" : "an integer array", spell));
    // The expected shape with the call's dimensions filled in, when every one is known.
    bool match = a.shape.size() == spec.shape.size(), known = true;
    std::vector<std::int64_t> expected;
    for (std::size_t i = 0; i < spec.shape.size(); ++i) {
      const std::string& dim = spec.shape[i];
      const std::int64_t size = dim == "batch" ? shape.batch : dim == "n_k" ? shape.n_k : -1;
      known = known && size >= 0;
      expected.push_back(size);
      match = match && (size < 0 || a.shape[i] == size);
    }
    if (!match)
      throw OptionError(spell.option(name) + " must have shape " + shape_rule(spec) +
                        (known ? " = " + detail::shape_text(expected) : std::string()) +
                        ", got " + detail::shape_text(a.shape));
  }
  const auto find = [&](const char* name) -> const IndexArray* {
    const auto found = given.find(name);
    return found == given.end() ? nullptr : &found->second;
  };
  Layout layout;
  layout.kv_heads = call.kv_heads;
  const IndexArray* lengths = find("key_lengths");
  const IndexArray* mask = find("key_padding_mask");
  const IndexArray* offsets = find("cu_seqlens");
  if (lengths && mask)
    throw OptionError("give at most one of " + spell.option("key_lengths") + " and " +
                      spell.option("key_padding_mask"));
  if (lengths) layout.key_padding = padding_of_lengths(lengths->data, shape.n_k, spell);
  if (mask)
    for (std::int64_t x : mask->data) layout.key_padding.push_back(x != 0 ? 1 : 0);
  if (offsets) layout.cu_seqlens = offsets->data;
  check_layout(method, layout, shape, settings, spell);
  return layout;
}

namespace detail {

// One sub-call of a slice: which of the slice's query rows attend to how many of its valid keys.
struct PiecePlan {
  Index q0 = 0, n_q = 0;  // the slice's query rows [q0, q0 + n_q), unless gathered
  bool gathered = false;  // the queries are the slice's valid (unpadded) positions, in order
  Index n_k = 0;          // the first n_k of the slice's valid keys
  bool causal = false;
  bool exclude_self = false;  // the queries are the first n_q of the keys' positions
};

// The sub-calls of a layout call. Each (batch, query head, sequence) is one slice against its key
// slice (batch, key head, sequence), whose valid keys are read in place when they are a prefix
// and gathered otherwise; a slice runs as the pieces of pieces(), in order.
template <typename Scalar>
class LayoutPlan {
 public:
  // The valid keys of one key slice.
  struct Keys {
    const Scalar* k = nullptr;  // null under shared QK
    const Scalar* v = nullptr;
    Index count = 0;             // valid keys
    Index row0 = 0, rows = 0;    // the key slice's rows [row0, row0 + rows) of the inputs
    std::shared_ptr<std::vector<Scalar>> k_rows, v_rows;  // gathered rows (null: a prefix)
    std::shared_ptr<std::vector<Index>> positions;        // their positions in the key slice
  };

  // One query slice of nq rows against its keys.
  struct Slice {
    Index q_row0;  // its first row of q (and of out)
    Index nq;
    Index keys;    // its key slice
    const std::uint8_t* padding;  // of the slice's batch item; null: none
    Index head;                   // the query head
  };

  // Gathers the valid keys of every key slice (in parallel) and lists the query slices.
  LayoutPlan(const Method& method, const Call& call, const Layout& layout, const Scalar* k,
             const Scalar* v)
      : call_(call), layout_(layout) {
    const BatchShape& s = call.shape;
    const Index kv_heads = layout.kv_heads ? layout.kv_heads : s.heads;
    const Index group = s.heads / kv_heads;
    group_ = group;
    for (const OptionSpec& spec : method.options())
      if (spec.head_axis != HeadAxis::none && call.options.given(spec.name) &&
          call.options.array(spec.name).shape.size() == std::size_t(spec.head_entry_rank) + 1)
        per_head_.push_back({spec.name, spec.head_axis});
    std::vector<std::pair<Index, Index>> sequences;  // [begin, end) along n
    if (layout.cu_seqlens.empty())
      sequences.push_back({0, -1});
    else
      for (std::size_t i = 0; i + 1 < layout.cu_seqlens.size(); ++i)
        sequences.push_back({layout.cu_seqlens[i], layout.cu_seqlens[i + 1]});
    const Index S = Index(sequences.size()), per_batch = kv_heads * S;

    keys_.resize(std::size_t(s.batch * per_batch));
    randattn::detail::parallel_for(Index(keys_.size()), [&](Index ks) {
      const Index b = ks / per_batch, kh = ks % per_batch / S;
      const auto [begin, end_or_all] = sequences[std::size_t(ks % S)];
      const Index k0 = end_or_all < 0 ? 0 : begin, nk = end_or_all < 0 ? s.n_k : end_or_all - begin;
      const Index row = (b * kv_heads + kh) * s.n_k + k0;
      keys_[std::size_t(ks)] = valid_keys(padding_of(b), row, nk, k ? k + row * s.d : nullptr,
                                          v + row * s.dv);
    });
    // In order: batch item, key head, sequence, query head of the group.
    for (Index b = 0; b < s.batch; ++b)
      for (Index kh = 0; kh < kv_heads; ++kh)
        for (Index sq = 0; sq < S; ++sq) {
          const auto [begin, end_or_all] = sequences[std::size_t(sq)];
          const Index q0 = end_or_all < 0 ? 0 : begin;
          const Index nq = end_or_all < 0 ? s.n_q : end_or_all - begin;
          for (Index g = 0; g < group; ++g) {
            const Index qs = b * s.heads + kh * group + g;
            slices_.push_back(
                {qs * s.n_q + q0, nq, b * per_batch + kh * S + sq, padding_of(b), kh * group + g});
          }
        }
  }

  const std::vector<Slice>& slices() const { return slices_; }
  const std::vector<Keys>& keys() const { return keys_; }
  const Keys& keys_of(const Slice& slice) const { return keys_[std::size_t(slice.keys)]; }

  // The pieces of a slice, in order.
  std::vector<PiecePlan> pieces(const Slice& slice) const {
    const bool causal = call_.settings.causal, self = call_.settings.exclude_self;
    const Keys& keys = keys_of(slice);
    const Index nq = slice.nq;
    const std::uint8_t* padding = slice.padding;
    if (!padding || (!causal && !self)) return {{0, nq, false, keys.count, causal, self}};
    // Queries and keys share positions: the queries at valid positions attend to the valid keys
    // (causally, or excluding their own); a padded position's own key is already masked.
    if (!keys.positions) {  // valid positions [0, L); the rest sees all L keys
      const Index L = keys.count;
      return {{0, L, false, L, causal, self}, {L, nq - L, false, L, false, false}};
    }
    std::vector<PiecePlan> out{{0, keys.count, true, keys.count, causal, self}};
    // Each run of padded positions [a, e) sees the valid keys before a (causal), or all of them.
    Index before = 0;
    for (Index a = 0; a < nq;) {
      if (!padding[a]) {
        ++before, ++a;
        continue;
      }
      Index e = a;
      while (e < nq && padding[e]) ++e;
      out.push_back({a, e - a, false, causal ? before : keys.count, false, false});
      a = e;
    }
    return out;
  }

  // The sub-call of a piece of query head `head`: one head, with each per-head option's entry.
  Call sub_call(const PiecePlan& p, Index head) const {
    Call sub = call_;
    sub.shape = BatchShape{1, 1, p.n_q, p.n_k, call_.shape.d, call_.shape.dv};
    sub.kv_heads = 0;
    sub.settings.causal = p.causal;
    sub.settings.exclude_self = p.exclude_self;
    sub.settings.compare = false;  // front ends compare the whole call
    for (const auto& [name, axis] : per_head_)
      sub.options =
          sub.options.with(name, head_entry(call_.options.array(name), entry_of(axis, head)));
    return sub;
  }

  // Whether per-head array options are given (cut per head): one sub-call per query head.
  bool per_head_options() const { return !per_head_.empty(); }
  // The entry of per-head option `name` that query head `head` uses, or -1 when the option is
  // not cut per head (a sub-call's gradient of it then counts for the whole option).
  Index option_entry(const std::string& name, Index head) const {
    for (const auto& [option, axis] : per_head_)
      if (option == name) return entry_of(axis, head);
    return -1;
  }
  const BatchShape& shape() const { return call_.shape; }

  // Copies the rows of a gathered piece (the slice's valid positions) from a slice's rows into
  // `to` (count x cols), or back (scatter).
  void gather(const Slice& slice, const Scalar* from, Index cols, Scalar* to) const {
    for (Index i = 0, t = 0; i < slice.nq; ++i)
      if (!slice.padding[i]) std::copy(from + i * cols, from + (i + 1) * cols, to + (t++) * cols);
  }
  void scatter(const Slice& slice, const Scalar* from, Index cols, Scalar* to) const {
    for (Index i = 0, t = 0; i < slice.nq; ++i)
      if (!slice.padding[i])
        std::copy(from + t * cols, from + (t + 1) * cols, to + i * cols), ++t;
  }

 private:
  const std::uint8_t* padding_of(Index b) const {
    return layout_.key_padding.empty() ? nullptr : layout_.key_padding.data() + b * call_.shape.n_k;
  }

  Keys valid_keys(const std::uint8_t* padding, Index row0, Index n_k, const Scalar* k,
                  const Scalar* v) const {
    const BatchShape& s = call_.shape;
    Keys keys{k, v, n_k, row0, n_k, nullptr, nullptr, nullptr};
    if (!padding) return keys;
    Index count = 0;
    while (count < n_k && !padding[count]) ++count;
    Index valid = count;
    for (Index j = count; j < n_k; ++j) valid += padding[j] ? 0 : 1;
    keys.count = count;
    if (valid == count) return keys;
    keys.count = valid;
    keys.k_rows = k ? std::make_shared<std::vector<Scalar>>(std::size_t(valid * s.d)) : nullptr;
    keys.v_rows = std::make_shared<std::vector<Scalar>>(std::size_t(valid * s.dv));
    keys.positions = std::make_shared<std::vector<Index>>();
    keys.positions->reserve(std::size_t(valid));
    for (Index j = 0; j < n_k; ++j) {
      if (padding[j]) continue;
      const Index t = Index(keys.positions->size());
      if (k) std::copy(k + j * s.d, k + (j + 1) * s.d, keys.k_rows->data() + t * s.d);
      std::copy(v + j * s.dv, v + (j + 1) * s.dv, keys.v_rows->data() + t * s.dv);
      keys.positions->push_back(j);
    }
    keys.k = keys.k_rows ? keys.k_rows->data() : nullptr;
    keys.v = keys.v_rows->data();
    return keys;
  }

  Index entry_of(HeadAxis axis, Index head) const {
    return axis == HeadAxis::kv_heads ? head / group_ : head;
  }

  // Entry h of a (heads, ...) array: its trailing dimensions.
  static ArrayValue head_entry(const ArrayValue& a, Index h) {
    ArrayValue e;
    e.shape.assign(a.shape.begin() + 1, a.shape.end());
    const std::size_t size = a.data.size() / std::size_t(a.shape[0]);
    e.data.assign(a.data.begin() + std::ptrdiff_t(h * Index(size)),
                  a.data.begin() + std::ptrdiff_t((h + 1) * Index(size)));
    e.source = a.source;
    return e;
  }

  Call call_;
  Layout layout_;
  Index group_ = 1;  // query heads per key/value head
  std::vector<std::pair<std::string, HeadAxis>> per_head_;
  std::vector<Keys> keys_;
  std::vector<Slice> slices_;
};

// Runs run_slice(i) for every slice: in parallel when there are at least as many slices as
// threads, else one after the other (each sub-call then uses the threads itself). Rethrows the
// error of the first failing slice, whatever the thread count.
template <typename RunSlice>
void for_each_slice(Index count, RunSlice&& run_slice) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(count));
  const auto guarded = [&](Index i) {
    try {
      run_slice(i);
    } catch (...) {
      errors[std::size_t(i)] = std::current_exception();
    }
  };
  if (count >= randattn::detail::available_threads()) {
    randattn::detail::parallel_for(count, guarded);
  } else {
    for (Index i = 0; i < count && !(i > 0 && errors[std::size_t(i - 1)]); ++i) guarded(i);
  }
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

// The first sub-call's fields, real ones averaged over the sub-calls weighted by their
// (query, key) pairs (so pairs_scored is the fraction of all valid pairs scored).
inline Report merged_reports(const std::vector<std::vector<std::pair<Report, double>>>& reports) {
  Report first;
  std::map<std::string, double> sums;
  double weight = 0;
  std::int64_t count = 0;
  for (const auto& slice : reports)
    for (const auto& [r, pairs] : slice) {
      if (count++ == 0) first = r;
      for (const auto& [name, value] : r)
        if (const double* x = std::get_if<double>(&value)) sums[name] += pairs * *x;
      weight += pairs;
    }
  for (auto& [name, value] : first)
    if (std::holds_alternative<double>(value) && weight > 0) value = sums.at(name) / weight;
  first.emplace_back("sub_calls", count);
  return first;
}

// Runs one piece's forward: its queries in place or gathered, its output rows in place or
// scattered back; a piece with no valid key outputs zeros. run(q, k, v, out) returns the report.
// `q_rows` holds a gathered piece's queries (kept by the caller when a backward needs them).
template <typename Scalar, typename Run>
std::optional<Report> run_piece_forward(const LayoutPlan<Scalar>& plan,
                                        const typename LayoutPlan<Scalar>::Slice& slice,
                                        const PiecePlan& p, const Scalar* q, Scalar* out,
                                        std::vector<Scalar>& q_rows, Run&& run) {
  const BatchShape& s = plan.shape();
  if (p.n_q == 0) return std::nullopt;
  const auto& keys = plan.keys_of(slice);
  const Scalar* slice_q = q + slice.q_row0 * s.d;
  Scalar* slice_out = out + slice.q_row0 * s.dv;
  if (p.n_k == 0) {  // no valid key: zeros, documented
    std::fill(slice_out + p.q0 * s.dv, slice_out + (p.q0 + p.n_q) * s.dv, Scalar(0));
    return std::nullopt;
  }
  if (!p.gathered) return run(slice_q + p.q0 * s.d, keys.k, keys.v, slice_out + p.q0 * s.dv);
  q_rows.resize(std::size_t(p.n_q * s.d));
  plan.gather(slice, slice_q, s.d, q_rows.data());
  std::vector<Scalar> o_rows(std::size_t(p.n_q * s.dv));
  Report r = run(q_rows.data(), keys.k, keys.v, o_rows.data());
  plan.scatter(slice, o_rows.data(), s.dv, slice_out);
  return r;
}

// The job of a layout call: each piece runs the plain job of its (n_q, n_k, causal,
// exclude_self) and, with per-head array options, its query head. The jobs are built first, in
// slice order; the slices then run in parallel, and their reports are merged in slice order.
template <typename Scalar>
class LayoutRunner {
 public:
  LayoutRunner(const Method& method, const Call& call, const Layout& layout)
      : method_(&method), call_(call), layout_(layout) {}

  Report operator()(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) {
    const LayoutPlan<Scalar> plan(*method_, call_, layout_, k, v);
    const bool per_head = plan.per_head_options();
    const auto key_of = [&](const PiecePlan& p, Index head) {
      return std::make_tuple(p.n_q, p.n_k, p.causal, p.exclude_self, per_head ? head : -1);
    };
    const auto& slices = plan.slices();
    // Every job, built before anything runs: the runs below only read the table.
    for (const auto& slice : slices)
      for (const PiecePlan& p : plan.pieces(slice))
        if (p.n_q > 0 && p.n_k > 0 && !jobs_.count(key_of(p, slice.head)))
          jobs_.emplace(key_of(p, slice.head), method_->build(plan.sub_call(p, slice.head), Scalar()));

    std::vector<std::vector<std::pair<Report, double>>> reports(slices.size());
    for_each_slice(Index(slices.size()), [&](Index i) {
      const auto& slice = slices[std::size_t(i)];
      std::vector<Scalar> q_rows;
      for (const PiecePlan& p : plan.pieces(slice)) {
        const Job<Scalar>& job = p.n_q > 0 && p.n_k > 0 ? jobs_.at(key_of(p, slice.head)) : none_;
        std::optional<Report> r = run_piece_forward(
            plan, slice, p, q, out, q_rows,
            [&](const Scalar* pq, const Scalar* pk, const Scalar* pv, Scalar* po) {
              return job(pq, pk, pv, po);
            });
        if (r) reports[std::size_t(i)].emplace_back(std::move(*r), double(p.n_q) * double(p.n_k));
      }
    });
    return merged_reports(reports);
  }

 private:
  const Method* method_;
  Call call_;
  Layout layout_;
  std::map<std::tuple<Index, Index, bool, bool, Index>, Job<Scalar>> jobs_;
  Job<Scalar> none_;
};

// The gradient of a layout call: every piece gets a differentiable sub-call of its own (it keeps
// its forward's state). The backward runs the pieces' backwards slice by slice (in parallel),
// writes each query row's gradient where its forward read it, and sums the key and value
// gradients of every piece that read a key, per key slice in slice order, so the result does
// not depend on the thread count. Masked keys get zero gradients.
template <typename Scalar>
class LayoutGradient final : public Gradient<Scalar> {
 public:
  LayoutGradient(const Method& method, const Call& call, const Layout& layout)
      : method_(&method), call_(call), layout_(layout) {}

  Report forward(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) override {
    plan_.emplace(*method_, call_, layout_, k, v);
    has_keys_ = k != nullptr;
    const auto& slices = plan_->slices();
    pieces_.clear();
    pieces_.resize(slices.size());
    for (std::size_t i = 0; i < slices.size(); ++i)
      for (const PiecePlan& p : plan_->pieces(slices[i])) {
        PieceState state{p, nullptr, {}};
        if (p.n_q > 0 && p.n_k > 0)
          state.gradient = method_->build_gradient(plan_->sub_call(p, slices[i].head), Scalar());
        pieces_[i].push_back(std::move(state));
      }
    std::vector<std::vector<std::pair<Report, double>>> reports(slices.size());
    for_each_slice(Index(slices.size()), [&](Index i) {
      for (PieceState& piece : pieces_[std::size_t(i)]) {
        std::optional<Report> r = run_piece_forward(
            *plan_, slices[std::size_t(i)], piece.plan, q, out, piece.q_rows,
            [&](const Scalar* pq, const Scalar* pk, const Scalar* pv, Scalar* po) {
              return piece.gradient->forward(pq, pk, pv, po);
            });
        if (r)
          reports[std::size_t(i)].emplace_back(std::move(*r),
                                               double(piece.plan.n_q) * double(piece.plan.n_k));
      }
    });
    return merged_reports(reports);
  }

  void backward(const Scalar* grad_out, Scalar* dq, Scalar* dk, Scalar* dv) override {
    if (!plan_) throw std::logic_error("randattn::registry: Gradient::backward() before forward()");
    const BatchShape& s = call_.shape;
    const auto& slices = plan_->slices();
    // Each slice's key and value gradients, over its key slice's valid keys.
    std::vector<std::vector<Scalar>> dk_slice(slices.size()), dv_slice(slices.size());
    for_each_slice(Index(slices.size()), [&](Index i) {
      const auto& slice = slices[std::size_t(i)];
      const Index count = plan_->keys_of(slice).count;
      std::vector<Scalar>& dks = dk_slice[std::size_t(i)];
      std::vector<Scalar>& dvs = dv_slice[std::size_t(i)];
      if (has_keys_) dks.assign(std::size_t(count * s.d), Scalar(0));
      dvs.assign(std::size_t(count * s.dv), Scalar(0));
      const Scalar* go = grad_out + slice.q_row0 * s.dv;
      Scalar* dq_slice = dq + slice.q_row0 * s.d;
      std::vector<Scalar> go_rows, dq_rows, dk_piece, dv_piece;
      for (PieceState& piece : pieces_[std::size_t(i)]) {
        const PiecePlan& p = piece.plan;
        if (p.n_q == 0) continue;
        if (p.n_k == 0) {
          std::fill(dq_slice + p.q0 * s.d, dq_slice + (p.q0 + p.n_q) * s.d, Scalar(0));
          continue;
        }
        const Scalar* piece_go = go + p.q0 * s.dv;
        Scalar* piece_dq = dq_slice + p.q0 * s.d;
        if (p.gathered) {
          go_rows.resize(std::size_t(p.n_q * s.dv));
          dq_rows.resize(std::size_t(p.n_q * s.d));
          plan_->gather(slice, go, s.dv, go_rows.data());
          piece_go = go_rows.data();
          piece_dq = dq_rows.data();
        }
        dk_piece.resize(std::size_t(p.n_k * s.d));
        dv_piece.resize(std::size_t(p.n_k * s.dv));
        piece.gradient->backward(piece_go, piece_dq, has_keys_ ? dk_piece.data() : nullptr,
                                 dv_piece.data());
        if (p.gathered) plan_->scatter(slice, dq_rows.data(), s.d, dq_slice);
        if (has_keys_)
          for (std::size_t t = 0; t < dk_piece.size(); ++t) dks[t] += dk_piece[t];
        for (std::size_t t = 0; t < dv_piece.size(); ++t) dvs[t] += dv_piece[t];
      }
    });
    // Per key slice: zeros, then the sum over its query slices (consecutive, in order).
    const auto& keys = plan_->keys();
    const Index group = Index(slices.size()) / Index(keys.size());
    randattn::detail::parallel_for(Index(keys.size()), [&](Index ks) {
      const auto& key = keys[std::size_t(ks)];
      const auto add = [&](Scalar* grad, Index cols, const std::vector<Scalar>& from) {
        Scalar* rows = grad + key.row0 * cols;
        for (Index t = 0; t < key.count; ++t) {
          Scalar* row = rows + (key.positions ? (*key.positions)[std::size_t(t)] : t) * cols;
          for (Index c = 0; c < cols; ++c) row[c] += from[std::size_t(t * cols + c)];
        }
      };
      if (has_keys_) std::fill(dk + key.row0 * s.d, dk + (key.row0 + key.rows) * s.d, Scalar(0));
      std::fill(dv + key.row0 * s.dv, dv + (key.row0 + key.rows) * s.dv, Scalar(0));
      for (Index g = 0; g < group; ++g) {
        const std::size_t i = std::size_t(ks * group + g);
        if (has_keys_) add(dk, s.d, dk_slice[i]);
        add(dv, s.dv, dv_slice[i]);
      }
    });
  }

  // Sums each option's gradient over the pieces, in slice order. A per-head option's sub-calls
  // each differentiate their head's entry: their gradients are summed into that entry's place of
  // the whole option's gradient (zero for an entry no piece used).
  std::vector<std::pair<std::string, std::vector<double>>> option_gradients() const override {
    std::vector<std::pair<std::string, std::vector<double>>> total;
    if (!plan_) return total;
    const auto& slices = plan_->slices();
    for (std::size_t i = 0; i < pieces_.size(); ++i)
      for (const PieceState& piece : pieces_[i]) {
        if (!piece.gradient) continue;
        for (const auto& option : piece.gradient->option_gradients()) {
          // Named, not a structured binding: C++17 lambdas cannot capture those.
          const std::string& name = option.first;
          const std::vector<double>& g = option.second;
          const Index entry = plan_->option_entry(name, slices[i].head);
          auto found = std::find_if(total.begin(), total.end(),
                                    [&](const auto& e) { return e.first == name; });
          if (found == total.end()) {
            const std::size_t size = entry < 0 ? g.size() : call_.options.array(name).data.size();
            total.emplace_back(name, std::vector<double>(size, 0.0));
            found = std::prev(total.end());
          }
          const std::size_t offset = entry < 0 ? 0 : std::size_t(entry) * g.size();
          for (std::size_t t = 0; t < g.size(); ++t) found->second[offset + t] += g[t];
        }
      }
    return total;
  }

 private:
  struct PieceState {
    PiecePlan plan;
    GradientPtr<Scalar> gradient;  // null for a piece with no queries or no keys
    std::vector<Scalar> q_rows;    // a gathered piece's queries, read by its backward
  };

  const Method* method_;
  Call call_;
  Layout layout_;
  std::optional<LayoutPlan<Scalar>> plan_;
  std::vector<std::vector<PieceState>> pieces_;  // per slice
  bool has_keys_ = true;
};

// The call with the layout's key/value heads, for the checks of the whole call's options.
inline Call whole_call(const Call& call, const Layout& layout) {
  Call whole = call;
  whole.kv_heads = layout.kv_heads;
  return whole;
}

}  // namespace detail

// The job of `method` for `call` under `layout` (checked with check_layout()): the method's own
// job when the layout is plain, else the sub-calls described above. Half-precision Scalar
// (Eigen::half, Eigen::bfloat16): the float32 job of the whole call, its inputs widened and its
// output rounded once (half_precision.hpp).
template <typename Scalar>
Job<Scalar> build_job(const Method& method, const Call& call, const Layout& layout) {
  if constexpr (is_half_precision_v<Scalar>) {
    return detail::half_job<Scalar>(method, call, layout.kv_heads,
                                    build_job<float>(method, call, layout));
  } else {
    if (layout.plain(call.shape)) return method.build(call, Scalar());
    // The whole call's job checks every option against the whole shape before anything runs.
    (void)method.build(detail::whole_call(call, layout), Scalar());
    return [&method, call, layout](const Scalar* q, const Scalar* k, const Scalar* v,
                                   Scalar* out) {
      detail::LayoutRunner<Scalar> runner(method, call, layout);
      return runner(q, k, v, out);
    };
  }
}

// A differentiable call of `method` under `layout` (see Gradient): the method's own when the
// layout is plain, else one per piece as for build_job(); for half-precision Scalar, the float32
// gradient of the whole call, as for build_job().
template <typename Scalar>
GradientPtr<Scalar> build_gradient(const Method& method, const Call& call, const Layout& layout) {
  if constexpr (is_half_precision_v<Scalar>) {
    return std::make_unique<detail::HalfGradient<Scalar>>(
        method, call, layout.kv_heads, build_gradient<float>(method, call, layout));
  } else {
    // Checks every option against the whole shape.
    GradientPtr<Scalar> whole = method.build_gradient(detail::whole_call(call, layout), Scalar());
    if (layout.plain(call.shape)) return whole;
    return std::make_unique<detail::LayoutGradient<Scalar>>(method, call, layout);
  }
}

}  // namespace randattn::registry
