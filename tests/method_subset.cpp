// A method table of the four methods that the [threads] cases call through the registry (the
// layouts' parallel sub-calls in test_threads.cpp). The ThreadSanitizer build runs only those
// cases, so it links this table (RANDATTN_TESTS_SUBSET_TABLE) instead of compiling every
// registered method once more under ThreadSanitizer, which took longer than its tests.

#include <randattn/registry/method_list.hpp>
#include <randattn/registry/methods/exact.hpp>
#include <randattn/registry/methods/features.hpp>
#include <randattn/registry/methods/lsf.hpp>
#include <randattn/registry/methods/lsh.hpp>
#include <randattn/registry/registry.hpp>

namespace randattn::registry {

const std::vector<std::unique_ptr<Method>>& methods() {
  static const std::vector<std::unique_ptr<Method>> table = [] {
    std::vector<std::unique_ptr<Method>> t;
    t.push_back(std::make_unique<ExactMethod>());
    t.push_back(std::make_unique<FeatureMethod<FavorFamily>>());
    t.push_back(std::make_unique<LshMethod>());
    t.push_back(std::make_unique<LsfMethod>());
    return t;
  }();
  return table;
}

}  // namespace randattn::registry
