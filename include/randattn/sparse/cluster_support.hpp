#pragma once
// The clusters support of sparse attention, as the decoding cache's `clusters` mode (after
// ClusterKV, arXiv 2412.03213, and Squeezed Attention, arXiv 2411.09688): the keys are clustered
// by k-means (seeded, kClusterSteps Lloyd steps; detail/kmeans.hpp) and each cluster keeps its
// centroid c and radius r, the largest distance of a member from c, so that for each member k
//     scale·q·k ≤ scale·q·c + |scale|·‖q‖·r        (Cauchy–Schwarz).
// Query i opens the `probe` clusters with the highest bounds (ties to the lower index) and every
// other cluster whose bound is within `margin` of a lower bound on the largest logit of the keys
// it scores: with the default margin, kClusterMargin, whatever a cluster left closed holds weighs
// less than 2^-24 of that key each; with −inf the `probe` clusters alone are opened. Its
// support is the members of the clusters opened. The lower bound: a centroid is the mean of the
// members k-means gave it, so the largest of their logits is at least scale·q·c; under causal
// masking the query's own key's logit is one too. No logit is computed twice.
//
// Causal: keys are clustered over completed chunks of C keys. Query chunk g (queries [gC, gC + C))
// sees the clusters of keys [0, gC) and scores its own chunk's keys j <= i exactly. k-means runs
// when the prefix first holds K keys, and again (from the previous centroids) whenever the prefix
// has doubled since; the chunks in between join their nearest centroid and widen its radius. So
// clustering costs O(n·K·d) per Lloyd step in all, and nothing query chunk g uses depends on a
// key at or after gC: outputs 0..j-1 do not depend on key j. A prefix of fewer than K keys is
// scored exactly. Without causal masking, one k-means over all keys (fewer than K: all scored).
//
// The index also serves the sampled remainder as its proposal (sampled_remainder.hpp): the groups
// are a query's clusters (their members before its chunk), each bounded as above.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../detail/chunk_products.hpp"
#include "../detail/kmeans.hpp"
#include "../detail/parallel.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/validation.hpp"
#include "../random/philox.hpp"
#include "../random/streams.hpp"

