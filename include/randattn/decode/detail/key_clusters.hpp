#pragma once
// Clusters of the cached keys of one kv head, for the `clusters` decode mode (after ClusterKV,
// Liu et al., arXiv 2412.03213, and Squeezed Attention, Hooper et al., arXiv 2411.09688: keys are
// grouped by similarity, a query scores the centroids and attends to the members of the best
// clusters). Each cluster keeps its centroid c, its radius r and its members, so that for every
// member k and any query q,
//     q·k = q·c + q·(k − c) ≤ q·c + ‖q‖·r        (Cauchy–Schwarz).
//
// The count stays `clusters` (K) at all times once K keys are filed:
//   - the first K keys filed are K clusters of one key each (k-means of K keys into K clusters);
//     before that the keys only wait (the cache scores them exactly);
//   - later keys are filed in blocks of K/16 (1 to 64; as the cache's SimHash tables hash theirs):
//     until its block is complete a key is pending, in no cluster (the cache scores it exactly);
//     the block's dots with the centroids come from one block x K product, which reads the
//     centroids once per block instead of once per key (from a transposed copy kept with them,
//     d x K row-major, that the product reads in place: Eigen's GEMM copied all K centroids
//     into its panels for every product, a quarter of the append's time); its keys then join
//     in order, each the centroid nearest at its turn (the dots with the few centroids moved
//     since the product are computed again), as if filed one by one;
//   - a key joins its nearest centroid (ties: lowest index); the centroid is the running
//     mean of the members (MacQueen's online k-means), so it follows the keys, and the radius
//     grows by the centroid's move (triangle inequality), then is recomputed exactly from the
//     members whenever the cluster has grown by an eighth since the last exact radius: an upper
//     bound of the largest member distance, never loose by more than the drift of one eighth;
//   - a cluster grown past 4× the mean size is split by a 2-means of its members (seeded by
//     Philox from the seed, the kv head and the count of splits; kSplitSteps Lloyd steps of
//     detail/kmeans.hpp, as the sparse clusters support's k-means), and
//     the two closest centroids are then merged (not the two halves just made with each other,
//     nor a pair whose union passes the limit while another pair remains), so the count is K
//     again.
//     Centroids and radii of the clusters made are exact (means and largest distances).
// Everything is a function of the keys in order and the seed: no thread count, no timing.
//
// Cost per key filed: K·d for the nearest centroid (a block's matrix product) and O(d) for the
// centroid and radius (amortised, the exact radius included); a split costs O(s·d) for its s
// members and O(K·d) for the closest pair (each cluster keeps its nearest neighbour, see
// merge_closest); the nearest neighbours of the first K keys cost O(K²·d) once.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include <Eigen/Core>

#include "../../core/types.hpp"
#include "../../detail/chunk_products.hpp"
#include "../../detail/kmeans.hpp"
#include "../../random/philox.hpp"
#include "../../random/streams.hpp"

namespace randattn::detail {

template <typename Scalar>
class KeyClusters {
 public:
  static constexpr int kSplitSteps = 4;      // Lloyd steps of a split's 2-means
  static constexpr Index kSplitFactor = 4;   // a cluster splits past this many times the mean size
  // Keys filed together once there are K clusters: K/16, from 1 to 64. The block amortises
  // one read of the K centroids; with few clusters there is little to amortise, and a smaller
  // block leaves fewer pending keys to be scored exactly.
  static constexpr Index kMaxFileBlock = 64;

  KeyClusters() = default;
  KeyClusters(Index dim, Index clusters, std::uint64_t seed, Index head)
      : dim_(dim), k_(clusters), seed_(seed), head_(head),
        file_block_(std::clamp<Index>(clusters / 16, 1, kMaxFileBlock)) {}

  Index dim() const { return dim_; }
  // K, and the clusters in use: 0 until K keys are filed, then K.
  Index target() const { return k_; }
  Index count() const { return built_ ? k_ : 0; }
  // Keys inserted (in clusters, waiting until there are K, or pending until their block is
  // complete), and of those the newest not in a cluster: the cache scores them exactly.
  Index keys() const { return keys_; }
  Index unfiled() const { return built_ ? Index(pending_.size()) : Index(waiting_.size()); }
  Index file_block() const { return file_block_; }
  Index splits() const { return Index(splits_); }

