// Tensor sparsification (Algorithm 1 and baselines), streaming, matricisation, sketched and exact
// HOSVD, the spectral-norm estimate and sparse-score attention.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <unsupported/Eigen/CXX11/Tensor>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "support.hpp"

using randattn::Index;
using randattn::RowMatrix;
using randattn::SparsifyOptions;
using randattn::SparsifyScheme;
using randattn::Vector;

namespace {

// Test tensor with entries in all three regimes of Algorithm 1: a low-rank signal, noise and a
// few spikes.
template <typename Scalar>
randattn::SyntheticTensor<Scalar> mixed_tensor(std::vector<Index> dims, std::uint64_t seed,
                                               Index spikes = 3) {
  randattn::SyntheticOptions opt;
  opt.noise = 0.5;
  opt.spikes = spikes;
  opt.spike_size = 0.5;
  return randattn::low_rank_plus_noise<Scalar>(dims, std::vector<Index>(dims.size(), 2), opt, seed);
}

SparsifyOptions options(double budget, std::uint64_t seed = 1,
                        SparsifyScheme scheme = SparsifyScheme::spa) {
  SparsifyOptions opt;
  opt.budget = budget;
  opt.seed = seed;
  opt.scheme = scheme;
  return opt;
}

// Algorithm 1's probabilities, written out independently of the library: double precision,
// naive summation.
template <typename Scalar>
std::vector<double> spa_probabilities(const Vector<Scalar>& a, double budget) {
  double fro2 = 0;
  for (Index i = 0; i < a.size(); ++i) fro2 += double(a(i)) * double(a(i));
  std::vector<double> p(std::size_t(a.size()));
  for (Index i = 0; i < a.size(); ++i) {
    const double x = double(a(i));
    p[std::size_t(i)] =
        x == 0 ? 0 : std::min(1.0, std::max(budget * x * x / fro2, budget / double(a.size())));
  }
  return p;
}

template <typename Scalar>
bool same_sketch(const randattn::SparseSketch<Scalar>& x, const randattn::SparseSketch<Scalar>& y) {
  return x.dims() == y.dims() && x.indices() == y.indices() && x.nnz() == y.nnz() &&
         std::memcmp(x.values().data(), y.values().data(), sizeof(Scalar) * std::size_t(x.nnz())) ==
             0 &&
         x.stats.expected_nnz == y.stats.expected_nnz &&
         x.stats.frobenius_norm == y.stats.frobenius_norm;
}

// Moments of one sketched entry X = (a / p) B, B ~ Bernoulli(p): mean a, variance
// a^2 (1 - p) / p, fourth cumulant a^4 (1 - p)(1 - 6 p (1 - p)) / p^3 (the Bernoulli's fourth
// cumulant p(1-p)(1-6p(1-p)) scaled by (a/p)^4). Cumulants add over independent entries.
struct Cumulants {
  double var = 0, k4 = 0;
  void add(double a, double p) {
    if (p >= 1 || a == 0) return;
    var += a * a * (1 - p) / p;
    k4 += a * a * a * a * (1 - p) * (1 - 6 * p * (1 - p)) / (p * p * p);
  }
};

// Chi-square-style check of unbiasedness for K independent statistics Y_i (each a sum of
// sketched entries), estimated by the mean of R independent sketches. With
// z_i = (mean_i - E Y_i) / sqrt(var_i / R), E[z_i^2] = 1 exactly and
// Var[z_i^2] = 2 + k4_i / (R var_i^2) (the fourth moment of a standardised mean of R i.i.d.
// terms is 3 + excess kurtosis / R). Summing over independent i: sum z_i^2 has mean K and a
// variance known in closed form, and the check allows 4 of its standard deviations.
struct ChiSquare {
  double sum_z2 = 0, expected = 0, variance = 0;
  void add(double mean, double truth, const Cumulants& c, int draws) {
    if (c.var == 0) return;
    const double z = (mean - truth) / std::sqrt(c.var / draws);
    sum_z2 += z * z;
    expected += 1;
    variance += 2 + c.k4 / (draws * c.var * c.var);
  }
  bool passes() const { return std::abs(sum_z2 - expected) <= 4 * std::sqrt(variance); }
};

void set_threads(int t) {
#if defined(_OPENMP)
  omp_set_num_threads(t);
#else
  (void)t;
#endif
}

}  // namespace

TEMPLATE_TEST_CASE("sketch: every tensor layout gives the same sketch", "[sketch]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const auto t = mixed_tensor<S>({4, 5, 6}, 3);
  const SparsifyOptions opt = options(30, 7);
  const auto ref = randattn::sparsify(t.view(), opt);
  CHECK(ref.nnz() > 0);

  Eigen::Tensor<S, 3, Eigen::RowMajor> row_major(4, 5, 6);
  Eigen::Tensor<S, 3, Eigen::ColMajor> col_major(4, 5, 6);
  for (Index i = 0; i < 4; ++i)
    for (Index j = 0; j < 5; ++j)
      for (Index k = 0; k < 6; ++k)
        row_major(i, j, k) = col_major(i, j, k) = t.data((i * 5 + j) * 6 + k);
  const Eigen::TensorMap<const Eigen::Tensor<S, 3, Eigen::RowMajor>> map(t.data.data(), 4, 5, 6);
  CHECK(same_sketch(ref, randattn::sparsify(row_major, opt)));
  CHECK(same_sketch(ref, randattn::sparsify(col_major, opt)));
  CHECK(same_sketch(ref, randattn::sparsify(map, opt)));
  CHECK(same_sketch(ref, randattn::sparsify(randattn::tensor_view(t.data.data(), {4, 5, 6}), opt)));
  // Strided: the same tensor inside a larger buffer (every entry followed by a gap).
  std::vector<S> gapped(std::size_t(2 * t.data.size()), S(99));
  for (Index i = 0; i < t.data.size(); ++i) gapped[std::size_t(2 * i)] = t.data(i);
  CHECK(same_sketch(ref, randattn::sparsify(
                             randattn::TensorView<S>(gapped.data(), {4, 5, 6}, {60, 12, 2}), opt)));

  // Order 2 from Eigen matrices of either storage order, a Map and a block.
  const RowMatrix<S> m = testing::gaussian<S>(5, 9, 11);
  const Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic> cm = m;
  const auto mref = randattn::sparsify(m, opt);
  CHECK(same_sketch(mref, randattn::sparsify(cm, opt)));
  CHECK(
      same_sketch(mref, randattn::sparsify(Eigen::Map<const RowMatrix<S>>(m.data(), 9, 11), opt)));
  const RowMatrix<S> big = testing::gaussian<S>(6, 12, 15);
  const RowMatrix<S> inner = big.block(2, 3, 9, 11);
  CHECK(
      same_sketch(randattn::sparsify(inner, opt), randattn::sparsify(big.block(2, 3, 9, 11), opt)));
}

