// LSH attention: rotations, cross-polytope hashing, sort-and-chunk and exact-bucket attention,
// checked against brute-force references that rebuild every token's target set from the same
// hash codes (std::stable_sort, std::map counts, double precision softmax).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::CrossPolytopeHash;
using randattn::HashCodes;
using randattn::Index;
using randattn::LshOptions;
using randattn::RotationKind;
using randattn::RowMatrix;
using testing::rel_error;

namespace {

using Targets = std::vector<std::map<Index, int>>;  // token -> (key -> number of rounds)

// Reformer chunks: per round, stable sort by bucket (ties by position), chunks of c, each chunk
// sees itself and the previous chunk (cyclically; a lone chunk sees itself once).
Targets chunk_targets(const HashCodes& codes, Index c) {
  const Index n = codes.rows(), chunks = (n + c - 1) / c;
  Targets t(static_cast<std::size_t>(n));
  for (Index rho = 0; rho < codes.cols(); ++rho) {
    std::vector<Index> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), Index(0));
    std::stable_sort(order.begin(), order.end(),
                     [&](Index a, Index b) { return codes(a, rho) < codes(b, rho); });
    const auto members = [&](Index g) {
      return std::vector<Index>(order.begin() + g * c, order.begin() + std::min(n, (g + 1) * c));
    };
    for (Index g = 0; g < chunks; ++g) {
      std::vector<Index> seen = members(g);
      if (chunks > 1) {
        const std::vector<Index> prev = members((g + chunks - 1) % chunks);
        seen.insert(seen.end(), prev.begin(), prev.end());
      }
      for (Index i : members(g))
        for (Index j : seen) ++t[static_cast<std::size_t>(i)][j];
    }
  }
  return t;
}

// Separate-key sort-and-chunk (HyperAttention's sortLSH): per round queries and keys are stably
// sorted by bucket (ties by position), each on its own; G = ceil(n_q / c) query chunks of c sorted
// queries (c >= n_q counts as c = n_q) and G key chunks of c_k = ceil(c n_k / n_q) sorted keys
// (trailing ones short or empty); query chunk g sees key chunks g and g - 1 (cyclically; with a
// single chunk, key chunk 0 once). The key set of each row is the union over rounds, the counts
// the multiset.
Targets separate_chunk_targets(const HashCodes& qc, const HashCodes& kc, Index chunk) {
  const Index n_q = qc.rows(), n_k = kc.rows();
  const Index c = std::min(chunk, n_q), chunks = (n_q + c - 1) / c;
  const Index ck = (c * n_k + n_q - 1) / n_q;
  Targets t(static_cast<std::size_t>(n_q));
  for (Index rho = 0; rho < qc.cols(); ++rho) {
    const auto sorted = [&](const HashCodes& codes) {
      std::vector<Index> order(static_cast<std::size_t>(codes.rows()));
      std::iota(order.begin(), order.end(), Index(0));
      std::stable_sort(order.begin(), order.end(),
                       [&](Index a, Index b) { return codes(a, rho) < codes(b, rho); });
      return order;
    };
    // Entries [g len, (g + 1) len) of `order`, cut at its end.
    const auto piece = [](const std::vector<Index>& order, Index g, Index len) {
      const Index size = Index(order.size());
      const Index begin = std::min(size, g * len), end = std::min(size, (g + 1) * len);
      return std::vector<Index>(order.begin() + begin, order.begin() + end);
    };
    const std::vector<Index> qo = sorted(qc), ko = sorted(kc);
    for (Index g = 0; g < chunks; ++g) {
      std::vector<Index> seen = piece(ko, g, ck);
      if (chunks > 1) {
        const std::vector<Index> prev = piece(ko, (g + chunks - 1) % chunks, ck);
        seen.insert(seen.end(), prev.begin(), prev.end());
      }
      for (Index i : piece(qo, g, c))
        for (Index j : seen) ++t[static_cast<std::size_t>(i)][j];
    }
  }
  return t;
}

// Rows whose target set holds no valid key (causal: no j <= i): the fallback rows.
std::vector<Index> rows_without_valid_targets(const Targets& targets, bool causal) {
  std::vector<Index> rows;
  for (Index i = 0; i < Index(targets.size()); ++i) {
    const auto& row = targets[static_cast<std::size_t>(i)];
    if (std::none_of(row.begin(), row.end(),
                     [&](const auto& jc) { return !causal || jc.first <= i; }))
      rows.push_back(i);
  }
  return rows;
}

// Exact buckets: query i sees key j in round rho when their codes agree.
Targets bucket_targets(const HashCodes& qc, const HashCodes& kc) {
  Targets t(static_cast<std::size_t>(qc.rows()));
  for (Index rho = 0; rho < qc.cols(); ++rho)
    for (Index i = 0; i < qc.rows(); ++i)
      for (Index j = 0; j < kc.rows(); ++j)
        if (qc(i, rho) == kc(j, rho)) ++t[static_cast<std::size_t>(i)][j];
  return t;
}

Eigen::MatrixXd unit_rows(const Eigen::MatrixXd& x) {
  Eigen::MatrixXd u = x;
  for (Index i = 0; i < x.rows(); ++i)
    if (x.row(i).norm() > 0) u.row(i) /= x.row(i).norm();
  return u;
}

// softmax over the target sets, in double. Shared QK (k empty): keys are the normalised queries
// and token i sees itself only when it has no other valid target. Separate keys: a query without
// valid targets attends to all valid keys. dedupe: each target once; otherwise weighted by count.
template <typename Scalar>
Eigen::MatrixXd reference(const RowMatrix<Scalar>& q_, const RowMatrix<Scalar>* k_,
                          const RowMatrix<Scalar>& v_, const Targets& targets, double scale,
                          bool causal, bool dedupe) {
  const Eigen::MatrixXd q = q_.template cast<double>(), v = v_.template cast<double>();
  const Eigen::MatrixXd keys = k_ ? Eigen::MatrixXd(k_->template cast<double>()) : unit_rows(q);
  Eigen::MatrixXd out = Eigen::MatrixXd::Zero(q.rows(), v.cols());
  for (Index i = 0; i < q.rows(); ++i) {
    std::map<Index, int> valid;
    for (const auto& [j, count] : targets[static_cast<std::size_t>(i)])
      if (!(causal && j > i) && !(!k_ && j == i)) valid[j] = dedupe ? 1 : count;
    if (valid.empty()) {
      if (!k_) {
        out.row(i) = v.row(i);
        continue;
      }
      for (Index j = 0; j < keys.rows(); ++j)
        if (!(causal && j > i)) valid[j] = 1;
    }
    out.row(i) = testing::softmax_over_targets(q, i, keys, v, valid, scale);
  }
  return out;
}

