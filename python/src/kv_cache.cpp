// randattn._core.KVCache: the library's KvCache<float> or KvCache<double> (decode/kv_cache.hpp)
// behind one class. The dtype (of the computation and results) is fixed at construction; inputs
// of the other float dtype are converted to it (one counted copy). The storage of keys and values
// (float32, float64, bfloat16, float16, int8) is independent of it. attend runs without the GIL and without excluding other
// attends (KvCache::attend is const and keeps no state); append and load take the cache
// exclusively, so Python threads may mix them freely.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <randattn/decode/kv_cache.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <variant>
#include <vector>

#include "arguments.hpp"
#include "bindings.hpp"
#include "options.hpp"

namespace randattn_python {

namespace {

using randattn::DecodeMode;
using randattn::KvCacheOptions;
using randattn::KvStorage;

// The storage named `name`; ValueError naming the known ones.
KvStorage storage_named(const std::string& name) {
  std::string names;
  for (const KvStorage s : {KvStorage::float32, KvStorage::float64, KvStorage::bfloat16,
                            KvStorage::float16, KvStorage::int8}) {
    if (name == randattn::to_string(s)) return s;
    names += std::string(names.empty() ? "'" : ", '") + randattn::to_string(s) + "'";
  }
  throw py::value_error("KVCache: unknown storage '" + name + "' (available: " + names + ")");
}

struct ModeInfo {
  const char* name;
  DecodeMode mode;
  std::vector<OptionSpec> options;
};

// Every mode's keyword options with the library's defaults. Centring is an option of every
// retrieval mode; seed of the random ones.
const std::vector<ModeInfo>& modes() {
  const KvCacheOptions o;
  const OptionSpec centre_tokens{"centre_tokens", std::int64_t(o.centre_tokens),
                                 "centre keys by the mean of the first centre_tokens keys"};
  const OptionSpec key_centre{"key_centre", std::monostate{},
                              "a given key centre, (head_dim,), (1, head_dim) or "
                              "(kv_heads, head_dim)"};
  const OptionSpec seed{"seed", std::int64_t(o.seed), "seed of the random hyperplanes"};
  static const std::vector<ModeInfo> all = {
      {"exact", DecodeMode::exact, {}},
      {"blocks",
       DecodeMode::blocks,
       {{"page_size", std::int64_t(o.page_size), "tokens per page"},
        {"top_pages", std::int64_t(o.top_pages), "pages attended per query head"},
        {"axes", std::int64_t(o.page_axes),
         "page boxes in the principal axes of the first `axes` keys (0: the keys' own coordinates)"},
        centre_tokens,
        key_centre}},
      {"lsh-sample",
       DecodeMode::lsh_sample,
       {{"bits", std::int64_t(o.lsh_bits), "SimHash bits K per table (0..16)"},
        {"tables", std::int64_t(o.lsh_tables), "hash tables L (2..1024)"},
        {"hash_block", std::int64_t(o.lsh_hash_block),
         "keys hashed per block, by one product (1..4096; the open block is scored exactly)"},
        seed,
        centre_tokens,
        key_centre}},
      {"lsf",
       DecodeMode::lsf,
       {{"filters", std::int64_t(o.lsf_filters), "filters m per table"},
        {"tables", std::int64_t(o.lsf_tables), "filter tables (1..64)"},
        {"eta", std::monostate{}, "probe threshold (default: from alpha)"},
        {"alpha", o.lsf_alpha, "target cosine of the threshold, when eta is not given"},
        {"min_probes", std::int64_t(o.lsf_min_probes), "best filters per table always opened"},
        seed,
        centre_tokens,
        key_centre}},
      {"clusters",
       DecodeMode::clusters,
       {{"clusters", std::int64_t(o.clusters), "key clusters per kv head (>= 1)"},
        {"probe", std::int64_t(o.probe), "clusters always opened per query head (1..clusters)"},
        {"margin", o.cluster_margin,
         "further clusters opened whose bound is within this many nats of the best logit "
         "(-inf: only the probe clusters)"},
        {"samples", std::int64_t(o.cluster_samples),
         "keys drawn from the closed clusters, importance-weighted (0: none)"},
        seed,
        centre_tokens,
        key_centre}},
  };
  return all;
}

const ModeInfo& mode_info(const std::string& name) {
  std::string names;
  for (const ModeInfo& m : modes()) {
    if (name == m.name) return m;
    names += std::string(names.empty() ? "'" : ", '") + m.name + "'";
  }
  throw py::value_error("KVCache: unknown mode '" + name + "' (available: " + names + ")");
}

const ModeInfo& mode_info(DecodeMode mode) {
  for (const ModeInfo& m : modes())
    if (m.mode == mode) return m;
  throw std::logic_error("unregistered decode mode");
}

bool owns(const ModeInfo& m, const std::string& name) {
  for (const OptionSpec& s : m.options)
    if (s.name == name) return true;
  return false;
}

// ValueError for an option of another mode (naming the modes that own it), TypeError for a
// keyword no mode has.
void check_mode_options(const ModeInfo& mode, const py::dict& given) {
  for (const auto& item : given) {
    const std::string name = py::str(item.first);
    if (owns(mode, name)) continue;
    std::string owners;
    for (const ModeInfo& m : modes())
      if (owns(m, name)) owners += std::string(owners.empty() ? "'" : " and '") + m.name + "'";
    if (!owners.empty())
      throw py::value_error("KVCache: option '" + name + "' belongs to mode " + owners +
                            ", not to mode '" + mode.name + "'");
    throw py::type_error("KVCache() got an unexpected keyword argument '" + name + "'");
  }
}

// The library's options from the keywords; every value is checked again by the KvCache
// constructor, which names the option.
KvCacheOptions to_options(const ModeInfo& mode, py::handle sinks, py::handle window,
                          py::handle scale, py::handle check_finite, const py::dict& given) {
  check_mode_options(mode, given);
  const KeywordOptions kw(mode.options, given);
  KvCacheOptions o;
  o.mode = mode.mode;
  o.sinks = to_integer(sinks, "sinks");
  o.window = to_integer(window, "window");
  if (!scale.is_none()) o.scale = to_real(scale, "scale");
  o.check_finite = to_flag(check_finite, "check_finite");
  const auto integer_in = [&](const char* name, std::int64_t lo, std::int64_t hi) {
    const std::int64_t v = kw.integer(name);
    if (v < lo || v > hi)
      throw py::value_error("KVCache: " + std::string(name) + " must be in [" + std::to_string(lo) +
                            ", " + std::to_string(hi) + "], got " + std::to_string(v));
    return v;
  };
  constexpr std::int64_t kBig = std::numeric_limits<std::int32_t>::max();
  if (owns(mode, "page_size")) {
    o.page_size = integer_in("page_size", 1, kBig);
    o.top_pages = integer_in("top_pages", 0, kBig);
    o.page_axes = integer_in("axes", 0, kBig);
  }
  if (owns(mode, "bits")) {
    o.lsh_bits = int(integer_in("bits", 0, 16));
    o.lsh_tables = int(integer_in("tables", 2, 1024));
    o.lsh_hash_block = integer_in("hash_block", 1, 4096);
  }
  if (owns(mode, "filters")) {
    o.lsf_filters = integer_in("filters", 2, 65536);
    o.lsf_tables = int(integer_in("tables", 1, 64));
    if (kw.given("eta") && given.contains("alpha"))
      throw py::value_error("KVCache: give eta or alpha, not both");
    if (kw.given("eta")) o.lsf_threshold = kw.real("eta");
    o.lsf_alpha = kw.real("alpha");
    o.lsf_min_probes = integer_in("min_probes", 0, kBig);
  }
  if (owns(mode, "clusters")) {
    o.clusters = integer_in("clusters", 1, kBig);
    o.probe = integer_in("probe", 1, o.clusters);
    o.cluster_margin = kw.real("margin");
    if (std::isnan(o.cluster_margin)) throw py::value_error("KVCache: margin must not be NaN");
    o.cluster_samples = integer_in("samples", 0, std::int64_t(1) << 24);
  }
  if (owns(mode, "seed")) o.seed = to_seed(kw.value("seed"), "seed");
  if (owns(mode, "centre_tokens")) {
    o.centre_tokens = integer_in("centre_tokens", 0, kBig);
    if (kw.given("key_centre")) {
      const py::array c = as_float_array(kw.value("key_centre"), "key_centre");
      if (c.ndim() != 1 && c.ndim() != 2)
        throw py::value_error("KVCache: key_centre must be (head_dim,) or (rows, head_dim), got shape " +
                              shape_str(shape_of(c)));
      const Index rows = c.ndim() == 1 ? 1 : c.shape(0), cols = c.shape(c.ndim() - 1);
      const auto cd = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(c);
      o.key_centre = Eigen::Map<const randattn::RowMatrix<double>>(cd.data(), rows, cols);
    }
  }
  return o;
}

// The (rows, cols) matrix view of a C-contiguous array of any leading shape.
template <typename Scalar>
Eigen::Map<const randattn::RowMatrix<Scalar>> rows_of(const RowMajorInput<Scalar>& in, Index rows,
                                                      Index cols) {
  return Eigen::Map<const randattn::RowMatrix<Scalar>>(in.data(), rows, cols);
}

class KVCache {
  // Defined first: member templates with deduced return types must be seen before their use.
  template <typename Fn>
  decltype(auto) visit(Fn&& fn) const {
    if (const auto* f = std::get_if<randattn::KvCache<float>>(&impl_)) return fn(*f);
    return fn(std::get<randattn::KvCache<double>>(impl_));
  }
  template <typename Fn>
  decltype(auto) visit(Fn&& fn) {
    if (auto* f = std::get_if<randattn::KvCache<float>>(&impl_)) return fn(*f);
    return fn(std::get<randattn::KvCache<double>>(impl_));
  }

