#pragma once
// Decoding over a key/value cache: one new token's queries attend to the n cached keys of one
// layer, exactly where it matters (attention sinks and a recent window, Xiao et al., "Efficient
// Streaming Language Models with Attention Sinks", arXiv 2309.17453) and by sublinear retrieval
// for the rest: Quest page bounds (arXiv 2406.10774), MagicPIG SimHash sampling with
// importance weights (arXiv 2410.16179) or locality-sensitive filters (Christiani, SODA 2017).
// See decode_options.hpp for the modes and options.
//
// Layout. A cache holds `kv_heads` key/value heads of head_dim (d) and value_dim (dv) columns.
//   append(k, v): k is (kv_heads·t) x d and v is (kv_heads·t) x dv, row-major, rows ordered
//     head-major: rows [h·t, (h + 1)·t) are the t new tokens of kv head h, oldest first.
//     t = 1 appends one token; t = 0 does nothing.
//   attend(q): q is q_heads x d, q_heads a positive multiple of kv_heads; query head i uses kv
//     head i / (q_heads / kv_heads) (grouped-query attention; the cache is never copied).
//     Returns q_heads x dv: softmax(scale · q_i·K_hᵀ) V_h, exactly (exact mode) or over the
//     exact part plus the retrieved keys.
//
// Every part of a query head's result (sinks + window tiles, retrieved keys) is an unnormalised
// (num, den, log-scale) triple merged by the online-softmax rule of SoftmaxAccumulator.
//
// Cost. append: O(d + dv) per token and kv head, plus O(d) for the page min/max (blocks),
// O(clusters·d) for the nearest centroid of the key leaving the window (clusters),
// O(L·K·d) for the hash codes (lsh_sample: one block of lsh_hash_block keys per matrix product,
// when the block fills) or O(L·m·d) for the filters (lsf); storage grows by amortised doubling
// and no index is ever rebuilt. Memory: n·(d + dv) stored entries per kv head (4 or 8 bytes,
// 2 for bfloat16/float16, 1 for int8 plus two scales per token; options.storage), plus
// 2·d·n/P (blocks), n·L bucket entries of 4 bytes and L·2^K bucket headers (lsh_sample), or
// n·L entries and L·m headers (lsf).
// attend: exact O(n·(d + dv)) per query head, every key and value row read once per kv head; blocks
// O(n/P·d + top_pages·P·(d + dv)); lsh_sample O(L·K·d + bucket entries + sampled·(d + dv));
// lsf O(L·m·d + n/64 + found·(d + dv)); plus the exact part (sinks + window).
//
// Threads. attend() is const and keeps no mutable state (its scratch is local to the call), so
// any number of threads may attend to one cache at once; append/save/load are not to be run
// concurrently with anything else on the same cache.
//
// Edge behaviour.
//   n = 0: attend throws std::invalid_argument (attention over no keys is undefined).
//   n = 1, or n ≤ sinks + window: every key is in the exact part; retrieval modes equal exact.
//   Retrieval candidates are the keys in [sinks, n − window). blocks: if at most top_pages pages
//     intersect that range, all are attended and the result equals exact decoding up to
//     rounding. lsh_sample: a key whose inclusion probability underflows is weighted as if
//     p = 1e-300; with lsh_bits = 0 every key collides (p = 1) and the result is exact.
//     lsf: with lsf_threshold = −inf every filter opens and the result is exact.
//   A query head with no key scored (sinks = window = 0 and nothing retrieved) outputs a zero
//     row, counted in DecodeReport::empty_heads.
//   lsh_sample hashes keys in blocks [0, B), [B, 2B), ... (B = lsh_hash_block), each once it
//     is full; the keys of the open block (at most B − 1, the newest) join the exact tail, so
//     the exact part is [0, sinks) and [min(n − window, hashed), n). Appending token by token
//     or in blocks of any length gives the same blocks, codes and results, bit for bit.
//   Centring (centre_tokens) with lsh_sample or lsf: keys cached before the mean is fixed are
//     indexed once when it is; until then every retrieval candidate is scored exactly (p = 1).
//     For blocks, centring lowers every page bound of a query by the same q·k̄, so the pages
//     chosen are those without centring; it is accepted for uniformity.
//   Huge norms: logits are formed in Scalar and shifted by their maximum before exp, so large
//     but finite logits are fine; if scale·q·k overflows, attend throws std::invalid_argument
//     ("overflowed") rather than returning Inf or NaN.
//
// Errors: wrong shapes, q_heads not a multiple of kv_heads, non-finite values (check_finite),
// d = 0, bad options, attend on an empty cache → std::invalid_argument naming the argument; the
// cache is checked before it is changed, so a failed append leaves it unchanged.
//
// Files: save(path) writes a portable little-endian file (magic "RAKVCACH", format version,
// scalar width, shapes, options, storage, keys and values as stored, FNV-1a checksum);
// load(path) reads the stored rows as they are (nothing is rounded again) and rebuilds the index
// by replaying the appends (the open block stays open), so a loaded cache gives bit-identical
// results. A corrupt, truncated or mismatched file throws std::invalid_argument and nothing is
// returned.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../core/options.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../detail/chunk_products.hpp"
#include "../detail/gathered_rows.hpp"
#include "../detail/validation.hpp"
#include "../linalg/principal_axes.hpp"
#include "decode_options.hpp"
#include "detail/binary_io.hpp"
#include "detail/filter_tables.hpp"
#include "detail/key_clusters.hpp"
#include "detail/page_bounds.hpp"
#include "detail/sorted_index_set.hpp"
#include "detail/stored_rows.hpp"
#include "simhash_tables.hpp"

namespace randattn {

template <typename Scalar_>
class KvCache {
 public:
  using Scalar = Scalar_;
  using Matrix = RowMatrix<Scalar>;
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "KvCache holds float or double");

  // Largest number of cached tokens (key indices are 32-bit).
  static constexpr Index kMaxTokens = std::numeric_limits<std::int32_t>::max();
  // Version 3 added the options of the clusters mode, version 4 the storage type, version 5 the
  // clusters' margin and samples, version 6 page_axes; versions 2 to 5 are still read (2 and 3:
  // float32/float64 storage of the file's scalar; 2 to 4: the default margin and no samples; 2
  // to 5: no page axes).
  static constexpr std::uint32_t kFileVersion = 6;
  // Keys drawn per query head from the closed clusters (draw indices are 32-bit counters).
  static constexpr Index kMaxClusterSamples = Index(1) << 24;