using testing::clustered;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Rotations and hashing
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Hadamard rotation equals H D3 H D2 H D1 / p^{3/2} and preserves norms", "[lsh]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  struct Case {
    Index d, buckets;
  };
  for (const Case c : {Case{50, 16}, Case{64, 512}, Case{3, 2}, Case{1, 8}, Case{16, 16}}) {
    INFO("d " << c.d << " buckets " << c.buckets);
    const randattn::HadamardRotation<Scalar> rot(c.d, c.buckets, 2, 11);
    const Index p = rot.padded_dim();
    CHECK(p == randattn::next_power_of_two(std::max(c.d, c.buckets / 2)));
    // Explicit Sylvester matrix H_p: H(a, b) = (-1)^popcount(a & b).
    Eigen::MatrixXd h(p, p);
    for (Index a = 0; a < p; ++a)
      for (Index b = 0; b < p; ++b)
        h(a, b) = (__builtin_popcountll(std::uint64_t(a & b)) % 2) ? -1.0 : 1.0;
    const RowMatrix<Scalar> x = testing::gaussian<Scalar>(3, 37, c.d, 3.0);
    for (Index round = 0; round < 2; ++round) {
      const Eigen::MatrixXd diag = rot.diagonals().template cast<double>();
      const Eigen::MatrixXd m = h * diag.row(3 * round + 2).asDiagonal() * h *
                                diag.row(3 * round + 1).asDiagonal() * h *
                                diag.row(3 * round).asDiagonal() / std::pow(double(p), 1.5);
      Eigen::MatrixXd xp = Eigen::MatrixXd::Zero(x.rows(), p);
      xp.leftCols(c.d) = x.template cast<double>();
      const Eigen::MatrixXd expected = xp * m.transpose();
      const RowMatrix<Scalar> y = rot.rotate(x, round);
      CHECK(rel_error(y, expected) < testing::tolerance<Scalar>());
      // Norm preservation, row by row.
      for (Index i = 0; i < x.rows(); ++i) {
        const double nx = x.row(i).template cast<double>().norm();
        CHECK(std::abs(y.row(i).template cast<double>().norm() - nx) <=
              testing::tolerance<Scalar>() * nx);
      }
      // The projection used by the hash (first h coordinates, folded transform) agrees.
      RowMatrix<Scalar> work;
      const RowMatrix<Scalar> proj = rot.project_round(x, round, work).transpose();
      CHECK(rel_error(proj, expected.leftCols(c.buckets / 2)) < testing::tolerance<Scalar>());
    }
    CHECK_THROWS_AS(rot.rotate(x, 2), std::invalid_argument);
  }
}

TEMPLATE_TEST_CASE(
    "Fused hash argmax equals a scalar argmax over the rotation's projections, ties included",
    "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  struct Case {
    Index d, buckets;
  };
  // Shapes with h below, at and above one SIMD packet, h not a power of two, folded Hadamard
  // rounds (h < p) and n not a multiple of the tile or packet widths.
  for (const Case c :
       {Case{64, 128}, Case{24, 10}, Case{5, 6}, Case{64, 16}, Case{3, 200}, Case{1, 2}}) {
    INFO("d " << c.d << " buckets " << c.buckets);
    const Index n = 1000, rounds = 2, half = c.buckets / 2;
    RowMatrix<Scalar> x = testing::gaussian<Scalar>(8, n, c.d);
    x.row(3).setZero();                  // all coordinates tie: bucket 0
    x.row(17) = x.row(16).cwiseAbs();    // nonnegative input
    x.row(18).setConstant(Scalar(0.5));  // repeated entries: ties in the dense projections
    for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
      const CrossPolytopeHash<Scalar> hash(kind, c.d, c.buckets, rounds, 21);
      const HashCodes codes = hash.hash(x);
      for (Index rho = 0; rho < rounds; ++rho) {
        // Projections of the same tiles the hash rotates (a GEMM's rounding may depend on its
        // width), h x n.
        RowMatrix<Scalar> y(half, n), work;
        for (Index i0 = 0; i0 < n; i0 += randattn::detail::kHashTile) {
          const Index count = std::min(randattn::detail::kHashTile, n - i0);
          const auto tile = x.middleRows(i0, count);
          if (kind == RotationKind::dense)
            y.middleCols(i0, count) = hash.dense_rotation()->project_round(tile, rho, work);
          else
            y.middleCols(i0, count) = hash.hadamard_rotation()->project_round(tile, rho, work);
        }
        Index mismatches = 0;
        for (Index i = 0; i < n; ++i) {
          // First maximum of [y; -y], positive half first.
          Index best = 0;
          Scalar top = y(0, i);
          for (Index k = 0; k < 2 * half; ++k) {
            const Scalar v = k < half ? y(k, i) : -y(k - half, i);
            if (v > top) top = v, best = k;
          }
          mismatches += codes(i, rho) != best;
        }
        CHECK(mismatches == 0);
      }
      CHECK(codes(3, 0) == 0);
    }
  }
}

TEST_CASE("Default rotation: dense while d h <= 6 p log2 p, Hadamard beyond", "[lsh]") {
  using randattn::default_rotation;
  CHECK(default_rotation(64, 16) == RotationKind::dense);      // 512 <= 6 * 64 * 6
  CHECK(default_rotation(64, 64) == RotationKind::dense);      // 2048 <= 2304
  CHECK(default_rotation(64, 128) == RotationKind::hadamard);  // 4096 > 2304
  CHECK(default_rotation(256, 64) == RotationKind::dense);     // 8192 <= 6 * 256 * 8
  CHECK(default_rotation(256, 512) == RotationKind::hadamard);
  CHECK(default_rotation(4, 4) == RotationKind::dense);  // 8 <= 6 * 4 * 2
  const CrossPolytopeHash<float> by_default(64, 128, 2, 5),
      explicit_kind(RotationKind::hadamard, 64, 128, 2, 5);
  CHECK(by_default.kind() == RotationKind::hadamard);
  const RowMatrix<float> x = testing::gaussian<float>(2, 100, 64);
  CHECK(by_default.hash(x) == explicit_kind.hash(x));
  CHECK(CrossPolytopeHash<float>(64, 16, 2, 5).kind() == RotationKind::dense);
  CHECK_THROWS_AS(CrossPolytopeHash<float>(0, 16, 2, 5), std::invalid_argument);
}