TEMPLATE_TEST_CASE("sketch: sparsify_into reuses a sketch's storage and gives the same bits",
                   "[sketch]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  using Catch::Matchers::Contains;
  const auto small = mixed_tensor<S>({6, 7, 8}, 3);     // partial tiles only
  const auto large = mixed_tensor<S>({16, 20, 24}, 4);  // whole tiles, the vector path
  randattn::SparseSketch<S> out;
  for (int threads : {1, 2}) {
    set_threads(threads);
    for (const auto* t : {&large, &small, &large}) {
      for (double budget : {20.0, 900.0}) {
        SparsifyOptions opt = options(budget, 5);
        opt.stream = std::uint32_t(threads);
        randattn::sparsify_into(t->view(), opt, out);
        CHECK(same_sketch(out, randattn::sparsify(t->view(), opt)));
        CHECK(out.stats.budget == budget);
      }
    }
  }
  set_threads(2);
  // A bad budget throws before `out` is touched.
  const auto kept = out.indices();
  CHECK_THROWS_WITH(randattn::sparsify_into(large.view(), options(0), out), Contains("budget"));
  CHECK(out.indices() == kept);

  // take_storage leaves the shape and no entries.
  auto sketch = randattn::sparsify(small.view(), options(50));
  const Index nnz = sketch.nnz();
  auto storage = std::move(sketch).take_storage();
  CHECK(Index(storage.first.size()) == nnz);
  CHECK(Index(storage.second.size()) == nnz);
  CHECK(sketch.nnz() == 0);
  CHECK(sketch.dims() == small.dims);

  // The sketched HOSVD reuses its sketches' storage from call to call: same bits each time.
  const auto first = randattn::sketched_hosvd(large.view(), {2, 2, 2}, options(3000, 9));
  const auto again = randattn::sketched_hosvd(large.view(), {2, 2, 2}, options(3000, 9));
  for (std::size_t j = 0; j < 3; ++j) {
    CHECK(first.factors[j] == again.factors[j]);
    CHECK(first.eigenvalues[j] == again.eigenvalues[j]);
  }
  CHECK(first.nnz == again.nnz);
}

TEST_CASE("sketch: the per-thread vector pool hands back the best fitting storage", "[sketch]") {
  using Pool = randattn::detail::VectorPool<std::int32_t>;
  randattn::release_sketch_storage();
  CHECK(Pool::held_count() == 0);
  for (std::size_t c : {100, 10, 1000}) {
    std::vector<std::int32_t> v;
    v.reserve(c);
    v.push_back(7);
    Pool::give(std::move(v));
  }
  CHECK(Pool::held_count() == 3);
  auto v = Pool::take(50);  // the smallest with room for 50
  CHECK(v.empty());
  CHECK(v.capacity() == 100);
  auto w = Pool::take(5000);  // none has room: the largest, grown
  CHECK(w.capacity() >= 5000);
  CHECK(Pool::held_count() == 1);
  // Full: a smaller vector than every held one is dropped, a larger one replaces the smallest.
  for (std::size_t i = 0; i < Pool::kHeld + 2; ++i) {
    std::vector<std::int32_t> u;
    u.reserve(200 + 10 * i);
    Pool::give(std::move(u));
  }
  CHECK(Pool::held_count() == Pool::kHeld);
  CHECK(Pool::take(0).capacity() == 200 + 10 * 2);  // 10, 200 and 210 went
  randattn::release_sketch_storage();
  CHECK(Pool::held_count() == 0);
}

TEST_CASE("sketch: a kept value beyond float's range is reported, on both sampling paths",
          "[sketch]") {
  using Catch::Matchers::Contains;
  // 256 entries (one whole tile) and 64 entries (a partial one), all equal: p = n / D = 1/8 for
  // budget D / 8, so a kept entry is stored as 8 a, beyond float's largest value for a = 3e38.
  for (Index d : {16, 8}) {
    const Vector<float> a = Vector<float>::Constant(d * d, 3e38f);
    const auto view = randattn::tensor_view(a.data(), {d, d});
    CHECK_THROWS_WITH(randattn::sparsify(view, options(double(d * d) / 8)),
                      Contains("overflows the scalar type"));
    randattn::SparseSketch<float> out = randattn::sparsify(
        randattn::tensor_view(a.data(), {d, d}), options(double(d * d)));  // p = 1: a itself
    CHECK(out.nnz() == d * d);
    CHECK_THROWS_WITH(randattn::sparsify_into(view, options(double(d * d) / 8), out),
                      Contains("overflows the scalar type"));
    CHECK(out.nnz() == 0);
  }
}