  KvCache(Index head_dim, Index value_dim, Index kv_heads, KvCacheOptions options = {})
      : d_(head_dim), dv_(value_dim), kv_heads_(kv_heads), opt_(std::move(options)) {
    const char* where = "KvCache";
    detail::require(head_dim >= 1, where, "head_dim must be >= 1, got ", head_dim);
    detail::require(value_dim >= 1, where, "value_dim must be >= 1, got ", value_dim);
    detail::require(kv_heads >= 1, where, "kv_heads must be >= 1, got ", kv_heads);
    detail::require(opt_.mode == DecodeMode::exact || opt_.mode == DecodeMode::blocks ||
                        opt_.mode == DecodeMode::lsh_sample || opt_.mode == DecodeMode::lsf ||
                        opt_.mode == DecodeMode::clusters,
                    where, "options.mode ", std::uint32_t(opt_.mode), " is not a DecodeMode");
    detail::require(opt_.sinks >= 0, where, "options.sinks must be >= 0, got ", opt_.sinks);
    detail::require(opt_.window >= 0, where, "options.window must be >= 0, got ", opt_.window);
    detail::require(opt_.block_size >= 0 && opt_.block_size <= detail::kMaxGemmDepth, where,
                    "options.block_size must be in [0, ", detail::kMaxGemmDepth, "], got ",
                    opt_.block_size);
    detail::require(opt_.page_size >= 1, where, "options.page_size must be >= 1, got ",
                    opt_.page_size);
    detail::require(opt_.top_pages >= 0, where, "options.top_pages must be >= 0, got ",
                    opt_.top_pages);
    detail::require(opt_.page_axes >= 0 && opt_.page_axes <= kMaxTokens, where,
                    "options.page_axes must be in [0, ", kMaxTokens, "], got ", opt_.page_axes);
    detail::require(opt_.lsh_bits >= 0 && opt_.lsh_bits <= 16, where,
                    "options.lsh_bits must be in [0, 16], got ", opt_.lsh_bits);
    detail::require(opt_.lsh_tables >= 2 && opt_.lsh_tables <= 1024, where,
                    "options.lsh_tables must be in [2, 1024], got ", opt_.lsh_tables);
    detail::require(opt_.lsh_hash_block >= 1 && opt_.lsh_hash_block <= 4096, where,
                    "options.lsh_hash_block must be in [1, 4096], got ", opt_.lsh_hash_block);
    detail::require(opt_.lsf_filters >= 2 && opt_.lsf_filters <= 65536, where,
                    "options.lsf_filters must be in [2, 65536], got ", opt_.lsf_filters);
    detail::require(opt_.lsf_tables >= 1 && opt_.lsf_tables <= 64, where,
                    "options.lsf_tables must be in [1, 64], got ", opt_.lsf_tables);
    detail::require(opt_.lsf_alpha > 0 && opt_.lsf_alpha < 1, where,
                    "options.lsf_alpha must be in (0, 1), got ", opt_.lsf_alpha);
    detail::require(!opt_.lsf_threshold || !std::isnan(*opt_.lsf_threshold), where,
                    "options.lsf_threshold must not be NaN");
    detail::require(opt_.lsf_min_probes >= 0, where, "options.lsf_min_probes must be >= 0, got ",
                    opt_.lsf_min_probes);
    detail::require(opt_.clusters >= 1 && opt_.clusters <= kMaxTokens, where,
                    "options.clusters must be in [1, ", kMaxTokens, "], got ", opt_.clusters);
    detail::require(opt_.probe >= 1 && opt_.probe <= opt_.clusters, where,
                    "options.probe must be in [1, options.clusters = ", opt_.clusters, "], got ",
                    opt_.probe);
    detail::require(!std::isnan(opt_.cluster_margin), where, "options.cluster_margin must not be NaN");
    detail::require(opt_.cluster_samples >= 0 && opt_.cluster_samples <= kMaxClusterSamples, where,
                    "options.cluster_samples must be in [0, ", kMaxClusterSamples, "], got ",
                    opt_.cluster_samples);
    detail::require(opt_.centre_tokens >= 0, where, "options.centre_tokens must be >= 0, got ",
                    opt_.centre_tokens);
    const bool given = opt_.key_centre.size() > 0;
    detail::require(!given || opt_.centre_tokens == 0, where,
                    "give either options.key_centre or options.centre_tokens, not both");
    detail::require(!given || ((opt_.key_centre.rows() == 1 || opt_.key_centre.rows() == kv_heads) &&
                               opt_.key_centre.cols() == head_dim),
                    where, "options.key_centre is ", detail::shape_of(opt_.key_centre),
                    ", expected 1x", head_dim, " or ", kv_heads, "x", head_dim);
    detail::require(!given || opt_.key_centre.allFinite(), where,
                    "options.key_centre has a non-finite entry");
    detail::require(!opt_.storage || detail::is_storage(std::uint32_t(*opt_.storage)), where,
                    "options.storage ", std::uint32_t(opt_.storage.value_or(KvStorage::float32)),
                    " is not a KvStorage");
    storage_ = opt_.storage.value_or(detail::storage_of<Scalar>());
    AttentionOptions scale_option;
    scale_option.scale = opt_.scale;
    scale_ = detail::resolve_scale<Scalar>(where, scale_option, detail::inverse_sqrt_dim(head_dim));

    heads_.resize(static_cast<std::size_t>(kv_heads));
    for (Index h = 0; h < kv_heads; ++h) {
      Head& head = heads_[h];
      head.keys = detail::StoredRows<Scalar>(d_, storage_);
      head.values = detail::StoredRows<Scalar>(dv_, storage_);
      head.centre = Vector<Scalar>::Zero(d_);
      head.key_sum = Eigen::VectorXd::Zero(d_);
      if (given) {
        head.centre = opt_.key_centre.row(opt_.key_centre.rows() == 1 ? 0 : h)
                          .transpose()
                          .template cast<Scalar>();
      }
      if (opt_.mode == DecodeMode::blocks)
        head.pages = detail::PageBounds<Scalar>(d_, opt_.page_size);
      if (opt_.mode == DecodeMode::clusters)
        head.clusters = detail::KeyClusters<Scalar>(d_, opt_.clusters, opt_.seed, h);
      if (opt_.mode == DecodeMode::lsh_sample)
        head.tables = detail::SimHashTables<Scalar>(d_, opt_.lsh_bits, opt_.lsh_tables, opt_.seed, h);
      if (opt_.mode == DecodeMode::lsf)
        head.filters = detail::FilterTables<Scalar>(d_, opt_.lsf_filters, opt_.lsf_tables, opt_.seed, h);
    }
    centred_ = given || opt_.centre_tokens > 0;
    centre_fixed_ = given;
    lsf_threshold_ = Scalar(opt_.lsf_threshold ? *opt_.lsf_threshold
                                               : filter_threshold(opt_.lsf_alpha, opt_.lsf_filters));
    key_row_.resize(d_);
  }

  Index size() const { return n_; }
  Index head_dim() const { return d_; }
  Index value_dim() const { return dv_; }
  Index kv_heads() const { return kv_heads_; }
  Scalar scale() const { return scale_; }
  const KvCacheOptions& options() const { return opt_; }
  // How keys and values are held (options().storage, or the Scalar type when it is unset).
  KvStorage storage() const { return storage_; }

  // Cached keys (n x d) and values (n x dv) of kv head h as the cache holds them, in Scalar
  // (a copy: int8 rows times their scales).
  Matrix keys(Index h) const { return head_at(h, "keys").keys.decoded(0, n_); }
  Matrix values(Index h) const { return head_at(h, "values").values.decoded(0, n_); }
  // The key centre used for retrieval scores (zero without centring or before it is fixed).
  const Vector<Scalar>& key_centre(Index h) const { return head_at(h, "key_centre").centre; }
  // Whether the key centre is fixed (given, or the first centre_tokens keys are cached).
  bool key_centre_fixed() const { return centre_fixed_; }