TEMPLATE_TEST_CASE("Cross-polytope codes are argmax([xR; -xR])", "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 500, d = 24, buckets = 10, rounds = 3;
  const RowMatrix<Scalar> x = testing::gaussian<Scalar>(5, n, d);
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    const CrossPolytopeHash<Scalar> hash(kind, d, buckets, rounds, 99);
    CHECK(hash.kind() == kind);
    CHECK(hash.buckets() == buckets);
    CHECK(hash.rounds() == rounds);
    const HashCodes codes = hash.hash(x);
    REQUIRE(codes.rows() == n);
    REQUIRE(codes.cols() == rounds);
    Index checked = 0;
    for (Index rho = 0; rho < rounds; ++rho) {
      // Reference projections in double.
      Eigen::MatrixXd y;
      if (kind == RotationKind::dense) {
        y = x.template cast<double>() *
            hash.dense_rotation()->matrix().template cast<double>().middleCols(rho * buckets / 2,
                                                                               buckets / 2);
      } else {
        y = hash.hadamard_rotation()->rotate(x, rho).template cast<double>().leftCols(buckets / 2);
      }
      for (Index i = 0; i < n; ++i) {
        Eigen::VectorXd both(buckets);
        both << y.row(i).transpose(), -y.row(i).transpose();
        Eigen::Index arg;
        const double top = both.maxCoeff(&arg);
        both(arg) = -INFINITY;
        // Skip near ties, where rounding of the projection may decide.
        if (top - both.maxCoeff() < 1e-4 * top) continue;
        ++checked;
        CHECK(codes(i, rho) == arg);
      }
    }
    CHECK(checked > 0.95 * n * rounds);
  }
}

TEMPLATE_TEST_CASE("Cross-polytope hash: ranges, scaling, zero vector, seeds, blocks", "[lsh]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 300, d = 20, buckets = 12, rounds = 4;
  RowMatrix<Scalar> x = testing::gaussian<Scalar>(8, n, d);
  x.row(7).setZero();
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    INFO("kind " << int(kind));
    const CrossPolytopeHash<Scalar> hash(kind, d, buckets, rounds, 5);
    const HashCodes codes = hash.hash(x);
    CHECK(codes.minCoeff() >= 0);
    CHECK(codes.maxCoeff() < buckets);
    CHECK((codes.row(7).array() == 0).all());  // zero vector: first entry of the tie
    // Positive scaling by a power of two is exact, so the codes are identical; negation flips the
    // half.
    CHECK(hash.hash(RowMatrix<Scalar>(Scalar(4) * x)) == codes);
    const HashCodes neg = hash.hash(RowMatrix<Scalar>(-x));
    for (Index i = 0; i < n; ++i)
      if (i != 7)
        for (Index rho = 0; rho < rounds; ++rho)
          CHECK(neg(i, rho) == (codes(i, rho) + buckets / 2) % buckets);
    // Same seed, same codes; another seed, other codes; any sub-block hashes alike.
    CHECK(CrossPolytopeHash<Scalar>(kind, d, buckets, rounds, 5).hash(x) == codes);
    CHECK(CrossPolytopeHash<Scalar>(kind, d, buckets, rounds, 6).hash(x) != codes);
    CHECK(hash.hash(x.middleRows(70, 101)) == codes.middleRows(70, 101));
    // Every bucket is used.
    std::vector<int> used(buckets, 0);
    for (Index i = 0; i < codes.size(); ++i) used[codes.data()[i]] = 1;
    CHECK(std::accumulate(used.begin(), used.end(), 0) == buckets);
    // Errors.
    CHECK_THROWS_AS(hash.hash(testing::gaussian<Scalar>(1, 3, d + 1)), std::invalid_argument);
    RowMatrix<Scalar> bad = x;
    bad(3, 4) = std::numeric_limits<Scalar>::quiet_NaN();
    CHECK_THROWS_AS(hash.hash(bad), std::invalid_argument);
  }
  // A user-supplied R is used as given.
  const CrossPolytopeHash<Scalar> drawn(RotationKind::dense, d, buckets, rounds, 5);
  const CrossPolytopeHash<Scalar> given(drawn.dense_rotation()->matrix(), rounds);
  CHECK(given.hash(x) == drawn.hash(x));
  CHECK(given.hadamard_rotation() == nullptr);
  CHECK_THROWS_AS(CrossPolytopeHash<Scalar>(RowMatrix<Scalar>::Ones(d, 7), 2),
                  std::invalid_argument);
  CHECK_THROWS_AS(CrossPolytopeHash<Scalar>(RotationKind::dense, d, 7, 2, 0),
                  std::invalid_argument);
  CHECK_THROWS_AS(CrossPolytopeHash<Scalar>(RotationKind::hadamard, d, 8, 0, 0),
                  std::invalid_argument);
  CHECK_THROWS_AS(CrossPolytopeHash<Scalar>(RotationKind::hadamard, 0, 8, 1, 0),
                  std::invalid_argument);
}

TEST_CASE("Collision rate of two unit vectors falls as their angle grows", "[lsh]") {
  // Rounds use independent rotations, so over N rounds the number of collisions of a fixed pair
  // is Binomial(N, p(theta)). Consecutive angles must differ in estimated rate by more than 4
  // standard errors of the difference, sqrt(p1(1-p1)/N + p2(1-p2)/N) <= sqrt(0.5/N) = 0.013 for
  // N = 3000, i.e. by 0.052 at most; the smallest gap of the rates (about 0.79, 0.45, 0.2, 0.07,
  // 0.01 at 15..135 degrees for h = 4 coordinates) is about 0.06 and there the rates are small,
  // so the required margin is 4 * 0.005.
  const Index d = 16, buckets = 8, rounds = 3000;
  const std::vector<double> degrees = {0, 15, 45, 75, 105, 135, 180};
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    const CrossPolytopeHash<double> hash(kind, d, buckets, rounds, 2024);
    RowMatrix<double> x = RowMatrix<double>::Zero(Index(degrees.size()) + 1, d);
    // A generic base direction u and a unit vector w orthogonal to it.
    const RowMatrix<double> g = testing::gaussian<double>(77, 2, d);
    const Eigen::RowVectorXd u = g.row(0).normalized();
    const Eigen::RowVectorXd w = (g.row(1) - g.row(1).dot(u) * u).normalized();
    x.row(0) = u;
    for (std::size_t a = 0; a < degrees.size(); ++a) {
      const double t = degrees[a] * M_PI / 180.0;
      x.row(Index(a) + 1) = std::cos(t) * u + std::sin(t) * w;
    }
    const HashCodes codes = hash.hash(x);
    std::vector<double> rate;
    for (std::size_t a = 0; a < degrees.size(); ++a)
      rate.push_back(
          (codes.row(0).array() == codes.row(Index(a) + 1).array()).template cast<double>().mean());
    INFO("kind " << int(kind) << " rates " << rate[0] << " " << rate[1] << " " << rate[2] << " "
                 << rate[3] << " " << rate[4] << " " << rate[5] << " " << rate[6]);
    CHECK(rate.front() == 1.0);  // same vector
    CHECK(rate.back() == 0.0);   // antipodal: the sign flips the half
    for (std::size_t a = 0; a + 2 < degrees.size(); ++a) {
      const double se =
          std::sqrt(rate[a] * (1 - rate[a]) / rounds + rate[a + 1] * (1 - rate[a + 1]) / rounds);
      CHECK(rate[a] - rate[a + 1] > 4 * se);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention against brute force
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Single chunk (c >= n) equals exact shared-QK attention with the self rule",
                   "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 150, d = 16, dv = 5;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(21, n, d),
                          v = testing::gaussian<Scalar>(22, n, dv);
  Targets all(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i)
    for (Index j = 0; j < n; ++j) all[static_cast<std::size_t>(i)][j] = 1;
  for (bool causal : {false, true}) {
    for (double scale : {1.0, 0.7}) {
      const Eigen::MatrixXd expected = reference<Scalar>(q, nullptr, v, all, scale, causal, true);
      LshOptions opt;
      opt.causal = causal;
      opt.scale = scale;
      for (Index chunk : {n, n + 1, Index(1) << 40}) {
        for (Index rounds : {1, 3}) {
          for (bool dedupe : {true, false}) {
            INFO("causal " << causal << " scale " << scale << " chunk " << chunk << " rounds "
                           << rounds << " dedupe " << dedupe);
            opt.chunk = chunk;
            opt.dedupe = dedupe;
            const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 8, rounds, 3);
            CHECK(rel_error(randattn::lsh_attention(hash, q, v, opt), expected) <
                  testing::tolerance<Scalar>());
          }
        }
      }
      CHECK(rel_error(randattn::shared_qk_attention(q, v, opt), expected) <
            testing::tolerance<Scalar>());
    }
  }
}