namespace randattn {

struct ClusterSupport {
  Index clusters = 16;  // K >= 1 clusters of the keys
  Index probe = 2;      // 1 <= probe <= K clusters opened at least per query
  Index chunk = 64;     // causal: clusters over completed chunks of C >= 1 keys
  // Further clusters opened: bound within this many nats of the best logit (not NaN; −inf: none).
  double margin = detail::kClusterMargin;
};

namespace detail {

constexpr int kClusterSteps = 4;  // Lloyd steps of each k-means

inline void check_cluster_support(const ClusterSupport& s, const char* where) {
  require(s.clusters >= 1, where, "clusters must be >= 1, got ", s.clusters);
  require(s.probe >= 1 && s.probe <= s.clusters, where, "probe must be in [1, clusters = ",
          s.clusters, "], got ", s.probe);
  require(!std::isnan(s.margin), where, "margin must not be NaN");
  require(s.chunk >= 1, where, "the clusters' chunk must be >= 1, got ", s.chunk);
}

// One span of keys: list[0, size) if list is given, else first + [0, size).
struct KeySpan {
  const std::int32_t* list;
  Index first, size;
  Index at(Index u) const { return list ? Index(list[u]) : first + u; }
};

// The clusters of one call's keys, for every query: which clustering it sees, its bounds and its
// keys.
template <typename Scalar>
class KeyClusterIndex {
 public:
  // q n_q x d, keys n_k x d (as the supports see them: centred or not).
  KeyClusterIndex(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                  const Eigen::Ref<const RowMatrix<Scalar>>& keys, const ClusterSupport& s,
                  Scalar scale, bool causal, std::uint64_t seed)
      : s_(s), causal_(causal), n_q_(q.rows()), n_k_(keys.rows()), K_(s.clusters) {
    check_cluster_support(s, "clusters support");
    const Index C = causal ? s.chunk : std::max<Index>(1, n_q_);
    const Index chunks = n_q_ == 0 ? 0 : (n_q_ + C - 1) / C;
    chunk_len_ = C;
    epoch_of_.assign(std::size_t(chunks), -1);
    // The prefix of keys query chunk g sees.
    const auto prefix = [&](Index g) { return causal ? std::min(g * C, n_k_) : n_k_; };
    std::vector<Index> first;  // first query chunk of each clustering
    for (Index g = 0, base = 0; g < chunks; ++g) {
      const Index p = prefix(g);
      if (p >= K_ && (base == 0 || p >= 2 * base)) {
        first.push_back(g);
        base = p;
      }
    }
    first.push_back(chunks);
    epochs_.resize(first.size() - 1);
    RowMatrix<Scalar> centroid;
    for (std::size_t e = 0; e + 1 < first.size(); ++e) {
      Epoch& ep = epochs_[e];
      ep.chunk0 = first[e];
      const Index span = first[e + 1] - first[e];
      ep.base = prefix(ep.chunk0);
      const Index end = prefix(first[e + 1] - 1);  // the keys its last chunk sees
      for (Index g = ep.chunk0; g < first[e + 1]; ++g) epoch_of_[std::size_t(g)] = Index(e);
      if (e == 0) seed_centroids(keys, ep.base, seed, centroid);
      build(keys, ep, end, span, [&](Index t) { return prefix(ep.chunk0 + t); }, centroid);
      centroid = ep.centroid;
    }
    // The rows' logits against their clustering's centroids, and the spread |scale|·‖q‖.
    logit_.resize(n_q_, K_);
    spread_ = (std::abs(scale) * q.rowwise().norm()).eval();
    self_.resize(causal ? n_q_ : 0);
    const Index blocks = (n_q_ + kAssignRows - 1) / kAssignRows;
    parallel_for(blocks, [&](Index b) {
      for (Index i0 = b * kAssignRows; i0 < std::min(n_q_, (b + 1) * kAssignRows);) {
        // Rows of one clustering at a time.
        const Index e = epoch_of_[std::size_t(i0 / C)];
        Index i1 = std::min({n_q_, (b + 1) * kAssignRows, (i0 / C + 1) * C});
        while (i1 < std::min(n_q_, (b + 1) * kAssignRows) && epoch_of_[std::size_t(i1 / C)] == e)
          i1 = std::min({n_q_, (b + 1) * kAssignRows, (i1 / C + 1) * C});
        if (e >= 0) {
          auto out = logit_.middleRows(i0, i1 - i0);
          row_dots(out, q.middleRows(i0, i1 - i0), epochs_[std::size_t(e)].centroid);
          out *= scale;
        }
        if (causal)
          for (Index i = i0; i < i1; ++i)
            self_(i) = i < n_k_ ? scale * q.row(i).dot(keys.row(i)) : Scalar(0);
        i0 = i1;
      }
    });
  }

  Index clusters() const { return K_; }

