// The x86 intrinsics header, included by every randattn header before Eigen (which includes it
// too). GCC 12's AVX-512 intrinsics pass deliberately undefined vectors (_mm512_undefined_ps)
// to their builtins, and -Wall reports "'__Y' is used uninitialized" wherever Eigen's packet
// code inlines them (GCC bug 105593). The two warnings are off for that header's own lines
// only: a header is read once, so the state at its first inclusion is the one that counts,
// and the user's code and ours keep them.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