 public:
  KVCache(py::handle head_dim, py::handle value_dim, py::handle kv_heads, const std::string& mode,
          py::handle sinks, py::handle window, py::handle scale, const std::string& dtype,
          const std::optional<std::string>& storage, py::handle check_finite,
          const py::dict& options) {
    const Index d = to_integer(head_dim, "head_dim"), dv = to_integer(value_dim, "value_dim"),
                h = to_integer(kv_heads, "kv_heads");
    KvCacheOptions o = to_options(mode_info(mode), sinks, window, scale, check_finite, options);
    if (storage) o.storage = storage_named(*storage);
    if (dtype == "float32") {
      impl_.emplace<randattn::KvCache<float>>(d, dv, h, std::move(o));
    } else if (dtype == "float64") {
      impl_.emplace<randattn::KvCache<double>>(d, dv, h, std::move(o));
    } else {
      throw py::type_error("dtype must be float32 or float64, got " + dtype);
    }
  }

  // Reads the scalar width from the header, then the library's load checks everything.
  static std::unique_ptr<KVCache> load(const std::string& path) {
    std::unique_ptr<KVCache> c(new KVCache);
    if (!std::ifstream(path, std::ios::binary)) {
      PyErr_SetString(PyExc_FileNotFoundError, ("KVCache.load: cannot open '" + path + "'").c_str());
      throw py::error_already_set();
    }
    const std::uint32_t width = randattn::kv_cache_file_scalar_bytes(path);
    py::gil_scoped_release release;
    if (width == 8) {
      c->impl_.emplace<randattn::KvCache<double>>(randattn::KvCache<double>::load(path));
    } else {  // float, or a file the float loader rejects with its message
      c->impl_.emplace<randattn::KvCache<float>>(randattn::KvCache<float>::load(path));
    }
    return c;
  }