  // Row i's support: calls add(j) for every key of it (valid keys only, each once).
  template <typename Add>
  void support_row(Index i, Add&& add, PooledVector<Index>& order) const {
    const Index valid = valid_keys(i, n_k_, causal_);
    const Index e = epoch_of_row(i);
    if (e < 0) {  // too few keys to cluster: all of them
      for (Index j = 0; j < valid; ++j) add(std::int32_t(j));
      return;
    }
    const Epoch& ep = epochs_[std::size_t(e)];
    const Index t = chunk_of(i) - ep.chunk0, p = prefix_of(i);
    for (Index j = p; j < valid; ++j) add(std::int32_t(j));  // the own chunk
    const auto bound = [&](Index c) { return logit_(i, c) + spread_(i) * ep.radius(t, c); };
    order.resize(std::size_t(K_));
    for (Index c = 0; c < K_; ++c) order[std::size_t(c)] = c;
    const Index probe = std::min(s_.probe, K_);
    std::partial_sort(order.begin(), order.begin() + probe, order.end(), [&](Index x, Index y) {
      const Scalar bx = bound(x), by = bound(y);
      return bx > by || (bx == by && x < y);
    });
    Scalar low = causal_ && i < n_k_ ? self_(i) : -std::numeric_limits<Scalar>::infinity();
    for (Index u = 0; u < probe; ++u)
      if (ep.count(0, order[std::size_t(u)]) > 0) low = std::max(low, logit_(i, order[std::size_t(u)]));
    const Scalar floor = low - Scalar(s_.margin);
    const auto open = [&](Index c) {
      const std::int32_t* m = ep.members.data() + ep.start[std::size_t(c)];
      for (Index u = 0; u < ep.count(t, c); ++u) add(m[u]);
    };
    for (Index u = 0; u < probe; ++u) open(order[std::size_t(u)]);
    std::sort(order.begin(), order.begin() + probe);
    for (Index c = 0, u = 0; c < K_; ++c) {
      if (u < probe && order[std::size_t(u)] == c) {
        ++u;
        continue;
      }
      if (!(bound(c) < floor)) open(c);
    }
  }

  // The support of every query.
  TargetSets target_sets() const {
    return gather_target_sets(
        n_q_, n_k_,
        [&](Index i, auto&& add) {
          PooledVector<Index> order(0, std::size_t(K_));
          support_row(i, add, order);
        },
        false, causal_);
  }

  // As a proposal of the sampled remainder: row i samples its clusters [0, sampled(i)) (all K, or
  // none while its prefix is scored exactly), group(i, c) the members of cluster c before its
  // chunk, group_of(i, j) the cluster of key j among them (-1: none), and takes the keys
  // [whole_from(i), valid) whole. bounds_into gives the rows' bounds on scale·q·k per cluster.
  Index groups() const { return K_; }
  double bound_scale() const { return 1.0; }  // the bounds are of the scaled logits
  template <typename Out>
  void bounds_into(const Eigen::Ref<const RowMatrix<Scalar>>&, Index i0, Out& out) const {
    for (Index r = 0; r < out.rows(); ++r) {
      const Index e = epoch_of_row(i0 + r);
      if (e < 0) continue;
      const Index t = chunk_of(i0 + r) - epochs_[std::size_t(e)].chunk0;
      out.row(r) = logit_.row(i0 + r) + spread_(i0 + r) * epochs_[std::size_t(e)].radius.row(t);
    }
  }
  Index sampled(Index i) const { return epoch_of_row(i) < 0 ? 0 : K_; }
  KeySpan group(Index i, Index c) const {
    const Epoch& ep = epochs_[std::size_t(epoch_of_row(i))];
    return {ep.members.data() + ep.start[std::size_t(c)], 0,
            ep.count(chunk_of(i) - ep.chunk0, c)};
  }
  Index group_of(Index i, Index j) const {
    const Index e = epoch_of_row(i);
    return e < 0 || j >= prefix_of(i) ? -1 : Index(epochs_[std::size_t(e)].label[std::size_t(j)]);
  }
  Index whole_from(Index i) const { return epoch_of_row(i) < 0 ? 0 : prefix_of(i); }