TEMPLATE_TEST_CASE(
    "Sort-and-chunk equals softmax over the union (multiset) of targets from the same hashes",
    "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index d = 12, dv = 6;
  struct Case {
    Index n, chunk, buckets;
  };
  // n a multiple of c with several chunks, two chunks (each the other's predecessor), and n not a
  // multiple of c (a short last chunk).
  for (const Case c : {Case{96, 16, 8}, Case{64, 32, 4}, Case{100, 16, 6}}) {
    const RowMatrix<Scalar> q = clustered<Scalar>(31 + c.n, c.n, d, 5, 0.6);
    const RowMatrix<Scalar> v = testing::gaussian<Scalar>(33, c.n, dv);
    for (Index rounds = 1; rounds <= 4; ++rounds) {
      for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
        const CrossPolytopeHash<Scalar> hash(kind, d, c.buckets, rounds, 1000 + rounds);
        const Targets targets = chunk_targets(hash.hash(q), c.chunk);
        for (bool causal : {false, true}) {
          for (bool dedupe : {true, false}) {
            INFO("n " << c.n << " chunk " << c.chunk << " rounds " << rounds << " kind "
                      << int(kind) << " causal " << causal << " dedupe " << dedupe);
            LshOptions opt;
            opt.chunk = c.chunk;
            opt.causal = causal;
            opt.dedupe = dedupe;
            opt.scale = 0.8;
            const Eigen::MatrixXd expected =
                reference<Scalar>(q, nullptr, v, targets, 0.8, causal, dedupe);
            CHECK(rel_error(randattn::lsh_attention(hash, q, v, opt), expected) <
                  testing::tolerance<Scalar>());
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("The correction matters: union and multiset differ once rounds overlap", "[lsh]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 96, d = 12;
  const RowMatrix<Scalar> q = clustered<Scalar>(41, n, d, 4, 0.5),
                          v = testing::gaussian<Scalar>(42, n, 4);
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 8, 4, 7);
  LshOptions with, without;
  with.chunk = without.chunk = 16;
  with.scale = without.scale = 1;
  without.dedupe = false;
  CHECK(rel_error(randattn::lsh_attention(hash, q, v, with),
                  randattn::lsh_attention(hash, q, v, without)) > 1e-3);
}

TEMPLATE_TEST_CASE("Exact buckets equal softmax over the union of bucket mates, with the fallback",
                   "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n_q = 90, n_k = 90, d = 10, dv = 4;
  const RowMatrix<Scalar> q = clustered<Scalar>(51, n_q, d, 6, 0.7);
  RowMatrix<Scalar> k = clustered<Scalar>(53, n_k, d, 6, 0.7);
  // Keys crowded around one direction leave most query buckets without keys: the fallback runs.
  RowMatrix<Scalar> crowded = testing::gaussian<Scalar>(55, n_k, d, 0.05);
  crowded.col(0).array() += Scalar(1);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(57, n_k, dv);
  for (Index rounds = 1; rounds <= 4; ++rounds) {
    const CrossPolytopeHash<Scalar> hash(RotationKind::hadamard, d, 16, rounds, 300 + rounds);
    const HashCodes qc = hash.hash(q);
    for (const RowMatrix<Scalar>* keys : {&k, &crowded}) {
      const Targets targets = bucket_targets(qc, hash.hash(*keys));
      for (bool causal : {false, true}) {
        for (bool dedupe : {true, false}) {
          INFO("rounds " << rounds << " crowded " << (keys == &crowded) << " causal " << causal
                         << " dedupe " << dedupe);
          LshOptions opt;
          opt.exact_buckets = true;
          opt.causal = causal;
          opt.dedupe = dedupe;
          opt.scale = 0.5;
          const RowMatrix<Scalar> out = randattn::lsh_attention(hash, q, *keys, v, opt);
          CHECK(out.allFinite());
          CHECK(rel_error(out, reference<Scalar>(q, keys, v, targets, 0.5, causal, dedupe)) <
                testing::tolerance<Scalar>());
        }
      }
    }
    // Shared QK with exact buckets: normalised keys, self rule.
    const Targets shared = bucket_targets(qc, qc);
    const RowMatrix<Scalar> vq = testing::gaussian<Scalar>(59, n_q, dv);
    for (bool causal : {false, true}) {
      LshOptions opt;
      opt.exact_buckets = true;
      opt.causal = causal;
      opt.scale = 1;
      CHECK(rel_error(randattn::lsh_attention(hash, q, vq, opt),
                      reference<Scalar>(q, nullptr, vq, shared, 1.0, causal, true)) <
            testing::tolerance<Scalar>());
    }
  }
}

TEMPLATE_TEST_CASE("Large buckets and chunks are tiled and still exact", "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  // Few buckets and c > tile: buckets of hundreds of tokens and chunk pairs of 600 keys.
  const Index n = 700, d = 8, dv = 3;
  const RowMatrix<Scalar> q = clustered<Scalar>(61, n, d, 3, 0.4),
                          v = testing::gaussian<Scalar>(62, n, dv);
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 4, 2, 8);
  const HashCodes codes = hash.hash(q);
  for (bool causal : {false, true}) {
    LshOptions opt;
    opt.causal = causal;
    opt.chunk = 300;
    opt.scale = 1;
    CHECK(rel_error(randattn::lsh_attention(hash, q, v, opt),
                    reference<Scalar>(q, nullptr, v, chunk_targets(codes, 300), 1.0, causal,
                                      true)) < testing::tolerance<Scalar>());
    opt.exact_buckets = true;
    CHECK(rel_error(randattn::lsh_attention(hash, q, v, opt),
                    reference<Scalar>(q, nullptr, v, bucket_targets(codes, codes), 1.0, causal,
                                      true)) < testing::tolerance<Scalar>());
  }
}

TEMPLATE_TEST_CASE(
    "Separate-key sort-and-chunk equals softmax over the union (multiset) of sorted chunk pairs",
    "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index d = 10, dv = 4;
  struct Case {
    Index n_q, n_k, buckets;
  };
  // n_q == n_k (causal too), more queries than keys, more keys than queries, and far fewer keys
  // than query chunks (empty key chunks: their queries fall back to all keys).
  for (const Case c :
       {Case{96, 96, 8}, Case{100, 37, 6}, Case{50, 130, 8}, Case{60, 5, 4}, Case{33, 33, 4}}) {
    const RowMatrix<Scalar> q = clustered<Scalar>(131 + c.n_q, c.n_q, d, 5, 0.6);
    const RowMatrix<Scalar> k = clustered<Scalar>(137 + c.n_k, c.n_k, d, 5, 0.6);
    const RowMatrix<Scalar> v = testing::gaussian<Scalar>(139, c.n_k, dv);
    for (Index rounds = 1; rounds <= 3; ++rounds) {
      for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
        const CrossPolytopeHash<Scalar> hash(kind, d, c.buckets, rounds, 700 + rounds);
        const HashCodes qc = hash.hash(q), kc = hash.hash(k);
        for (Index chunk :
             {Index(1), Index(4), Index(7), Index(16), c.n_q, c.n_q + 3, Index(1) << 40}) {
          const Targets targets = separate_chunk_targets(qc, kc, chunk);
          for (bool causal : {false, true}) {
            if (causal && c.n_q != c.n_k) continue;
            for (bool dedupe : {true, false}) {
              INFO("n_q " << c.n_q << " n_k " << c.n_k << " rounds " << rounds << " kind "
                          << int(kind) << " chunk " << chunk << " causal " << causal << " dedupe "
                          << dedupe);
              LshOptions opt;
              opt.chunk = chunk;
              opt.causal = causal;
              opt.dedupe = dedupe;
              opt.scale = 0.6;
              const RowMatrix<Scalar> out = randattn::lsh_attention(hash, q, k, v, opt);
              CHECK(out.allFinite());
              CHECK(rel_error(out, reference<Scalar>(q, &k, v, targets, 0.6, causal, dedupe)) <
                    testing::tolerance<Scalar>());
            }
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("Many rounds: the union counted once per pair is still the exact union",
                   "[lsh]", RANDATTN_TEST_SCALARS) {
  // Beyond detail::kCountTableRounds the duplicate counts come from a per-query table built once
  // instead of a pass over the rounds per pair: every mode must still give the union.
  using Scalar = TestType;
  const Index n = 72, n_k = 60, d = 10, dv = 3, rounds = randattn::detail::kCountTableRounds + 5;
  const RowMatrix<Scalar> q = clustered<Scalar>(151, n, d, 4, 0.5),
                          k = clustered<Scalar>(152, n_k, d, 4, 0.5),
                          vq = testing::gaussian<Scalar>(153, n, dv),
                          vk = testing::gaussian<Scalar>(154, n_k, dv);
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 8, rounds, 17);
  const HashCodes qc = hash.hash(q), kc = hash.hash(k);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    LshOptions opt;
    opt.chunk = 16;
    opt.causal = causal;
    opt.scale = 0.7;
    CHECK(rel_error(randattn::lsh_attention(hash, q, vq, opt),
                    reference<Scalar>(q, nullptr, vq, chunk_targets(qc, 16), 0.7, causal, true)) <
          testing::tolerance<Scalar>());
    if (!causal) {
      CHECK(rel_error(randattn::lsh_attention(hash, q, k, vk, opt),
                      reference<Scalar>(q, &k, vk, separate_chunk_targets(qc, kc, 16), 0.7, false,
                                        true)) < testing::tolerance<Scalar>());
    }
    opt.exact_buckets = true;
    if (!causal) {
      CHECK(rel_error(randattn::lsh_attention(hash, q, k, vk, opt),
                      reference<Scalar>(q, &k, vk, bucket_targets(qc, kc), 0.7, false, true)) <
            testing::tolerance<Scalar>());
    }
    CHECK(rel_error(randattn::lsh_attention(hash, q, vq, opt),
                    reference<Scalar>(q, nullptr, vq, bucket_targets(qc, qc), 0.7, causal, true)) <
          testing::tolerance<Scalar>());
  }
}

TEMPLATE_TEST_CASE("Separate-key sort-and-chunk: pairs seen in several rounds count once", "[lsh]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n_q = 120, n_k = 80, d = 12;
  const RowMatrix<Scalar> q = clustered<Scalar>(141, n_q, d, 4, 0.5),
                          k = clustered<Scalar>(142, n_k, d, 4, 0.5),
                          v = testing::gaussian<Scalar>(143, n_k, 4);
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 8, 4, 7);
  const Targets targets = separate_chunk_targets(hash.hash(q), hash.hash(k), 16);
  // The rounds overlap, so the union and the multiset differ, and the correction matters.
  Index repeated = 0;
  for (const auto& row : targets)
    for (const auto& jc : row) repeated += jc.second > 1;
  REQUIRE(repeated > 0);
  LshOptions with, without;
  with.chunk = without.chunk = 16;
  with.scale = without.scale = 1;
  without.dedupe = false;
  CHECK(rel_error(randattn::lsh_attention(hash, q, k, v, with),
                  randattn::lsh_attention(hash, q, k, v, without)) > 1e-3);
}

TEMPLATE_TEST_CASE(
    "Separate-key sort-and-chunk: a query without a valid key attends to all of them", "[lsh]",
    RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 64, d = 8, dv = 3;
  const RowMatrix<Scalar> q = clustered<Scalar>(151, n, d, 4, 0.5),
                          k = clustered<Scalar>(152, n, d, 4, 0.5),
                          v = testing::gaussian<Scalar>(153, n, dv);
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 8, 1, 9);
  // Exact softmax of query i over keys [0, end), in double.
  const auto all_keys = [&](Index i, Index end, double scale) {
    std::map<Index, int> valid;
    for (Index j = 0; j < end; ++j) valid[j] = 1;
    return testing::softmax_over_targets(q.template cast<double>(), i, k.template cast<double>(),
                                         v.template cast<double>(), valid, scale);
  };
  // Causal with chunks of one: query i sees two keys per round, often both later than i.
  LshOptions opt;
  opt.causal = true;
  opt.chunk = 1;
  opt.scale = 0.9;
  const std::vector<Index> causal_rows =
      rows_without_valid_targets(separate_chunk_targets(hash.hash(q), hash.hash(k), 1), true);
  REQUIRE(causal_rows.size() >= 5);
  RowMatrix<Scalar> out = randattn::lsh_attention(hash, q, k, v, opt);
  REQUIRE(out.allFinite());
  for (Index i : causal_rows) {
    INFO("causal row " << i);
    CHECK((out.row(i).template cast<double>() - all_keys(i, i + 1, 0.9)).norm() <
          10 * testing::tolerance<Scalar>());
  }
  // Bidirectional, four keys for 16 query chunks of 4: most key chunks are empty.
  const RowMatrix<Scalar> few = k.topRows(4), few_v = v.topRows(4);
  opt.causal = false;
  opt.chunk = 4;
  const std::vector<Index> empty_rows =
      rows_without_valid_targets(separate_chunk_targets(hash.hash(q), hash.hash(few), 4), false);
  REQUIRE(empty_rows.size() >= 8);
  out = randattn::lsh_attention(hash, q, few, few_v, opt);
  REQUIRE(out.allFinite());
  for (Index i : empty_rows) {
    INFO("row " << i);
    std::map<Index, int> valid;
    for (Index j = 0; j < 4; ++j) valid[j] = 1;
    const Eigen::RowVectorXd expected =
        testing::softmax_over_targets(q.template cast<double>(), i, few.template cast<double>(),
                                      few_v.template cast<double>(), valid, 0.9);
    CHECK((out.row(i).template cast<double>() - expected).norm() <
          10 * testing::tolerance<Scalar>());
  }
}

// ---------------------------------------------------------------------------------------------
// Causality, batching, threads, edge cases
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Causal: changing the last token leaves earlier outputs bit-identical", "[lsh]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 200, d = 16, dv = 8;
  const RowMatrix<Scalar> q = clustered<Scalar>(71, n, d, 5, 0.5),
                          k = clustered<Scalar>(72, n, d, 5, 0.5);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(73, n, dv);
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 8, 3, 12);
  LshOptions opt;
  opt.causal = true;
  opt.chunk = 16;
  opt.scale = 1;

  // Exact buckets: any change of token n-1 (query, key, value).
  RowMatrix<Scalar> q2 = q, k2 = k, v2 = v;
  q2.row(n - 1) = testing::gaussian<Scalar>(74, 1, d, 3.0);
  k2.row(n - 1) = testing::gaussian<Scalar>(75, 1, d, 3.0);
  v2.row(n - 1) = testing::gaussian<Scalar>(76, 1, dv, 3.0);
  REQUIRE(hash.hash(q2).row(n - 1) != hash.hash(q).row(n - 1));
  opt.exact_buckets = true;
  RowMatrix<Scalar> a = randattn::lsh_attention(hash, q, k, v, opt),
                    b = randattn::lsh_attention(hash, q2, k2, v2, opt);
  CHECK(testing::rows_bit_identical(a, b, n - 1));
  CHECK(!testing::rows_bit_identical(a, b, n));
  a = randattn::lsh_attention(hash, q, v, opt);
  b = randattn::lsh_attention(hash, q2, v2, opt);
  CHECK(testing::rows_bit_identical(a, b, n - 1));

  // Sort-and-chunk: any change of token n-1 that keeps its buckets. A change of its buckets
  // moves the chunk boundaries behind it in the sorted order, so by the definition itself (the
  // brute-force target sets) earlier tokens see other past keys; see lsh_attention.hpp.
  const auto past_targets = [&](const RowMatrix<Scalar>& x) {
    Targets t = chunk_targets(hash.hash(x), opt.chunk);
    for (Index i = 0; i < n; ++i)
      for (auto it = t[std::size_t(i)].begin(); it != t[std::size_t(i)].end();)
        it = it->first > i ? t[std::size_t(i)].erase(it) : std::next(it);
    return t;
  };
  const Targets before = past_targets(q), after = past_targets(q2);
  CHECK(!std::equal(before.begin(), before.end() - 1, after.begin()));
  opt.exact_buckets = false;
  RowMatrix<Scalar> q3 = q;
  q3.row(n - 1) *= Scalar(2.5);
  REQUIRE(hash.hash(q3) == hash.hash(q));
  a = randattn::lsh_attention(hash, q, v, opt);
  b = randattn::lsh_attention(hash, q3, v2, opt);
  CHECK(testing::rows_bit_identical(a, b, n - 1));
  CHECK(!testing::rows_bit_identical(a, b, n));
}

TEMPLATE_TEST_CASE("Separate-key sort-and-chunk, causal: no key after the query is scored", "[lsh]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 150, d = 12, dv = 5;
  const RowMatrix<Scalar> q = clustered<Scalar>(161, n, d, 5, 0.5),
                          k = clustered<Scalar>(162, n, d, 5, 0.5);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(163, n, dv);
  const CrossPolytopeHash<Scalar> hash(RotationKind::hadamard, d, 8, 3, 13);
  for (Index chunk : {Index(1), Index(8), Index(32), n}) {
    for (bool dedupe : {true, false}) {
      INFO("chunk " << chunk << " dedupe " << dedupe);
      LshOptions opt;
      opt.causal = true;
      opt.chunk = chunk;
      opt.dedupe = dedupe;
      const RowMatrix<Scalar> out = randattn::lsh_attention(hash, q, k, v, opt);
      // Values do not move keys between chunks: new values of keys m.. (huge ones, so that any
      // weight they got would show) leave rows 0..m-1 bit-identical, and change later rows.
      for (Index m : {Index(1), Index(40), Index(120)}) {
        RowMatrix<Scalar> v2 = v;
        v2.bottomRows(n - m) = testing::gaussian<Scalar>(164 + m, n - m, dv, 1e3);
        const RowMatrix<Scalar> out2 = randattn::lsh_attention(hash, q, k, v2, opt);
        CHECK(testing::rows_bit_identical(out, out2, m));
        CHECK(!testing::rows_bit_identical(out, out2, n));
      }
    }
  }
}

TEMPLATE_TEST_CASE("LSH's default logit scale is 1/sqrt(d), as for every method", "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const randattn::BatchShape shape{1, 2, 70, 70, 9, 3};  // batch, heads, n_q, n_k, d, dv
  const Index n = shape.slices() * shape.n_q;
  const RowMatrix<Scalar> q = clustered<Scalar>(181, n, shape.d, 4, 0.6),
                          k = clustered<Scalar>(182, n, shape.d, 4, 0.6),
                          v = testing::gaussian<Scalar>(183, n, shape.dv);
  const RowMatrix<Scalar> q0 = q.topRows(shape.n_q), k0 = k.topRows(shape.n_k),
                          v0 = v.topRows(shape.n_k);
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, shape.d, 8, 2, 19);
  for (bool exact_buckets : {false, true}) {
    INFO("exact_buckets " << exact_buckets);
    LshOptions by_default, explicit_scale, reformer;
    by_default.chunk = explicit_scale.chunk = reformer.chunk = 16;
    by_default.exact_buckets = explicit_scale.exact_buckets = reformer.exact_buckets =
        exact_buckets;
    explicit_scale.scale = 1.0 / std::sqrt(double(shape.d));
    reformer.scale = 1;
    // Shared QK and separate keys, one call: bit-identical to the explicit 1/sqrt(d), and not
    // Reformer's scale 1.
    const RowMatrix<Scalar> shared = randattn::lsh_attention(hash, q0, v0, by_default);
    CHECK(testing::rows_bit_identical(shared, randattn::lsh_attention(hash, q0, v0, explicit_scale),
                                      shape.n_q));
    CHECK(rel_error(shared, randattn::lsh_attention(hash, q0, v0, reformer)) > 1e-3);
    const RowMatrix<Scalar> separate = randattn::lsh_attention(hash, q0, k0, v0, by_default);
    CHECK(testing::rows_bit_identical(
        separate, randattn::lsh_attention(hash, q0, k0, v0, explicit_scale), shape.n_q));
    CHECK(rel_error(separate, randattn::lsh_attention(hash, q0, k0, v0, reformer)) > 1e-3);
    // Batched calls resolve the same default.
    RowMatrix<Scalar> out(n, shape.dv), out_k(n, shape.dv);
    randattn::lsh_attention_batched<Scalar>(hash, q.data(), v.data(), out.data(), shape,
                                            by_default);
    randattn::lsh_attention_batched<Scalar>(hash, q.data(), k.data(), v.data(), out_k.data(), shape,
                                            by_default);
    CHECK(testing::rows_bit_identical(out, RowMatrix<Scalar>(shared), shape.n_q));
    CHECK(testing::rows_bit_identical(out_k, RowMatrix<Scalar>(separate), shape.n_q));
  }
  // The exact shared-QK limit uses the same default.
  LshOptions explicit_scale;
  explicit_scale.scale = 1.0 / std::sqrt(double(shape.d));
  CHECK(testing::rows_bit_identical(randattn::shared_qk_attention(q0, v0),
                                    randattn::shared_qk_attention(q0, v0, explicit_scale),
                                    shape.n_q));
}

TEMPLATE_TEST_CASE("LSH attention edge cases and argument checks", "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index d = 6;
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 4, 2, 1);
  LshOptions opt;
  // n = 0: empty; n = 1: the token attends to itself.
  CHECK(
      randattn::lsh_attention(hash, RowMatrix<Scalar>(0, d), RowMatrix<Scalar>(0, 3), opt).rows() ==
      0);
  const RowMatrix<Scalar> q1 = testing::gaussian<Scalar>(1, 1, d),
                          v1 = testing::gaussian<Scalar>(2, 1, 3);
  CHECK(rel_error(randattn::lsh_attention(hash, q1, v1, opt), v1) == 0.0);
  // d = 1.
  const CrossPolytopeHash<Scalar> hash1(RotationKind::hadamard, 1, 2, 2, 1);
  const RowMatrix<Scalar> qd = testing::gaussian<Scalar>(3, 40, 1),
                          vd = testing::gaussian<Scalar>(4, 40, 2);
  opt.chunk = 8;
  CHECK(rel_error(randattn::lsh_attention(hash1, qd, vd, opt),
                  reference<Scalar>(qd, nullptr, vd, chunk_targets(hash1.hash(qd), 8), 1.0, false,
                                    true)) < testing::tolerance<Scalar>());
  // Zero rows and huge rows: the normalised key stays finite, the output too.
  RowMatrix<Scalar> q = testing::gaussian<Scalar>(5, 50, d);
  q.row(3).setZero();
  q.row(4) *= Scalar(1e30);
  q.row(5).setZero();
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(6, 50, 3);
  opt.scale = 1e-30;
  CHECK(randattn::lsh_attention(hash, q, v, opt).allFinite());
  opt.scale.reset();
  // Errors name the problem.
  const RowMatrix<Scalar> k = testing::gaussian<Scalar>(7, 50, d);
  for (bool exact_buckets : {false, true}) {
    INFO("exact_buckets " << exact_buckets);
    opt = LshOptions();
    opt.exact_buckets = exact_buckets;
    CHECK_NOTHROW(randattn::lsh_attention(hash, q, k, v, opt));
    // No queries: empty; one key: every query's output is its value.
    CHECK(randattn::lsh_attention(hash, RowMatrix<Scalar>(0, d), k, v, opt).rows() == 0);
    const RowMatrix<Scalar> one_k = k.topRows(1), one_v = v.topRows(1);
    const RowMatrix<Scalar> out = randattn::lsh_attention(hash, q, one_k, one_v, opt);
    CHECK(rel_error(out, RowMatrix<Scalar>(one_v.replicate(q.rows(), 1))) <
          testing::tolerance<Scalar>());
    CHECK_THROWS_AS(
        randattn::lsh_attention(hash, q, RowMatrix<Scalar>(0, d), RowMatrix<Scalar>(0, 3), opt),
        std::invalid_argument);
    CHECK_THROWS_AS(randattn::lsh_attention(hash, q, RowMatrix<Scalar>(k.leftCols(d - 1)), v, opt),
                    std::invalid_argument);
    opt.causal = true;
    CHECK_THROWS_AS(randattn::lsh_attention(hash, q, RowMatrix<Scalar>(k.topRows(49)),
                                            RowMatrix<Scalar>(v.topRows(49)), opt),
                    std::invalid_argument);
  }
  opt = LshOptions();
  CHECK_THROWS_AS(randattn::lsh_attention(hash, testing::gaussian<Scalar>(1, 5, d + 1),
                                          testing::gaussian<Scalar>(1, 5, 2), opt),
                  std::invalid_argument);
  CHECK_THROWS_AS(randattn::lsh_attention(hash, q, RowMatrix<Scalar>(v.topRows(10)), opt),
                  std::invalid_argument);
  opt.chunk = 0;
  CHECK_THROWS_AS(randattn::lsh_attention(hash, q, v, opt), std::invalid_argument);
  opt.chunk = 8;
  RowMatrix<Scalar> bad = q;
  bad(1, 1) = std::numeric_limits<Scalar>::infinity();
  try {
    randattn::lsh_attention(hash, bad, v, opt);
    FAIL("no exception");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("non-finite") != std::string::npos);
  }
  opt.scale = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(randattn::lsh_attention(hash, q, v, opt), std::invalid_argument);
  CHECK(randattn::reformer_buckets(16384, 64) == 512);
  CHECK(randattn::reformer_buckets(100, 64) == 4);
  CHECK(randattn::reformer_buckets(1, 64) == 2);
}

