// The registry's method list, compiled once for every front end of the build (randattn-cli,
// randattn-mpi, the Python module and the tests that use the registry) rather than in each of
// them: see include/randattn/registry/method_list.hpp. Compiled with
// RANDATTN_REGISTRY_SEPARATE_TABLE, as are the programs that link it.

#include <randattn/registry/method_table.hpp>