  // The gradients through the bounds B_ic = scale·q_i·c + |scale|·‖q_i‖·r_c given gamma(i, c) =
  // ∂L/∂B_ic (n_q x K; zero where unused), added to dq and dk (keys as given to the index): q_i
  // receives scale·c + |scale|·r_c·q_i/‖q_i‖; the radius r_c = ‖k_a − c‖ of its farthest member a
  // passes |scale|·‖q_i‖·(k_a − c)/r_c to k_a and its opposite to c; a centroid, the mean of the
  // m_c keys k-means labelled with it, passes a share 1/m_c of its gradient to each of them. The
  // discrete choices (assignments, the farthest member) are held constant, as is the centroid of
  // a cluster k-means left empty (kept from its start). Keys in fixed order: the result does not
  // depend on the thread count.
  void bound_gradients(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                       const Eigen::Ref<const RowMatrix<Scalar>>& keys,
                       const Eigen::Ref<const RowMatrix<Scalar>>& gamma, Scalar scale,
                       Eigen::Ref<RowMatrix<Scalar>> dq, Eigen::Ref<RowMatrix<Scalar>> dk) const {
    const Index d = q.cols();
    const Scalar a_scale = std::abs(scale);
    parallel_for(n_q_, [&](Index i) {
      const Index e = epoch_of_row(i);
      const Scalar norm = q.row(i).norm();
      if (e < 0) return;
      const Epoch& ep = epochs_[std::size_t(e)];
      const auto g = gamma.row(i);
      dq.row(i) += scale * (g * ep.centroid);
      if (norm > 0)
        dq.row(i) += (a_scale / norm * g.dot(ep.radius.row(chunk_of(i) - ep.chunk0))) * q.row(i);
    });
    RowMatrix<Scalar> dc(K_, d), gq(K_, d);
    Vector<Scalar> gr(K_);
    for (std::size_t e = 0; e < epochs_.size(); ++e) {
      const Epoch& ep = epochs_[e];
      dc.setZero();
      for (Index t = 0; t < ep.radius.rows(); ++t) {
        const Index i0 = (ep.chunk0 + t) * chunk_len_, rows = std::min(chunk_len_, n_q_ - i0);
        gq.noalias() = scale * (gamma.middleRows(i0, rows).transpose() * q.middleRows(i0, rows));
        gr.noalias() = a_scale * (gamma.middleRows(i0, rows).transpose() *
                                  q.middleRows(i0, rows).rowwise().norm());
        dc += gq;
        for (Index c = 0; c < K_; ++c) {
          const Index a = ep.far(t, c);
          if (a < 0 || !(ep.radius(t, c) > 0) || gr(c) == 0) continue;
          const auto u = ((keys.row(a) - ep.centroid.row(c)) / ep.radius(t, c)).eval();
          dk.row(a) += gr(c) * u;
          dc.row(c) -= gr(c) * u;
        }
      }
      for (Index j = 0; j < ep.base; ++j) {
        const Index c = ep.label[std::size_t(j)];
        dk.row(j) += dc.row(c) / Scalar(ep.count(0, c));
      }
    }
  }

 private:
  // One clustering: k-means of the keys [0, base), served to query chunks [chunk0, chunk0 +
  // radius.rows()); the keys after base that these chunks see joined their nearest centroid.
  struct Epoch {
    Index chunk0 = 0, base = 0;
    RowMatrix<Scalar> centroid;                // K x d
    std::vector<std::int32_t> label;           // per key seen
    std::vector<Index> start;                  // K + 1: cluster c's members at members[start[c]..)
    std::vector<std::int32_t> members;         // ascending within each cluster
    RowMatrix<Scalar> radius;                  // per chunk and cluster: of the members before it
    using Indices = Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Indices count;                             // their number
    Indices far;                               // the member at the radius (-1: none)
  };

  Index chunk_of(Index i) const { return i / chunk_len_; }
  Index epoch_of_row(Index i) const { return epoch_of_[std::size_t(chunk_of(i))]; }
  Index prefix_of(Index i) const {
    return causal_ ? std::min(chunk_of(i) * chunk_len_, n_k_) : n_k_;
  }

  // K distinct keys of [0, base) (Floyd's sampling on Philox uniforms), in increasing order.
  void seed_centroids(const Eigen::Ref<const RowMatrix<Scalar>>& keys, Index base,
                      std::uint64_t seed, RowMatrix<Scalar>& centroid) const {
    const Philox rng(seed, streams::sparse_cluster_seeds);
    std::vector<char> taken(std::size_t(base), 0);
    for (Index j = base - K_; j < base; ++j) {
      const Index t = std::min(j, Index(rng.uniform(std::uint64_t(j)) * double(j + 1)));
      taken[std::size_t(taken[std::size_t(t)] ? j : t)] = 1;
    }
    centroid.resize(K_, keys.cols());
    for (Index j = 0, c = 0; j < base; ++j)
      if (taken[std::size_t(j)]) centroid.row(c++) = keys.row(j);
  }

