#pragma once
// Tile sizes shared by the hashing families (LSH, LSF). They fix which rows are rotated, scored
// and multiplied together, so results depend on them, never on the thread count.

#include "../../core/types.hpp"

namespace randattn::detail {

constexpr Index kHashTile =
    64;  // vectors rotated (or scored) together: the work buffer stays in cache
constexpr Index kHashChunk = 1024;  // vectors per parallel work item, which owns one work buffer

// Row and column tiles of the target kernels; a chunk of length c <= 128 and its predecessor
// fit one tile each.
constexpr Index kTargetRowTile = 128;
constexpr Index kTargetColTile = 256;

}  // namespace randattn::detail