// ---------------------------------------------------------------------------------------------
// Pairs scored and the chunk plan
// ---------------------------------------------------------------------------------------------

namespace {

// Σ_i |valid targets of i|, with a row left without one counted as what it scores: itself
// (shared QK) or all its valid keys (separate keys).
Index reference_pairs(const Targets& targets, Index n_k, bool shared, bool causal) {
  Index pairs = 0;
  for (Index i = 0; i < Index(targets.size()); ++i) {
    Index valid = 0;
    for (const auto& jc : targets[static_cast<std::size_t>(i)])
      valid += !(causal && jc.first > i) && !(shared && jc.first == i);
    pairs += valid > 0 ? valid : shared ? 1 : causal ? i + 1 : n_k;
  }
  return pairs;
}

}  // namespace

TEMPLATE_TEST_CASE("lsh_target_pairs counts the distinct pairs of the target sets", "[lsh]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index d = 12;
  struct Case {
    Index n_q, n_k, buckets;
  };
  for (const Case c : {Case{70, 70, 8}, Case{90, 31, 6}, Case{40, 110, 8}, Case{1, 1, 2}}) {
    const RowMatrix<Scalar> q = clustered<Scalar>(11 + c.n_q, c.n_q, d, 4, 0.6);
    const RowMatrix<Scalar> k = clustered<Scalar>(17 + c.n_k, c.n_k, d, 4, 0.6);
    for (Index rounds : {Index(1), Index(3)}) {
      const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, c.buckets, rounds, 40 + rounds);
      const HashCodes qc = hash.hash(q), kc = hash.hash(k);
      for (Index chunk : {Index(1), Index(8), c.n_q + 5}) {
        for (bool causal : {false, true}) {
          for (bool exact : {false, true}) {
            INFO("n_q " << c.n_q << " n_k " << c.n_k << " rounds " << rounds << " chunk " << chunk
                        << " causal " << causal << " exact buckets " << exact);
            LshOptions opt;
            opt.chunk = chunk;
            opt.causal = causal;
            opt.exact_buckets = exact;
            const Targets shared = exact ? bucket_targets(qc, qc) : chunk_targets(qc, chunk);
            CHECK(randattn::lsh_target_pairs<Scalar>(hash, q, opt) ==
                  reference_pairs(shared, c.n_q, true, causal));
            if (causal && c.n_q != c.n_k) continue;
            const Targets separate =
                exact ? bucket_targets(qc, kc) : separate_chunk_targets(qc, kc, chunk);
            CHECK(randattn::lsh_target_pairs<Scalar>(hash, q, k, opt) ==
                  reference_pairs(separate, c.n_k, false, causal));
          }
        }
      }
    }
  }
  // One chunk holding the sequence: every pair but the diagonal (shared QK), every pair
  // (separate keys); causal shared QK scores i earlier keys, and position 0 itself.
  const Index n = 50;
  const RowMatrix<Scalar> x = testing::gaussian<Scalar>(3, n, d);
  const CrossPolytopeHash<Scalar> hash(d, 4, 2, 9);
  LshOptions one;
  one.chunk = n;
  CHECK(randattn::lsh_target_pairs<Scalar>(hash, x, one) == n * (n - 1));
  CHECK(randattn::lsh_target_pairs<Scalar>(hash, x, x, one) == n * n);
  one.causal = true;
  CHECK(randattn::lsh_target_pairs<Scalar>(hash, x, one) == 1 + n * (n - 1) / 2);
  CHECK(randattn::lsh_target_pairs<Scalar>(hash, x, x, one) == n * (n + 1) / 2);
  CHECK_THROWS_AS(randattn::lsh_target_pairs<Scalar>(hash, RowMatrix<Scalar>(3, d + 1), one),
                  randattn::invalid_argument);
}