TEMPLATE_TEST_CASE("sketch: Algorithm 1 probabilities, values and thresholds", "[sketch]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const auto t = mixed_tensor<S>({6, 7, 8}, 11);
  const double n = 60;
  const auto sk = randattn::sparsify(t.view(), options(n, 5));
  const std::vector<double> p = spa_probabilities(t.data, n);
  const double fro = t.data.template cast<double>().norm(), D = double(t.data.size());

  CHECK(sk.stats.frobenius_norm == Approx(fro).epsilon(1e-12));
  CHECK(sk.stats.keep_threshold() == Approx(fro / std::sqrt(n)).epsilon(1e-12));
  CHECK(sk.stats.uniform_threshold() == Approx(fro / std::sqrt(D)).epsilon(1e-12));
  CHECK(sk.stats.expected_nnz == Approx(std::accumulate(p.begin(), p.end(), 0.0)).epsilon(1e-12));
  CHECK(sk.stats.expected_nnz <= 2 * n);

  // Every stored value is a / p; every entry with p = 1 is stored.
  std::size_t e = 0;
  Index certain = 0;
  for (Index i = 0; i < t.data.size(); ++i) {
    const double pi = p[std::size_t(i)];
    const bool stored = e < sk.indices().size() && sk.indices()[e] == i;
    if (pi >= 1) {
      ++certain;
      CHECK(stored);
    }
    if (stored) {
      CHECK(double(sk.values()[e]) ==
            Approx(double(t.data(i)) / pi).epsilon(testing::tolerance<S>()));
      ++e;
    }
  }
  CHECK(e == sk.indices().size());
  CHECK(certain > 0);  // the spikes are above ||A||_F / sqrt(n)

  // A budget of D or more keeps everything: A_hat = A exactly.
  const auto all = randattn::sparsify(t.view(), options(D, 5));
  CHECK(all.nnz() == t.data.size());
  CHECK(randattn::densify(all) == t.data);
  // n = 1 entry and d = 1 dimensions work.
  const S one = S(-2.5);
  const auto tiny = randattn::sparsify(randattn::tensor_view(&one, {1, 1, 1}), options(3));
  REQUIRE(tiny.nnz() == 1);
  CHECK(tiny.values()[0] == one);
  const auto half = randattn::sparsify(randattn::tensor_view(&one, {1, 1}), options(0.5, 9));
  CHECK(half.stats.expected_nnz == 0.5);
  for (S v : half.values()) CHECK(v == S(-5));
  // An empty tensor gives an empty sketch.
  const auto empty = randattn::sparsify(randattn::tensor_view<S>(nullptr, {3, 0, 2}), options(3));
  CHECK(empty.nnz() == 0);
  CHECK(empty.size() == 0);
}

TEST_CASE("sketch: sixteen-lane Philox equals the scalar blocks", "[sketch]") {
  const randattn::Philox rng(0x0123456789ABCDEFull, 77);
  randattn::PhiloxLanes::Words words;
  // Counters inside one 2^32 range and across its end (the high counter word changes mid-call).
  for (std::uint64_t i0 : {std::uint64_t(0), std::uint64_t(4096), (std::uint64_t(1) << 32) - 5}) {
    for (std::uint32_t j : {0u, 1u}) {
      randattn::PhiloxLanes::generate(rng, i0, j, words);
      for (int l = 0; l < randattn::PhiloxLanes::kLanes; ++l) {
        const randattn::Philox::Bits b = rng.bits(i0 + std::uint64_t(l), j);
        for (int w = 0; w < 4; ++w) CHECK(words[w][l] == b[std::size_t(w)]);
      }
    }
  }
}

TEMPLATE_TEST_CASE("sketch: entry omega is kept when (r + v) / 2^16 < p, with the documented draws",
                   "[sketch]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  // 720000 entries: 2812 full tiles of 256 and a partial one; every regime occurs at this
  // budget, and about one entry in 2^16 with 0 < p < 1 needs its fine draw (about eleven here).
  const auto t = mixed_tensor<S>({80, 90, 100}, 17, 4);
  SparsifyOptions opt = options(150000, 13);
  opt.stream = 4;
  const auto sk = randattn::sparsify(t.view(), opt);
  // The rule written out from its description: entry offset o = omega % 256 of group g = o / 16
  // takes the 16-bit half g % 2 of word (g / 2) % 4 of Philox block 32 (omega / 256) + 16 (g / 8)
  // + o % 16; on r = floor(2^16 p) the 53-bit uniform v of counter (omega, j = 1) decides
  // v < 2^16 p - floor(2^16 p).
  const randattn::Philox rng(opt.seed, opt.stream);
  std::vector<Index> expected;
  Index ties = 0;
  for (Index omega = 0; omega < t.data.size(); ++omega) {
    const double p = sk.stats.rule.probability(double(t.data(omega)));
    const Index o = omega % 256, g = o / 16;
    const std::uint32_t word = rng.bits(
        std::uint64_t(32 * (omega / 256) + 16 * (g / 8) + o % 16))[std::size_t((g / 2) % 4)];
    const double r = double((word >> (16 * (g % 2))) & 0xFFFFu), scaled = 65536 * p,
                 floor_scaled = std::floor(scaled);
    bool keep = r < floor_scaled;
    if (r == floor_scaled && p > 0) {
      ++ties;
      keep = rng.uniform(std::uint64_t(omega), 1) < scaled - floor_scaled;
    }
    if (keep) expected.push_back(omega);
  }
  CHECK(ties > 0);
  CHECK(sk.indices() == expected);
  Index wrong_values = 0;
  for (Index e = 0; e < sk.nnz(); ++e) {
    const double a = double(t.data(sk.indices()[std::size_t(e)]));
    wrong_values += sk.values()[std::size_t(e)] != static_cast<S>(a / sk.stats.rule.probability(a));
  }
  CHECK(wrong_values == 0);
}

