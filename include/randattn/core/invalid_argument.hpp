#pragma once
// The one exception type of the library's argument checks.
//
// Every bad argument anywhere in randattn -- a shape that does not fit, an option out of range, a
// non-finite input, a malformed or unreadable .npy file (io::NpyError derives from this class),
// a distributed call whose ranks disagree -- throws randattn::invalid_argument. It derives from
// std::invalid_argument, so `catch (const std::invalid_argument&)` catches it too (and the Python
// binding reports it as ValueError). Failures that are not about the arguments (an MPI call that
// fails, std::bad_alloc) keep their own types.

#include <stdexcept>
#include <string>

namespace randattn {

class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace randattn