  // count() x dim centroids, their squared norms and radii.
  auto centroids() const { return centroid_.topRows(count()); }
  auto radii() const { return radius_.head(count()); }
  const std::vector<std::int32_t>& members(Index c) const { return members_[std::size_t(c)]; }
  // out (rows x count(), sized) = rows · centroidsᵀ, reading the transposed copy in place.
  template <typename Out, typename Rows>
  void dots(Out&& out, const Rows& rows) const { centroid_dots(out, rows, count()); }

  // Inserts key j (its row at key_of(j), as for every member: a pointer to dim scalars, valid
  // until the next call of key_of), the next candidate in order.
  template <typename KeyOf>
  void insert(std::int32_t j, KeyOf key_of) {
    ++keys_;
    if (!built_) {
      waiting_.push_back(j);
      if (Index(waiting_.size()) == k_) build(key_of);
      return;
    }
    pending_.push_back(j);
    if (Index(pending_.size()) == file_block_) file_pending(key_of);
  }

  std::size_t bytes() const {
    std::size_t b = sizeof(Scalar) * std::size_t(centroid_.size() + columns_.size() + norm2_.size() +
                                                 radius_.size());
    for (const auto& m : members_) b += m.capacity() * sizeof(std::int32_t);
    return b + (waiting_.capacity() + pending_.capacity()) * sizeof(std::int32_t);
  }

 private:
  using Row = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;
  auto row(const Scalar* p) const { return Eigen::Map<const Row>(p, dim_); }

  // out = rows · [centroids 0 .. count)ᵀ, reading the transposed copy in place.
  template <typename Out, typename Rows>
  void centroid_dots(Out&& out, const Rows& rows, Index count) const {
    row_panel_product(out, rows, columns_.leftCols(count), false);
  }
  // Centroid c changed: its column of the transposed copy follows.
  void moved(Index c) { columns_.col(c) = centroid_.row(c).transpose(); }

  // The pending block: its dot products with the centroids from one product; then each key in
  // order joins its nearest centroid, the dots with the centroids that moved since (those its
  // block's earlier keys joined) computed again, so that the choice is the one of filing key
  // by key. After a split the block's remaining dots are computed again.
  template <typename KeyOf>
  void file_pending(KeyOf key_of) {
    const Index B = Index(pending_.size());
    block_.resize(B, dim_);
    for (Index u = 0; u < B; ++u) block_.row(u) = row(key_of(pending_[std::size_t(u)]));
    dots_.resize(B, k_);
    centroid_dots(dots_, block_, k_);
    moved_.clear();
    for (Index u = 0; u < B; ++u) {
      const auto x = block_.row(u);
      for (const std::int32_t c : moved_) dots_(u, c) = x.dot(centroid_.row(c));
      // ‖x − c‖² − ‖x‖² of every centroid, its least value, then its first index (ties: the
      // lowest), in three vectorised passes over K entries.
      gaps_.noalias() = norm2_.head(k_).transpose() - 2 * dots_.row(u);
      const Scalar low = gaps_.minCoeff();
      const std::int32_t a = std::int32_t(std::find(gaps_.data(), gaps_.data() + k_, low) - gaps_.data());
      const std::uint64_t before = splits_;
      join(pending_[std::size_t(u)], a, u, key_of);
      if (splits_ != before) {
        moved_.clear();
        if (u + 1 < B)
          centroid_dots(dots_.bottomRows(B - u - 1), block_.bottomRows(B - u - 1), k_);
      } else if (std::find(moved_.begin(), moved_.end(), a) == moved_.end()) {
        moved_.push_back(a);
      }
    }
    pending_.clear();
  }

