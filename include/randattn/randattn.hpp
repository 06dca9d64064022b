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
#include "features/projection.hpp"
#include "features/feature_maps.hpp"
#include "attention/random_feature_attention.hpp"
#include "features/hybrid.hpp"
