#pragma once
// RANDATTN_UNROLL before a loop over a compile-time extent (the rows and packets of a register
// tile) unrolls it completely at any optimisation level. GCC unrolls such loops at -O3 but at
// -O2 only where unrolling does not grow the code; a tile's accumulator array then stays in
// memory, and every multiply-add loads and stores it.
#if defined(__clang__)
#define RANDATTN_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define RANDATTN_UNROLL _Pragma("GCC unroll 64")
#else
#define RANDATTN_UNROLL
#endif
