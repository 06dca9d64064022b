// The MPI test binary: every rank runs the same Catch2 session between MPI_Init and
// MPI_Finalize. Tests reduce their checks across ranks before asserting, so a failure is seen by
// every rank and no rank waits in a collective for one that stopped.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int failed = Catch::Session().run(argc, argv);
  int any = failed;
  MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any ? 1 : 0;
}