  // Fixes the key centre of a cache built with options.centre_tokens > 0 before it has
  // fixed it itself, to `centre` (1 x d or kv_heads x d), and indexes the keys cached so far,
  // as the cache does when its own first centre_tokens keys are in. For a cache holding part of
  // a sequence (mpi/kv_cache.hpp: the centre is the mean of the sequence's first tokens, which
  // are spread over ranks). Throws std::invalid_argument (cache unchanged) otherwise.
  void fix_key_centre(const Eigen::Ref<const Matrix>& centre) {
    const char* where = "KvCache::fix_key_centre";
    detail::require(opt_.centre_tokens > 0 && !centre_fixed_, where,
                    "the centre is given or already fixed (centre_tokens = ", opt_.centre_tokens,
                    ", ", n_, " tokens cached)");
    detail::require((centre.rows() == 1 || centre.rows() == kv_heads_) && centre.cols() == d_,
                    where, "centre is ", detail::shape_of(centre), ", expected 1x", d_, " or ",
                    kv_heads_, "x", d_);
    detail::require_finite(centre, where, "centre", true);
    fix_centre_and_index(centre);
  }

  // clusters: the clusters of kv head h (centroids, radii, members; none until
  // options().clusters keys are candidates).
  const detail::KeyClusters<Scalar>& key_clusters(Index h) const {
    return head_at(h, "key_clusters").clusters;
  }

  // lsh_sample: the keys [0, hashed_tokens()) are hashed (whole blocks of lsh_hash_block
  // tokens); later ones are attended exactly.
  Index hashed_tokens() const { return hashed_; }

  // Bytes held: keys and values (with int8 scales), the retrieval index, both; and the bytes of
  // one token's keys and values in all kv heads as stored.
  std::size_t storage_bytes() const {
    std::size_t b = 0;
    for (const Head& h : heads_) b += h.keys.bytes() + h.values.bytes();
    return b;
  }
  std::size_t index_bytes() const {
    std::size_t b = 0;
    for (const Head& h : heads_)
      b += h.pages.bytes() + h.tables.bytes() + h.filters.bytes() + h.clusters.bytes() +
           h.centred_norm.capacity() * sizeof(Scalar);
    return b;
  }
  std::size_t memory_bytes() const { return storage_bytes() + index_bytes(); }
  std::size_t bytes_per_token() const {
    return std::size_t(kv_heads_) *
           (heads_[0].keys.bytes_per_row() + heads_[0].values.bytes_per_row());
  }

  // Allocates (and touches) storage for `tokens` cached tokens in total, so appends up to that
  // size only copy; for lsh_sample the hash index gets pages for the bucket entries of the keys
  // still to be filed (twice their count: the bound of its chunks). Never needed for correctness.
  void reserve(Index tokens) {
    detail::require(tokens >= 0 && tokens <= kMaxTokens, "KvCache::reserve", "tokens must be in [0, ",
                    kMaxTokens, "], got ", tokens);
    for (Head& h : heads_) {
      h.keys.reserve_rows(tokens);
      h.values.reserve_rows(tokens);
      if (opt_.mode == DecodeMode::blocks) h.pages.reserve_tokens(tokens);
      if (opt_.mode == DecodeMode::lsh_sample) {
        h.centred_norm.reserve(static_cast<std::size_t>(tokens));
        h.tables.reserve_keys(static_cast<std::size_t>(std::max<Index>(tokens - hashed_, 0)));
      }
      if (opt_.mode == DecodeMode::lsf)
        h.filters.reserve_buckets(static_cast<std::size_t>(tokens / opt_.lsf_filters) + 1);
    }
  }

  // Appends t tokens: k (kv_heads·t) x d, v (kv_heads·t) x dv, head-major rows (see top).
  void append(const Eigen::Ref<const Matrix>& k, const Eigen::Ref<const Matrix>& v) {
    const char* where = "KvCache::append";
    detail::require(k.cols() == d_, where, "k is ", detail::shape_of(k), " but head_dim is ", d_);
    detail::require(v.cols() == dv_, where, "v is ", detail::shape_of(v), " but value_dim is ",
                    dv_);
    detail::require(k.rows() % kv_heads_ == 0, where, "k has ", k.rows(),
                    " rows, not a multiple of kv_heads = ", kv_heads_,
                    " (rows are kv_heads blocks of t tokens)");
    detail::require(v.rows() == k.rows(), where, "v (", detail::shape_of(v), ") and k (",
                    detail::shape_of(k), ") must have the same number of rows");
    const Index t = k.rows() / kv_heads_;
    detail::require(t <= kMaxTokens - n_, where, "the cache would exceed ", kMaxTokens,
                    " tokens (", n_, " cached, ", t, " appended)");
    // What the storage cannot hold first: an int8 cache refuses NaN whatever check_finite says.
    const auto storable = [&](const auto& rows, const char* name) {
      const char* why = detail::StoredRows<Scalar>::unstorable(rows, storage_);
      detail::require(!why, where, name, " ", why ? why : "", " (", to_string(storage_), ")");
    };
    storable(k, "k");
    storable(v, "v");
    detail::require_finite(k, where, "k", opt_.check_finite);
    detail::require_finite(v, where, "v", opt_.check_finite);
    if (t == 0) return;
    for (Head& h : heads_) {  // allocation failures happen here, before any token is added
      h.keys.reserve_rows(n_ + t);
      h.values.reserve_rows(n_ + t);
    }
    for (Index i = 0; i < t; ++i) {
      for (Index h = 0; h < kv_heads_; ++h) {
        heads_[h].keys.push_row(k.row(h * t + i).data());
        heads_[h].values.push_row(v.row(h * t + i).data());
      }
      index_token();
    }
  }

  // Attention of q (q_heads x d) over the cache -> q_heads x dv. See the top of this file.
  Matrix attend(const Eigen::Ref<const Matrix>& q, DecodeReport* report = nullptr) const {
    const char* where = "KvCache::attend";
    detail::require(n_ > 0, where, "the cache is empty: attention over no keys is undefined");
    const SoftmaxAccumulator<Scalar> acc = attend_partial(q, opt_.sinks, opt_.window, report);
    Matrix out(q.rows(), dv_);
    acc.finalize_into(out);
    detail::require(detail::all_finite(out), where, overflow_message());
    return out;
  }

