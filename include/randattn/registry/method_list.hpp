#pragma once
// The declaration of the registry's method list, methods(). By default it is an inline function
// defined by registry.hpp, so a program only includes headers. Building every registered method
// for float and double is most of a front end's compile time, though, so a program with several
// translation units that use the registry can compile the list once: define
// RANDATTN_REGISTRY_SEPARATE_TABLE in every translation unit of the program, and include
// <randattn/registry/method_table.hpp> in exactly one of them. The others then see this
// declaration only and compile none of the methods.

#include <memory>
#include <vector>

#include "method.hpp"

#ifdef RANDATTN_REGISTRY_SEPARATE_TABLE
#define RANDATTN_REGISTRY_TABLE_LINKAGE
#else
#define RANDATTN_REGISTRY_TABLE_LINKAGE inline
#endif

namespace randattn::registry {

// Every method, in the order listed to users.
RANDATTN_REGISTRY_TABLE_LINKAGE const std::vector<std::unique_ptr<Method>>& methods();

}  // namespace randattn::registry