TEMPLATE_TEST_CASE("sketch: Algorithm 1 is unbiased (mean of many sketches)",
                   "[sketch][statistical]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  // 120 entries, budget 30: large entries kept, moderate ones a^2-sampled, small ones uniform.
  const auto t = mixed_tensor<S>({6, 5, 4}, 21, 2);
  const double n = 30;
  const std::vector<double> p = spa_probabilities(t.data, n);
  const int draws = 3000;
  Eigen::VectorXd sum = Eigen::VectorXd::Zero(t.data.size());
  for (int r = 0; r < draws; ++r) {
    const auto sk = randattn::sparsify(t.view(), options(n, 1000 + std::uint64_t(r)));
    for (Index e = 0; e < sk.nnz(); ++e)
      sum(sk.indices()[std::size_t(e)]) += double(sk.values()[std::size_t(e)]);
  }
  const Eigen::VectorXd mean = sum / draws;
  ChiSquare entries, slices;
  Index certain = 0, sampled = 0;
  for (Index i = 0; i < t.data.size(); ++i) {
    const double a = double(t.data(i)), pi = p[std::size_t(i)];
    if (pi >= 1) {
      ++certain;
      CHECK(mean(i) == Approx(a).epsilon(1e-6));  // kept in every sketch, value exactly a
    } else {
      ++sampled;
    }
    Cumulants c;
    c.add(a, pi);
    entries.add(mean(i), a, c, draws);
  }
  // The sums over the 6 mode-0 slices: independent sums of independent entries.
  for (Index s = 0; s < 6; ++s) {
    Cumulants c;
    double truth = 0, est = 0;
    for (Index i = s * 20; i < (s + 1) * 20; ++i) {
      c.add(double(t.data(i)), p[std::size_t(i)]);
      truth += double(t.data(i));
      est += mean(i);
    }
    slices.add(est, truth, c, draws);
  }
  CHECK(certain > 0);
  CHECK(sampled > 100);
  INFO("entries: sum z^2 = " << entries.sum_z2 << ", expected " << entries.expected << " +- "
                             << 4 * std::sqrt(entries.variance));
  CHECK(entries.passes());
  INFO("slices: sum z^2 = " << slices.sum_z2 << ", expected " << slices.expected << " +- "
                            << 4 * std::sqrt(slices.variance));
  CHECK(slices.passes());
}

TEMPLATE_TEST_CASE("sketch: E[nnz] <= 2n and the realised nnz lies in a Chernoff band",
                   "[sketch][statistical]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const auto t = mixed_tensor<S>({30, 40, 50}, 31, 10);
  for (double n : {300.0, 3000.0}) {
    const std::vector<double> p = spa_probabilities(t.data, n);
    const double mu = std::accumulate(p.begin(), p.end(), 0.0);
    CHECK(mu <= 2 * n);
    CHECK(mu >= n * 0.5);
    // nnz is a sum of independent Bernoulli(p_i): P(|nnz - mu| >= delta mu) <= 2 exp(-delta^2 mu /
    // 3) for delta <= 1. delta below makes that 1e-6 per check (40 checks: 4e-5 in all).
    const double delta = std::sqrt(3 * std::log(2 / 1e-6) / mu);
    REQUIRE(delta <= 1);
    for (std::uint64_t seed = 1; seed <= 20; ++seed) {
      const auto sk = randattn::sparsify(t.view(), options(n, seed));
      // Two summation orders of 60000 positive terms differ by at most about 60000 * 2^-53.
      CHECK(sk.stats.expected_nnz == Approx(mu).epsilon(1e-11));
      CHECK(std::abs(double(sk.nnz()) - mu) <= delta * mu);
    }
  }
}

TEMPLATE_TEST_CASE(
    "sketch: the same seed gives the identical sketch in memory, streamed, on 1 or 2 threads",
    "[sketch][threads]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  // 120000 entries: several chunks of 32768, so the parallel path splits the work.
  const auto t = mixed_tensor<S>({40, 50, 60}, 41, 20);
  const SparsifyOptions opt = options(5000, 77);
  set_threads(1);
  const auto one = randattn::sparsify(t.view(), opt);
  set_threads(2);
  const auto two = randattn::sparsify(t.view(), opt);
  CHECK(same_sketch(one, two));
  CHECK(one.nnz() > 4000);

  const Index D = t.data.size();
  auto streamed = [&](auto next_block) {
    randattn::StreamingSparsifier<S> s(t.dims, opt);
    for (int pass = 0; pass < 2; ++pass) {
      for (Index pos = 0, b = 0; pos < D; ++b) {
        const Index len = std::min(next_block(b + pass * 1000003), D - pos);
        if (pass == 0)
          s.add_norm_block(t.data.data() + pos, len);
        else
          s.add_sample_block(t.data.data() + pos, len);
        pos += len;
      }
    }
    return s.finish();
  };
  for (Index block : {Index(1), Index(7), Index(1000), Index(32768), Index(50000), D}) {
    INFO("block size " << block);
    CHECK(same_sketch(one, streamed([&](Index) { return block; })));
  }
  // Irregular block sizes, different in the two passes.
  const randattn::Philox sizes(5);
  CHECK(same_sketch(
      one, streamed([&](Index b) { return Index(1 + sizes.bits(std::uint64_t(b))[0] % 9000); })));

  // Other seeds and streams give other sketches.
  SparsifyOptions other = opt;
  other.seed = 78;
  CHECK_FALSE(same_sketch(one, randattn::sparsify(t.view(), other)));
  other = opt;
  other.stream = 1;
  CHECK_FALSE(same_sketch(one, randattn::sparsify(t.view(), other)));
}