  // k: (kv_heads, t, head_dim) or (kv_heads, head_dim) for one token; v likewise with value_dim.
  void append(py::handle k_obj, py::handle v_obj) {
    const py::array k = as_float_array(k_obj, "k"), v = as_float_array(v_obj, "v");
    visit([&](auto& cache) {
      using Scalar = typename std::decay_t<decltype(cache)>::Scalar;
      const Index t = tokens(k, "k", cache.head_dim(), cache.kv_heads());
      const Index tv = tokens(v, "v", cache.value_dim(), cache.kv_heads());
      if (t != tv)
        throw py::value_error("KVCache.append: k holds " + std::to_string(t) + " tokens but v holds " +
                              std::to_string(tv) + " (k " + shape_str(shape_of(k)) + ", v " +
                              shape_str(shape_of(v)) + ")");
      const RowMajorInput<Scalar> kin(k), vin(v);
      const Index rows = cache.kv_heads() * t;
      py::gil_scoped_release release;
      std::unique_lock<std::shared_mutex> lock(mutex_);
      cache.append(rows_of(kin, rows, cache.head_dim()), rows_of(vin, rows, cache.value_dim()));
    });
  }

  // (out (q_heads, value_dim), report fields).
  std::pair<py::array, py::dict> attend(py::handle q_obj, bool want_report) const {
    const py::array q = as_float_array(q_obj, "q");
    py::array out;
    randattn::DecodeReport rep;
    Index attended = 0;  // the size seen by this attend (appends may follow at once)
    visit([&](const auto& cache) {
      using Scalar = typename std::decay_t<decltype(cache)>::Scalar;
      if (q.ndim() != 2 || q.shape(1) != cache.head_dim())
        throw py::value_error("KVCache.attend: q must be (q_heads, " +
                              std::to_string(cache.head_dim()) + "), got shape " +
                              shape_str(shape_of(q)));
      const RowMajorInput<Scalar> qin(q);
      const Index qh = q.shape(0);
      py::array_t<Scalar> o({qh, cache.value_dim()});
      Scalar* od = o.mutable_data();
      {
        py::gil_scoped_release release;
        std::shared_lock<std::shared_mutex> lock(mutex_);
        // Computed in Eigen's storage, then copied: results must not depend on the alignment
        // NumPy gave the output buffer.
        const randattn::RowMatrix<Scalar> r =
            cache.attend(rows_of(qin, qh, cache.head_dim()), want_report ? &rep : nullptr);
        attended = cache.size();
        std::copy(r.data(), r.data() + r.size(), od);
      }
      out = o;
    });
    py::dict fields;
    if (want_report) {
      fields["mode"] = mode();
      fields["size"] = attended;
      fields["keys_scored"] = rep.keys_scored();
      fields["exact_keys"] = rep.exact_keys;
      fields["retrieved_keys"] = rep.retrieved_keys;
      fields["pages_scored"] = rep.pages_scored;
      fields["pages_opened"] = rep.pages_opened;
      fields["tables_probed"] = rep.tables_probed;
      fields["bucket_entries"] = rep.bucket_entries;
      fields["filters_opened"] = rep.filters_opened;
      fields["clusters_opened"] = rep.clusters_opened;
      fields["empty_heads"] = rep.empty_heads;
      fields["bytes_per_token"] = rep.bytes_per_token;
    }
    return {out, fields};
  }

