#pragma once
// What the attention methods need to run on this rank's rows (randattn-mpi only; compiled when
// RANDATTN_CLI_MPI is defined): the communicator, the row layout and the global token count,
// and a loop over the local rows of every (batch, head) slice.

#include <randattn/mpi/lsh_attention.hpp>
#include <randattn/mpi/random_feature_attention.hpp>
#include <randattn/mpi/ring_attention.hpp>

#include <Eigen/Core>

namespace randattn_cli {

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

}  // namespace randattn_cli
