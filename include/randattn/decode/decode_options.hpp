#pragma once
// Options and per-call report of decoding over a key/value cache (decode/kv_cache.hpp).
//
// Modes:
//   exact       softmax over every cached key, tiled (flash-attention style); the reference.
//   blocks      page retrieval after Quest (Tang et al., arXiv 2406.10774): per page of
//               `page_size` tokens the per-coordinate min and max of its keys; a query scores a
//               page by the upper bound Σ_c max(q_c·min_c, q_c·max_c) ≥ q·k of every key in it and
//               attends exactly to the `top_pages` pages with the highest bound; with
//               `page_axes` the boxes are taken in the principal axes of the first keys.
//   lsh_sample  SimHash sampling after MagicPIG (Chen et al., arXiv 2410.16179): K = `lsh_bits`
//               sign bits per table, L = `lsh_tables` tables; a key is sampled when it collides
//               with the query in at least two tables, and its logit is lowered by log p, p its
//               exact inclusion probability (self-normalised importance sampling).
//   lsf         locality-sensitive filters (decode/detail/filter_tables.hpp): each key is stored
//               in its best filter of each of `lsf_tables` tables of `lsf_filters` Gaussian
//               filters; the query opens the filters whose cosine with it reaches the threshold (and at least
//               its `lsf_min_probes` best per table) and attends exactly to the keys found.
//   clusters    key clusters after ClusterKV (arXiv 2412.03213) (decode/detail/key_clusters.hpp):
//               `clusters` clusters per kv head, each with its centroid c and radius r; a query
//               opens the clusters whose bound scale·q·c + |scale|·‖q‖·r on a member's logit is
//               within `cluster_margin` of the best logit scored (by default a negligible
//               margin), and at least its `probe` highest bounds, and attends exactly to their
//               members; `cluster_samples` keys drawn from the closed clusters estimate the rest.
// In every retrieval mode the first `sinks` and the last `window` tokens are attended exactly and
// are never candidates of the retrieval, so no key is counted twice.
//
// Storage (KvCacheOptions::storage) is how keys and values are held, whatever the scalar type
// of the queries and results (the cache's Scalar, in which everything is computed):
//   float32, float64  as given (float64 -> float32 rounds to nearest);
//   bfloat16, float16 rounded to nearest, ties to even (from double directly, not through float);
//                     a finite entry beyond the type's range is refused (float16: |x| > 65504);
//   int8              symmetric, one scale per token and kv head for its key and one for its
//                     value: x ≈ s·round(x / s), s = max|x| / 127; non-finite entries are refused
//                     even with check_finite = false, since they have no scale.
// Every decode mode reads the stored rows directly (converted to Scalar in registers).

#include <cstdint>
#include <optional>
#include <vector>

#include "../core/types.hpp"

namespace randattn {

enum class DecodeMode : std::uint32_t {
  exact = 0,
  blocks = 1,
  lsh_sample = 2,
  lsf = 3,
  clusters = 4
};

enum class KvStorage : std::uint32_t {
  float32 = 0,
  float64 = 1,
  bfloat16 = 2,
  float16 = 3,
  int8 = 4
};

inline const char* to_string(KvStorage storage) {
  switch (storage) {
    case KvStorage::float32: return "float32";
    case KvStorage::float64: return "float64";
    case KvStorage::bfloat16: return "bfloat16";
    case KvStorage::float16: return "float16";
    case KvStorage::int8: return "int8";
  }
  return "unknown";
}

inline const char* to_string(DecodeMode mode) {
  switch (mode) {
    case DecodeMode::exact: return "exact";
    case DecodeMode::blocks: return "blocks";
    case DecodeMode::lsh_sample: return "lsh_sample";
    case DecodeMode::lsf: return "lsf";
    case DecodeMode::clusters: return "clusters";
  }
  return "unknown";
}

struct KvCacheOptions {
  DecodeMode mode = DecodeMode::exact;
  // How keys and values are stored (see the top of this file); unset: the cache's Scalar.
  std::optional<KvStorage> storage;
  // Logits are scale·q·k; default 1/sqrt(head_dim).
  std::optional<double> scale;
  // Always exact (retrieval modes): the first `sinks` tokens and the last `window` tokens.
  Index sinks = 4;
  Index window = 256;
  // Key tile length of the exact parts; rounding only. 0 = automatic (256), at most 256.
  Index block_size = 0;