  void save(const std::string& path) const {
    std::string failure;
    visit([&](const auto& cache) {
      py::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(mutex_);
      try {
        cache.save(path);
      } catch (const std::runtime_error& e) {  // cannot open or write the file
        failure = e.what();
      }
    });
    if (!failure.empty()) {
      PyErr_SetString(PyExc_OSError, failure.c_str());
      throw py::error_already_set();
    }
  }

  Index size() const {
    return visit([&](const auto& cache) {
      std::shared_lock<std::shared_mutex> lock(mutex_);
      return cache.size();
    });
  }
  std::string mode() const {
    return visit([](const auto& c) { return std::string(mode_info(c.options().mode).name); });
  }
  std::string dtype() const {
    return std::holds_alternative<randattn::KvCache<float>>(impl_) ? "float32" : "float64";
  }
  std::string storage() const {
    return visit([](const auto& c) { return std::string(randattn::to_string(c.storage())); });
  }
  // Bytes of the whole cache (keys, values, scales and the retrieval index), and of one token's
  // keys and values in all kv heads as stored.
  std::size_t memory_bytes() const {
    return visit([&](const auto& c) {
      std::shared_lock<std::shared_mutex> lock(mutex_);
      return c.memory_bytes();
    });
  }
  std::size_t bytes_per_token() const {
    return visit([](const auto& c) { return c.bytes_per_token(); });
  }
  Index head_dim() const { return visit([](const auto& c) { return c.head_dim(); }); }
  Index value_dim() const { return visit([](const auto& c) { return c.value_dim(); }); }
  Index kv_heads() const { return visit([](const auto& c) { return c.kv_heads(); }); }
  double scale() const { return visit([](const auto& c) { return double(c.scale()); }); }