  // The unnormalised per-query-head state of attend (q_heads rows of [num | den] relative to
  // exp(log-scale)), with the first `sinks` and the last `window` cached tokens as the exact part
  // in retrieval modes (mode exact attends to every token whatever they are). attend() is
  // attend_partial(q, options().sinks, options().window) finalised; shards of one cache
  // (mpi/kv_cache.hpp) pass the counts of their own tokens that are global sinks and window and
  // merge their states with SoftmaxAccumulator::merge. An empty cache gives an empty state
  // (every log-scale −inf). Throws "overflowed" when scale·q·k overflows.
  SoftmaxAccumulator<Scalar> attend_partial(const Eigen::Ref<const Matrix>& q, Index sinks,
                                            Index window, DecodeReport* report = nullptr) const {
    const char* where = "KvCache::attend";
    detail::require(q.cols() == d_, where, "q is ", detail::shape_of(q), " but head_dim is ", d_);
    detail::require(q.rows() >= 1 && q.rows() % kv_heads_ == 0, where, "q has ", q.rows(),
                    " query heads, which must be a positive multiple of kv_heads = ", kv_heads_);
    detail::require(sinks >= 0 && window >= 0, where, "sinks and window must be >= 0, got ", sinks,
                    " and ", window);
    detail::require_finite(q, where, "q", opt_.check_finite);

    const Index q_heads = q.rows(), group = q_heads / kv_heads_;
    DecodeReport local;
    DecodeReport& rep = report ? *report : local;
    const bool record = rep.record_keys;
    rep = DecodeReport{};
    rep.record_keys = record;
    rep.bytes_per_token = Index(bytes_per_token());
    if (record) rep.scored_keys.assign(static_cast<std::size_t>(q_heads), {});

    const bool retrieval = opt_.mode != DecodeMode::exact;
    // Exact part: [0, s_end) and [w_begin, n); retrieval candidates: [s_end, w_begin).
    Index s_end = n_, w_begin = n_;
    if (retrieval) {
      s_end = std::min(sinks, n_);
      w_begin = std::max(s_end, n_ - std::min(window, n_));
      // lsh_sample: keys not hashed yet (the open block, or all while the centre is pending)
      // are recent; they join the exact tail.
      if (opt_.mode == DecodeMode::lsh_sample) w_begin = std::max(s_end, std::min(w_begin, hashed_));
      if (opt_.mode == DecodeMode::clusters) {
        // Only keys in [own sinks, n − own window) are clustered (a shard's partial call may
        // pass other counts): the others are scored exactly. With every cluster to be opened
        // (probe == clusters) or none built yet, every key is: one exact range, the tiles of
        // exact mode, bit for bit.
        // The newest keys past the window that are not filed yet (their block is open) are
        // scored exactly too.
        const Index lo = std::min(opt_.sinks, n_);
        const Index hi = std::max(lo, n_ - std::min(opt_.window, n_) - heads_[0].clusters.unfiled());
        s_end = std::min(std::max(s_end, lo), w_begin);
        w_begin = std::max(s_end, std::min(w_begin, hi));
        if (heads_[0].clusters.count() == 0 || opt_.probe >= opt_.clusters || w_begin == s_end)
          s_end = w_begin = n_;
      }
    }
    const Index block = opt_.block_size > 0 ? opt_.block_size : Index(256);

    SoftmaxAccumulator<Scalar> all(q_heads, dv_);
    if (n_ == 0) {
      rep.empty_heads = q_heads;
      return all;
    }
    Scratch scratch;
    if (opt_.mode == DecodeMode::lsh_sample) scratch.counts.assign(static_cast<std::size_t>(n_), 0);
    if (opt_.mode == DecodeMode::lsf || opt_.mode == DecodeMode::clusters) scratch.members.reset(n_);
    for (Index h = 0; h < kv_heads_; ++h) {
      const Head& head = heads_[h];
      const auto qg = q.middleRows(h * group, group);
      const Matrix qs = scale_ * qg;
      SoftmaxAccumulator<Scalar> acc(group, dv_);
      exact_range(qs, head, 0, s_end, block, scratch, acc);
      exact_range(qs, head, w_begin, n_, block, scratch, acc);
      rep.exact_keys += group * (s_end + n_ - w_begin);
      if (record) {
        for (Index r = 0; r < group; ++r) {
          auto& keys = rep.scored_keys[h * group + r];
          for (Index j = 0; j < s_end; ++j) keys.push_back(std::int32_t(j));
          for (Index j = w_begin; j < n_; ++j) keys.push_back(std::int32_t(j));
        }
      }
      if (retrieval && w_begin > s_end) {
        if (opt_.mode == DecodeMode::blocks) {
          retrieve_pages(head, qg, s_end, w_begin, acc, scratch, rep, h * group);
        } else if (opt_.mode == DecodeMode::lsf) {
          retrieve_filtered(head, qg, s_end, w_begin, acc, scratch, rep, h * group);
        } else if (opt_.mode == DecodeMode::clusters) {
          retrieve_clustered(head, qg, s_end, w_begin, acc, scratch, rep, h * group);
        } else {
          retrieve_sampled(head, qg, s_end, w_begin, acc, scratch, rep, h * group);
        }
      }
      for (Index r = 0; r < group; ++r) rep.empty_heads += acc.log_scale()(r) == -kInf;
      all.merge_rows(h * group, acc.numden(), acc.log_scale());
    }
    detail::require(detail::all_finite(all.numden()), where, overflow_message());
    if (record) {
      for (auto& keys : rep.scored_keys) std::sort(keys.begin(), keys.end());
    }
    return all;
  }

  // Writes the cache (shapes, options, keys and values) to a portable little-endian file.
  void save(const std::string& path) const {
    detail::LittleEndianWriter w(path, "KvCache::save");
    write_to(w);
    w.finish();
  }

  // Reads a file written by save() with the same Scalar; throws std::invalid_argument for a
  // missing, corrupt, truncated or mismatched file.
  static KvCache load(const std::string& path) {
    detail::LittleEndianReader r(path, "KvCache::load");
    return read_from(r, path, "KvCache::load");
  }

  // The cache as save() writes it, without the checksum: for files that hold a cache as their
  // last section (mpi/kv_cache.hpp).
  void write_to(detail::LittleEndianWriter& w) const {
    w.raw(kMagic, 8);
    w.u32(kFileVersion);
    w.u32(sizeof(Scalar));
    w.u64(std::uint64_t(d_));
    w.u64(std::uint64_t(dv_));
    w.u64(std::uint64_t(kv_heads_));
    w.u64(std::uint64_t(n_));
    w.u32(std::uint32_t(opt_.mode));
    w.u8(opt_.scale.has_value());
    w.f64(opt_.scale.value_or(0.0));
    w.u64(std::uint64_t(opt_.sinks));
    w.u64(std::uint64_t(opt_.window));
    w.u64(std::uint64_t(opt_.block_size));
    w.u64(std::uint64_t(opt_.page_size));
    w.u64(std::uint64_t(opt_.top_pages));
    w.u32(std::uint32_t(opt_.lsh_bits));
    w.u32(std::uint32_t(opt_.lsh_tables));
    w.u64(opt_.seed);
    w.u64(std::uint64_t(opt_.lsh_hash_block));
    w.u64(std::uint64_t(opt_.lsf_filters));
    w.u32(std::uint32_t(opt_.lsf_tables));
    w.f64(opt_.lsf_alpha);
    w.u8(opt_.lsf_threshold.has_value());
    w.f64(opt_.lsf_threshold.value_or(0.0));
    w.u64(std::uint64_t(opt_.lsf_min_probes));
    w.u64(std::uint64_t(opt_.clusters));
    w.u64(std::uint64_t(opt_.probe));
    w.u64(std::uint64_t(opt_.centre_tokens));
    w.u8(opt_.check_finite);
    w.u64(std::uint64_t(opt_.key_centre.rows()));
    w.reals(opt_.key_centre.data(), static_cast<std::size_t>(opt_.key_centre.size()));
    w.u32(std::uint32_t(storage_));
    w.f64(opt_.cluster_margin);
    w.u64(std::uint64_t(opt_.cluster_samples));
    w.u64(std::uint64_t(opt_.page_axes));
    for (const Head& h : heads_) {
      h.keys.write(w, n_);
      h.values.write(w, n_);
    }
  }