  // Key j (row u of the block) joins cluster a.
  template <typename KeyOf>
  void join(std::int32_t j, std::int32_t a, Index u, KeyOf key_of) {
    const auto x = block_.row(u);
    auto& m = members_[std::size_t(a)];
    m.push_back(j);
    const Scalar size = Scalar(m.size());
    auto c = centroid_.row(a);
    const Scalar before = (x - c).norm();
    c += (x - c) / size;
    norm2_(a) = c.squaredNorm();
    moved(a);
    // The centroid moved by before/size: every old member is at most r + that from it.
    radius_(a) = std::max(radius_(a) + before / size, before * (size - 1) / size);
    if (Index(m.size()) >= exact_at_[std::size_t(a)]) exact_radius(a, key_of);
    if (k_ > 1 && Index(m.size()) * k_ > kSplitFactor * keys_) split_and_merge(a, key_of);
  }

  // The first K keys: one cluster each.
  template <typename KeyOf>
  void build(KeyOf key_of) {
    centroid_.setZero(k_ + 1, dim_);  // one spare row for the half of a split
    columns_.setZero(dim_, line_padded<Scalar>(k_ + 1));
    norm2_.setZero(k_ + 1);
    radius_.setZero(k_ + 1);
    members_.assign(std::size_t(k_ + 1), {});
    exact_at_.assign(std::size_t(k_ + 1), 0);
    for (Index c = 0; c < k_; ++c) {
      const std::int32_t j = waiting_[std::size_t(c)];
      centroid_.row(c) = row(key_of(j));
      norm2_(c) = centroid_.row(c).squaredNorm();
      moved(c);
      members_[std::size_t(c)] = {j};
      exact_at_[std::size_t(c)] = 2;
    }
    nn_.assign(std::size_t(k_ + 1), -1);
    nnd_.setZero(k_ + 1);
    fresh_.resize(std::size_t(k_));
    std::iota(fresh_.begin(), fresh_.end(), 0);
    refresh_rows(k_, -1, -1);
    waiting_.clear();
    waiting_.shrink_to_fit();
    built_ = true;
  }

  // The largest member distance to the centroid; the next exact radius at 9/8 of the size.
  template <typename KeyOf>
  void exact_radius(Index c, KeyOf key_of) {
    const auto& m = members_[std::size_t(c)];
    const auto centre = centroid_.row(c);
    Scalar r = 0;
    for (const std::int32_t j : m) r = std::max(r, (row(key_of(j)) - centre).norm());
    radius_(c) = r;
    const Index size = Index(m.size());
    exact_at_[std::size_t(c)] = size + std::max<Index>(1, size / 8);
  }

  // Mean of the members (in double, in member order), then the exact radius.
  template <typename KeyOf>
  void recentre(Index c, KeyOf key_of) {
    Eigen::Matrix<double, 1, Eigen::Dynamic> sum = Eigen::Matrix<double, 1, Eigen::Dynamic>::Zero(dim_);
    for (const std::int32_t j : members_[std::size_t(c)]) sum += row(key_of(j)).template cast<double>();
    centroid_.row(c) = (sum / double(members_[std::size_t(c)].size())).template cast<Scalar>();
    norm2_(c) = centroid_.row(c).squaredNorm();
    moved(c);
    exact_radius(c, key_of);
  }

