// Contract tests of randattn-cli: results, the --report line, and the error contract (one line on
// stderr starting with "randattn-cli: error: ", exit code 2, no output file written).
#include <randattn/io/npy.hpp>
#include <randattn/randattn.hpp>

#include <catch2/catch.hpp>

#ifdef RANDATTN_TEST_CLI

#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace testing {
extern const char* const cli_path;  // cli_path.cpp
}  // namespace testing
using randattn::io::NpyArray;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

struct Result {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Scratch directory holding the inputs and outputs of one test case.
class Workspace {
 public:
  Workspace() {
    std::random_device rd;
    dir_ = fs::temp_directory_path() /
           ("randattn_cli_test_" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directories(dir_);
    fs::create_directories(dir_ / "logs");
  }
  ~Workspace() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // " --<name> <quoted path of file>".
  std::string flag(const std::string& name, const std::string& file) const {
    return " --" + name + " " + quote(path(file));
  }
  // The attention inputs q.npy, k.npy (or --shared-qk), v.npy and the output o.npy.
  std::string attention_io(bool with_keys = true) const {
    return flag("q", "q.npy") + (with_keys ? flag("k", "k.npy") : " --shared-qk") +
           flag("v", "v.npy") + flag("out", "o.npy");
  }

  // Runs randattn-cli with `args` (already shell-quoted where needed).
  Result run(const std::string& args) const {
    return run_command(quote(testing::cli_path) + " " + args);
  }
  Result run_command(const std::string& command) const {
    const fs::path out = dir_ / "logs" / "stdout", err = dir_ / "logs" / "stderr";
    const std::string cmd =
        "(" + command + ") >" + quote(out.string()) + " 2>" + quote(err.string());
    const int status = std::system(cmd.c_str());
    Result r;
    r.exit_code = (status != -1 && WIFEXITED(status)) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  // Runs randattn-cli under an address-space limit of `kib` KiB (ulimit -v). Not in builds with
  // AddressSanitizer: its shadow memory reserves terabytes of address space at start-up, so the
  // tool could not start under any such limit.
  Result run_limited(const std::string& args, long kib) const {
    return run_command("ulimit -v " + std::to_string(kib) + "; " + quote(testing::cli_path) +
                       " " + args);
  }

  // Files in the workspace (logs excluded), sorted.
  std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().filename() != "logs") names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path dir_;
};

template <typename T>
std::vector<T> data(std::size_t n, std::uint64_t seed) {
  std::vector<T> v(n);
  std::uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = static_cast<T>(static_cast<double>(s >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  }
  return v;
}

template <typename T>
void save(const Workspace& ws, const std::string& name, const std::vector<std::int64_t>& shape,
          std::uint64_t seed) {
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  randattn::io::write_npy(ws.path(name), data<T>(n, seed), shape);
}

// Softmax attention in double, slice by slice, for (batch*heads) row-major slices.
template <typename T>
std::vector<double> reference(const std::vector<T>& q, const std::vector<T>& k,
                              const std::vector<T>& v, std::int64_t slices, std::int64_t nq,
                              std::int64_t nk, std::int64_t d, std::int64_t dv, double scale,
                              bool causal) {
  std::vector<double> out(static_cast<std::size_t>(slices * nq * dv), 0.0);
  for (std::int64_t s = 0; s < slices; ++s) {
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t lim = causal ? i + 1 : nk;
      std::vector<double> logits(static_cast<std::size_t>(lim));
      double mx = -INFINITY;
      for (std::int64_t j = 0; j < lim; ++j) {
        double dot = 0;
        for (std::int64_t c = 0; c < d; ++c)
          dot += double(q[(s * nq + i) * d + c]) * double(k[(s * nk + j) * d + c]);
        logits[j] = scale * dot;
        mx = std::max(mx, logits[j]);
      }
      double den = 0;
      for (auto& l : logits) den += (l = std::exp(l - mx));
      for (std::int64_t j = 0; j < lim; ++j)
        for (std::int64_t c = 0; c < dv; ++c)
          out[(s * nq + i) * dv + c] += logits[j] / den * double(v[(s * nk + j) * dv + c]);
    }
  }
  return out;
}

void require_error(const Workspace& ws, const std::string& args, const std::string& phrase = "") {
  const std::vector<std::string> before = ws.files();
  const Result r = ws.run(args);
  INFO("args: " << args << "\nstderr: " << r.err << "\nstdout: " << r.out);
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());
  CHECK(r.err.rfind("randattn-cli: error: ", 0) == 0);
  REQUIRE(!r.err.empty());
  CHECK(r.err.back() == '\n');
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  if (!phrase.empty()) CHECK(r.err.find(phrase) != std::string::npos);
  CHECK(ws.files() == before);  // no output, no temporary left behind
}

}  // namespace

TEST_CASE("cli: --help exits 0", "[cli]") {
  Workspace ws;
  Result r = ws.run("--help");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("attention") != std::string::npos);
  r = ws.run("attention --help");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("--method") != std::string::npos);
  CHECK(r.out.find("--causal") != std::string::npos);
}

TEST_CASE("cli: 2-D float32 exact attention", "[cli]") {
  Workspace ws;
  save<float>(ws, "q.npy", {5, 4}, 1);
  save<float>(ws, "k.npy", {7, 4}, 2);
  save<float>(ws, "v.npy", {7, 3}, 3);
  const Result r = ws.run("attention --method exact" + ws.attention_io());
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.empty());
  CHECK(r.err.empty());
  const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
  CHECK(o.shape == std::vector<std::int64_t>{5, 3});
  REQUIRE(o.is_float32());
  const auto ref = reference(data<float>(20, 1), data<float>(28, 2), data<float>(21, 3), 1, 5, 7, 4,
                             3, 0.5, false);
  for (std::size_t i = 0; i < ref.size(); ++i)
    CHECK(o.values<float>()[i] == Approx(ref[i]).margin(1e-5));
  CHECK(ws.files() == std::vector<std::string>{"k.npy", "o.npy", "q.npy", "v.npy"});
}

TEST_CASE("cli: float16 inputs give the float32 result on their values, rounded once", "[cli]") {
  Workspace ws;
  const std::vector<std::int64_t> qk_shape{1, 2, 6, 8}, v_shape{1, 2, 6, 5};
  save<Eigen::half>(ws, "q.npy", qk_shape, 7);
  save<Eigen::half>(ws, "k.npy", qk_shape, 8);
  save<Eigen::half>(ws, "v.npy", v_shape, 9);
  // The same values widened to float32 (exactly).
  for (const char* name : {"q", "k", "v"}) {
    const NpyArray h = randattn::io::read_npy(ws.path(std::string(name) + ".npy"));
    REQUIRE(h.is_float16());
    const std::vector<Eigen::half>& values = h.values<Eigen::half>();
    randattn::io::write_npy(ws.path(std::string(name) + "32.npy"),
                            std::vector<float>(values.begin(), values.end()), h.shape);
  }
  for (const std::string method :
       {"exact --causal", "favor --features 16 --seed 3", "lsh --chunk 2"}) {
    INFO("method " << method);
    Result r = ws.run("attention --report --method " + method + ws.attention_io());
    INFO("stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out.find("\"dtype\":\"float16\"") != std::string::npos);
    r = ws.run("attention --method " + method + ws.flag("q", "q32.npy") + ws.flag("k", "k32.npy") +
               ws.flag("v", "v32.npy") + ws.flag("out", "o32.npy"));
    REQUIRE(r.exit_code == 0);
    const NpyArray o16 = randattn::io::read_npy(ws.path("o.npy"));
    const NpyArray o32 = randattn::io::read_npy(ws.path("o32.npy"));
    CHECK(o16.shape == std::vector<std::int64_t>{1, 2, 6, 5});
    REQUIRE(o16.is_float16());
    REQUIRE(o32.values<float>().size() == o16.values<Eigen::half>().size());
    for (std::size_t i = 0; i < o16.size(); ++i) {
      INFO("entry " << i);
      CHECK(Eigen::numext::bit_cast<std::uint16_t>(o16.values<Eigen::half>()[i]) ==
            Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(o32.values<float>()[i])));
    }
  }
  // --compare measures the float16 output against exact attention in float16.
  const Result r = ws.run("attention --method favor --features 16 --compare" + ws.attention_io());
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("\"rel_error\":") != std::string::npos);
  // Mixed dtypes and float16 tensors for the sketches are refused.
  require_error(ws,
                "attention" + ws.flag("q", "q.npy") + ws.flag("k", "k32.npy") +
                    ws.flag("v", "v.npy") + ws.flag("out", "x.npy"),
                "--q, --k and --v must have the same dtype, got q float16, k float32, v float16");
  require_error(ws, "sparsify --in " + quote(ws.path("q.npy")) + " --budget 8 --out " +
                        quote(ws.path("x.npy")),
                "float16 tensors are not sketched");
}