  // Reads what write_to() wrote, which must end the file (its checksum is checked first), and
  // rebuilds the index by replaying the appends; at_token(cache, i) runs before token i is
  // replayed and once more with i = size() at the end.
  struct NoHook {
    void operator()(KvCache&, Index) const {}
  };
  template <typename AtToken = NoHook>
  static KvCache read_from(detail::LittleEndianReader& r, const std::string& path,
                           const char* where, AtToken at_token = {}) {
    const unsigned char* magic = r.take(8, "magic");
    detail::require(std::equal(magic, magic + 8, reinterpret_cast<const unsigned char*>(kMagic)),
                    where, "'", path, "' is not a KvCache file (bad magic)");
    const std::uint32_t version = r.u32("version");
    detail::require(version >= 2 && version <= kFileVersion, where, "'", path,
                    "' has format version ", version, ", this build reads versions 2 to ",
                    kFileVersion);
    const std::uint32_t width = r.u32("scalar width");
    detail::require(width == sizeof(Scalar), where, "'", path, "' holds ", width * 8,
                    "-bit values, loading as ", sizeof(Scalar) * 8, "-bit");
    detail::require(r.checksum_ok(), where, "'", path, "' is corrupt or truncated (checksum mismatch)");
    constexpr std::uint64_t kLimit = std::uint64_t(1) << 31;
    const std::uint64_t d = r.u64("head_dim"), dv = r.u64("value_dim"), kvh = r.u64("kv_heads"),
                        n = r.u64("size");
    detail::require(d >= 1 && d < kLimit && dv >= 1 && dv < kLimit && kvh >= 1 && kvh < kLimit &&
                        n < kLimit,
                    where, "'", path, "' has implausible shapes: head_dim ", d, ", value_dim ",
                    dv, ", kv_heads ", kvh, ", size ", n);
    KvCacheOptions o;
    o.mode = DecodeMode(r.u32("mode"));
    const bool has_scale = r.u8("scale flag") != 0;
    const double scale = r.f64("scale");
    if (has_scale) o.scale = scale;
    o.sinks = Index(r.u64("sinks"));
    o.window = Index(r.u64("window"));
    o.block_size = Index(r.u64("block_size"));
    o.page_size = Index(r.u64("page_size"));
    o.top_pages = Index(r.u64("top_pages"));
    o.lsh_bits = int(r.u32("lsh_bits"));
    o.lsh_tables = int(r.u32("lsh_tables"));
    o.seed = r.u64("seed");
    o.lsh_hash_block = Index(r.u64("lsh_hash_block"));
    o.lsf_filters = Index(r.u64("lsf_filters"));
    o.lsf_tables = int(r.u32("lsf_tables"));
    o.lsf_alpha = r.f64("lsf_alpha");
    const bool has_threshold = r.u8("lsf_threshold flag") != 0;
    const double threshold = r.f64("lsf_threshold");
    if (has_threshold) o.lsf_threshold = threshold;
    o.lsf_min_probes = Index(r.u64("lsf_min_probes"));
    if (version >= 3) {
      o.clusters = Index(r.u64("clusters"));
      o.probe = Index(r.u64("probe"));
    }
    o.centre_tokens = Index(r.u64("centre_tokens"));
    o.check_finite = r.u8("check_finite") != 0;
    const std::uint64_t centre_rows = r.u64("key_centre rows");
    detail::require(centre_rows <= kvh, where, "'", path, "' has ", centre_rows,
                    " key_centre rows for ", kvh, " kv heads");
    if (centre_rows > 0) {
      o.key_centre.resize(Index(centre_rows), Index(d));
      r.reals(o.key_centre.data(), std::size_t(centre_rows * d), "key_centre");
    }
    if (version >= 4) {
      const std::uint32_t storage = r.u32("storage");
      detail::require(detail::is_storage(storage), where, "'", path, "' has storage type ",
                      storage, ", which this build does not know");
      o.storage = KvStorage(storage);
    }
    if (version >= 5) {
      o.cluster_margin = r.f64("cluster_margin");
      o.cluster_samples = Index(r.u64("cluster_samples"));
    }
    if (version >= 6) o.page_axes = Index(r.u64("page_axes"));
    const KvStorage storage = o.storage.value_or(detail::storage_of<Scalar>());
    // Bytes per token and kv head: entries, and two int8 scales.
    const std::uint64_t per_token =
        (d + dv) * detail::storage_bytes_per_entry(storage) +
        (storage == KvStorage::int8 ? 2 * sizeof(Scalar) : 0);
    detail::require(r.remaining() / per_token / kvh >= n && r.remaining() == kvh * n * per_token,
                    where, "'", path, "' has ", r.remaining(), " bytes of keys and values, expected ",
                    kvh * n * per_token, " (truncated or corrupt)");
    // Constructing validates the options (a message naming the bad one); then replay the
    // appends so the index is the one the original cache built.
    KvCache cache = [&] {
      try {
        return KvCache(Index(d), Index(dv), Index(kvh), std::move(o));
      } catch (const std::invalid_argument& e) {
        detail::fail(where, "'", path, "' holds invalid options: ", e.what());
      }
    }();
    for (Head& h : cache.heads_) {
      h.keys.read(r, Index(n), where, path);
      h.values.read(r, Index(n), where, path);
      if (cache.opt_.check_finite) {
        detail::StoredRows<Scalar>::visit_pair(
            h.keys, h.values, [&](const auto& keys, const Scalar*, const auto& values, const Scalar*) {
              for (const auto* rows : {&keys, &values})
                for (Index e = 0; e < rows->size(); ++e)
                  detail::require(std::isfinite(detail::widen<double>(rows->data()[e])), where,
                                  "'", path, "' holds a non-finite key or value");
            });
      }
    }
    // The rows are in; the index is built token by token as the appends built it.
    for (Index i = 0; i < Index(n); ++i) {
      at_token(cache, i);
      cache.index_token();
    }
    at_token(cache, Index(n));
    return cache;
  }

 private:
  static constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity();
  static constexpr char kMagic[9] = "RAKVCACH";

  struct Head {
    detail::StoredRows<Scalar> keys, values;
    detail::PageBounds<Scalar> pages;        // blocks
    detail::SimHashTables<Scalar> tables;    // lsh_sample
    detail::FilterTables<Scalar> filters;    // lsf
    detail::KeyClusters<Scalar> clusters;    // clusters
    std::vector<Scalar> centred_norm;        // lsh_sample: ‖k_j − centre‖ of hashed keys
    Vector<Scalar> centre;                   // zero without centring
    Eigen::VectorXd key_sum;                 // sum of the first centre_tokens keys
  };

  // Per-call scratch of attend (local to the call: attend keeps no state).
  struct Scratch {
    std::vector<std::int32_t> idx;
    Eigen::Matrix<Scalar, 1, Eigen::Dynamic> logits;
    typename detail::SimHashTables<Scalar>::HashScratch hash;
    typename detail::FilterTables<Scalar>::Scratch filter;
    std::vector<std::uint8_t> counts;  // lsh_sample: collisions per key
    detail::SortedIndexSet members;     // lsf, clusters: the keys found
    std::vector<std::uint32_t> codes;
    std::vector<typename detail::SimHashTables<Scalar>::Run> bucket_runs;
    std::vector<typename detail::SimHashTables<Scalar>::Cursor> walking;
    std::vector<std::pair<Scalar, std::int32_t>> ranked;
    std::vector<double> mass;                              // clusters: cumulative proposal
    std::vector<std::pair<std::int32_t, Scalar>> drawn;    // clusters: (key, log(samples·p))
    RowMatrix<Scalar> bounds, bound_q, tile_nd;
    Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> scores;  // column per query head
    Vector<Scalar> tile_max;
    Eigen::Matrix<Scalar, 1, Eigen::Dynamic> nd, qrow;
  };

  static const char* overflow_message() {
    return "the result overflowed: scale·q·k exceeds the floating-point range (or the cache "
           "holds NaN/Inf, appended with check_finite = false); rescale the queries, keys or the "
           "logit scale";
  }

  const Head& head_at(Index h, const char* what) const {
    detail::require(h >= 0 && h < kv_heads_, what, "kv head ", h, " is outside [0, ", kv_heads_,
                    ")");
    return heads_[h];
  }

