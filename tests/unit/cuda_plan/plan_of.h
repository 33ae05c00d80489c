// The plan a named dispatch entry gives for a problem ("<no plan>" / "<no entry>" when it has
// none / is not in the table): the plan tests' look-up.
#pragma once
#include <string>

#include "ops/ops.h"

namespace m3::test {

template <class Entries>
std::string plan_of(const Entries& entries, const std::string& name, const ops::Problem& p) {
  for (const auto& e : entries)
    if (e.name == name) return e.plan ? e.plan(p) : std::string("<no plan>");
  return std::string("<no entry>");
}

}  // namespace m3::test