TEST_CASE("cli: 4-D float64 causal attention with --report", "[cli]") {
  Workspace ws;
  save<double>(ws, "q.npy", {2, 3, 6, 4}, 4);
  save<double>(ws, "k.npy", {2, 3, 6, 4}, 5);
  save<double>(ws, "v.npy", {2, 3, 6, 5}, 6);
  const Result r =
      ws.run("attention" + ws.attention_io() + " --causal --scale 0.3 --threads 2 --report");
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.empty());

  const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
  CHECK(o.shape == std::vector<std::int64_t>{2, 3, 6, 5});
  REQUIRE(o.is_float64());
  const auto ref = reference(data<double>(144, 4), data<double>(144, 5), data<double>(180, 6), 6, 6,
                             6, 4, 5, 0.3, true);
  for (std::size_t i = 0; i < ref.size(); ++i)
    CHECK(o.values<double>()[i] == Approx(ref[i]).margin(1e-12));

  // Exactly one JSON object on one line.
  REQUIRE(std::count(r.out.begin(), r.out.end(), '\n') == 1);
  REQUIRE(r.out.back() == '\n');
  const std::string line = r.out.substr(0, r.out.size() - 1);
  const std::string head =
      R"({"method":"exact","dtype":"float64","q":[2,3,6,4],"k":[2,3,6,4],"v":[2,3,6,5],"out":[2,3,6,5],)"
      R"("causal":true,"scale":0.3,"threads":)";
  CHECK(line.rfind(head, 0) == 0);
  const std::size_t shared = line.find(",\"shared_qk\":false,\"seconds\":");
  REQUIRE(shared != std::string::npos);
  const std::size_t sec = line.find(",\"seconds\":");
  REQUIRE(sec != std::string::npos);
  const std::string threads = line.substr(head.size(), shared - head.size());
  CHECK((threads == "1" || threads == "2"));
  const std::string seconds = line.substr(sec + 11, line.size() - sec - 12);
  char* end = nullptr;
  const double s = std::strtod(seconds.c_str(), &end);
  CHECK(*end == '\0');
  CHECK(s >= 0.0);
  CHECK(line.back() == '}');
}

TEST_CASE("cli: --report shows the default scale 1/sqrt(d)", "[cli]") {
  Workspace ws;
  save<float>(ws, "q.npy", {3, 64}, 7);
  save<float>(ws, "k.npy", {4, 64}, 8);
  save<float>(ws, "v.npy", {4, 2}, 9);
  const Result r = ws.run("attention" + ws.attention_io() + " --report");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find(R"("dtype":"float32")") != std::string::npos);
  CHECK(r.out.find(R"("causal":false,"scale":0.125,)") != std::string::npos);
  CHECK(r.out.find(R"("out":[3,2])") != std::string::npos);
}

// np.save of a transposed array writes Fortran order; other tools write big-endian data. Both
// are read as NumPy reads them: the same output, bit for bit, as from the C-order file.
TEST_CASE("cli: Fortran-order and big-endian inputs read as NumPy reads them", "[cli]") {
  Workspace ws;
  save<float>(ws, "q.npy", {5, 4}, 1);
  save<float>(ws, "k.npy", {7, 4}, 2);
  save<float>(ws, "v.npy", {7, 3}, 3);
  const std::vector<float> q = randattn::io::read_npy(ws.path("q.npy")).values<float>();
  // q's 5 x 4 values column by column, each float's bytes reversed: '>f4' in Fortran order.
  std::string payload;
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 5; ++i) {
      char bytes[4];
      std::memcpy(bytes, &q[static_cast<std::size_t>(i * 4 + j)], 4);
      for (int b = 3; b >= 0; --b) payload += bytes[b];
    }
  std::string header = "{'descr': '>f4', 'fortran_order': True, 'shape': (5, 4), }";
  header.append(128 - 10 - header.size() - 1, ' ');
  header += '\n';
  std::ofstream(ws.path("q_fortran_be.npy"), std::ios::binary)
      << std::string("\x93NUMPY\x01\x00", 8) << static_cast<char>(header.size()) << '\0'
      << header << payload;

  const std::string kv = ws.flag("k", "k.npy") + ws.flag("v", "v.npy");
  REQUIRE(ws.run("attention --method favor --features 8" + ws.flag("q", "q.npy") + kv +
                 ws.flag("out", "o_c.npy"))
              .exit_code == 0);
  const Result r = ws.run("attention --method favor --features 8" +
                          ws.flag("q", "q_fortran_be.npy") + kv + ws.flag("out", "o_f.npy"));
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::vector<float> expected = randattn::io::read_npy(ws.path("o_c.npy")).values<float>();
  const std::vector<float> got = randattn::io::read_npy(ws.path("o_f.npy")).values<float>();
  REQUIRE(got.size() == expected.size());
  CHECK(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0);
}

TEST_CASE("cli: every failure is one stderr line, exit code 2 and no output", "[cli]") {
  Workspace ws;
  save<float>(ws, "q.npy", {5, 4}, 1);
  save<float>(ws, "k.npy", {7, 4}, 2);
  save<float>(ws, "v.npy", {7, 3}, 3);
  save<float>(ws, "q3d.npy", {1, 5, 4}, 1);
  save<float>(ws, "q1d.npy", {4}, 1);
  save<float>(ws, "k_d5.npy", {7, 5}, 2);
  save<float>(ws, "v_n6.npy", {6, 3}, 3);
  save<double>(ws, "v_f64.npy", {7, 3}, 3);
  save<float>(ws, "q4d.npy", {1, 2, 5, 4}, 1);
  save<float>(ws, "k4d.npy", {1, 2, 7, 4}, 1);
  save<float>(ws, "v4d_b2.npy", {2, 2, 7, 3}, 1);
  save<float>(ws, "k0.npy", {0, 4}, 1);
  save<float>(ws, "v0.npy", {0, 3}, 1);
  {
    std::vector<float> bad = data<float>(20, 1);
    bad[7] = NAN;
    randattn::io::write_npy(ws.path("q_nan.npy"), bad, {5, 4});
    std::vector<float> inf = data<float>(21, 3);
    inf[20] = INFINITY;
    randattn::io::write_npy(ws.path("v_inf.npy"), inf, {7, 3});
  }
  {
    std::ofstream(ws.path("garbage.npy")) << "this is not an npy file";
    // A version 1.0 file written by hand: header dictionary padded to 128 bytes, then payload.
    auto raw_npy = [&](const std::string& name, const std::string& dict,
                       std::size_t payload_bytes) {
      std::ofstream f(ws.path(name), std::ios::binary);
      std::string header = dict;
      header.append(128 - 10 - header.size() - 1, ' ');
      header += '\n';
      f << std::string("\x93NUMPY\x01\x00", 8) << static_cast<char>(header.size()) << '\0' << header
        << std::string(payload_bytes, '\0');
    };
    raw_npy("int.npy", "{'descr': '<i4', 'fortran_order': False, 'shape': (5, 4), }", 80);
    raw_npy("complex.npy", "{'descr': '<c8', 'fortran_order': False, 'shape': (5, 4), }", 160);
    raw_npy("truncated.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (5, 4), }", 79);
    std::ofstream(ws.path("short_header.npy"), std::ios::binary)
        << std::string("\x93NUMPY\x01\x00\x76\x00{'de", 14);
  }
  const std::string q = ws.flag("q", "q.npy"), k = ws.flag("k", "k.npy");
  const std::string v = ws.flag("v", "v.npy"), out = ws.flag("out", "o.npy");
  auto with = [&](const std::string& flag, const std::string& file) { return ws.flag(flag, file); };

  SECTION("unreadable or malformed input") {
    require_error(ws, "attention" + with("q", "missing.npy") + k + v + out,
                  "missing.npy: no such file");
    require_error(ws, "attention" + with("q", "garbage.npy") + k + v + out, "bad magic");
    require_error(ws, "attention" + q + with("k", "int.npy") + v + out, "unsupported dtype '<i4'");
    require_error(ws, "attention" + q + with("k", "complex.npy") + v + out,
                  "unsupported dtype '<c8'");
    require_error(ws, "attention" + with("q", "truncated.npy") + k + v + out, "truncated");
    require_error(ws, "attention" + with("q", "short_header.npy") + k + v + out, "truncated");
    require_error(ws, "attention" + q + k + with("v", "logs") + out, "is a directory");
  }
  SECTION("wrong number of dimensions") {
    require_error(ws, "attention" + with("q", "q3d.npy") + k + v + out, "got shape (1, 5, 4)");
    require_error(ws, "attention" + with("q", "q1d.npy") + k + v + out, "got shape (4,)");
    require_error(ws, "attention" + with("q", "q4d.npy") + k + v + out,
                  "same number of dimensions");
  }
  SECTION("mismatched shapes and dtypes") {
    require_error(ws, "attention" + q + with("k", "k_d5.npy") + v + out, "feature dimension");
    require_error(ws, "attention" + q + k + with("v", "v_n6.npy") + out, "number of tokens");
    require_error(ws, "attention" + q + k + with("v", "v_f64.npy") + out, "same dtype");
    require_error(
        ws,
        "attention" + with("q", "q4d.npy") + with("k", "k4d.npy") + with("v", "v4d_b2.npy") + out,
        "batch dimensions of --q, --k and --v");
    require_error(ws, "attention" + q + with("k", "k0.npy") + with("v", "v0.npy") + out,
                  "at least one key");
    require_error(ws, "attention --causal" + q + k + v + out);  // causal needs n_q == n_k
  }
  SECTION("non-finite input") {
    require_error(ws, "attention" + with("q", "q_nan.npy") + k + v + out, "non-finite");
    require_error(ws, "attention" + q + k + with("v", "v_inf.npy") + out, "non-finite");
  }
  SECTION("unknown method, flags and subcommands; bad option values") {
    require_error(ws, "attention --method nosuch" + q + k + v + out, "unknown --method 'nosuch'");
    require_error(ws, "attention --bogus" + q + k + v + out);
    require_error(ws, "attention" + q + k + v);  // --out missing
    require_error(ws, "");
    require_error(ws, "frobnicate");
    require_error(ws, "attention --threads 0" + q + k + v + out, "--threads");
    require_error(ws, "attention --scale nan" + q + k + v + out);
    require_error(ws, "attention --scale abc" + q + k + v + out);
  }
  SECTION("unwritable output") {
    require_error(ws, "attention" + q + k + v + with("out", "no_dir/o.npy"), "--out");
    fs::create_directory(ws.path("taken"));
    require_error(ws, "attention" + q + k + v + with("out", "taken"), "--out");
  }
  SECTION("a failed run leaves an existing output untouched") {
    std::ofstream(ws.path("o.npy")) << "previous";
    require_error(ws, "attention" + with("q", "q_nan.npy") + k + v + out);
    CHECK(slurp(ws.path("o.npy")) == "previous");
  }
}