  // Counts token n_ in, its rows being stored in every kv head already, and indexes its key as
  // stored (so that a loaded cache, which reads the stored rows, builds the same index).
  void index_token() {
    const bool pending = centre_pending();
    for (Index h = 0; h < kv_heads_; ++h) {
      Head& head = heads_[h];
      const Scalar* k = head.keys.row_as(n_, key_row_.data());
      if (opt_.mode == DecodeMode::blocks) head.pages.append(k);
      if (pending) {
        for (Index c = 0; c < d_; ++c) head.key_sum(c) += double(k[c]);
      }
      if (opt_.mode == DecodeMode::lsf && !pending) file_key(head, n_);
    }
    ++n_;
    // clusters: the key leaving the window (if past the sinks) joins the clusters.
    if (opt_.mode == DecodeMode::clusters && n_ > opt_.window && n_ - 1 - opt_.window >= opt_.sinks) {
      const auto j = std::int32_t(n_ - 1 - opt_.window);
      for (Head& head : heads_)
        head.clusters.insert(j, [&](std::int32_t i) { return head.keys.row_as(i, key_row_.data()); });
    }
    if (opt_.mode == DecodeMode::blocks && n_ == opt_.page_axes) {
      for (Head& head : heads_) {
        const auto key_at = [&](Index j) { return head.keys.row_as(j, key_row_.data()); };
        head.pages.rotate(detail::principal_axes<Scalar>(n_, d_, key_at), key_at);
      }
    }
    if (pending && n_ == opt_.centre_tokens) {
      Matrix centre(kv_heads_, d_);
      for (Index h = 0; h < kv_heads_; ++h)
        centre.row(h) = (heads_[h].key_sum / double(n_)).transpose().template cast<Scalar>();
      fix_centre_and_index(centre);
    } else {
      hash_closed_blocks();
    }
  }

  bool centre_pending() const { return centred_ && !centre_fixed_; }

  // Fixes the centre (1 x d or kv_heads x d) and indexes the keys cached while it was pending.
  template <typename Centre>
  void fix_centre_and_index(const Centre& centre) {
    centre_fixed_ = true;
    for (Index h = 0; h < kv_heads_; ++h)
      heads_[h].centre = centre.row(centre.rows() == 1 ? 0 : h).transpose();
    if (opt_.mode == DecodeMode::lsf) {
      for (Head& head : heads_)
        for (Index j = 0; j < n_; ++j) file_key(head, j);
    }
    hash_closed_blocks();
  }

  void file_key(Head& head, Index j) {
    head.filters.insert(std::int32_t(j), head.keys.row_as(j, key_row_.data()),
                        centred_ ? head.centre.data() : nullptr, filter_scratch_);
  }

  // lsh_sample: hashes every block [hashed_, hashed_ + B) that has filled. The product has the
  // same shape for every block and a block is hashed only once it is complete, so its codes
  // are the same however its tokens were appended.
  void hash_closed_blocks() {
    if (opt_.mode != DecodeMode::lsh_sample || centre_pending()) return;
    const Index B = opt_.lsh_hash_block;
    const auto L = static_cast<std::size_t>(opt_.lsh_tables);
    while (n_ - hashed_ >= B) {
      // Scratch sized on first use; no allocation per block afterwards.
      hash_codes_.resize(L * static_cast<std::size_t>(B));
      for (Head& head : heads_) {
        const auto index = [&](const auto& centred) {
          head.tables.codes_block(centred, hash_scratch_, hash_codes_.data());
          head.tables.insert_block(std::int32_t(hashed_), B, hash_codes_.data());
          for (Index r = 0; r < B; ++r) head.centred_norm.push_back(centred.row(r).norm());
        };
        const Scalar* stored = head.keys.scalar_data();
        if (centred_ || !stored) {
          hash_block_ = head.keys.decoded(hashed_, B);
          if (centred_) hash_block_.rowwise() -= head.centre.transpose();
          index(hash_block_);
        } else {
          index(ConstRowMatrixMap<Scalar>(stored + hashed_ * d_, B, d_));  // hashed where it lies
        }
      }
      hashed_ += B;
    }
  }

  // Keys [first, last) for the group's scaled queries qs (g x d), in tiles of `block` keys. Every
  // key and value row is read once per kv head however many query heads share it (grouped-query
  // attention), straight from the cache's storage: the logits are dot products of the tile's key
  // rows with the g query rows, and the numerators a product whose tiles hold g rows of the
  // result in registers while the value rows stream through (detail/chunk_products.hpp).
  // Decoding is bound by the stream of K and V; a GEMM would first copy (pack) the tile's rows.
  // The sums run in a fixed order, so the rounding depends on the shapes only.
  // Stored rows other than Scalar are converted as they are loaded (detail/packet_load.hpp); an
  // int8 row's scale multiplies its logit, and the weight of its value row.
  void exact_range(const Matrix& qs, const Head& head, Index first, Index last, Index block,
                   Scratch& s, SoftmaxAccumulator<Scalar>& acc) const {
    if (first >= last) return;
    detail::StoredRows<Scalar>::visit_pair(
        head.keys, head.values,
        [&](const auto& keys, const Scalar* key_scale, const auto& values, const Scalar* value_scale) {
          exact_tiles(qs, keys, key_scale, values, value_scale, first, last, block, s, acc);
        });
  }

  template <typename Keys, typename Values>
  void exact_tiles(const Matrix& qs, const Keys& keys, const Scalar* key_scale, const Values& values,
                   const Scalar* value_scale, Index first, Index last, Index block, Scratch& s,
                   SoftmaxAccumulator<Scalar>& acc) const {
    const Index g = qs.rows();
    s.scores.resize(block, g);
    s.tile_nd.resize(g, dv_ + 1);
    s.tile_max.resize(g);
    for (Index j0 = first; j0 < last; j0 += block) {
      const Index bk = std::min(block, last - j0);
      auto w = s.scores.topRows(bk);
      // Rows are requested a few at a time ahead of their logits: the hardware prefetcher alone
      // streams them at well under a plain read's rate. Measured best per machine: with AVX-512
      // (Zen 4) keys and values of the rows about to be scored; with AVX2 (Zen 3), where the
      // logits take twice as long, the keys of the next group only. Requests further ahead
      // (16–64 rows, spread over the value product too) ran slower on a Zen 5.
      for (Index i = 0; i < bk; i += kStreamRows) {
        const Index m = std::min(kStreamRows, bk - i);
        if (kPrefetchValues) {
          detail::prefetch_row(&keys.coeffRef(j0 + i, 0), m * d_);
          detail::prefetch_row(&values.coeffRef(j0 + i, 0), m * dv_);
        } else if (const Index next = j0 + i + m; next < last) {
          detail::prefetch_row(&keys.coeffRef(next, 0), std::min(kStreamRows, last - next) * d_);
        }
        detail::row_dots(w.middleRows(i, m), keys.middleRows(j0 + i, m), qs);
        if (key_scale) w.middleRows(i, m).array().colwise() *= scales(key_scale, j0 + i, m);
      }
      for (Index r = 0; r < g; ++r) {
        const Scalar c = w.col(r).maxCoeff();
        s.tile_max(r) = c;
        w.col(r).array() = (w.col(r).array() - c).exp();
        s.tile_nd(r, dv_) = w.col(r).sum();
      }
      if (value_scale) w.array().colwise() *= scales(value_scale, j0, bk);
      detail::row_panel_product_streamed(s.tile_nd.leftCols(dv_), w.transpose(),
                                         values.middleRows(j0, bk), false);
      acc.merge_rows(0, s.tile_nd, s.tile_max);
    }
  }

