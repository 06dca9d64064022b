#pragma once
// randattn: randomized attention approximation and tensor sketching on Eigen.

#include "core/types.hpp"
#include "core/softmax_accumulator.hpp"
#include "core/scaled_features.hpp"
#include "core/linear_attention.hpp"
#include "core/linear_decoder.hpp"
#include "core/exact_attention.hpp"
#include "linalg/hadamard.hpp"
#include "random/philox.hpp"
#include "random/fill.hpp"
#include "lsh/rotation.hpp"
#include "lsh/cross_polytope.hpp"
#include "lsh/target_blocks.hpp"
#include "lsh/lsh_attention.hpp"
