#pragma once
// Small self-contained SVG line charts (no dependencies) for sweep results.
#include <string>
#include <vector>

namespace m3::bench {

struct ChartSeries {
  std::string name;
  std::vector<double> x;
  std::vector<double> y;
  std::vector<std::string> point_labels;  // optional, one per point (e.g. "c=8")
};

struct ChartPanel {
  std::string title;
  std::string x_label;
  std::string y_label;
  bool log_x = false;  // log2 axis ticked at the data's x values (concurrency sweeps)
  std::vector<ChartSeries> series;
};

// Panels side by side in one SVG document.
std::string render_svg_chart(const std::vector<ChartPanel>& panels, int panel_width = 560,
                             int panel_height = 420);

// "Nice" axis ticks (1, 2, 5 x 10^k steps) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target_count = 5);
std::string xml_escape(const std::string& text);

}  // namespace m3::bench