  // Splits cluster a into a and a new cluster K (the spare row), then merges the closest pair.
  template <typename KeyOf>
  void split_and_merge(Index a, KeyOf key_of) {
    std::vector<std::int32_t>& m = members_[std::size_t(a)];
    const Index s = Index(m.size());
    // 2-means seeded by two distinct members drawn from Philox (seed, kv head, split count).
    const Philox rng(seed_, streams::kv_cache_clusters);
    const std::uint32_t lane = std::uint32_t(2 * head_);
    const Index i0 = std::min(s - 1, Index(rng.uniform(splits_, lane) * double(s)));
    Index i1 = std::min(s - 2, Index(rng.uniform(splits_, lane + 1) * double(s - 1)));
    if (i1 >= i0) ++i1;
    ++splits_;
    split_rows_.resize(s, dim_);
    for (Index u = 0; u < s; ++u) split_rows_.row(u) = row(key_of(m[std::size_t(u)]));
    RowMatrix<Scalar> halves(2, dim_);
    halves.row(0) = split_rows_.row(i0);
    halves.row(1) = split_rows_.row(i1);
    side_.resize(std::size_t(s));
    Index sizes[2];
    lloyd_steps<Scalar>(split_rows_, halves, kSplitSteps, side_.data(), sizes);
    if (sizes[1] == 0 || sizes[1] == s) {  // identical keys: cut by position
      for (Index u = 0; u < s; ++u) side_[std::size_t(u)] = u >= s / 2;
    }
    std::vector<std::int32_t>& other = members_[std::size_t(k_)];
    other.clear();
    Index kept = 0;
    for (Index u = 0; u < s; ++u) {
      if (side_[std::size_t(u)]) {
        other.push_back(m[std::size_t(u)]);
      } else {
        m[std::size_t(kept++)] = m[std::size_t(u)];
      }
    }
    m.resize(std::size_t(kept));
    recentre(a, key_of);
    recentre(k_, key_of);
    merge_closest(a, key_of);
  }

  // Rows [0, rows) after clusters c0 and c1 (c1 may be −1) moved: their nearest neighbours
  // are recomputed (with `apart`, not each other), and so are those of the rows whose neighbour
  // was one of them; every other row compares its neighbour with them. The dots of all the rows
  // recomputed come from one product, which reads the centroids once.
  void update_neighbours(Index rows, Index c0, Index c1, bool apart) {
    fresh_.assign({std::int32_t(c0)});
    if (c1 >= 0) fresh_.push_back(std::int32_t(c1));
    for (Index x = 0; x < rows; ++x) {
      const std::int32_t y = nn_[std::size_t(x)];
      if (x != c0 && x != c1 && (y == c0 || y == c1 || y < 0)) fresh_.push_back(std::int32_t(x));
    }
    refresh_rows(rows, apart ? c1 : -1, apart ? c0 : -1);
    // Rows 0 and 1 of the product are c0's and c1's dots.
    for (Index x = 0; x < rows; ++x) {
      if (std::find(fresh_.begin(), fresh_.end(), std::int32_t(x)) != fresh_.end()) continue;
      for (Index i = 0; i < (c1 >= 0 ? 2 : 1); ++i) {
        const Index c = fresh_[std::size_t(i)];
        const Scalar g = norm2_(x) + norm2_(c) - 2 * fresh_dots_(i, x);
        if (g < nnd_(x)) nnd_(x) = g, nn_[std::size_t(x)] = std::int32_t(c);
      }
    }
  }

  // The nearest other cluster among rows [0, rows) of every row in fresh_, from one product;
  // fresh_[0] never takes skip0 and fresh_[1] never skip1 (−1: no row is skipped).
  void refresh_rows(Index rows, Index skip0, Index skip1) {
    const Index m = Index(fresh_.size());
    fresh_rows_.resize(m, dim_);
    for (Index i = 0; i < m; ++i) fresh_rows_.row(i) = centroid_.row(fresh_[std::size_t(i)]);
    fresh_dots_.resize(m, rows);
    centroid_dots(fresh_dots_, fresh_rows_, rows);
    for (Index i = 0; i < m; ++i) {
      const Index x = fresh_[std::size_t(i)];
      const Index skip = i == 0 ? skip0 : i == 1 ? skip1 : -1;
      nn_[std::size_t(x)] = -1;
      nnd_(x) = std::numeric_limits<Scalar>::infinity();
      for (Index y = 0; y < rows; ++y) {
        if (y == x || y == skip) continue;
        const Scalar g = norm2_(x) + norm2_(y) - 2 * fresh_dots_(i, y);
        if (g < nnd_(x)) nnd_(x) = g, nn_[std::size_t(x)] = std::int32_t(y);
      }
    }
  }

