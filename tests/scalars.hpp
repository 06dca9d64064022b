#pragma once
// The scalar types of the templated test cases: TEMPLATE_TEST_CASE(name, tags,
// RANDATTN_TEST_SCALARS). Under a sanitizer (RANDATTN_TEST_SANITIZED, see tests/CMakeLists.txt)
// they run in float only: the double instantiation is the same source, compiling every such case
// twice under a sanitizer costs minutes of CI, and the double paths stay covered by the plain
// cases in double and by the registry's methods, which are built for both. The plain build runs
// both types.
#ifdef RANDATTN_TEST_SANITIZED
#define RANDATTN_TEST_SCALARS float
#else
#define RANDATTN_TEST_SCALARS float, double
#endif