TEMPLATE_TEST_CASE("sketch: mode-j matricisation, coordinates and densify", "[sketch]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const std::vector<Index> dims{2, 3, 4};
  Vector<S> a(24);
  for (Index i = 0; i < 24; ++i) a(i) = S(i + 1);
  const auto sk = randattn::sparsify(randattn::tensor_view(a.data(), dims), options(1e6));
  REQUIRE(sk.nnz() == 24);
  CHECK(randattn::densify(sk) == a);
  const auto c = sk.coordinates();
  for (Index e = 0; e < 24; ++e) CHECK((c(e, 0) * 3 + c(e, 1)) * 4 + c(e, 2) == e);
  CHECK(sk.coordinate(23, 1) == 2);

  // M_j(i_j, col) = A(i_0, i_1, i_2) with col running over the other indices in row-major order.
  for (Index mode = 0; mode < 3; ++mode) {
    const auto m = randattn::unfold(sk, mode);
    const auto r = randattn::unfold<Eigen::RowMajor>(sk, mode);
    CHECK(m.rows() == dims[std::size_t(mode)]);
    CHECK(m.cols() == 24 / dims[std::size_t(mode)]);
    const Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic> dense = m.toDense();
    CHECK(dense == r.toDense());
    for (Index i0 = 0; i0 < 2; ++i0)
      for (Index i1 = 0; i1 < 3; ++i1)
        for (Index i2 = 0; i2 < 4; ++i2) {
          const Index idx[3] = {i0, i1, i2};
          Index col = 0;
          for (Index l = 0; l < 3; ++l)
            if (l != mode) col = col * dims[std::size_t(l)] + idx[l];
          CHECK(dense(idx[mode], col) == a((i0 * 3 + i1) * 4 + i2));
        }
  }
  // A sparse sketch: unfolding and densify agree entry by entry.
  const auto t = mixed_tensor<S>({5, 6, 7}, 3);
  const auto s = randattn::sparsify(t.view(), options(40, 2));
  const Vector<S> d = randattn::densify(s);
  const auto m1 = randattn::unfold(s, 1);
  CHECK(m1.nonZeros() == s.nnz());
  for (Index e = 0; e < s.nnz(); ++e) {
    const Index i0 = s.coordinate(e, 0), i1 = s.coordinate(e, 1), i2 = s.coordinate(e, 2);
    CHECK(m1.coeff(i1, i0 * 7 + i2) == d((i0 * 6 + i1) * 7 + i2));
  }
}

TEMPLATE_TEST_CASE("sketch: baselines at matched expected nnz", "[sketch]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const auto t = mixed_tensor<S>({20, 25, 30}, 51, 5);
  const double n = 800;
  const auto spa = randattn::sparsify(t.view(), options(n, 3));
  for (SparsifyScheme scheme : {SparsifyScheme::ndt, SparsifyScheme::l2, SparsifyScheme::uniform}) {
    INFO(randattn::scheme_name(scheme));
    const auto b = randattn::sparsify(t.view(), options(n, 3, scheme));
    const randattn::SamplingRule rule = b.stats.rule;
    // The reported expectation is the sum of the rule's p; it matches Algorithm 1's (ndt moves in
    // steps: an entry jumps from 0 to its p when the cutoff passes it, so it matches to one step).
    double sum_p = 0, max_step = 0;
    for (Index i = 0; i < t.data.size(); ++i) {
      const double pi = rule.probability(double(t.data(i)));
      sum_p += pi;
      max_step = std::max(max_step, pi);
    }
    CHECK(b.stats.expected_nnz == Approx(sum_p).epsilon(1e-11));  // two summation orders
    const double tol = scheme == SparsifyScheme::ndt ? max_step : 1e-9 * sum_p;
    CHECK(std::abs(b.stats.expected_nnz - spa.stats.expected_nnz) <= tol);
    // The shape of each rule.
    for (Index e = 0; e < b.nnz(); ++e) {
      const double a = double(t.data(b.indices()[std::size_t(e)]));
      CHECK(std::abs(a) >= rule.cutoff);
      CHECK(double(b.values()[std::size_t(e)]) ==
            Approx(a / rule.probability(a)).epsilon(testing::tolerance<S>()));
    }
    if (scheme == SparsifyScheme::uniform) {
      CHECK(rule.scale == 0);
      CHECK(rule.floor == Approx(spa.stats.expected_nnz / double(t.data.size())).epsilon(1e-9));
    } else {
      CHECK(rule.floor == 0);
      CHECK((scheme == SparsifyScheme::ndt) == (rule.cutoff > 0));
    }
  }
  // ndt zeroes the small entries: its sketch is biased, Algorithm 1's is not; with the cutoff
  // above the noise level most entries are never kept.
  const auto ndt = randattn::sparsify(t.view(), options(n, 3, SparsifyScheme::ndt));
  Index zeroed = 0;
  for (Index i = 0; i < t.data.size(); ++i)
    zeroed += std::abs(double(t.data(i))) < ndt.stats.rule.cutoff;
  CHECK(zeroed > t.data.size() / 2);
}

TEMPLATE_TEST_CASE("sketch: Algorithm 1 beats NDT-style and uniform sampling at matched nnz",
                   "[sketch][statistical]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  // Order 3, d = 64, Tucker rank 3, noise 0.3, at budgets D/30 and D/10 (relative errors 0.1 to
  // 0.5, the useful range), mean of 3 draws. The spectral norms are power-method estimates.
  // Incoherent (sign) factors with and without 30 spikes of size 0.3, and Gaussian factors without
  // spikes. On Gaussian-factor tensors with spikes, NDT-style is slightly better at these budgets
  // (see docs/sketch_spectral_error.png); both beat uniform sampling by far there.
  struct Case {
    const char* name;
    bool flat;
    Index spikes;
  };
  const Index d = 64;
  const double D = double(d * d * d);
  randattn::SpectralNormOptions est;
  est.max_iterations = 30;
  est.random_starts = 2;
  for (const Case c : {Case{"sign factors", true, 0}, Case{"sign factors + spikes", true, 30},
                       Case{"gaussian factors", false, 0}}) {
    randattn::SyntheticOptions so;
    so.noise = 0.3;
    so.flat_factors = c.flat;
    so.spikes = c.spikes;
    so.spike_size = 0.3;
    const auto t = randattn::low_rank_plus_noise<S>({d, d, d}, {3, 3, 3}, so, 11);
    const randattn::SpectralNormEstimate norm = randattn::spectral_norm(t.view(), est);
    for (double fraction : {1.0 / 30, 1.0 / 10}) {
      double err[3] = {0, 0, 0};
      const SparsifyScheme schemes[3] = {SparsifyScheme::spa, SparsifyScheme::ndt,
                                         SparsifyScheme::uniform};
      for (int s = 0; s < 3; ++s) {
        for (std::uint64_t seed = 1; seed <= 3; ++seed) {
          const auto sk = randattn::sparsify(t.view(), options(fraction * D, seed, schemes[s]));
          err[s] += randattn::sketch_error(t.view(), sk, est, norm).relative_spectral / 3;
        }
      }
      INFO(c.name << ", n = D * " << fraction << ": spa " << err[0] << ", ndt " << err[1]
                  << ", uniform " << err[2]);
      CHECK(err[0] < 0.5);
      CHECK(err[0] <= err[1]);
      CHECK(err[0] <= err[2]);
    }
  }
}