  // Merges the two closest of the K + 1 clusters (the halves a and K just split are not
  // compared with each other; a pair whose union passes the split limit only if every pair does) and moves cluster K into the freed row. Each cluster keeps its
  // nearest neighbour, exact when computed (at the start, and for every cluster a split or
  // merge makes or changes, or whose neighbour it changes); the running means move centroids a
  // little in between, so the pair is the closest up to that drift, at O(K·d) per split.
  template <typename KeyOf>
  void merge_closest(Index a, KeyOf key_of) {
    const Index k1 = k_ + 1;
    update_neighbours(k1, a, k_, true);
    // The closest pair whose union stays within the split limit (else the closest): merging
    // two large clusters would only split again.
    Index bx = 0;
    bool bx_fits = false;
    for (Index x = 0; x < k1; ++x) {
      const std::size_t y = std::size_t(nn_[std::size_t(x)]);
      const bool fits = Index(members_[std::size_t(x)].size() + members_[y].size()) * k_ <=
                        kSplitFactor * keys_;
      if ((fits && !bx_fits) || (fits == bx_fits && nnd_(x) < nnd_(bx))) bx = x, bx_fits = fits;
    }
    Index by = nn_[std::size_t(bx)];
    if (by < bx) std::swap(bx, by);
    auto& into = members_[std::size_t(bx)];
    auto& from = members_[std::size_t(by)];
    const std::size_t mid = into.size();
    into.insert(into.end(), from.begin(), from.end());
    std::inplace_merge(into.begin(), into.begin() + std::ptrdiff_t(mid), into.end());
    from.clear();
    recentre(bx, key_of);
    if (by != k_) {
      std::swap(members_[std::size_t(by)], members_[std::size_t(k_)]);
      centroid_.row(by) = centroid_.row(k_);
      norm2_(by) = norm2_(k_);
      moved(by);
      radius_(by) = radius_(k_);
      exact_at_[std::size_t(by)] = exact_at_[std::size_t(k_)];
      nn_[std::size_t(by)] = nn_[std::size_t(k_)];
      nnd_(by) = nnd_(k_);
    }
    members_[std::size_t(k_)].clear();
    // Row K is gone: neighbours that were by (merged away) are recomputed; K is now row by.
    for (Index x = 0; x < k_; ++x) {
      std::int32_t& y = nn_[std::size_t(x)];
      if (y == by) y = -1;
      else if (y == k_) y = std::int32_t(by);
    }
    update_neighbours(k_, bx, -1, false);
  }

  Index dim_ = 0, k_ = 0;
  std::uint64_t seed_ = 0;
  Index head_ = 0;
  Index file_block_ = 1;
  Index keys_ = 0;
  std::uint64_t splits_ = 0;
  bool built_ = false;
  RowMatrix<Scalar> centroid_;  // (K + 1) x d: rows [0, K) in use, row K a split's scratch
  RowMatrix<Scalar> columns_;   // d x (K + 1, padded to whole cache lines): centroid_ transposed
  Vector<Scalar> norm2_, radius_;
  std::vector<std::vector<std::int32_t>> members_;  // ascending key indices
  std::vector<Index> exact_at_;                     // size at which the radius is recomputed
  std::vector<std::int32_t> waiting_;               // keys inserted before there are K
  std::vector<std::int32_t> pending_;               // keys of the block not filed yet
  RowMatrix<Scalar> block_;                         // their keys, while filing
  RowMatrix<Scalar> dots_;                          // their dots with the centroids
  Row gaps_;                                        // one key's squared distances, shifted
  std::vector<std::int32_t> moved_;                 // centroids moved since those dots
  std::vector<std::int32_t> side_;  // a split's halves (0 or 1) per member
  RowMatrix<Scalar> split_rows_;    // a split's members' keys
  std::vector<std::int32_t> fresh_;  // clusters whose nearest neighbour is recomputed
  RowMatrix<Scalar> fresh_rows_, fresh_dots_;  // their centroids, and dots with every centroid
  std::vector<std::int32_t> nn_;  // nearest other cluster
  Vector<Scalar> nnd_;            // its squared distance
};

}  // namespace randattn::detail