  // blocks: tokens per page and pages attended per query head.
  Index page_size = 32;
  Index top_pages = 64;
  // blocks: > 0 takes the page boxes in the principal axes of the first `page_axes` keys of each
  // kv head (the eigenvectors of their covariance, linalg/principal_axes.hpp), fixed once that
  // many tokens are cached; the pages cached until then are summarised again. 0: the keys' own
  // coordinates. Keys of trained models vary along few directions, and the rotated box is then
  // often the tighter bound (docs/decode.md measures both, and what they change in a model).
  Index page_axes = 0;

  // lsh_sample: bits per table (0..16), tables (2..1024), seed of the hyperplanes, and the
  // tokens hashed together (1..4096): keys are hashed in blocks aligned to their positions,
  // [0, B), [B, 2B), ..., one matrix product per block when it fills; the keys of the open
  // block are attended exactly, like the window.
  int lsh_bits = 8;
  int lsh_tables = 64;
  std::uint64_t seed = 0;
  Index lsh_hash_block = 64;

  // lsf: filters per table (>= 2), tables (1..64), target cosine α in (0, 1) of the threshold
  // η = α·√(2 ln m) − √(2(1 − α²) ln ln m), or η itself (−inf opens every filter), and the
  // number of best filters per table that always open. The hyperplanes use `seed` too.
  Index lsf_filters = 256;
  int lsf_tables = 4;
  double lsf_alpha = 0.5;
  std::optional<double> lsf_threshold;
  Index lsf_min_probes = 1;

  // clusters: clusters per kv head (at all times, once that many keys are retrieval candidates;
  // fewer candidates are all scored exactly) and the fewest clusters opened per query head
  // (1..clusters; probe == clusters is exact decoding). The splits' 2-means use `seed`.
  Index clusters = 64;
  Index probe = 8;
  // clusters: after the `probe` clusters, every other cluster whose bound is within
  // `cluster_margin` nats of the best logit scored is opened too. The default, 24·ln 2, leaves
  // closed only clusters whose every member weighs under 2⁻²⁴ of the best key (the result is
  // exact decoding's within rounding); −inf opens the `probe` clusters alone (a fixed budget).
  double cluster_margin = 16.635532333438686;
  // clusters: keys drawn with replacement from the clusters left closed, a cluster c with
  // probability ∝ n_c·exp(scale·q·c) and then a member uniformly, each scored with its logit
  // lowered by log(samples·p) (self-normalised importance sampling of the closed clusters'
  // share, as lsh_sample does for the keys it misses). 0: the closed clusters are left out.
  Index cluster_samples = 0;

  // Key centring for retrieval scores (hash codes, page bounds) only; logits always use the raw
  // keys. Either the mean of the first `centre_tokens` tokens of each kv head (fixed once that
  // many tokens are cached), or a given `key_centre` (1 x head_dim for every kv head, or
  // kv_heads x head_dim). Both empty / 0: no centring.
  Index centre_tokens = 0;
  RowMatrix<double> key_centre;

  // Reject NaN / Inf in appended keys and values and in queries.
  bool check_finite = true;
};

// What one attend() call did, summed over query heads.
struct DecodeReport {
  // Input: also record, per query head, the indices of every key scored (exact and retrieved).
  bool record_keys = false;

  Index exact_keys = 0;      // keys of the always-exact part (every key in exact mode)
  Index retrieved_keys = 0;  // keys scored by the retrieval
  Index pages_scored = 0;    // blocks: page bounds evaluated
  Index pages_opened = 0;    // blocks: pages attended
  Index tables_probed = 0;   // lsh_sample: hash tables looked up
  Index bucket_entries = 0;  // lsh_sample, lsf: bucket entries visited
  Index filters_opened = 0;  // lsf: filters opened (all tables)
  Index clusters_opened = 0; // clusters: clusters whose members were scored
  Index empty_heads = 0;     // query heads with no key scored at all (their output row is 0)
  std::vector<std::vector<std::int32_t>> scored_keys;  // per query head, when record_keys
  Index bytes_per_token = 0;  // bytes of one cached token's keys and values (all kv heads)

  Index keys_scored() const { return exact_keys + retrieved_keys; }
};

}  // namespace randattn