TEMPLATE_TEST_CASE("sketch: exact HOSVD matches the SVD of the unfoldings", "[sketch][hosvd]",
                   RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const auto t = mixed_tensor<S>({5, 6, 7}, 61);
  const std::vector<Index> ranks{2, 3, 4};
  const auto h = randattn::exact_hosvd(t.view(), ranks);
  const auto full = randattn::sparsify(t.view(), options(1e9));  // = A, for its unfoldings
  for (Index j = 0; j < 3; ++j) {
    const Eigen::MatrixXd m = randattn::unfold(full, j).toDense().template cast<double>();
    const Eigen::JacobiSVD<Eigen::MatrixXd> svd(m, Eigen::ComputeThinU);
    const RowMatrix<S>& u = h.factors[std::size_t(j)];
    const Index r = ranks[std::size_t(j)];
    CHECK(u.rows() == t.dims[std::size_t(j)]);
    CHECK(u.cols() == r);
    const Eigen::MatrixXd ud = u.template cast<double>();
    CHECK((ud.transpose() * ud - Eigen::MatrixXd::Identity(r, r)).norm() <
          100 * testing::tolerance<S>());
    CHECK(randattn::sin_theta_distance(svd.matrixU().leftCols(r), ud) <
          1000 * testing::tolerance<S>());
    for (Index i = 0; i < r; ++i) {
      CHECK(double(h.eigenvalues[std::size_t(j)](i)) ==
            Approx(svd.singularValues()(i) * svd.singularValues()(i))
                .epsilon(100 * testing::tolerance<S>()));
    }
  }
  // Full budget: both sketches equal A, so N_j = M_j M_j^T and the subspaces agree with exact.
  const auto s = randattn::sketched_hosvd(t.view(), ranks, options(1e9, 4));
  CHECK(s.nnz[0] == t.data.size());
  for (std::size_t j = 0; j < 3; ++j)
    CHECK(randattn::sin_theta_distance(h.factors[j], s.factors[j]) <
          1000 * testing::tolerance<S>());
}

TEMPLATE_TEST_CASE("sketch: sketched HOSVD approaches the exact subspaces as the budget grows",
                   "[sketch][hosvd]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  // Order 3, d = 100, Tucker rank 3, noise 0.3; worst mode's sin-Theta, mean of 3 seeds.
  randattn::SyntheticOptions so;
  so.noise = 0.3;
  const auto t = randattn::low_rank_plus_noise<S>({100, 100, 100}, {3, 3, 3}, so, 5);
  const std::vector<Index> ranks{3, 3, 3};
  const auto exact = randattn::exact_hosvd(t.view(), ranks);
  // The exact subspaces are close to the planted ones at this noise level.
  for (std::size_t j = 0; j < 3; ++j)
    CHECK(randattn::sin_theta_distance(t.factors[j], exact.factors[j]) < 0.2);
  double previous = 2;
  for (double n : {1e4, 3e4, 1e5, 3e5}) {
    double worst = 0;
    for (std::uint64_t seed = 1; seed <= 3; ++seed) {
      const auto h = randattn::sketched_hosvd(t.view(), ranks, options(n, seed));
      double w = 0;
      for (std::size_t j = 0; j < 3; ++j)
        w = std::max(w, randattn::sin_theta_distance(exact.factors[j], h.factors[j]));
      worst += w / 3;
    }
    INFO("budget " << n << ": sin-theta " << worst);
    CHECK(worst < previous);
    previous = worst;
  }
  CHECK(previous < 0.1);
}

TEMPLATE_TEST_CASE("sketch: spectral norm estimate and sin-theta distance", "[sketch]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  // Order 2: exact, equal to the largest singular value.
  const RowMatrix<S> m = testing::gaussian<S>(71, 13, 8);
  const auto e2 = randattn::spectral_norm(m);
  CHECK(e2.exact);
  const double sigma =
      Eigen::JacobiSVD<Eigen::MatrixXd>(m.template cast<double>()).singularValues()(0);
  CHECK(e2.lower == Approx(sigma).epsilon(100 * testing::tolerance<S>()));
  CHECK(e2.upper == e2.lower);

  // Orthogonally decomposable tensor sum_i lambda_i e_i o e_i o e_i: the norm is max lambda_i.
  Eigen::Tensor<S, 3, Eigen::RowMajor> diag(4, 4, 4);
  diag.setZero();
  diag(0, 0, 0) = S(1);
  diag(1, 1, 1) = S(-3);
  diag(2, 2, 2) = S(2);
  const auto ed = randattn::spectral_norm(diag);
  CHECK_FALSE(ed.exact);
  CHECK(ed.lower == Approx(3).epsilon(1e-5));
  CHECK(ed.upper == Approx(3).epsilon(1e-5));

  // Rank one a o b o c: lower = upper = |a| |b| |c|.
  const Vector<S> a = testing::gaussian<S>(72, 5, 1).col(0),
                  b = testing::gaussian<S>(73, 6, 1).col(0),
                  c = testing::gaussian<S>(74, 7, 1).col(0);
  Vector<S> r1(5 * 6 * 7);
  for (Index i = 0; i < 5; ++i)
    for (Index j = 0; j < 6; ++j)
      for (Index k = 0; k < 7; ++k) r1((i * 6 + j) * 7 + k) = a(i) * b(j) * c(k);
  const auto e1 = randattn::spectral_norm(randattn::tensor_view(r1.data(), {5, 6, 7}));
  const double abc = double(a.norm()) * double(b.norm()) * double(c.norm());
  CHECK(e1.lower == Approx(abc).epsilon(1e-5));
  CHECK(e1.upper == Approx(abc).epsilon(1e-5));

  // Any tensor: max |a| <= lower <= upper <= ||A||_F.
  const auto t = mixed_tensor<S>({7, 8, 9, 3}, 75);
  const auto et = randattn::spectral_norm(t.view());
  CHECK(et.lower >= double(t.data.cwiseAbs().maxCoeff()));
  CHECK(et.lower <= et.upper);
  CHECK(et.upper <= double(t.data.norm()) * (1 + 1e-6));

  // sin-theta of two lines at angle theta, and of a subspace containing the other.
  const double theta = 0.3;
  Eigen::MatrixXd u = Eigen::MatrixXd::Zero(3, 1), v = Eigen::MatrixXd::Zero(3, 1);
  u(0, 0) = 1;
  v(0, 0) = std::cos(theta);
  v(1, 0) = std::sin(theta);
  CHECK(randattn::sin_theta_distance(u, v) == Approx(std::sin(theta)).epsilon(1e-14));
  const Eigen::MatrixXd plane = Eigen::MatrixXd::Identity(3, 2);
  CHECK(randattn::sin_theta_distance(plane, v) == Approx(0).margin(1e-15));
  CHECK(randattn::sin_theta_distance(v, plane) == Approx(1).epsilon(1e-14));
}