  static auto scales(const Scalar* all, Index first, Index count) {
    return Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(all + first, count);
  }

  static constexpr Index kStreamRows = 16;  // rows per request of exact_range
  // Values are requested with their keys on AVX-512 builds only (see exact_range).
  static constexpr bool kPrefetchValues = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32;

  template <typename QG>
  void retrieve_pages(const Head& head, const QG& qg, Index first, Index last,
                      SoftmaxAccumulator<Scalar>& acc, Scratch& s, DecodeReport& rep,
                      Index head0) const {
    const Index P = opt_.page_size;
    const Index p0 = first / P, p1 = (last - 1) / P + 1, np = p1 - p0;
    head.pages.bounds(qg, p0, np, s.bounds, s.bound_q);
    if (centre_fixed_) {
      // Lowers each row by q·k̄: the ranking is unchanged (see the top of the file).
      const Vector<Scalar> shift = qg * head.centre;
      s.bounds.colwise() -= shift;
    }
    const Index take = std::min(np, opt_.top_pages);
    for (Index r = 0; r < qg.rows(); ++r) {
      rep.pages_scored += np;
      s.ranked.resize(static_cast<std::size_t>(np));
      for (Index p = 0; p < np; ++p) s.ranked[p] = {s.bounds(r, p), std::int32_t(p0 + p)};
      if (take < np) {
        // Highest bound first; ties by page index, so the choice is deterministic.
        std::nth_element(s.ranked.begin(), s.ranked.begin() + take, s.ranked.end(),
                         [](const auto& a, const auto& b) {
                           return a.first > b.first || (a.first == b.first && a.second < b.second);
                         });
        s.ranked.resize(static_cast<std::size_t>(take));
      }
      std::sort(s.ranked.begin(), s.ranked.end(),
                [](const auto& a, const auto& b) { return a.second < b.second; });
      rep.pages_opened += Index(s.ranked.size());
      s.idx.clear();
      for (const auto& [bound, page] : s.ranked) {
        const Index j0 = std::max(first, Index(page) * P), j1 = std::min(last, (Index(page) + 1) * P);
        for (Index j = j0; j < j1; ++j) s.idx.push_back(std::int32_t(j));
      }
      score_and_merge(head, qg.row(r), r, head0, s, rep, acc);
    }
  }

  template <typename QG>
  void retrieve_sampled(const Head& head, const QG& qg, Index first, Index last,
                        SoftmaxAccumulator<Scalar>& acc, Scratch& s, DecodeReport& rep,
                        Index head0) const {
    const int L = opt_.lsh_tables;
    s.codes.resize(static_cast<std::size_t>(L));
    for (Index r = 0; r < qg.rows(); ++r) {
      const Eigen::Matrix<Scalar, 1, Eigen::Dynamic> q = qg.row(r);
      s.idx.clear();
      head.tables.codes(q.data(), nullptr, s.hash, s.codes.data());
      rep.tables_probed += L;
      s.bucket_runs.clear();
      head.tables.collect_buckets(s.codes.data(), s.bucket_runs, s.walking);
      // A key joins at its second collision, whichever tables they are in.
      for (const auto& run : s.bucket_runs) {
        rep.bucket_entries += run.count;
        for (Index i = 0; i < run.count; ++i) {
          const std::int32_t j = run.entries[i];
          std::uint8_t& c = s.counts[j];
          if (c < 2 && ++c == 2 && j >= first && j < last) s.idx.push_back(j);
        }
      }
      for (const auto& run : s.bucket_runs)
        for (Index i = 0; i < run.count; ++i) s.counts[run.entries[i]] = 0;
      std::sort(s.idx.begin(), s.idx.end());
      const Scalar q_norm = q.norm();
      const Scalar q_centre = centred_ ? q.dot(head.centre.transpose()) : Scalar(0);
      const auto correction = [&](std::int32_t j, Scalar dot) {
        const Scalar denom = q_norm * head.centred_norm[j];
        const double cos = denom > 0 ? double(dot - q_centre) / double(denom) : 0.0;
        const double p = simhash_sample_probability(cos, opt_.lsh_bits, L);
        return Scalar(std::log(std::max(p, 1e-300)));
      };
      score_and_merge(head, q, r, head0, s, rep, acc, &correction);
    }
  }

  template <typename QG>
  void retrieve_filtered(const Head& head, const QG& qg, Index first, Index last,
                         SoftmaxAccumulator<Scalar>& acc, Scratch& s, DecodeReport& rep,
                         Index head0) const {
    for (Index r = 0; r < qg.rows(); ++r) {
      const Eigen::Matrix<Scalar, 1, Eigen::Dynamic> q = qg.row(r);
      s.idx.clear();
      if (!centre_fixed_ && centred_) {
        // The centre is not fixed yet, so no key is stored in a filter: score every candidate.
        for (Index j = first; j < last; ++j) s.idx.push_back(std::int32_t(j));
      } else {
        rep.filters_opened += head.filters.probe(
            q.data(), lsf_threshold_, opt_.lsf_min_probes, s.filter,
            [&](const std::vector<std::int32_t>& bucket) {
              rep.bucket_entries += Index(bucket.size());
              for (const std::int32_t j : bucket) s.members.insert(j);  // the union of the buckets
            });
        s.members.drain(first, last, s.idx);
      }
      score_and_merge(head, q, r, head0, s, rep, acc);
    }
  }