TEST_CASE("LshChunkPlan: sorted order by (bucket, position), chunks of c, the last one shorter",
          "[lsh]") {
  HashCodes codes(7, 2);
  codes << 1, 0,  //
      0, 0,       //
      1, 1,       //
      0, 1,       //
      2, 0,       //
      0, 1,       //
      1, 0;
  const randattn::LshChunkPlan plan(codes, 3, 3);
  CHECK(plan.tokens() == 7);
  CHECK(plan.rounds() == 2);
  CHECK(plan.chunks() == 3);
  const std::vector<std::int32_t> round0(plan.sorted(0), plan.sorted(0) + 7),
      round1(plan.sorted(1), plan.sorted(1) + 7);
  CHECK(round0 == std::vector<std::int32_t>{1, 3, 5, 0, 2, 6, 4});
  CHECK(round1 == std::vector<std::int32_t>{0, 1, 4, 6, 2, 3, 5});
  CHECK(plan.chunk_size(0) == 3);
  CHECK(plan.chunk_size(2) == 1);
  CHECK(plan.chunk_size(3) == 0);
  CHECK(*plan.chunk(1, 2) == 5);
  for (Index rho = 0; rho < 2; ++rho)
    for (Index s = 0; s < 7; ++s) CHECK(plan.chunk_of()(plan.sorted(rho)[s], rho) == s / 3);
  CHECK_THROWS_AS(randattn::LshChunkPlan(codes, 3, 0), randattn::invalid_argument);
}

