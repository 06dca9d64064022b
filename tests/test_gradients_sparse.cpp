// Backward of sparse + low-rank attention (sparse_lowrank_backward.hpp) against central finite
// differences of the same seeded forward (tests/gradient_check.hpp), in double: every support
// kind (window with sinks, key blocks, LSH, LSF, unions), every remainder (none, positive random
// features, sampled keys with block-bound or uniform probabilities), causal and not, self
// exclusion and key centring, at n = 37 (no multiple of the block, chunk or causal feature chunk
// sizes, spanning two or more of each) and at n = 300 by directions. The finite differences call
// sparse_lowrank_attention with the forward's seed, so hashes, draws and probabilities are the
// same; the saving forward writes its bits. Inputs that the backward refuses are refused before
// anything is written.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "gradient_check.hpp"
#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::BlockSupport;
using randattn::CrossPolytopeHash;
using randattn::FeatureRemainder;
using randattn::Index;
using randattn::LocalitySensitiveFilters;
using randattn::NoRemainder;
using randattn::RotationKind;
using randattn::RowMatrix;
using randattn::SampledRemainder;
using randattn::SparseLowRankOptions;
using randattn::SupportSpec;
using randattn::WindowSupport;

namespace {

using Mat = RowMatrix<double>;
using Favor = randattn::PositiveFeatures<double>;

struct Case {
  Index n = 37, d = 4, dv = 3;
  bool causal = false, exclude_self = false, centre_keys = false;
  bool lsh = false, lsf = false;
  bool exact_buckets = false, dedupe = true;  // the LSH part's options
  std::optional<WindowSupport> window;
  std::optional<BlockSupport> blocks;
  std::string remainder = "none";  // none, favor, sampled, uniform
  std::uint64_t seed = 1;
  int directions = 0;            // > 0: directional checks instead of every entry
  bool expect_fallback = false;  // LSH chunks alone: some row falls back to all its valid keys

  std::string describe() const {
    return std::string(lsh ? " lsh" : "") + (exact_buckets ? " buckets" : "") +
           (dedupe ? "" : " multiset") + (lsf ? " lsf" : "") + (window ? " window" : "") +
           (blocks ? " blocks" : "") + " + " + remainder + (causal ? " causal" : "") +
           (exclude_self ? " exclude_self" : "") + (centre_keys ? " centred" : "") +
           " n=" + std::to_string(n) + " seed=" + std::to_string(seed);
  }
};

// The case's gradients against finite differences of sparse_lowrank_attention, after checking
// that the saving forward writes its bits.
template <typename Remainder>
void check_with(const Case& c, const SupportSpec<double>& support, const Remainder& remainder) {
  INFO(c.describe());
  Mat q = testing::gaussian<double>(c.seed, c.n, c.d);
  Mat k = testing::gaussian<double>(c.seed + 1, c.n, c.d);
  Mat v = testing::gaussian<double>(c.seed + 2, c.n, c.dv);
  const Mat g = testing::gaussian<double>(c.seed + 3, c.n, c.dv);
  SparseLowRankOptions opt;
  opt.causal = c.causal;
  opt.exclude_self = c.exclude_self;
  opt.centre_keys = c.centre_keys;
  opt.centre_prefix = 16;
  opt.seed = c.seed + 4;
  Mat out(c.n, c.dv), dq(c.n, c.d), dk(c.n, c.d), dv(c.n, c.dv);
  const auto saved =
      randattn::sparse_lowrank_forward<double>(q, k, v, support, out, remainder, opt);
  CHECK(out == randattn::sparse_lowrank_attention<double>(q, k, v, support, remainder, opt));
  if (c.expect_fallback)
    CHECK((saved.lsh_kernel && !saved.lsh_kernel->choices.fallback_rows.empty()));
  randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, g, dq, dk, dv);
  const auto f = [&] {
    return testing::contract(
        g, randattn::sparse_lowrank_attention<double>(q, k, v, support, remainder, opt));
  };
  const testing::OneThread one_thread;
  if (c.directions > 0) {
    testing::check_directions("dq, dk, dv", {&q, &k, &v}, {dq, dk, dv}, f, c.directions, c.seed + 5);
    return;
  }
  testing::check_gradient("dq", q, dq, f);
  testing::check_gradient("dk", k, dk, f);
  testing::check_gradient("dv", v, dv, f);
}

