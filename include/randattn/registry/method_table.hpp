#pragma once
// The definition of methods(): every registered method (see method_list.hpp for compiling it in
// one translation unit of a program). To add a method: one header in methods/ with a class
// deriving from TypedMethod (see method.hpp), and one line below.

#include <memory>
#include <vector>

#include "method_list.hpp"
#include "methods/auto.hpp"
#include "methods/exact.hpp"
#include "methods/features.hpp"
#include "methods/hedgehog.hpp"
#include "methods/lsf.hpp"
#include "methods/lsh.hpp"
#include "methods/sparse_lowrank.hpp"
#include "registry.hpp"

namespace randattn::registry {

RANDATTN_REGISTRY_TABLE_LINKAGE const std::vector<std::unique_ptr<Method>>& methods() {
  static const std::vector<std::unique_ptr<Method>> table = [] {
    std::vector<std::unique_ptr<Method>> t;
    t.push_back(std::make_unique<ExactMethod>());
    t.push_back(std::make_unique<FeatureMethod<FavorFamily>>());
    t.push_back(std::make_unique<FeatureMethod<FavorHypFamily>>());
    t.push_back(std::make_unique<FeatureMethod<TrigFamily>>());
    t.push_back(std::make_unique<FeatureMethod<OprfFamily>>());
    t.push_back(std::make_unique<FeatureMethod<SderfFamily>>());
    t.push_back(std::make_unique<FeatureMethod<HybridFamily>>());
    t.push_back(std::make_unique<FeatureMethod<HybridGaussianFamily>>());
    t.push_back(std::make_unique<FeatureMethod<HedgehogFamily>>());
    t.push_back(std::make_unique<LshMethod>());
    t.push_back(std::make_unique<LsfMethod>());
    t.push_back(std::make_unique<SparseLowRankMethod>());
    t.push_back(std::make_unique<AutoMethod>());
    return t;
  }();
  return table;
}

}  // namespace randattn::registry
