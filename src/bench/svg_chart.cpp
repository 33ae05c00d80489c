#include "bench/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <sstream>

namespace m3::bench {

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int target_count) {
  if (!(hi > lo)) hi = lo + 1.0;
  const double raw = (hi - lo) / std::max(1, target_count);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  // Integer multiples of step (no accumulated error), from below lo to at or above hi.
  const auto first = static_cast<long>(std::floor(lo / step + 1e-9));
  const auto last = static_cast<long>(std::ceil(hi / step - 1e-9));
  std::vector<double> ticks;
  for (long k = first; k <= last; ++k) ticks.push_back(static_cast<double>(k) * step);
  return ticks;
}

namespace {

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};

std::string fmt(double v) {
  char buf[32];
  if (std::abs(v) >= 1e4 || (std::abs(v) < 1e-2 && v != 0)) {
    std::snprintf(buf, sizeof(buf), "%.3g", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  }
  return buf;
}

void render_panel(std::ostringstream& os, const ChartPanel& panel, double ox, double w, double h) {
  const double left = ox + 70, right = ox + w - 20, top = 40, bottom = h - 55;
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin, ymax = 0;
  std::set<double> xs;
  for (const ChartSeries& s : panel.series) {
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      if (panel.log_x && s.x[i] <= 0) continue;
      xmin = std::min(xmin, s.x[i]);
      xmax = std::max(xmax, s.x[i]);
      ymax = std::max(ymax, s.y[i]);
      xs.insert(s.x[i]);
    }
  }
  if (xs.empty()) { xmin = 0; xmax = 1; }
  std::vector<double> xticks;
  auto tx = [&](double v) { return panel.log_x ? std::log2(v) : v; };
  double xlo, xhi;
  if (panel.log_x) {
    xticks.assign(xs.begin(), xs.end());
    xlo = tx(xmin);
    xhi = tx(xmax);
    if (xhi <= xlo) { xlo -= 1; xhi += 1; }
  } else {
    xticks = nice_ticks(std::min(0.0, xmin), xmax);
    xlo = xticks.front();
    xhi = xticks.back();
  }
  const std::vector<double> yticks = nice_ticks(0.0, ymax > 0 ? ymax : 1.0);
  const double yhi = yticks.back();
  auto px = [&](double v) { return left + (tx(v) - xlo) / (xhi - xlo) * (right - left); };
  auto py = [&](double v) { return bottom - v / yhi * (bottom - top); };

  os << "<text x=\"" << (left + right) / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">"
     << xml_escape(panel.title) << "</text>\n";
  for (double t : yticks) {
    os << "<line x1=\"" << left << "\" x2=\"" << right << "\" y1=\"" << py(t) << "\" y2=\"" << py(t)
       << "\" stroke=\"#ddd\"/><text x=\"" << left - 6 << "\" y=\"" << py(t) + 4
       << "\" text-anchor=\"end\" font-size=\"11\">" << fmt(t) << "</text>\n";
  }
  for (double t : xticks) {
    os << "<line x1=\"" << px(t) << "\" x2=\"" << px(t) << "\" y1=\"" << top << "\" y2=\"" << bottom
       << "\" stroke=\"#eee\"/><text x=\"" << px(t) << "\" y=\"" << bottom + 16
       << "\" text-anchor=\"middle\" font-size=\"11\">" << fmt(t) << "</text>\n";
  }
  os << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << right - left << "\" height=\""
     << bottom - top << "\" fill=\"none\" stroke=\"#333\"/>\n";
  os << "<text x=\"" << (left + right) / 2 << "\" y=\"" << h - 15
     << "\" text-anchor=\"middle\" font-size=\"12\">" << xml_escape(panel.x_label) << "</text>\n";
  os << "<text transform=\"translate(" << ox + 18 << "," << (top + bottom) / 2
     << ") rotate(-90)\" text-anchor=\"middle\" font-size=\"12\">" << xml_escape(panel.y_label) << "</text>\n";
  for (size_t k = 0; k < panel.series.size(); ++k) {
    const ChartSeries& s = panel.series[k];
    const char* color = kColors[k % (sizeof(kColors) / sizeof(kColors[0]))];
    std::ostringstream pts;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]) || (panel.log_x && s.x[i] <= 0)) continue;
      pts << px(s.x[i]) << "," << py(s.y[i]) << " ";
      os << "<circle cx=\"" << px(s.x[i]) << "\" cy=\"" << py(s.y[i]) << "\" r=\"3.5\" fill=\"" << color << "\"/>\n";
      if (i < s.point_labels.size() && !s.point_labels[i].empty()) {
        os << "<text x=\"" << px(s.x[i]) + 5 << "\" y=\"" << py(s.y[i]) - 6 << "\" font-size=\"10\" fill=\""
           << color << "\">" << xml_escape(s.point_labels[i]) << "</text>\n";
      }
    }
    os << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\" points=\"" << pts.str() << "\"/>\n";
    const double ly = top + 14 + 16 * static_cast<double>(k);
    os << "<line x1=\"" << right - 150 << "\" x2=\"" << right - 130 << "\" y1=\"" << ly - 4 << "\" y2=\"" << ly - 4
       << "\" stroke=\"" << color << "\" stroke-width=\"2\"/><text x=\"" << right - 125 << "\" y=\"" << ly
       << "\" font-size=\"11\">" << xml_escape(s.name) << "</text>\n";
  }
}

}  // namespace

std::string render_svg_chart(const std::vector<ChartPanel>& panels, int panel_width, int panel_height) {
  std::ostringstream os;
  const int width = panel_width * static_cast<int>(std::max<size_t>(1, panels.size()));
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << panel_height
     << "\" viewBox=\"0 0 " << width << " " << panel_height << "\" font-family=\"sans-serif\">\n";
  os << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  for (size_t i = 0; i < panels.size(); ++i) {
    render_panel(os, panels[i], static_cast<double>(i) * panel_width, panel_width, panel_height);
  }
  os << "</svg>\n";
  return os.str();
}

}  // namespace m3::bench
