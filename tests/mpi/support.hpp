#pragma once
// Helpers of the MPI tests: every rank builds the same global inputs from a seed, takes its own
// rows, and checks are reduced across ranks before they are asserted (so all ranks agree on
// pass or fail and none waits in a collective for a rank that stopped).

#include <algorithm>
#include <cmath>
#include <vector>

#include <mpi.h>

#include <randattn/mpi/communicator.hpp>
#include <randattn/mpi/partition.hpp>
#include <randattn/randattn.hpp>

namespace mpitest {

using randattn::Index;
using randattn::RowMatrix;
using randattn::mpi::Communicator;
using randattn::mpi::RowLayout;
using randattn::mpi::RowPartition;

template <typename Scalar>
RowMatrix<Scalar> gaussian(std::uint64_t seed, Index rows, Index cols, double sd = 1.0) {
  return randattn::gaussian_matrix<Scalar>(randattn::Philox(seed), rows, cols, sd);
}

// This rank's rows of a global matrix in the given layout.
template <typename Scalar>
RowMatrix<Scalar> local_rows(const RowMatrix<Scalar>& global, const Communicator& comm,
                             RowLayout layout = RowLayout::contiguous) {
  const RowPartition part(global.rows(), comm.size(), layout);
  RowMatrix<Scalar> out(part.local_rows(comm.rank()), global.cols());
  Index at = 0;
  for (const auto& s : part.segments(comm.rank())) {
    out.middleRows(at, s.count) = global.middleRows(s.first, s.count);
    at += s.count;
  }
  return out;
}

// The global matrix from every rank's local rows (in the layout), on every rank.
template <typename Scalar>
RowMatrix<Scalar> gather_rows(Communicator& comm, const RowMatrix<Scalar>& local, Index global_rows,
                              RowLayout layout = RowLayout::contiguous) {
  const std::vector<Scalar> mine(local.data(), local.data() + local.size());
  const std::vector<Scalar> all = comm.allgatherv(mine);
  const RowPartition part(global_rows, comm.size(), layout);
  RowMatrix<Scalar> out(global_rows, local.cols());
  Index at = 0;
  for (int r = 0; r < comm.size(); ++r) {
    for (const auto& s : part.segments(r)) {
      for (Index i = 0; i < s.count; ++i, ++at)
        for (Index j = 0; j < local.cols(); ++j)
          out(s.first + i, j) = all[std::size_t(at * local.cols() + j)];
    }
  }
  return out;
}

// max |a − b| / max |b|, the same on every rank.
template <typename Scalar>
double relative_error(Communicator& comm, const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
  double e = (a.template cast<double>() - b.template cast<double>()).cwiseAbs().maxCoeff() /
             std::max(1e-300, b.template cast<double>().cwiseAbs().maxCoeff());
  if (!(e == e)) e = HUGE_VAL;
  MPI_Allreduce(MPI_IN_PLACE, &e, 1, MPI_DOUBLE, MPI_MAX, comm.get());
  return e;
}

// True on every rank when `ok` holds on every rank.
inline bool all_ranks(Communicator& comm, bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, comm.get());
  return v == 1;
}

}  // namespace mpitest
