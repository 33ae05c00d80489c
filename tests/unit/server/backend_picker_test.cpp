// disagg-proxy's server choice: fewest requests in flight, ties in turn.
#include <gtest/gtest.h>

#include <optional>

#include "server/backend_picker.h"

namespace m3::server {
namespace {

TEST(BackendPicker, FewestInFlightThenInTurn) {
  BackendPicker p({"a", "b", "c"});
  {
    // Idle: in turn.
    EXPECT_EQ(p.pick().url(), "a");
    EXPECT_EQ(p.pick().url(), "b");
    EXPECT_EQ(p.pick().url(), "c");
    EXPECT_EQ(p.pick().url(), "a");
  }
  // A long request on b, two on c: the next ones go to a until it has as many.
  std::optional<BackendPicker::Lease> on_b, on_c1, on_c2;
  on_b.emplace(p.pick());  // b (after a)
  EXPECT_EQ(on_b->url(), "b");
  on_c1.emplace(p.pick());
  on_c2.emplace(p.pick());
  EXPECT_EQ(on_c1->url(), "c");
  EXPECT_EQ(on_c2->url(), "a");
  EXPECT_EQ(p.in_flight(0), 1);
  {
    auto x = p.pick();  // a 1, b 1, c 1: in turn from after a
    EXPECT_EQ(x.url(), "b");
    auto y = p.pick();  // a 1, b 2, c 1
    EXPECT_EQ(y.url(), "c");
  }
  on_b.reset();  // b drops to 0
  EXPECT_EQ(p.pick().url(), "b");
  EXPECT_EQ(p.in_flight(1), 0);
}

}  // namespace
}  // namespace m3::server