TEMPLATE_TEST_CASE("lsh_attention_into and shared_qk_attention_into equal the allocating forms",
                   "[lsh][into]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  using Refs = std::vector<Eigen::Ref<const RowMatrix<Scalar>>>;
  const RowMatrix<Scalar> q = clustered<Scalar>(81, 60, 8, 4, 0.5),
                          k = clustered<Scalar>(82, 60, 8, 4, 0.5),
                          v = testing::gaussian<Scalar>(83, 60, 3);
  const CrossPolytopeHash<Scalar> hash(RotationKind::dense, 8, 4, 2, 84);
  for (const bool causal : {false, true}) {
    INFO("causal " << causal);
    LshOptions opt;
    opt.causal = causal;
    opt.chunk = 16;
    const auto run_shared = [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
      randattn::lsh_attention_into(hash, in[0], in[1], out, opt);
    };
    testing::check_into_form<Scalar>(randattn::lsh_attention(hash, q, v, opt), {q, v},
                                     {"qk", "v"}, run_shared);
    const auto run_separate = [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
      randattn::lsh_attention_into(hash, in[0], in[1], in[2], out, opt);
    };
    testing::check_into_form<Scalar>(randattn::lsh_attention(hash, q, k, v, opt), {q, k, v},
                                     {"q", "k", "v"}, run_separate);
    const auto run_exact = [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
      randattn::shared_qk_attention_into(in[0], in[1], out, opt);
    };
    testing::check_into_form<Scalar>(randattn::shared_qk_attention(q, v, opt), {q, v},
                                     {"qk", "v"}, run_exact);
  }
  // Values near the overflow bound take the power-of-two headroom path: still bit for bit.
  const RowMatrix<Scalar> huge = v * (std::numeric_limits<Scalar>::max() / Scalar(16));
  RowMatrix<Scalar> out(60, 3);
  randattn::lsh_attention_into(hash, q, huge, out);
  CHECK(out == randattn::lsh_attention(hash, q, huge));
}