  // clusters: per query head, the bound scale·q·c + |scale|·‖q‖·r ≥ scale·q·k of every member k
  // of each cluster; the `probe` highest bounds are opened (ties by index) and scored; then
  // every other cluster whose bound is within cluster_margin of the best logit so far (the exact
  // part's and the probed clusters'), whose members could still carry weight; then
  // cluster_samples keys drawn from the clusters left closed (see decode_options.hpp).
  template <typename QG>
  void retrieve_clustered(const Head& head, const QG& qg, Index first, Index last,
                          SoftmaxAccumulator<Scalar>& acc, Scratch& s, DecodeReport& rep,
                          Index head0) const {
    const auto& cl = head.clusters;
    const Index K = cl.count();
    s.bounds.resize(qg.rows(), K);
    cl.dots(s.bounds, qg);
    s.bounds *= scale_;
    const auto open = [&](std::int32_t c) {
      for (const std::int32_t j : cl.members(c)) s.members.insert(j);
    };
    for (Index r = 0; r < qg.rows(); ++r) {
      const auto q = qg.row(r);
      const Scalar spread = std::abs(scale_) * q.norm();
      s.ranked.resize(static_cast<std::size_t>(K));
      for (Index c = 0; c < K; ++c)
        s.ranked[c] = {s.bounds(r, c) + spread * cl.radii()(c), std::int32_t(c)};
      const Index probe = std::min(opt_.probe, K);
      // Highest bound first, ties by index; with no margin only the first `probe` are needed.
      const auto higher = [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      if (opt_.cluster_margin > -kInf)
        std::sort(s.ranked.begin(), s.ranked.end(), higher);
      else
        std::partial_sort(s.ranked.begin(), s.ranked.begin() + probe, s.ranked.end(), higher);
      s.idx.clear();
      for (Index u = 0; u < probe; ++u) open(s.ranked[u].second);
      s.members.drain(first, last, s.idx);
      score_and_merge(head, q, r, head0, s, rep, acc);
      Index opened = probe;
      if (opt_.cluster_margin > -kInf) {
        const Scalar floor = acc.log_scale()(r) - Scalar(opt_.cluster_margin);
        s.idx.clear();
        for (; opened < K && !(s.ranked[opened].first < floor); ++opened) open(s.ranked[opened].second);
        s.members.drain(first, last, s.idx);
        if (!s.idx.empty()) score_and_merge(head, q, r, head0, s, rep, acc);
      }
      rep.clusters_opened += opened;
      if (opt_.cluster_samples > 0 && opened < K)
        sample_closed_clusters(head, r, opened, first, last, head0, s, rep, acc, q);
    }
  }

  // cluster_samples keys drawn with replacement from the clusters s.ranked[opened, K): cluster c
  // with probability π_c ∝ n_c·exp(scale·q·c), then a member uniformly, so key j has p_j = π_c/n_c
  // and its logit is lowered by log(samples·p_j). The draws are a pure function of (seed, cache
  // size, query head, draw).
  template <typename QRow>
  void sample_closed_clusters(const Head& head, Index r, Index opened, Index first, Index last,
                              Index head0, Scratch& s, DecodeReport& rep,
                              SoftmaxAccumulator<Scalar>& acc, const QRow& q) const {
    const auto& cl = head.clusters;
    const Index K = cl.count(), closed = K - opened;
    s.mass.resize(static_cast<std::size_t>(closed));
    double top = -kInf;
    for (Index u = 0; u < closed; ++u) {
      const Index c = s.ranked[opened + u].second;
      if (!cl.members(c).empty()) top = std::max(top, double(s.bounds(r, c)));
    }
    if (top == -kInf) return;  // the closed clusters have no member
    double total = 0;
    for (Index u = 0; u < closed; ++u) {
      const Index c = s.ranked[opened + u].second;
      const double n_c = double(cl.members(c).size());
      total += n_c > 0 ? n_c * std::exp(double(s.bounds(r, c)) - top) : 0.0;
      s.mass[u] = total;  // cumulative
    }
    const Philox rng(opt_.seed, streams::kv_cache_cluster_draws);
    const std::uint64_t draw_key = (std::uint64_t(n_) << 24) | std::uint64_t(head0 + r);
    const Index S = opt_.cluster_samples;
    s.drawn.clear();
    for (Index t = 0; t < S; ++t) {
      const double u = rng.uniform(draw_key, std::uint32_t(2 * t)) * total;
      const Index pick = std::min<Index>(
          closed - 1, Index(std::upper_bound(s.mass.begin(), s.mass.end(), u) - s.mass.begin()));
      const Index c = s.ranked[opened + pick].second;
      const auto& members = cl.members(c);
      if (members.empty()) continue;  // probability 0 up to rounding at a cumulative boundary
      const double n_c = double(members.size());
      const std::int32_t j = members[std::min<std::size_t>(
          members.size() - 1, std::size_t(rng.uniform(draw_key, std::uint32_t(2 * t + 1)) * n_c))];
      if (j < first || j >= last) continue;  // outside this call's candidates: weight 0
      const double p = n_c * std::exp(double(s.bounds(r, c)) - top) / total / n_c;
      s.drawn.push_back({j, Scalar(std::log(double(S) * p))});
    }
    std::sort(s.drawn.begin(), s.drawn.end());
    s.idx.clear();
    for (const auto& [j, log_sp] : s.drawn) s.idx.push_back(j);
    const auto correction = [&](std::int32_t j, Scalar) {
      return std::lower_bound(s.drawn.begin(), s.drawn.end(), std::pair<std::int32_t, Scalar>{j, -kInf})
          ->second;
    };
    score_and_merge(head, q, r, head0, s, rep, acc, &correction);
  }

  struct NoCorrection {};

  // Softmax over the keys s.idx (ascending) of one query head, logits scale·q·k_j (minus
  // log p_j with a correction), merged into row r of acc. The rows are read where they lie, in
  // index order (detail/gathered_rows.hpp).
  template <typename QRow, typename Correction = NoCorrection>
  void score_and_merge(const Head& head, const QRow& q, Index r, Index head0, Scratch& s,
                       DecodeReport& rep, SoftmaxAccumulator<Scalar>& acc,
                       const Correction* correction = nullptr) const {
    const std::size_t m = s.idx.size();
    rep.retrieved_keys += Index(m);
    if (rep.record_keys) {
      auto& keys = rep.scored_keys[head0 + r];
      keys.insert(keys.end(), s.idx.begin(), s.idx.end());
    }
    if (m == 0) return;
    s.logits.resize(Index(m));
    s.qrow = q;
    detail::StoredRows<Scalar>::visit_pair(
        head.keys, head.values,
        [&](const auto& keys, const Scalar* key_scale, const auto& values, const Scalar* value_scale) {
          detail::gathered_dots(s.logits.data(), keys.data(), keys.outerStride(), s.idx.data(),
                                Index(m), s.qrow.data(), d_);
          if (key_scale) {
            for (std::size_t u = 0; u < m; ++u) s.logits(Index(u)) *= key_scale[s.idx[u]];
          }
          if constexpr (!std::is_same<Correction, NoCorrection>::value) {
            for (std::size_t u = 0; u < m; ++u) {
              const Scalar dot = s.logits(Index(u));
              s.logits(Index(u)) = scale_ * dot - (*correction)(s.idx[u], dot);
            }
          } else {
            s.logits *= scale_;
          }
          const Scalar c = s.logits.maxCoeff();
          if (c == -kInf) return;
          s.logits = (s.logits.array() - c).exp();  // the weights, vectorised
          s.nd.resize(dv_ + 1);
          s.nd(dv_) = s.logits.sum();
          if (value_scale) {
            for (std::size_t u = 0; u < m; ++u) s.logits(Index(u)) *= value_scale[s.idx[u]];
          }
          auto num = s.nd.head(dv_);
          num.setZero();
          detail::gathered_weighted_sum(num.data(), s.logits.data(), values.data(),
                                        values.outerStride(), s.idx.data(), Index(m), dv_);
          acc.merge_rows(r, s.nd, Vector<Scalar>::Constant(1, c));
        });
  }

  Index d_, dv_, kv_heads_;
  KvCacheOptions opt_;
  Scalar scale_ = 1;
  Index n_ = 0;
  Index hashed_ = 0;  // lsh_sample: keys [0, hashed_) are in the tables (whole blocks)
  bool centred_ = false, centre_fixed_ = false;
  std::vector<Head> heads_;
  typename detail::SimHashTables<Scalar>::HashScratch hash_scratch_;  // append scratch
  typename detail::FilterTables<Scalar>::Scratch filter_scratch_;
  Scalar lsf_threshold_ = 0;
  std::vector<std::uint32_t> hash_codes_;
  Matrix hash_block_;  // the centred (or decoded) keys of the block being hashed
  KvStorage storage_ = detail::storage_of<Scalar>();
  Vector<Scalar> key_row_;  // a key decoded from its storage for the index
};

// The width in bytes (4 or 8) of the values in a file written by KvCache<Scalar>::save: which
// KvCache<Scalar>::load reads it. Reads the header only as far as the width; load() checks the
// rest. Throws randattn::invalid_argument for a file that cannot be read or is too short.
inline std::uint32_t kv_cache_file_scalar_bytes(const std::string& path) {
  detail::LittleEndianReader r(path, "kv_cache_file_scalar_bytes");
  r.take(8, "magic");
  r.u32("version");
  return r.u32("scalar width");
}

}  // namespace randattn
