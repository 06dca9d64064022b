#pragma once
// randattn-mpi's runners: each registered method's computation on this rank's rows of every
// (batch, head) slice, registered here beside the library's registry (which does not depend on
// MPI). A method without a runner is refused by randattn-mpi.

#include <randattn/mpi/lsh_attention.hpp>
#include <randattn/mpi/random_feature_attention.hpp>
#include <randattn/mpi/ring_attention.hpp>
#include <randattn/registry/methods/features.hpp>
#include <randattn/registry/methods/lsh.hpp>
#include <randattn/registry/registry.hpp>

#include <Eigen/Core>

#include <functional>
#include <map>
#include <string>

#include "common.hpp"

namespace randattn_cli {

namespace reg = randattn::registry;

struct Shards {
  randattn::mpi::Communicator& comm;
  randattn::mpi::RowLayout layout;
  randattn::Index rows;  // global number of tokens n (queries)
};

// fn(q, k, v, out) on the local rows of each slice of contiguous (slices, rows, cols) buffers;
// out is a writable row-major map.
template <typename Scalar, typename Fn>
void for_each_local_slice(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out,
                          const randattn::BatchShape& local, Fn&& fn) {
  using randattn::RowMatrix;
  using CMap = Eigen::Map<const RowMatrix<Scalar>>;
  for (randattn::Index s = 0; s < local.slices(); ++s) {
    Eigen::Map<RowMatrix<Scalar>> o(out + s * local.n_q * local.dv, local.n_q, local.dv);
    fn(CMap(q + s * local.n_q * local.d, local.n_q, local.d),
       CMap(k + s * local.n_k * local.d, local.n_k, local.d),
       CMap(v + s * local.n_k * local.dv, local.n_k, local.dv), o);
  }
}

// A method's sharded computation: `call` holds the global shape, `local` the local row counts.
template <typename Scalar>
using ShardedRunner = std::function<reg::Report(const Shards&, const reg::Call& call,
                                                const Scalar* q, const Scalar* k, const Scalar* v,
                                                Scalar* out, const randattn::BatchShape& local)>;

namespace sharded {

// Ring attention, in the layout chosen with --layout.
template <typename Scalar>
reg::Report exact(const Shards& shards, const reg::Call& call, const Scalar* q, const Scalar* k,
                  const Scalar* v, Scalar* out, const randattn::BatchShape& local) {
  randattn::mpi::RingOptions opt;
  opt.causal = call.settings.causal;
  opt.scale = call.settings.scale;
  opt.layout = shards.layout;
  for_each_local_slice(q, k, v, out, local,
                       [&](const auto& qs, const auto& ks, const auto& vs, auto& os) {
                         os = randattn::mpi::ring_attention<Scalar>(shards.comm, qs, ks, vs, opt);
                       });
  return {};
}

// Every rank draws the same map(s) from the seed; only key summaries move.
template <typename Family, typename Scalar>
reg::Report features(const Shards& shards, const reg::Call& call, const Scalar* q, const Scalar* k,
                     const Scalar* v, Scalar* out, const randattn::BatchShape& local) {
  using Method = reg::FeatureMethod<Family>;
  Method::check(call);
  return Method::template with_map<Scalar>(
      call, nullptr, [&](const auto& maps, const randattn::RandomFeatureOptions& opt) {
        randattn::Index s = 0;  // slice index: per-head calibration gives each head its map
        for_each_local_slice(q, k, v, out, local,
                             [&](const auto& qs, const auto& ks, const auto& vs, auto& os) {
                               os = randattn::mpi::random_feature_attention(
                                   shards.comm, maps.of_slice(s++), qs, ks, vs, opt);
                             });
      });
}

// Sort-and-chunk shared-QK attention across ranks (the hash is drawn from the seed on each rank).
template <typename Scalar>
reg::Report lsh(const Shards& shards, const reg::Call& call, const Scalar* q, const Scalar* k,
                const Scalar* v, Scalar* out, const randattn::BatchShape& local) {
  if (!call.settings.shared_qk)
    throw CliError("randattn-mpi: --method lsh is distributed with --shared-qk only");
  const randattn::CrossPolytopeHash<Scalar> hash = reg::LshMethod::make_hash<Scalar>(call);
  randattn::LshOptions opt;
  opt.chunk = call.options.integer("chunk");
  opt.exact_buckets = call.options.flag("exact_buckets");
  opt.causal = call.settings.causal;
  opt.scale = call.settings.scale;
  opt.dedupe = call.options.flag("dedupe");
  for_each_local_slice(q, k, v, out, local,
                       [&](const auto& qs, const auto&, const auto& vs, auto& os) {
                         os = randattn::mpi::lsh_attention<Scalar>(shards.comm, hash, qs, vs, opt);
                       });
  return {{"buckets", std::int64_t(hash.buckets())},
          {"chunk", opt.chunk},
          {"rounds", std::int64_t(hash.rounds())},
          {"rotation",
           call.options.given("rotations") ? std::string("file") : call.options.text("rotation")},
          {"dedupe", opt.dedupe},
          {"exact_buckets", opt.exact_buckets},
          {"seed", call.settings.seed}};
}

}  // namespace sharded

// The runner of each distributed method, by registered name (lsf is not distributed: its key
// filters would have to be gathered on every rank).
template <typename Scalar>
const std::map<std::string, ShardedRunner<Scalar>>& sharded_runners() {
  static const std::map<std::string, ShardedRunner<Scalar>> runners = {
      {"exact", sharded::exact<Scalar>},
      {"favor", sharded::features<reg::FavorFamily, Scalar>},
      {"favor-hyp", sharded::features<reg::FavorHypFamily, Scalar>},
      {"trig", sharded::features<reg::TrigFamily, Scalar>},
      {"oprf", sharded::features<reg::OprfFamily, Scalar>},
      {"sderf", sharded::features<reg::SderfFamily, Scalar>},
      {"hybrid", sharded::features<reg::HybridFamily, Scalar>},
      {"hybrid-gaussian", sharded::features<reg::HybridGaussianFamily, Scalar>},
      {"lsh", sharded::lsh<Scalar>},
  };
  return runners;
}

}  // namespace randattn_cli