// ---- Random-feature methods (favor, favor-hyp, trig) ------------------------------------------

namespace {

// The positive-feature formula of Performer (Lemma 1) with the rows of W as ω, then attention, in
// double.
std::vector<double> favor_reference(const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v, const std::vector<double>& w,
                                    std::int64_t n, std::int64_t d, std::int64_t dv, std::int64_t m,
                                    double scale) {
  const double c = std::sqrt(scale);
  auto phi = [&](const std::vector<double>& x, std::int64_t i) {
    double sq = 0;
    for (std::int64_t t = 0; t < d; ++t) sq += c * x[i * d + t] * c * x[i * d + t];
    std::vector<double> f(static_cast<std::size_t>(m));
    for (std::int64_t r = 0; r < m; ++r) {
      double u = 0;
      for (std::int64_t t = 0; t < d; ++t) u += w[r * d + t] * c * x[i * d + t];
      f[r] = std::exp(u - sq / 2) / std::sqrt(double(m));
    }
    return f;
  };
  std::vector<double> out(static_cast<std::size_t>(n * dv), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto fq = phi(q, i);
    double den = 0;
    std::vector<double> num(static_cast<std::size_t>(dv), 0.0);
    for (std::int64_t j = 0; j < n; ++j) {
      const auto fk = phi(k, j);
      double a = 0;
      for (std::int64_t r = 0; r < m; ++r) a += fq[r] * fk[r];
      den += a;
      for (std::int64_t t = 0; t < dv; ++t) num[t] += a * v[j * dv + t];
    }
    for (std::int64_t t = 0; t < dv; ++t) out[i * dv + t] = num[t] / den;
  }
  return out;
}

// The text of top-level field `key` of a one-line JSON report ("" when absent), and as a number
// (NaN when absent).
std::string json_field(const std::string& line, const std::string& key) {
  const std::size_t at = line.find("\"" + key + "\":");
  if (at == std::string::npos) return "";
  const std::size_t begin = at + key.size() + 3;
  return line.substr(begin, line.find_first_of(",}", begin) - begin);
}

double json_number(const std::string& line, const std::string& key) {
  const std::string text = json_field(line, key);
  return text.empty() ? NAN : std::strtod(text.c_str(), nullptr);
}

}  // namespace

TEST_CASE("cli: favor with --omega evaluates the Performer formulas with W", "[cli][features]") {
  Workspace ws;
  const std::int64_t n = 6, d = 4, dv = 3, m = 5;
  save<double>(ws, "q.npy", {n, d}, 11);
  save<double>(ws, "k.npy", {n, d}, 12);
  save<double>(ws, "v.npy", {n, dv}, 13);
  save<double>(ws, "w.npy", {m, d}, 14);
  const std::string io = ws.attention_io();
  const Result r = ws.run("attention --method favor --omega " + quote(ws.path("w.npy")) + io +
                          " --scale 0.6 --report");
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find(R"("method":"favor")") != std::string::npos);
  CHECK(r.out.find(R"("features":5,"projection":"user")") != std::string::npos);
  CHECK(r.out.find(R"("feature_dim":5)") != std::string::npos);
  const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
  const auto ref =
      favor_reference(data<double>(n * d, 11), data<double>(n * d, 12), data<double>(n * dv, 13),
                      data<double>(m * d, 14), n, d, dv, m, 0.6);
  for (std::size_t i = 0; i < ref.size(); ++i)
    CHECK(o.values<double>()[i] == Approx(ref[i]).margin(1e-12));

  // The shared flags are rejected by methods outside the family and checked against W.
  require_error(ws, "attention --method exact --features 8" + io, "--features");
  require_error(ws, "attention --method favor --features 4 --omega " + quote(ws.path("w.npy")) + io,
                "rows of --omega");
  require_error(ws,
                "attention --method favor --projection iid --omega " + quote(ws.path("w.npy")) + io,
                "cannot be combined");
  save<double>(ws, "w_d5.npy", {m, 5}, 14);
  require_error(ws, "attention --method trig --omega " + quote(ws.path("w_d5.npy")) + io,
                "expected an (r, 4)");
  require_error(ws, "attention --method favor --projection gaussian" + io, "--projection");
  require_error(ws, "attention --method favor --features 0" + io, "--features");
}

TEST_CASE("cli: favor, favor-hyp and trig with --compare", "[cli][features]") {
  Workspace ws;
  const std::int64_t n = 64, d = 8, dv = 4;
  save<float>(ws, "q.npy", {2, 2, n, d}, 21);
  save<float>(ws, "k.npy", {2, 2, n, d}, 22);
  save<float>(ws, "v.npy", {2, 2, n, dv}, 23);
  const std::string io = ws.attention_io();
  const auto exact =
      reference(data<float>(4 * n * d, 21), data<float>(4 * n * d, 22), data<float>(4 * n * dv, 23),
                4, n, n, d, dv, 1.0 / std::sqrt(double(d)), true);
  for (const std::string method : {"favor", "favor-hyp", "trig"}) {
    for (const std::string projection : {"iid", "orthogonal", "hadamard"}) {
      INFO(method << " " << projection);
      const Result r = ws.run("attention --method " + method + " --features 128 --projection " +
                              projection + " --seed 3 --causal --compare" + io);
      INFO("stderr: " << r.err);
      REQUIRE(r.exit_code == 0);
      REQUIRE(std::count(r.out.begin(), r.out.end(), '\n') == 1);
      CHECK(r.out.find("\"projection\":\"" + projection + "\",\"seed\":3") != std::string::npos);
      CHECK(json_number(r.out, "feature_dim") == (method == "favor" ? 128 : 256));
      const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
      double diff = 0, norm = 0;
      for (std::size_t i = 0; i < exact.size(); ++i) {
        diff += std::pow(double(o.values<float>()[i]) - exact[i], 2);
        norm += exact[i] * exact[i];
      }
      // The reported error is the error of the written output against exact attention.
      CHECK(json_number(r.out, "rel_error") == Approx(std::sqrt(diff / norm)).epsilon(1e-4));
      CHECK(json_number(r.out, "rel_error") < 0.5);
    }
  }
}

