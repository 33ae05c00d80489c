#include "bench/svg_chart.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "bench/bench_serve.h"

namespace m3::bench {
namespace {

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
  return n;
}

TEST(NiceTicks, OneTwoFiveSteps) {
  EXPECT_EQ(nice_ticks(0, 97), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  const std::vector<double> unit = nice_ticks(0, 1);
  ASSERT_EQ(unit.size(), 6u);
  for (size_t i = 0; i < unit.size(); ++i) EXPECT_NEAR(unit[i], 0.2 * static_cast<double>(i), 1e-12);
  EXPECT_EQ(nice_ticks(0, 4.5).back(), 5.0);
  EXPECT_EQ(nice_ticks(0, 100), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  EXPECT_EQ(nice_ticks(-3, 3).front(), -4.0);
}

TEST(SvgChart, PanelsSeriesAndEscaping) {
  ChartPanel a{"tput <vs> interactivity", "x", "y", false, {{"s1", {1, 2, 3}, {10, 20, 15}, {"c=1", "c=2", "c=4"}}}};
  ChartPanel b{"ttft", "concurrency", "ms", true, {{"median", {1, 2, 4}, {5, 6, 9}, {}}, {"p99", {1, 2, 4}, {7, 8, 12}, {}}}};
  const std::string svg = render_svg_chart({a, b});
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"1120\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_EQ(count(svg, "<polyline"), 3u);
  EXPECT_EQ(count(svg, "<circle"), 9u);
  EXPECT_NE(svg.find("tput &lt;vs&gt; interactivity"), std::string::npos);
  EXPECT_NE(svg.find(">c=4</text>"), std::string::npos);
}

TEST(SvgChart, SweepChartFromResults) {
  nlohmann::json points = nlohmann::json::array();
  for (int c : {1, 2, 4}) {
    points.push_back({{"max_concurrency", c},
                      {"summary",
                       {{"interactivity_tok_s", 100.0 / c},
                        {"per_gpu", {{"output_throughput", 90.0 * c}}},
                        {"ttft_ms", {{"median", 10.0 * c}, {"p99", 20.0 * c}}}}}});
  }
  const std::string svg = render_sweep_chart(points, "m3");
  EXPECT_EQ(count(svg, "<polyline"), 3u);
  EXPECT_NE(svg.find("throughput vs interactivity"), std::string::npos);
  EXPECT_NE(svg.find("TTFT vs concurrency"), std::string::npos);
}

}  // namespace
}  // namespace m3::bench
