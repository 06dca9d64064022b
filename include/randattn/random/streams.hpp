#pragma once
// Every Philox stream number the library draws from, in one table. A draw is a pure function of
// (seed, stream, index): two purposes that share a seed must use different streams here, so a
// new random quantity gets a new row below, never a reused number.
//
// Numbers the caller chooses are not listed: `SparsifyOptions::stream` (a sketch; the sketched
// HOSVD uses stream and stream + 1 for its two independent sketches) and the streams of the
// synthetic tensor generators in sketch/synthetic.hpp (0 .. order + 2 of their own seed).
// Hybrid feature maps give each component its own seed (detail::component_seed), so their
// components draw from the projection streams below.

#include <cstdint>

namespace randattn::streams {

// Projections ω of the random-feature maps (features/projection.hpp): "PRJ" + purpose.
constexpr std::uint32_t projection_iid = 0x50524a00u;         // i.i.d. Gaussian rows
constexpr std::uint32_t projection_orthogonal = 0x50524a01u;  // Gaussian blocks before QR
constexpr std::uint32_t projection_row_norm = 0x50524a02u;    // χ(d) row norms
constexpr std::uint32_t projection_hadamard = 0x50524a03u;    // ±1 diagonals of H D3 H D2 H D1

// Rotations of cross-polytope LSH (hashing/rotation.hpp): "LSH" + purpose.
constexpr std::uint32_t lsh_dense_rotation = 0x4C534801u;     // Gaussian (d, rounds, b/2)
constexpr std::uint32_t lsh_hadamard_rotation = 0x4C534802u;  // ±1 diagonals per round

// Pairs (q_i, k_j) sampled by mean_kernel_relative_mse (features/kernel_variance.hpp): "VAR".
constexpr std::uint32_t kernel_variance_pairs = 0x56415201u;

// Locality-sensitive filters (lsf/filters.hpp): "LSF" + purpose.
constexpr std::uint32_t lsf_dense_filters = 0x4C534601u;     // Gaussian (tables, m, d)
constexpr std::uint32_t lsf_hadamard_filters = 0x4C534602u;  // seed of the H D3 H D2 H D1 rotations

// Retrieval indexes of the key/value cache (decode/): "KVC" + purpose.
constexpr std::uint32_t kv_cache_simhash = 0x4B564301u;  // SimHash hyperplanes (simhash_tables.hpp)
constexpr std::uint32_t kv_cache_filters =
    0x4B564302u;  // filters (decode/detail/filter_tables.hpp)
constexpr std::uint32_t kv_cache_clusters =
    0x4B564303u;  // seeds of a cluster's split (decode/detail/key_clusters.hpp)
constexpr std::uint32_t kv_cache_cluster_draws =
    0x4B564304u;  // keys drawn from the closed clusters (decode/kv_cache.hpp)

// Keys drawn by the sampled remainder of sparse + low-rank attention (sparse/sampled_remainder.hpp):
// "SPL" + purpose.
constexpr std::uint32_t sparse_remainder_draws = 0x53504C01u;
// Seeds of the clusters support's k-means (sparse/cluster_support.hpp).
constexpr std::uint32_t sparse_cluster_seeds = 0x53504C02u;

}  // namespace randattn::streams