// The case's support (hash and filters built here) and remainder.
void check_case(const Case& c) {
  const CrossPolytopeHash<double> hash(RotationKind::dense, c.d, 4, 2, c.seed + 6);
  const LocalitySensitiveFilters<double> filters(RotationKind::dense, c.d, 6, 2, c.seed + 7);
  SupportSpec<double> s;
  if (c.lsh) {
    s.lsh = &hash;
    s.lsh_options.chunk = 8;
    s.lsh_options.exact_buckets = c.exact_buckets;
    s.lsh_options.dedupe = c.dedupe;
  }
  if (c.lsf) {
    s.lsf = &filters;
    s.lsf_options.eta = 0.6;
  }
  s.window = c.window;
  s.blocks = c.blocks;
  const randattn::OrthogonalProjection<double> projection(16, c.d, c.seed + 8);
  const Favor favor(projection);
  if (c.remainder == "favor")
    check_with(c, s, FeatureRemainder<Favor>{favor, {}});
  else if (c.remainder == "sampled")
    check_with(c, s, SampledRemainder{6, false, 8});
  else if (c.remainder == "uniform")
    check_with(c, s, SampledRemainder{6, true, 8});
  else
    check_with(c, s, NoRemainder{});
}

// dq, dk and dv of the inputs (given in double) in Scalar.
template <typename Scalar, typename Remainder>
std::vector<RowMatrix<Scalar>> gradients_in(const Mat& q, const Mat& k, const Mat& v, const Mat& g,
                                            const SupportSpec<Scalar>& s, const Remainder& r,
                                            const SparseLowRankOptions& opt) {
  const RowMatrix<Scalar> qs = q.cast<Scalar>(), ks = k.cast<Scalar>(), vs = v.cast<Scalar>(),
                          gs = g.cast<Scalar>();
  RowMatrix<Scalar> out(q.rows(), v.cols()), dq(q.rows(), q.cols()), dk(k.rows(), k.cols()),
      dv(v.rows(), v.cols());
  const auto saved = randattn::sparse_lowrank_forward<Scalar>(qs, ks, vs, s, out, r, opt);
  randattn::sparse_lowrank_backward<Scalar>(saved, qs, ks, vs, out, gs, dq, dk, dv);
  return {dq, dk, dv};
}

}  // namespace

TEST_CASE("Sparse + low-rank backward: window with sinks and key blocks", "[gradients][sparse]") {
  Case c;
  c.window = WindowSupport{4, 2};
  check_case(c);  // no remainder
  c.causal = true;
  c.remainder = "favor";
  check_case(c);
  c.remainder = "uniform";
  check_case(c);

  Case b;
  b.blocks = BlockSupport{8, 1};
  b.remainder = "sampled";
  b.centre_keys = true;  // the bounds see centred keys
  check_case(b);
  b.centre_keys = false;
  b.causal = true;
  check_case(b);
  b.remainder = "none";
  check_case(b);
}

TEST_CASE("Sparse + low-rank backward: LSH and LSF supports", "[gradients][sparse]") {
  // LSH chunks alone: E by LSH's own kernel and the feature correction chunk by chunk, so the
  // backward walks the chunks.
  Case lsh;
  lsh.lsh = true;
  lsh.remainder = "favor";
  check_case(lsh);
  lsh.causal = true;
  lsh.seed = 3;  // a row without a valid key in its chunks: the fallback
  lsh.expect_fallback = true;
  check_case(lsh);
  lsh.remainder = "none";
  check_case(lsh);
  lsh.dedupe = false;  // multiset rounds: E weighs a pair by its round count
  lsh.remainder = "sampled";
  check_case(lsh);
  lsh.dedupe = true;
  lsh.expect_fallback = false;
  lsh.exact_buckets = true;  // E by the bucket kernel, differentiated on its target sets
  check_case(lsh);

  Case lsf;
  lsf.lsf = true;
  lsf.causal = true;
  lsf.remainder = "sampled";
  check_case(lsf);
  lsf.causal = false;
  lsf.remainder = "favor";
  lsf.centre_keys = true;
  check_case(lsf);
}

TEST_CASE("Sparse + low-rank backward: unions and self exclusion", "[gradients][sparse]") {
  Case u;
  u.lsh = true;
  u.window = WindowSupport{3, 1};
  u.exclude_self = true;
  u.remainder = "sampled";
  check_case(u);
  u.causal = true;
  u.remainder = "favor";
  check_case(u);

  Case w;
  w.lsf = true;
  w.blocks = BlockSupport{8, 1};
  w.exclude_self = true;
  w.causal = true;
  w.remainder = "sampled";
  w.centre_keys = true;
  check_case(w);
}

TEST_CASE("Sparse + low-rank backward at n = 300", "[gradients][sparse]") {
  Case c;
  c.n = 300;
  c.lsh = true;
  c.window = WindowSupport{16, 4};
  c.blocks = BlockSupport{32, 1};
  c.remainder = "favor";
  c.causal = true;
  c.directions = 3;
  check_case(c);
  c.causal = false;
  c.remainder = "sampled";
  check_case(c);
}