TEMPLATE_TEST_CASE("sketch: sparse_score_attention_into equals sparse_score_attention bit for bit",
                   "[sketch][attention][into]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  using Refs = std::vector<Eigen::Ref<const RowMatrix<S>>>;
  const RowMatrix<S> q = testing::gaussian<S>(91, 23, 6), k = testing::gaussian<S>(92, 23, 6),
                     v = testing::gaussian<S>(93, 23, 4);
  randattn::SparseScoreOptions opt;
  opt.budget = 60;  // about a tenth of the scores: some rows keep no entry and output zeros
  opt.seed = 5;
  opt.block_size = 7;
  for (const bool causal : {false, true}) {
    INFO("causal " << causal);
    opt.causal = causal;
    const RowMatrix<S> expected = randattn::sparse_score_attention(q, k, v, opt);
    testing::check_into_form<S>(
        expected, {q, k, v}, {"q", "k", "v"}, [&](const Refs& in, Eigen::Ref<RowMatrix<S>> out) {
          randattn::sparse_score_attention_into(in[0], in[1], in[2], out, opt);
        });
  }
}

TEMPLATE_TEST_CASE("sketch: sparse-score attention through the softmax accumulator",
                   "[sketch][attention]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const RowMatrix<S> q = testing::gaussian<S>(81, 37, 8), k = testing::gaussian<S>(82, 45, 8),
                     v = testing::gaussian<S>(83, 45, 5);
  randattn::SparseScoreOptions opt;
  opt.budget = 1e9;  // keeps every score: exact attention up to rounding
  for (bool causal : {false, true}) {
    const RowMatrix<S> kk = causal ? RowMatrix<S>(k.topRows(37)) : k,
                       vv = causal ? RowMatrix<S>(v.topRows(37)) : v;
    opt.causal = causal;
    randattn::ExactOptions eo;
    eo.causal = causal;
    const RowMatrix<S> exact = randattn::naive_attention(q, kk, vv, eo);
    CHECK(testing::rel_error(randattn::sparse_score_attention(q, kk, vv, opt), exact) <
          100 * testing::tolerance<S>());
  }
  opt.causal = false;

  // The core step for a given W_hat, as a SparseTensor and as an Eigen::SparseMatrix.
  opt.budget = 300;
  opt.seed = 9;
  const auto res = randattn::sparse_score_attention_accumulate<S>(q, k, v, opt);
  const auto& w = res.weights;
  CHECK(w.dims() == std::vector<Index>{37, 45});
  const auto csr = randattn::unfold<Eigen::RowMajor>(w, 0);
  const auto from_matrix = randattn::sparse_score_accumulate(csr, v, res.accumulator.log_scale());
  CHECK(from_matrix.numden() == res.accumulator.numden());
  const RowMatrix<S> dense = Eigen::Map<const RowMatrix<S>>(randattn::densify(w).data(), 37, 45);
  RowMatrix<S> ve(45, 6);
  ve << v, RowMatrix<S>::Ones(45, 1);
  CHECK(testing::rel_error(res.accumulator.numden(), RowMatrix<S>(dense * ve)) <
        10 * testing::tolerance<S>());
  // Block size does not change the sketch beyond the rounding of the score products.
  opt.block_size = 5;
  const auto res5 = randattn::sparse_score_attention_accumulate<S>(q, k, v, opt);
  CHECK(res5.weights.nnz() == w.nnz());

  // Unbiased [num | den]: the mean over draws of the denominators (row sums of W_hat) against
  // the row sums of W = exp(s - c), chi-square-style as for the tensor entries.
  const double scale = 1 / std::sqrt(8.0);
  const Eigen::MatrixXd logits =
      scale * q.template cast<double>() * k.template cast<double>().transpose();
  const int draws = 400;
  Eigen::MatrixXd mean = Eigen::MatrixXd::Zero(37, 6);
  for (int r = 0; r < draws; ++r) {
    opt.seed = 100 + std::uint64_t(r);
    mean += randattn::sparse_score_attention_accumulate<S>(q, k, v, opt)
                .accumulator.numden()
                .template cast<double>() /
            draws;
  }
  ChiSquare den;
  for (Index i = 0; i < 37; ++i) {
    Cumulants c;
    double truth = 0;
    for (Index j = 0; j < 45; ++j) {
      const double wij = std::exp(logits(i, j) - logits.row(i).maxCoeff());
      c.add(wij, res.weights.stats.rule.probability(wij));
      truth += wij;
    }
    den.add(mean(i, 5), truth, c, draws);
  }
  INFO("sum z^2 = " << den.sum_z2 << ", expected " << den.expected << " +- "
                    << 4 * std::sqrt(den.variance));
  CHECK(den.passes());
}