TEST_CASE("cli: hybrid and hybrid-gaussian", "[cli][hybrid]") {
  Workspace ws;
  const std::int64_t n = 40, d = 6, dv = 2;
  save<double>(ws, "q.npy", {n, d}, 31);
  save<double>(ws, "k.npy", {n, d}, 32);
  save<double>(ws, "v.npy", {n, dv}, 33);
  const std::string io = ws.attention_io();
  Result r = ws.run(
      "attention --method hybrid --features 16 --lambda-features 4 --seed 2 --causal --compare" +
      io);
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(json_number(r.out, "feature_dim") == 2 * 5 * 32 + 32);  // 2 (n_lambda + 1) 2m + 2m
  CHECK(json_number(r.out, "lambda_features") == 4);
  CHECK(std::isfinite(json_number(r.out, "rel_error")));
  r = ws.run(
      "attention --method hybrid-gaussian --features 16 --lambda-features 4 --bandwidth 0.5 "
      "--report" +
      io);
  REQUIRE(r.exit_code == 0);
  CHECK(json_number(r.out, "feature_dim") == 2 * 4 * (32 + 16) + 16);  // 2 n_lambda (2m + m) + m
  CHECK(json_number(r.out, "bandwidth") == 0.5);
  const NpyArray o =
      randattn::io::read_npy(ws.path("o.npy"));  // keep the array alive while iterating
  for (double x : o.values<double>()) CHECK(std::isfinite(x));
  save<double>(ws, "w.npy", {4, d}, 34);
  require_error(ws, "attention --method hybrid --omega " + quote(ws.path("w.npy")) + io, "--omega");
  require_error(ws, "attention --method favor --bandwidth 2" + io, "--bandwidth");
  require_error(ws, "attention --method hybrid-gaussian --bandwidth -1" + io, "--bandwidth");
}

TEST_CASE("cli: oprf and sderf, their fit modes and the predicted kernel MSE", "[cli][oprf]") {
  Workspace ws;
  const std::int64_t n = 64, d = 8, dv = 4;
  save<float>(ws, "q.npy", {2, 1, n, d}, 41);
  save<float>(ws, "k.npy", {2, 1, n, d}, 42);
  save<float>(ws, "v.npy", {2, 1, n, dv}, 43);
  save<double>(ws, "c.npy", {16, d}, 44);
  save<double>(ws, "c_bad.npy", {16, d + 1}, 45);
  save<double>(ws, "ck.npy", {20, d}, 46);
  save<double>(ws, "c_heads.npy", {1, 16, d}, 47);
  save<double>(ws, "c_heads_bad.npy", {2, 16, d}, 48);
  const std::string io = ws.attention_io();
  const std::string calibration = " --fit given --calibration " + quote(ws.path("c.npy"));
  for (const std::string method : {"oprf", "sderf"}) {
    INFO(method);
    for (const std::string& fit : {std::string(""), std::string(" --fit given --rho 0.4"),
                                  calibration, " --causal" + calibration,
                                  " --fit given --calibration-q " + quote(ws.path("c.npy")) +
                                      " --calibration-k " + quote(ws.path("ck.npy")),
                                  " --fit given --calibration " + quote(ws.path("c_heads.npy"))}) {
      INFO(fit);
      const Result r =
          ws.run("attention --method " + method + " --features 128 --seed 2 --compare" + fit + io);
      INFO("stderr: " << r.err);
      REQUIRE(r.exit_code == 0);
      CHECK(json_number(r.out, "feature_dim") == 128);
      CHECK(r.out.find(fit.empty() ? "\"fit\":\"queries+keys\"" : "\"fit\":\"given\"") !=
            std::string::npos);
      // Entries in [-1, 1], d = 8, scale 1/sqrt(8): |q + k|^2 scaled is about 1, a small error.
      CHECK(json_number(r.out, "rel_error") < 0.5);
      CHECK(json_number(r.out, "predicted_rel_mse") > 0);
      CHECK(json_number(r.out, "predicted_rel_mse") < 0.1);
    }
    const std::string base = "attention --method " + method + io;
    require_error(ws, base + " --causal", "--fit given");
    require_error(ws, base + " --fit given",
                  "exactly one of --rho, --calibration, or --calibration-q with --calibration-k");
    require_error(ws, base + " --fit given --rho 1" + " --calibration " + quote(ws.path("c.npy")),
                  "exactly one");
    require_error(ws, base + " --rho 1", "need --fit given");
    require_error(ws, base + " --fit given --rho -1", "--rho");
    require_error(ws, base + " --fit sequence", "--fit");
    require_error(ws, base + " --fit given --calibration " + quote(ws.path("c_bad.npy")),
                  "--calibration");
    require_error(ws, base + " --fit given --calibration " + quote(ws.path("missing.npy")),
                  "--calibration");
    require_error(ws, base + " --fit given --calibration " + quote(ws.path("c_heads_bad.npy")),
                  "per-head (1, r, 8)");
    require_error(ws, base + " --fit given --calibration-q " + quote(ws.path("c.npy")),
                  "--calibration-k is missing");
    require_error(ws,
                  base + " --calibration-q " + quote(ws.path("c.npy")) + " --calibration-k " +
                      quote(ws.path("ck.npy")),
                  "need --fit given");
  }
  require_error(ws, "attention --method favor --rho 1" + io, "--rho");
  require_error(ws, "attention --method hybrid --fit given" + io, "--fit");
  // favor, favor-hyp and trig report the closed form too; the hybrid has none.
  for (const std::string method : {"favor", "favor-hyp", "trig"}) {
    const Result r = ws.run("attention --method " + method + " --report" + io);
    REQUIRE(r.exit_code == 0);
    CHECK(json_number(r.out, "predicted_rel_mse") > 0);
  }
  const Result r = ws.run("attention --method hybrid --report" + io);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("predicted_rel_mse") == std::string::npos);
}

// --- method lsh ------------------------------------------------------------------------------

namespace {

// Output of the library's LSH attention on the same data, slice by slice.
template <typename T>
std::vector<T> lsh_reference(const std::vector<T>& q, const std::vector<T>* k,
                             const std::vector<T>& v, const randattn::BatchShape& shape,
                             const randattn::CrossPolytopeHash<T>& hash,
                             const randattn::LshOptions& opt) {
  std::vector<T> out(static_cast<std::size_t>(shape.slices() * shape.n_q * shape.dv));
  if (k)
    randattn::lsh_attention_batched(hash, q.data(), k->data(), v.data(), out.data(), shape, opt);
  else
    randattn::lsh_attention_batched(hash, q.data(), v.data(), out.data(), shape, opt);
  return out;
}

}  // namespace