TEST_CASE("Sparse + low-rank backward: thread count, refused inputs", "[gradients][sparse]") {
  const Index n = 150, d = 4, dv = 3;
  const Mat q = testing::gaussian<double>(41, n, d), k = testing::gaussian<double>(42, n, d);
  const Mat v = testing::gaussian<double>(43, n, dv), g = testing::gaussian<double>(44, n, dv);
  const CrossPolytopeHash<double> hash(RotationKind::dense, d, 4, 2, 45);
  SupportSpec<double> s;
  s.lsh = &hash;
  s.lsh_options.chunk = 16;
  s.window = WindowSupport{8, 2};
  SparseLowRankOptions opt;
  opt.seed = 46;
  Mat out(n, dv), dq(n, d), dk(n, d), dvv(n, dv);
  const auto saved = randattn::sparse_lowrank_forward<double>(q, k, v, s, out,
                                                              SampledRemainder{8, false, 16}, opt);
  randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, g, dq, dk, dvv);
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  Mat dq1(n, d), dk1(n, d), dv1(n, dv);
  randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, g, dq1, dk1, dv1);
  omp_set_num_threads(3);
  Mat dq3(n, d), dk3(n, d), dv3(n, dv);
  randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, g, dq3, dk3, dv3);
  omp_set_num_threads(threads);
  CHECK(dq1 == dq3);
  CHECK(dk1 == dk3);
  CHECK(dv1 == dv3);
  CHECK(dq1 == dq);
#endif

  // Refused before anything is written.
  Mat dq0 = Mat::Constant(n, d, 7), dk0 = Mat::Constant(n, d, 7), dv0 = Mat::Constant(n, dv, 7);
  const auto untouched = [&] {
    return (dq0.array() == 7).all() && (dk0.array() == 7).all() && (dv0.array() == 7).all();
  };
  CHECK_THROWS_AS(randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, g.topRows(n - 1),
                                                            dq0, dk0, dv0),
                  std::invalid_argument);
  CHECK_THROWS_AS(randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, g.leftCols(dv - 1),
                                                            dq0, dk0, dv0),
                  std::invalid_argument);
  Mat bad = g;
  bad(3, 1) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(
      randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, bad, dq0, dk0, dv0),
      std::invalid_argument);
  bad(3, 1) = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(
      randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, bad, dq0, dk0, dv0),
      std::invalid_argument);
  Mat small(n, d - 1);
  CHECK_THROWS_AS(
      randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, g, small, dk0, dv0),
      std::invalid_argument);
  CHECK_THROWS_AS(randattn::sparse_lowrank_backward<double>(saved, q.topRows(n - 1), k, v, out, g,
                                                            dq0, dk0, dv0),
                  std::invalid_argument);
  // Exact-bucket LSH alone over multiset rounds weighs pairs by their round counts: no backward.
  SupportSpec<double> multiset;
  multiset.lsh = &hash;
  multiset.lsh_options.exact_buckets = true;
  multiset.lsh_options.dedupe = false;
  const auto saved_multiset = randattn::sparse_lowrank_forward<double>(q, k, v, multiset, out);
  CHECK_THROWS_WITH(
      randattn::sparse_lowrank_backward<double>(saved_multiset, q, k, v, out, g, dq0, dk0, dv0),
      Catch::Contains("dedupe"));
  CHECK(untouched());
}

TEST_CASE("Sparse + low-rank backward: float within its rounding of double",
          "[gradients][sparse]") {
  // A window support and data-independent sampling probabilities: the same choices in both types.
  const Index n = 100, d = 4, dv = 3;
  const Mat q = testing::gaussian<double>(51, n, d), k = testing::gaussian<double>(52, n, d);
  const Mat v = testing::gaussian<double>(53, n, dv), g = testing::gaussian<double>(54, n, dv);
  SupportSpec<double> sd;
  SupportSpec<float> sf;
  sd.window = sf.window = WindowSupport{8, 2};
  SparseLowRankOptions opt;
  opt.causal = true;
  opt.seed = 55;
  const randattn::PositiveFeatures<double> md(randattn::OrthogonalProjection<double>(16, d, 56));
  const randattn::PositiveFeatures<float> mf(randattn::OrthogonalProjection<float>(16, d, 56));
  const auto check = [](const std::vector<RowMatrix<float>>& f, const std::vector<Mat>& x) {
    for (std::size_t a = 0; a < x.size(); ++a) CHECK(testing::rel_error(f[a], x[a]) < 1e-4);
  };
  check(gradients_in<float>(q, k, v, g, sf, FeatureRemainder<decltype(mf)>{mf, {}}, opt),
        gradients_in<double>(q, k, v, g, sd, FeatureRemainder<decltype(md)>{md, {}}, opt));
  check(gradients_in<float>(q, k, v, g, sf, SampledRemainder{6, true, 8}, opt),
        gradients_in<double>(q, k, v, g, sd, SampledRemainder{6, true, 8}, opt));
}