TEMPLATE_TEST_CASE("sketch: invalid input throws std::invalid_argument with a clear message",
                   "[sketch]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const auto t = mixed_tensor<S>({4, 5, 6}, 3);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(randattn::sparsify(t.view(), options(0)),
                    Contains("budget must be a positive"));
  CHECK_THROWS_WITH(randattn::sparsify(t.view(), options(-3)), Contains("budget"));
  CHECK_THROWS_WITH(randattn::sparsify(t.view(), options(std::nan(""))), Contains("budget"));
  const Vector<S> zeros = Vector<S>::Zero(24);
  CHECK_THROWS_WITH(randattn::sparsify(randattn::tensor_view(zeros.data(), {2, 3, 4}), options(5)),
                    Contains("all zero"));
  Vector<S> bad = t.data;
  bad(3 * 30 + 2 * 6 + 1) = std::numeric_limits<S>::quiet_NaN();
  CHECK_THROWS_WITH(randattn::sparsify(randattn::tensor_view(bad.data(), {4, 5, 6}), options(5)),
                    Contains("non-finite entry at (3, 2, 1)"));
  CHECK_THROWS_WITH(randattn::exact_hosvd(randattn::tensor_view(bad.data(), {4, 5, 6}), {1, 1, 1}),
                    Contains("non-finite"));
  CHECK_THROWS_WITH(randattn::spectral_norm(randattn::tensor_view(bad.data(), {4, 5, 6})),
                    Contains("non-finite"));
  CHECK_THROWS_WITH(randattn::tensor_view(t.data.data(), {120}), Contains("order k >= 2"));
  CHECK_THROWS_AS(randattn::sparsify(randattn::tensor_view(t.data.data(), {120}), options(5)),
                  std::invalid_argument);
  CHECK_THROWS_WITH(randattn::SparseTensor<S>({5}, {}, {}), Contains("order k >= 2"));
  CHECK_THROWS_WITH(randattn::SparseTensor<S>({2, 2}, {3, 1}, {S(1), S(2)}),
                    Contains("strictly increasing"));
  CHECK_THROWS_WITH(randattn::parse_scheme("foo"), Contains("unknown sparsification scheme 'foo'"));

  // Ranks: one per mode, each in [1, d_j].
  CHECK_THROWS_WITH(randattn::exact_hosvd(t.view(), {2, 6, 2}),
                    Contains("rank 6 of mode 1 must be in [1, d_1] = [1, 5]"));
  CHECK_THROWS_WITH(randattn::exact_hosvd(t.view(), {0, 1, 1}), Contains("rank 0 of mode 0"));
  CHECK_THROWS_WITH(randattn::exact_hosvd(t.view(), {1, 1}),
                    Contains("2 ranks given for a tensor of order 3"));
  CHECK_THROWS_WITH(randattn::sketched_hosvd(t.view(), {2, 2, 7}, options(10)),
                    Contains("rank 7 of mode 2"));
  CHECK_THROWS_WITH(randattn::sketched_hosvd(t.view(), {2, 2, 2}, options(0)), Contains("budget"));
  CHECK_THROWS_WITH(randattn::sketched_hosvd(randattn::tensor_view(zeros.data(), {2, 3, 4}),
                                             {1, 1, 1}, options(5)),
                    Contains("all zero"));

  // Streaming misuse.
  SparsifyOptions opt = options(10);
  CHECK_THROWS_WITH(randattn::StreamingSparsifier<S>({7}, opt), Contains("order k >= 2"));
  opt.scheme = SparsifyScheme::ndt;
  CHECK_THROWS_WITH(randattn::StreamingSparsifier<S>({4, 5, 6}, opt), Contains("spa only"));
  opt.scheme = SparsifyScheme::spa;
  {
    randattn::StreamingSparsifier<S> s({4, 5, 6}, opt);
    CHECK_THROWS_WITH(s.add_sample_block(t.data.data(), 10), Contains("pass 1 is not complete"));
    CHECK_THROWS_WITH(s.add_norm_block(t.data.data(), 121), Contains("runs past the end"));
    CHECK_THROWS_WITH(s.finish(), Contains("both passes must be complete"));
    s.add_norm_block(t.data.data(), 120);
    CHECK_THROWS_WITH(s.add_norm_block(t.data.data(), 1), Contains("pass 1 is complete"));
    Vector<S> changed = t.data;
    changed(7) += S(1);
    s.add_sample_block(changed.data(), 120);
    CHECK_THROWS_WITH(s.finish(), Contains("pass 2 saw different data"));
  }
  {
    randattn::StreamingSparsifier<S> s({4, 5, 6}, opt);
    s.add_norm_block(bad.data(), 60);
    CHECK_THROWS_WITH(s.add_norm_block(bad.data() + 60, 60),
                      Contains("non-finite entry at (3, 2, 1)"));
  }
  {
    randattn::StreamingSparsifier<S> s({2, 3, 4}, opt);
    CHECK_THROWS_WITH(s.add_norm_block(zeros.data(), 24), Contains("all zero"));
  }

  // Spectral norm and sin-theta arguments; sparse scores must be nonnegative.
  randattn::SpectralNormOptions so;
  so.max_iterations = 0;
  CHECK_THROWS_WITH(randattn::spectral_norm(t.view(), so), Contains("max_iterations"));
  CHECK_THROWS_WITH(randattn::sin_theta_distance(Eigen::MatrixXd::Identity(3, 1),
                                                 Eigen::MatrixXd::Identity(4, 1)),
                    Contains("same number of rows"));
  const randattn::SparseTensor<S> negative({2, 3}, {1, 4}, {S(1), S(-1)});
  CHECK_THROWS_WITH(randattn::sparse_score_accumulate(negative, RowMatrix<S>::Ones(3, 2)),
                    Contains("nonnegative"));
  CHECK_THROWS_WITH(randattn::sparse_score_accumulate(
                        randattn::SparseTensor<S>({2, 3}, {1}, {S(1)}), RowMatrix<S>::Ones(4, 2)),
                    Contains("v has 4 rows"));
  randattn::SparseScoreOptions sso;
  const RowMatrix<S> q = RowMatrix<S>::Ones(3, 2);
  CHECK_THROWS_WITH(randattn::sparse_score_attention(q, q, q, sso), Contains("budget"));
}