  // k-means of keys [0, ep.base) from `centroid`, the keys [base, end) assigned, and per chunk t
  // (seeing keys [0, prefix(t))) the clusters' sizes and radii.
  template <typename Prefix>
  void build(const Eigen::Ref<const RowMatrix<Scalar>>& keys, Epoch& ep, Index end, Index span,
             Prefix&& prefix, const RowMatrix<Scalar>& centroid) const {
    ep.centroid = centroid;
    ep.label.resize(std::size_t(end));
    std::vector<Index> sizes(static_cast<std::size_t>(K_));
    lloyd_steps<Scalar>(keys.topRows(ep.base), ep.centroid, kClusterSteps, ep.label.data(),
                        sizes.data());
    const Vector<Scalar> norm2 = ep.centroid.rowwise().squaredNorm();
    nearest_centroids<Scalar>(keys.middleRows(ep.base, end - ep.base), ep.centroid, norm2,
                              ep.label.data() + ep.base);
    ep.start.assign(std::size_t(K_) + 1, 0);
    for (Index j = 0; j < end; ++j) ++ep.start[std::size_t(ep.label[std::size_t(j)]) + 1];
    for (Index c = 0; c < K_; ++c) ep.start[std::size_t(c) + 1] += ep.start[std::size_t(c)];
    ep.members.resize(std::size_t(end));
    std::vector<Index> next(ep.start.begin(), ep.start.end() - 1);
    for (Index j = 0; j < end; ++j)
      ep.members[std::size_t(next[std::size_t(ep.label[std::size_t(j)])]++)] = std::int32_t(j);
    // Radii and sizes grow key by key; chunk t takes those of the keys before prefix(t).
    ep.radius.resize(span, K_);
    ep.count.resize(span, K_);
    ep.far.resize(span, K_);
    Vector<Scalar> r = Vector<Scalar>::Zero(K_);
    Eigen::Matrix<Index, 1, Eigen::Dynamic> n = Eigen::Matrix<Index, 1, Eigen::Dynamic>::Zero(K_),
                                            far = n.array() - 1;
    Index j = 0;
    for (Index t = 0; t < span; ++t) {
      for (; j < prefix(t); ++j) {
        const Index c = ep.label[std::size_t(j)];
        const Scalar dist = (keys.row(j) - ep.centroid.row(c)).norm();
        if (far(c) < 0 || dist > r(c)) r(c) = dist, far(c) = j;
        ++n(c);
      }
      ep.radius.row(t) = r.transpose();
      ep.count.row(t) = n;
      ep.far.row(t) = far;
    }
  }

  ClusterSupport s_;
  bool causal_;
  Index n_q_, n_k_, K_, chunk_len_ = 1;
  std::vector<Epoch> epochs_;
  std::vector<Index> epoch_of_;  // per query chunk: its clustering, -1 for none (all keys scored)
  RowMatrix<Scalar> logit_;      // n_q x K: scale·q_i·c of the row's clustering
  Vector<Scalar> spread_, self_;  // |scale|·‖q_i‖; causal: scale·q_i·k_i
};

}  // namespace detail

// The clusters support's target sets: q n_q x d, keys n_k x d (as the supports see them). `seed`
// seeds the k-means.
template <typename Scalar>
TargetSets cluster_target_sets(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                               const Eigen::Ref<const RowMatrix<Scalar>>& keys,
                               const ClusterSupport& s, Scalar scale, bool causal,
                               std::uint64_t seed) {
  return detail::KeyClusterIndex<Scalar>(q, keys, s, scale, causal, seed).target_sets();
}

}  // namespace randattn