TEST_CASE("cli: lsh with shared QK, a user rotation file and the --report fields", "[cli][lsh]") {
  Workspace ws;
  save<float>(ws, "q.npy", {40, 6}, 11);
  save<float>(ws, "v.npy", {40, 3}, 12);
  const auto q = data<float>(240, 11), v = data<float>(120, 12);
  randattn::BatchShape shape;
  shape.n_q = shape.n_k = 40;
  shape.d = 6;
  shape.dv = 3;
  const std::string io = ws.attention_io(/*with_keys=*/false);

  SECTION("drawn rotation, defaults: b = 2 ceil(n / 64), r = 4, seed 0, scale 1/sqrt(d)") {
    const Result r = ws.run("attention --method lsh --threads 1 --report" + io);
    INFO("stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(std::stod(json_field(r.out, "scale")) == 1 / std::sqrt(6.0));
    CHECK(json_field(r.out, "shared_qk") == "true");
    CHECK(json_field(r.out, "buckets") == "2");
    CHECK(json_field(r.out, "rounds") == "4");
    CHECK(json_field(r.out, "rotation") == "\"dense\"");
    CHECK(json_field(r.out, "dedupe") == "true");
    randattn::LshOptions opt;
    opt.scale = 1 / std::sqrt(6.0);
    const auto expected = lsh_reference<float>(
        q, nullptr, v, shape,
        randattn::CrossPolytopeHash<float>(randattn::RotationKind::dense, 6, 2, 4, 0), opt);
    const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
    CHECK(o.shape == std::vector<std::int64_t>{40, 3});
    for (std::size_t i = 0; i < expected.size(); ++i)
      CHECK(o.values<float>()[i] == Approx(expected[i]).margin(1e-5));
  }
  SECTION("--rotations R.npy of shape (d, r, b/2) is used as is") {
    save<double>(ws, "R.npy", {6, 3, 4}, 13);
    const Result r =
        ws.run("attention --method lsh --chunk 8 --causal --no-dedupe --report --rotations " +
               quote(ws.path("R.npy")) + io);
    INFO("stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(json_field(r.out, "buckets") == "8");
    CHECK(json_field(r.out, "rounds") == "3");
    CHECK(json_field(r.out, "rotation") == "\"file\"");
    const auto rd = data<double>(72, 13);
    randattn::RowMatrix<float> rm(6, 12);
    std::copy(rd.begin(), rd.end(), rm.data());
    randattn::LshOptions opt;
    opt.chunk = 8;
    opt.causal = true;
    opt.dedupe = false;
    opt.scale = 1 / std::sqrt(6.0);
    const auto expected =
        lsh_reference<float>(q, nullptr, v, shape, randattn::CrossPolytopeHash<float>(rm, 3), opt);
    const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
    for (std::size_t i = 0; i < expected.size(); ++i)
      CHECK(o.values<float>()[i] == Approx(expected[i]).margin(1e-5));
  }
  SECTION("--compare with a single chunk reports exact agreement") {
    const Result r =
        ws.run("attention --method lsh --chunk 64 --buckets 4 --rounds 2 --report --compare" + io);
    INFO("stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(std::stod(json_field(r.out, "rel_error")) < 1e-5);
    CHECK(std::stod(json_field(r.out, "speedup")) > 0);
  }
}

TEST_CASE("cli: lsh with separate keys needs exact buckets, batched float64", "[cli][lsh]") {
  Workspace ws;
  save<double>(ws, "q.npy", {2, 2, 30, 5}, 21);
  save<double>(ws, "k.npy", {2, 2, 30, 5}, 22);
  save<double>(ws, "v.npy", {2, 2, 30, 4}, 23);
  const std::string io = ws.attention_io();
  const Result r = ws.run(
      "attention --method lsh --exact-buckets --causal --rotation hadamard --buckets 6 --rounds 3 "
      "--seed 9 --scale 0.5 --report --compare" +
      io);
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(json_field(r.out, "exact_buckets") == "true");
  CHECK(json_field(r.out, "rotation") == "\"hadamard\"");
  CHECK(!json_field(r.out, "rel_error").empty());
  randattn::BatchShape shape;
  shape.batch = shape.heads = 2;
  shape.n_q = shape.n_k = 30;
  shape.d = 5;
  shape.dv = 4;
  randattn::LshOptions opt;
  opt.exact_buckets = true;
  opt.causal = true;
  opt.scale = 0.5;
  const auto k = data<double>(600, 22);
  const auto expected = lsh_reference<double>(
      data<double>(600, 21), &k, data<double>(480, 23), shape,
      randattn::CrossPolytopeHash<double>(randattn::RotationKind::hadamard, 5, 6, 3, 9), opt);
  const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
  CHECK(o.shape == std::vector<std::int64_t>{2, 2, 30, 4});
  for (std::size_t i = 0; i < expected.size(); ++i)
    CHECK(o.values<double>()[i] == Approx(expected[i]).margin(1e-12));
}

TEST_CASE("cli: lsh errors are one stderr line, exit code 2 and no output", "[cli][lsh]") {
  Workspace ws;
  save<float>(ws, "q.npy", {20, 4}, 1);
  save<float>(ws, "v.npy", {20, 3}, 3);
  save<float>(ws, "R.npy", {4, 2, 3}, 5);
  save<float>(ws, "R2d.npy", {4, 6}, 5);
  save<float>(ws, "R_d5.npy", {5, 2, 3}, 5);
  const std::string q = ws.flag("q", "q.npy"), v = ws.flag("v", "v.npy"),
                    out = ws.flag("out", "o.npy");
  const std::string lsh = "attention --method lsh --shared-qk" + q + v + out;
  require_error(ws, "attention" + q + v + out, "--k is required for --method exact");
  require_error(ws, "attention" + q + v + out, "--shared-qk");
  require_error(ws, "attention --method lsh" + q + v + out, "--shared-qk");
  require_error(ws, "attention --shared-qk" + q + v + out, "does not support --shared-qk");
  require_error(ws, "attention --chunk 8" + q + " --k " + quote(ws.path("q.npy")) + v + out,
                "belongs to --method lsh");
  require_error(ws, lsh + " --k " + quote(ws.path("q.npy")), "exclude each other");
  require_error(ws, lsh + " --buckets 7", "buckets must be even");
  require_error(ws, lsh + " --rounds 0", "rounds");
  require_error(ws, lsh + " --chunk 0", "--chunk");
  require_error(ws, lsh + " --rotation gaussian");
  require_error(ws, lsh + " --rotations " + quote(ws.path("R2d.npy")), "(d, r, b/2)");
  require_error(ws, lsh + " --rotations " + quote(ws.path("R_d5.npy")), "d = 4");
  require_error(ws, lsh + " --rotations " + quote(ws.path("R.npy")) + " --rounds 3", "--rounds 3");
  require_error(ws, lsh + " --rotations " + quote(ws.path("R.npy")) + " --buckets 4",
                "--buckets 4");
  require_error(ws, lsh + " --rotations " + quote(ws.path("R.npy")) + " --rotation dense",
                "exclude");
  require_error(ws, lsh + " --rotations " + quote(ws.path("missing.npy")), "--rotations");
}

// --- lsf ------------------------------------------------------------------------------------

TEST_CASE("cli: lsf matches the library, with the --report and --compare fields", "[cli][lsf]") {
  Workspace ws;
  SECTION("2-D float32, dense filters, --eta") {
    save<float>(ws, "q.npy", {40, 6}, 31);
    save<float>(ws, "k.npy", {50, 6}, 32);
    save<float>(ws, "v.npy", {50, 3}, 33);
    const Result r =
        ws.run("attention --method lsf --filters 8 --tables 3 --eta 0.5 --threads 1 --report" +
               ws.attention_io());
    INFO("stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(json_field(r.out, "filters") == "8");
    CHECK(json_field(r.out, "tables") == "3");
    CHECK(json_field(r.out, "eta") == "0.5");
    CHECK(json_field(r.out, "min_probes") == "1");
    CHECK(json_field(r.out, "rotation") == "\"dense\"");
    const double pairs = std::stod(json_field(r.out, "pairs_scored"));
    CHECK(pairs > 0);
    CHECK(pairs <= 1);
    const randattn::LocalitySensitiveFilters<float> f(randattn::RotationKind::dense, 6, 8, 3, 0);
    randattn::LsfOptions opt;
    opt.eta = 0.5;
    const auto q = data<float>(240, 31), k = data<float>(300, 32), v = data<float>(150, 33);
    using CMap = Eigen::Map<const randattn::RowMatrix<float>>;
    const randattn::RowMatrix<float> expected = randattn::lsf_attention(
        f, CMap(q.data(), 40, 6), CMap(k.data(), 50, 6), CMap(v.data(), 50, 3), opt);
    const randattn::LsfProbeStats st =
        randattn::lsf_probe_stats<float>(f, CMap(q.data(), 40, 6), CMap(k.data(), 50, 6), opt);
    CHECK(pairs == Approx(double(st.target_pairs) / (40.0 * 50.0)));
    const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
    CHECK(o.shape == std::vector<std::int64_t>{40, 3});
    for (std::size_t i = 0; i < o.values<float>().size(); ++i)
      CHECK(o.values<float>()[i] == Approx(expected.data()[i]).margin(1e-5));
  }
  SECTION("4-D float64, causal, Hadamard filters, --alpha, --min-probes, --compare") {
    save<double>(ws, "q.npy", {2, 2, 30, 8}, 41);
    save<double>(ws, "k.npy", {2, 2, 30, 8}, 42);
    save<double>(ws, "v.npy", {2, 2, 30, 4}, 43);
    const std::string io = ws.attention_io();
    const Result r = ws.run(
        "attention --method lsf --filters 16 --tables 2 --alpha 0.6 --min-probes 2 --rotation "
        "hadamard --causal --seed 9 --scale 0.5 --compare" +
        io);
    INFO("stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(json_field(r.out, "rotation") == "\"hadamard\"");
    CHECK(std::stod(json_field(r.out, "eta")) == Approx(randattn::filter_threshold(0.6, 16)));
    CHECK(std::stod(json_field(r.out, "speedup")) > 0);
    CHECK(std::stod(json_field(r.out, "rel_error")) > 0);
    randattn::BatchShape shape;
    shape.batch = shape.heads = 2;
    shape.n_q = shape.n_k = 30;
    shape.d = 8;
    shape.dv = 4;
    randattn::LsfOptions opt;
    opt.alpha = 0.6;
    opt.min_probes = 2;
    opt.causal = true;
    opt.scale = 0.5;
    std::vector<double> expected(480);
    randattn::lsf_attention_batched(
        randattn::LocalitySensitiveFilters<double>(randattn::RotationKind::hadamard, 8, 16, 2, 9),
        data<double>(960, 41).data(), data<double>(960, 42).data(), data<double>(480, 43).data(),
        expected.data(), shape, opt);
    const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
    CHECK(o.shape == std::vector<std::int64_t>{2, 2, 30, 4});
    for (std::size_t i = 0; i < expected.size(); ++i)
      CHECK(o.values<double>()[i] == Approx(expected[i]).margin(1e-12));
    // Every filter opened: exact attention, every pair scored (half of them under causal masking).
    const Result all =
        ws.run("attention --method lsf --filters 4 --tables 2 --eta=-100 --compare" + io);
    REQUIRE(all.exit_code == 0);
    CHECK(std::stod(json_field(all.out, "rel_error")) < 1e-12);
    CHECK(std::stod(json_field(all.out, "pairs_scored")) == 1.0);
  }
}

TEST_CASE("cli: lsf errors are one stderr line, exit code 2 and no output", "[cli][lsf]") {
  Workspace ws;
  save<float>(ws, "q.npy", {20, 4}, 1);
  save<float>(ws, "k.npy", {20, 4}, 2);
  save<float>(ws, "v.npy", {20, 3}, 3);
  const std::string io = ws.attention_io();
  const std::string lsf = "attention --method lsf" + io;
  require_error(ws, "attention --method lsf --eta 1" + ws.attention_io(/*with_keys=*/false),
                "--method lsf does not support --shared-qk");
  require_error(ws,
                "attention --method lsf --eta 1" + ws.flag("q", "q.npy") + ws.flag("v", "v.npy") +
                    ws.flag("out", "o.npy"),
                "--k is required for --method lsf");
  require_error(ws, "attention --filters 8" + io, "belongs to --method lsf");
  require_error(ws, "attention --method lsh --exact-buckets --tables 2" + io,
                "belongs to --method lsf");
  require_error(ws, lsf, "exactly one of --eta and --alpha");
  require_error(ws, lsf + " --eta 1 --alpha 0.5", "exactly one of --eta and --alpha");
  require_error(ws, lsf + " --eta 1 --filters 0", "--filters");
  require_error(ws, lsf + " --eta 1 --filters=-3", "--filters");
  require_error(ws, lsf + " --eta 1 --tables 0", "--tables");
  require_error(ws, lsf + " --eta nan", "--eta");
  require_error(ws, lsf + " --eta inf", "--eta");
  require_error(ws, lsf + " --eta x");
  require_error(ws, lsf + " --alpha 0", "--alpha");
  require_error(ws, lsf + " --alpha 1", "--alpha");
  require_error(ws, lsf + " --alpha 1.5", "--alpha");
  require_error(ws, lsf + " --alpha=-0.2", "--alpha");
  require_error(ws, lsf + " --alpha nan", "--alpha");
  require_error(ws, lsf + " --eta 1 --filters 8 --min-probes 0", "--min-probes");
  require_error(ws, lsf + " --eta 1 --filters 8 --min-probes 9", "--min-probes");
  require_error(ws, lsf + " --eta 1 --rotation gaussian");
  require_error(ws, lsf + " --eta 1 --scale nan", "--scale");
}

TEST_CASE("cli: sparse-lowrank matches the library, with its report", "[cli][sparse_lowrank]") {
  Workspace ws;
  save<double>(ws, "q.npy", {30, 6}, 51);
  save<double>(ws, "k.npy", {30, 6}, 52);
  save<double>(ws, "v.npy", {30, 3}, 53);
  const Result r = ws.run(
      "attention --method sparse-lowrank --support window,blocks --window 3 --sinks 1 "
      "--block-size 8 --top-blocks 1 --remainder sample --samples 4 --causal --seed 5 --report" +
      ws.attention_io());
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("\"support\":\"window,blocks\"") != std::string::npos);
  CHECK(json_field(r.out, "remainder") == "\"sample\"");
  CHECK(json_field(r.out, "clamped_rows") == "0");
  const double pairs = std::stod(json_field(r.out, "pairs_scored"));
  CHECK(pairs > 0);
  CHECK(pairs < 0.5);  // causal: at most the lower triangle
  CHECK(std::stod(json_field(r.out, "samples")) > 0);
  randattn::SupportSpec<double> support;
  support.window = randattn::WindowSupport{3, 1};
  support.blocks = randattn::BlockSupport{8, 1};
  randattn::SparseLowRankOptions opt;
  opt.causal = true;
  opt.seed = 5;
  const auto q = data<double>(180, 51), k = data<double>(180, 52), v = data<double>(90, 53);
  using CMap = Eigen::Map<const randattn::RowMatrix<double>>;
  const randattn::RowMatrix<double> expected = randattn::sparse_lowrank_attention<double>(
      CMap(q.data(), 30, 6), CMap(k.data(), 30, 6), CMap(v.data(), 30, 3), support,
      randattn::SampledRemainder{4, false, 8}, opt);
  const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
  REQUIRE(o.shape == std::vector<std::int64_t>{30, 3});
  for (std::size_t i = 0; i < 90; ++i) CHECK(o.values<double>()[i] == expected.data()[i]);
}

TEST_CASE("cli: sparse-lowrank errors are one stderr line, exit code 2 and no output",
          "[cli][sparse_lowrank]") {
  Workspace ws;
  save<float>(ws, "q.npy", {20, 4}, 1);
  save<float>(ws, "k.npy", {20, 4}, 2);
  save<float>(ws, "v.npy", {20, 3}, 3);
  const std::string m = "attention --method sparse-lowrank" + ws.attention_io();
  require_error(ws, m + " --support hash", "unknown support 'hash'");
  require_error(ws, m + " --support lsh,lsh", "listed twice");
  require_error(ws, m + " --remainder exact", "--remainder must be one of");
  require_error(ws, m + " --remainder sample --samples 0", "--samples must be at least 1");
  require_error(ws, m + " --support window --window=-1", "--window must be non-negative");
  require_error(ws, m + " --support window --sinks=-1", "--sinks must be non-negative");
  require_error(ws, m + " --support window --window 0", "window support needs");
  require_error(ws, m + " --support blocks --block-size 0", "--block-size must be at least 1");
  require_error(ws, m + " --support lsf", "exactly one of --eta and --alpha");
  require_error(ws, m + " --no-dedupe", "--dedupe false");
  require_error(ws, m + " --remainder oprf --causal", "--fit given");
}

// --- sparsify and hosvd ---------------------------------------------------------------------

TEST_CASE("cli: sparsify an order-3 float32 tensor with --report", "[cli][sketch]") {
  Workspace ws;
  save<float>(ws, "a.npy", {6, 7, 8}, 11);
  const std::string base =
      "sparsify --in " + quote(ws.path("a.npy")) + " --budget 60 --seed 5 --out ";
  const Result r = ws.run(base + quote(ws.path("ahat.npy")) + " --report");
  INFO("stderr: " << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.empty());
  const NpyArray a = randattn::io::read_npy(ws.path("a.npy")),
                 h = randattn::io::read_npy(ws.path("ahat.npy"));
  CHECK(h.shape == std::vector<std::int64_t>{6, 7, 8});
  REQUIRE(h.is_float32());
  // The output is the library's sketch for the same seed, densified.
  randattn::SparsifyOptions opt;
  opt.budget = 60;
  opt.seed = 5;
  const auto sk =
      randattn::sparsify(randattn::tensor_view(a.values<float>().data(), {6, 7, 8}), opt);
  const randattn::Vector<float> dense = randattn::densify(sk);
  CHECK(std::equal(h.values<float>().begin(), h.values<float>().end(), dense.data()));

  REQUIRE(std::count(r.out.begin(), r.out.end(), '\n') == 1);
  CHECK(r.out.rfind(R"({"scheme":"spa","dtype":"float32","shape":[6,7,8],)", 0) == 0);
  CHECK(json_number(r.out, "nnz") == double(sk.nnz()));
  CHECK(json_number(r.out, "expected_nnz") == Approx(sk.stats.expected_nnz));
  const auto err =
      randattn::sketch_error(randattn::tensor_view(a.values<float>().data(), {6, 7, 8}), sk);
  CHECK(json_number(r.out, "rel_fro_error") == Approx(err.relative_frobenius));
  CHECK(json_number(r.out, "rel_spectral_error") == Approx(err.relative_spectral));
  CHECK(r.out.find(R"("spectral_exact":false)") != std::string::npos);

  // Same seed, same bytes; the budget of every entry returns the input itself.
  REQUIRE(ws.run(base + quote(ws.path("again.npy"))).exit_code == 0);
  CHECK(slurp(ws.path("again.npy")) == slurp(ws.path("ahat.npy")));
  REQUIRE(ws.run("sparsify --in " + quote(ws.path("a.npy")) + " --budget 336 --out " +
                 quote(ws.path("all.npy")))
              .exit_code == 0);
  CHECK(randattn::io::read_npy(ws.path("all.npy")).values<float>() == a.values<float>());
}

TEST_CASE("cli: sparsify a float64 matrix with each scheme", "[cli][sketch]") {
  Workspace ws;
  save<double>(ws, "m.npy", {20, 30}, 12);
  for (const char* scheme : {"spa", "ndt", "l2", "uniform"}) {
    const Result r =
        ws.run(std::string("sparsify --in ") + quote(ws.path("m.npy")) + " --budget 100 --scheme " +
               scheme + " --out " + quote(ws.path("mhat.npy")) + " --report");
    INFO(scheme << " stderr: " << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(randattn::io::read_npy(ws.path("mhat.npy")).is_float64());
    CHECK(r.out.find(std::string("\"scheme\":\"") + scheme + "\"") != std::string::npos);
    CHECK(r.out.find(R"("spectral_exact":true)") !=
          std::string::npos);  // order 2: the exact matrix norm
  }
}

TEST_CASE("cli: hosvd writes orthonormal factors, exact or sketched", "[cli][sketch]") {
  Workspace ws;
  save<double>(ws, "a.npy", {5, 6, 7}, 13);
  const NpyArray a = randattn::io::read_npy(ws.path("a.npy"));
  const auto view = randattn::tensor_view(a.values<double>().data(), {5, 6, 7});
  const Result exact = ws.run("hosvd --in " + quote(ws.path("a.npy")) +
                              " --ranks 2,3,4 --out-prefix " + quote(ws.path("U")) + " --report");
  INFO("stderr: " << exact.err);
  REQUIRE(exact.exit_code == 0);
  CHECK(exact.out.rfind(
            R"({"method":"exact","dtype":"float64","shape":[5,6,7],"ranks":[2,3,4],"seconds":)",
            0) == 0);
  const auto reference = randattn::exact_hosvd(view, {2, 3, 4});
  for (int j = 0; j < 3; ++j) {
    const NpyArray u = randattn::io::read_npy(ws.path("U" + std::to_string(j) + ".npy"));
    REQUIRE(u.shape == std::vector<std::int64_t>{a.shape[std::size_t(j)], 2 + j});
    const auto m = randattn::io::as_matrix<double>(u);
    CHECK((m.transpose() * m - Eigen::MatrixXd::Identity(2 + j, 2 + j)).norm() < 1e-12);
    CHECK(randattn::sin_theta_distance(m, reference.factors[std::size_t(j)]) < 1e-10);
  }
  const Result sketched =
      ws.run("hosvd --in " + quote(ws.path("a.npy")) + " --ranks 1,1,1 --budget 1000 --seed 2" +
             " --out-prefix " + quote(ws.path("S")) + " --report");
  REQUIRE(sketched.exit_code == 0);
  CHECK(sketched.out.find(R"("method":"sketched")") != std::string::npos);
  CHECK(sketched.out.find(R"("nnz":[210,210])") != std::string::npos);  // budget >= D: every entry
  CHECK(ws.files() == std::vector<std::string>{"S0.npy", "S1.npy", "S2.npy", "U0.npy", "U1.npy",
                                               "U2.npy", "a.npy"});
}

TEST_CASE("cli: sparsify and hosvd failures are one stderr line, exit code 2 and no output",
          "[cli][sketch]") {
  Workspace ws;
  save<float>(ws, "a.npy", {4, 5, 6}, 14);
  save<float>(ws, "v.npy", {7}, 15);
  randattn::io::write_npy(ws.path("zeros.npy"), std::vector<float>(24, 0.0f), {2, 3, 4});
  std::vector<float> bad = data<float>(120, 14);
  bad[(1 * 5 + 2) * 6 + 3] = NAN;
  randattn::io::write_npy(ws.path("nan.npy"), bad, {4, 5, 6});
  const std::string in = " --in " + quote(ws.path("a.npy"));
  const std::string out = " --out " + quote(ws.path("o.npy"));
  const std::string prefix = " --out-prefix " + quote(ws.path("P"));
  auto with = [&](const std::string& file) { return " --in " + quote(ws.path(file)); };

  require_error(ws, "sparsify" + in + " --budget 0" + out, "budget must be a positive");
  require_error(ws, "sparsify" + in + " --budget -2" + out, "budget");
  require_error(ws, "sparsify" + with("zeros.npy") + " --budget 5" + out, "all zero");
  require_error(ws, "sparsify" + with("nan.npy") + " --budget 5" + out,
                "non-finite entry at (1, 2, 3)");
  require_error(ws, "sparsify" + with("v.npy") + " --budget 5" + out,
                "order k >= 2, got shape (7,)");
  require_error(ws, "sparsify" + with("missing.npy") + " --budget 5" + out, "no such file");
  require_error(ws, "sparsify" + in + " --budget 5 --scheme foo" + out,
                "unknown sparsification scheme 'foo'");
  require_error(ws, "sparsify" + in + out);  // --budget missing
  require_error(ws, "sparsify" + in + " --budget 5 --out " + quote(ws.path("no_dir/o.npy")),
                "--out");

  require_error(ws, "hosvd" + in + " --ranks 2,6,2" + prefix,
                "rank 6 of mode 1 must be in [1, d_1] = [1, 5]");
  require_error(ws, "hosvd" + in + " --ranks 0,1,1" + prefix, "rank 0 of mode 0");
  require_error(ws, "hosvd" + in + " --ranks 2,2" + prefix,
                "2 ranks given for a tensor of order 3");
  require_error(ws, "hosvd" + in + " --ranks 2,2,2 --budget 0" + prefix, "budget");
  require_error(ws, "hosvd" + in + " --ranks 2,2,2 --seed 4" + prefix, "--seed requires --budget");
  require_error(ws, "hosvd" + with("nan.npy") + " --ranks 1,1,1" + prefix, "non-finite");
  require_error(ws, "hosvd" + with("zeros.npy") + " --ranks 1,1,1 --budget 5" + prefix, "all zero");
  require_error(ws, "hosvd" + with("v.npy") + " --ranks 1" + prefix, "order k >= 2");
  require_error(ws, "hosvd" + in + " --ranks 1,1,1 --out-prefix " + quote(ws.path("no_dir/P")),
                "--out-prefix");
}

TEST_CASE("cli: sizes, threads and seeds out of range are refused before any work",
          "[cli][robustness]") {
  Workspace ws;
  save<float>(ws, "q.npy", {6, 4}, 1);
  save<float>(ws, "k.npy", {6, 4}, 2);
  save<float>(ws, "v.npy", {6, 3}, 3);
  save<float>(ws, "v0.npy", {6, 0}, 3);
  const std::string io = ws.attention_io();
  // Threads: at most 1024, refused (not clamped) beyond; never a crash of the OpenMP runtime.
  require_error(ws, "attention" + io + " --threads 100000", "--threads must be in [1, 1024]");
  require_error(ws, "attention" + io + " --threads 2147483647", "--threads must be in [1, 1024]");
  require_error(ws, "attention" + io + " --threads 0", "--threads must be in [1, 1024]");
  // Size options: refused with their range before anything is drawn.
  require_error(ws, "attention --method lsh" + io + " --rounds 1000000", "--rounds must be in [1, 4096]");
  require_error(ws, "attention --method lsh" + io + " --rounds 0", "--rounds must be in [1, 4096]");
  require_error(ws, "attention --method lsh" + io + " --buckets 1000000000",
                "--buckets must be in [2, 16777216]");
  require_error(ws, "attention --method lsh" + io + " --chunk 1000000000", "--chunk must be in");
  require_error(ws, "attention --method favor" + io + " --features 1000000000",
                "--features must be in [1, 16777216]");
  require_error(ws, "attention --method hybrid" + io + " --lambda-features 1000000000",
                "--lambda-features must be in [1, 16777216]");
  require_error(ws, "attention --method lsf --eta 0" + io + " --filters 1000000000",
                "--filters must be in [1, 8388608]");
  require_error(ws, "attention --method lsf --eta 0" + io + " --tables 100000",
                "--tables must be in [1, 4096]");
  // Seeds: decimal integers in [0, 2^64), as in Python; no wrap-around of -1 or 2^64.
  for (const char* seed : {"-1", "18446744073709551616", "1.5", "0x10", "", "+3"}) {
    require_error(ws, "attention --method favor" + io + " --seed '" + seed + "'",
                  "--seed: must be an integer in [0, 2^64)");
    require_error(ws, "sparsify --in " + quote(ws.path("q.npy")) + " --budget 4 --seed '" + seed +
                          "' --out " + quote(ws.path("o.npy")),
                  "--seed: must be an integer in [0, 2^64)");
  }
  const Result top =
      ws.run("attention --method favor" + io + " --seed 18446744073709551615 --report");
  CHECK(top.exit_code == 0);
  // The report shows the seed as given, not as a signed 64-bit integer.
  CHECK(top.out.find("\"seed\":18446744073709551615") != std::string::npos);
  // dv = 0 is refused, as in Python.
  require_error(ws, "attention" + ws.flag("q", "q.npy") + ws.flag("k", "k.npy") +
                        ws.flag("v", "v0.npy") + ws.flag("out", "o0.npy"),
                "value dimension dv must be positive");
}

TEST_CASE("cli: a size that cannot be allocated is refused with the size it needs", "[cli][robustness]") {
  Workspace ws;
  save<float>(ws, "q.npy", {6, 64}, 1);
  save<float>(ws, "k.npy", {6, 64}, 2);
  save<float>(ws, "v.npy", {6, 3}, 3);
  // 2^24 projections of dimension 64 need more than 8 GB; a 1 GB address-space limit makes that
  // fail.
  if (kAddressSanitizer) {
    WARN("left out: an address-space limit and AddressSanitizer's shadow memory do not mix");
    return;
  }
  const std::string cmd = "attention --method favor" + ws.attention_io() + " --features 16777216";
  const Result r = ws.run_limited(cmd, 1 << 20);
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("randattn-cli: error: ") == 0);
  CHECK(r.err.find("method favor: out of memory: needs about ") != std::string::npos);
  CHECK(r.err.find(" GB (") != std::string::npos);
  CHECK(!fs::exists(ws.path("o.npy")));
}

TEST_CASE("cli: one behaviour for eta = -inf and scales the input type cannot hold",
          "[cli][robustness]") {
  Workspace ws;
  save<float>(ws, "q.npy", {7, 4}, 1);
  save<float>(ws, "k.npy", {9, 4}, 2);
  save<float>(ws, "v.npy", {9, 3}, 3);
  const std::string io = ws.attention_io();
  // eta = -inf opens every filter: LSF is exact attention.
  const Result r = ws.run("attention --method lsf --eta -inf" + io);
  REQUIRE(r.exit_code == 0);
  const NpyArray o = randattn::io::read_npy(ws.path("o.npy"));
  const auto& got = std::get<std::vector<float>>(o.data);
  const std::vector<double> want =
      reference(data<float>(28, 1), data<float>(36, 2), data<float>(27, 3), 1, 7, 9, 4, 3, 0.5,
                false);
  REQUIRE(got.size() == want.size());
  for (std::size_t t = 0; t < got.size(); ++t) CHECK(std::abs(got[t] - want[t]) < 1e-5);
  require_error(ws, "attention --method lsf --eta inf" + io, "--eta must be a finite number or -inf");
  require_error(ws, "attention --method lsf --eta nan" + io, "--eta must be a finite number or -inf");
  // A scale beyond float32's range is refused by every method, favor included.
  for (const char* method : {"exact", "favor", "favor-hyp", "trig", "hybrid", "lsh", "lsf --eta 0"}) {
    require_error(ws, std::string("attention --method ") + method + io + " --scale 1e39",
                  "--scale = 1e+39 is not representable in float32");
  }
}

TEST_CASE("cli: outputs never replace what is not a regular file; hosvd is all or nothing",
          "[cli][robustness]") {
  Workspace ws;
  save<float>(ws, "q.npy", {5, 4}, 1);
  save<float>(ws, "k.npy", {5, 4}, 2);
  save<float>(ws, "v.npy", {5, 3}, 3);
  save<float>(ws, "a.npy", {4, 5, 6}, 4);
  const std::string inputs = ws.flag("q", "q.npy") + ws.flag("k", "k.npy") + ws.flag("v", "v.npy");
  // A FIFO, a symbolic link and a directory in place of --out stay what they are.
  REQUIRE(::mkfifo(ws.path("fifo").c_str(), 0600) == 0);
  fs::create_symlink(ws.path("q.npy"), ws.path("link.npy"));
  fs::create_directory(ws.path("dir.npy"));
  const std::string q_bytes = slurp(ws.path("q.npy"));
  require_error(ws, "attention" + inputs + ws.flag("out", "fifo"), "is a FIFO, not a regular file");
  require_error(ws, "attention" + inputs + ws.flag("out", "link.npy"),
                "is a symbolic link, not a regular file");
  require_error(ws, "attention" + inputs + ws.flag("out", "dir.npy"), "is a directory");
  require_error(ws, "sparsify --in " + quote(ws.path("a.npy")) + " --budget 9" +
                        ws.flag("out", "fifo"),
                "is a FIFO");
  CHECK(fs::is_fifo(fs::symlink_status(ws.path("fifo"))));
  CHECK(fs::is_symlink(fs::symlink_status(ws.path("link.npy"))));
  CHECK(slurp(ws.path("q.npy")) == q_bytes);
  // hosvd: U0.npy exists, U1.npy cannot be written: the run fails and U0.npy keeps its bytes.
  save<float>(ws, "U0.npy", {2, 2}, 9);
  fs::create_directory(ws.path("U1.npy"));
  const std::string before = slurp(ws.path("U0.npy"));
  require_error(ws, "hosvd --in " + quote(ws.path("a.npy")) + " --ranks 2,2,2 --out-prefix " +
                        quote(ws.path("U")),
                "U1.npy");
  CHECK(slurp(ws.path("U0.npy")) == before);
  CHECK(fs::is_directory(ws.path("U1.npy")));
  // Success replaces all three.
  fs::remove(ws.path("U1.npy"));
  const Result ok = ws.run("hosvd --in " + quote(ws.path("a.npy")) +
                           " --ranks 2,2,2 --out-prefix " + quote(ws.path("U")));
  CHECK(ok.exit_code == 0);
  CHECK(slurp(ws.path("U0.npy")) != before);
  CHECK(ws.files() == std::vector<std::string>{"U0.npy", "U1.npy", "U2.npy", "a.npy", "dir.npy",
                                               "fifo", "k.npy", "link.npy", "q.npy", "v.npy"});
}

TEST_CASE("cli: finite input never gives NaN or Inf: a result or the overflow error",
          "[cli][robustness]") {
  Workspace ws;
  const float big = std::ldexp(1.0f, 127);
  std::vector<float> v = data<float>(24, 3);
  for (float& x : v) x *= big;
  std::vector<float> q = data<float>(32, 1), k = data<float>(32, 2);
  randattn::io::write_npy(ws.path("q.npy"), q, {8, 4});
  randattn::io::write_npy(ws.path("k.npy"), k, {8, 4});
  randattn::io::write_npy(ws.path("v.npy"), v, {8, 3});
  // Values near float32's maximum: LSH and LSF outputs are finite convex combinations.
  for (const char* method : {"lsh --exact-buckets --buckets 4", "lsf --eta 0"}) {
    INFO(method);
    const Result r = ws.run(std::string("attention --method ") + method + ws.attention_io());
    REQUIRE(r.exit_code == 0);
    const auto out = std::get<std::vector<float>>(randattn::io::read_npy(ws.path("o.npy")).data);
    for (float x : out) CHECK((std::isfinite(x) && std::abs(x) <= big));
  }
  // Logits beyond the range: LSF reports the overflow as exact attention does.
  for (float& x : q) x *= 1e30f;
  for (float& x : k) x *= 1e30f;
  randattn::io::write_npy(ws.path("q.npy"), q, {8, 4});
  randattn::io::write_npy(ws.path("k.npy"), k, {8, 4});
  fs::remove(ws.path("o.npy"));
  for (const char* method : {"exact", "lsf --eta 0"})
    require_error(ws, std::string("attention --method ") + method + ws.attention_io(),
                  "overflowed the floating-point range");
  // Exact HOSVD of entries near 1e20 (their squares overflow float32).
  std::vector<float> a = data<float>(120, 4);
  for (float& x : a) x *= 1e20f;
  randattn::io::write_npy(ws.path("a.npy"), a, {4, 5, 6});
  require_error(ws, "hosvd --in " + quote(ws.path("a.npy")) + " --ranks 2,2,2 --out-prefix " +
                        quote(ws.path("U")),
                "overflowed the floating-point range");
}

#else

TEST_CASE("cli: randattn-cli not built, contract tests skipped", "[cli]") {
  WARN("RANDATTN_BUILD_TOOLS is OFF: randattn-cli contract tests skipped");
}

#endif
