#pragma once
// Hash codes: one row per token, one column per round (LSH) or table (LSF); entries in
// [0, buckets) (LSH buckets, LSF filters).

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>

#include <Eigen/Core>

namespace randattn {

using HashCodes = Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

}  // namespace randattn
