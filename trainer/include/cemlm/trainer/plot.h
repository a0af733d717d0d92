// A dependency-free SVG line chart for the loss curves written next to each checkpoint.
#pragma once
#include <string>
#include <vector>

namespace cemlm {

struct Series {
  std::string label;
  std::vector<double> x, y;  // same length; one polyline, with markers when it has few points
};

// A 800×480 SVG: one coloured line per series, axes with "nice" tick values, axis labels,
// a title and a legend. Series without points are listed in the legend only.
std::string line_chart_svg(const std::vector<Series>& series, const std::string& title,
                           const std::string& x_label, const std::string& y_label);

}  // namespace cemlm