  // {sinks, window, check_finite, and the mode's options} as given or defaulted.
  py::dict options() const {
    return visit([](const auto& c) {
      const KvCacheOptions& o = c.options();
      py::dict d;
      d["sinks"] = o.sinks;
      d["window"] = o.window;
      d["check_finite"] = o.check_finite;
      const ModeInfo& m = mode_info(o.mode);
      const auto set = [&](const char* name, py::object value) {
        if (owns(m, name)) d[name] = std::move(value);
      };
      set("page_size", py::cast(o.page_size));
      set("top_pages", py::cast(o.top_pages));
      set("axes", py::cast(o.page_axes));
      set("bits", py::cast(o.lsh_bits));
      if (o.mode == DecodeMode::lsh_sample) d["tables"] = o.lsh_tables;
      set("hash_block", py::cast(o.lsh_hash_block));
      if (o.mode == DecodeMode::lsf) d["tables"] = o.lsf_tables;
      set("filters", py::cast(o.lsf_filters));
      set("eta", o.lsf_threshold ? py::cast(*o.lsf_threshold) : py::none());
      set("alpha", py::cast(o.lsf_alpha));
      set("min_probes", py::cast(o.lsf_min_probes));
      set("clusters", py::cast(o.clusters));
      set("probe", py::cast(o.probe));
      set("margin", py::cast(o.cluster_margin));
      set("samples", py::cast(o.cluster_samples));
      set("seed", py::cast(o.seed));
      set("centre_tokens", py::cast(o.centre_tokens));
      if (o.key_centre.size() > 0) {
        py::array_t<double> kc({o.key_centre.rows(), o.key_centre.cols()});
        std::copy(o.key_centre.data(), o.key_centre.data() + o.key_centre.size(), kc.mutable_data());
        set("key_centre", kc);
      } else {
        set("key_centre", py::none());
      }
      return d;
    });
  }

 private:
  KVCache() = default;

  // Tokens t of an append argument: (kv_heads, t, cols) or (kv_heads, cols).
  static Index tokens(const py::array& a, const std::string& name, Index cols, Index kv_heads) {
    const bool ok = (a.ndim() == 3 || a.ndim() == 2) && a.shape(0) == kv_heads &&
                    a.shape(a.ndim() - 1) == cols;
    if (!ok)
      throw py::value_error("KVCache.append: " + name + " must be (" + std::to_string(kv_heads) +
                            ", t, " + std::to_string(cols) + ") or (" + std::to_string(kv_heads) +
                            ", " + std::to_string(cols) + ") for one token, got shape " +
                            shape_str(shape_of(a)));
    return a.ndim() == 3 ? a.shape(1) : 1;
  }

  std::variant<std::monostate, randattn::KvCache<float>, randattn::KvCache<double>> impl_;
  // Shared by attends and saves, exclusive for appends (attend itself needs no lock).
  mutable std::shared_mutex mutex_;
};

}  // namespace

void bind_kv_cache(py::module_& m) {
  using namespace pybind11::literals;
  py::class_<KVCache>(m, "KVCache")
      .def(py::init<py::handle, py::handle, py::handle, const std::string&, py::handle, py::handle,
                    py::handle, const std::string&, const std::optional<std::string>&, py::handle,
                    const py::dict&>(),
           "head_dim"_a, "value_dim"_a, "kv_heads"_a, "mode"_a, "sinks"_a, "window"_a, "scale"_a,
           "dtype"_a, "storage"_a, "check_finite"_a, "options"_a)
      .def_static("load", &KVCache::load, "path"_a)
      .def("append", &KVCache::append, "k"_a, "v"_a)
      .def("attend", &KVCache::attend, "q"_a, "report"_a)
      .def("save", &KVCache::save, "path"_a)
      .def_property_readonly("size", &KVCache::size)
      .def_property_readonly("mode", &KVCache::mode)
      .def_property_readonly("dtype", &KVCache::dtype)
      .def_property_readonly("storage", &KVCache::storage)
      .def_property_readonly("memory_bytes", &KVCache::memory_bytes)
      .def_property_readonly("bytes_per_token", &KVCache::bytes_per_token)
      .def_property_readonly("head_dim", &KVCache::head_dim)
      .def_property_readonly("value_dim", &KVCache::value_dim)
      .def_property_readonly("kv_heads", &KVCache::kv_heads)
      .def_property_readonly("scale", &KVCache::scale)
      .def_property_readonly("options", &KVCache::options);

  py::dict d;
  for (const ModeInfo& mode : modes()) d[py::str(mode.name)] = defaults_of(mode.options);
  m.attr("kv_cache_modes") = d;
}

}  // namespace randattn_python
