// SVG line chart: data ranges, tick placement at 1/2/5·10^k steps, and the markup.
#include "cemlm/trainer/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace cemlm {
namespace {

constexpr double kWidth = 800, kHeight = 480;
constexpr double kLeft = 70, kRight = 180, kTop = 40, kBottom = 60;  // margins
const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                               "#9467bd", "#8c564b", "#e377c2", "#17becf"};

struct Range {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  void add(double v) {
    if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
};

double nice_step(double span) {
  const double raw = span / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

// Widens the range to whole ticks; a flat or empty range gets a unit span.
double tick_range(Range& r) {
  if (r.empty()) r.lo = 0, r.hi = 1;
  if (r.hi - r.lo < 1e-12) r.lo -= 0.5, r.hi += 0.5;
  const double step = nice_step(r.hi - r.lo);
  r.lo = std::floor(r.lo / step) * step;
  r.hi = std::ceil(r.hi / step) * step;
  return step;
}

// The ticks lo, lo + step, ..., hi of a range tick_range() widened: counted, not summed (a step
// under half an ulp of lo never moves a running sum: 1e17 and 1e17 + 16 looped for good), and at
// most kMaxTicks + 1 (a range too wide for doubles gets its first tick only).
std::vector<double> ticks(const Range& r, double step) {
  constexpr double kMaxTicks = 100;
  const double n = std::floor((r.hi - r.lo) / step + 0.5);
  if (!(n >= 0 && n <= kMaxTicks)) return {r.lo};
  std::vector<double> out;
  for (int i = 0; i <= int(n); ++i) out.push_back(r.lo + i * step);
  return out;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '<')
      out += "&lt;";
    else if (ch == '>')
      out += "&gt;";
    else if (ch == '&')
      out += "&amp;";
    else
      out += ch;
  }
  return out;
}

std::string fmt(const char* f, double a, double b = 0, double c = 0, double d = 0) {
  char buf[128];
  std::snprintf(buf, sizeof(buf), f, a, b, c, d);
  return buf;
}

std::string tick_label(double v) { return fmt("%g", std::abs(v) < 1e-12 ? 0.0 : v); }

}  // namespace

std::string line_chart_svg(const std::vector<Series>& series, const std::string& title,
                           const std::string& x_label, const std::string& y_label) {
  Range xr, yr;
  for (const Series& s : series)
    for (size_t i = 0; i < s.x.size(); ++i)
      if (std::isfinite(s.y[i])) xr.add(s.x[i]), yr.add(s.y[i]);
  const double xstep = tick_range(xr), ystep = tick_range(yr);
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (x - xr.lo) / (xr.hi - xr.lo) * pw; };
  auto py = [&](double y) { return kTop + (yr.hi - y) / (yr.hi - yr.lo) * ph; };

  std::string svg =
      fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
          "font-family=\"sans-serif\" font-size=\"12\">\n",
          kWidth, kHeight);
  svg += fmt("<rect width=\"%g\" height=\"%g\" fill=\"white\"/>\n", kWidth, kHeight);
  svg += fmt("<text x=\"%g\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">", kLeft + pw / 2) +
         escape(title) + "</text>\n";
  for (const double x : ticks(xr, xstep)) {
    svg += fmt("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", px(x),
               kTop, px(x), kTop + ph);
    svg += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", px(x), kTop + ph + 18) +
           tick_label(x) + "</text>\n";
  }
  for (const double y : ticks(yr, ystep)) {
    svg += fmt("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", kLeft,
               py(y), kLeft + pw, py(y));
    svg += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", kLeft - 6, py(y) + 4) +
           tick_label(y) + "</text>\n";
  }
  svg +=
      fmt("<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" stroke=\"black\"/>\n",
          kLeft, kTop, pw, ph);
  svg += fmt("<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">", kLeft + pw / 2, kHeight - 15) +
         escape(x_label) + "</text>\n";
  svg += fmt("<text transform=\"translate(18,%g) rotate(-90)\" text-anchor=\"middle\">",
             kTop + ph / 2) +
         escape(y_label) + "</text>\n";
  for (size_t k = 0; k < series.size(); ++k) {
    const Series& s = series[k];
    const char* color = kColors[k % std::size(kColors)];
    std::string points;
    for (size_t i = 0; i < s.x.size(); ++i)
      if (std::isfinite(s.y[i])) points += fmt("%.1f,%.1f ", px(s.x[i]), py(s.y[i]));
    svg += "<polyline fill=\"none\" stroke-width=\"1.5\" stroke=\"" + std::string(color) +
           "\" points=\"" + points + "\"/>\n";
    if (s.x.size() <= 50)  // markers only where they stay readable (evaluations)
      for (size_t i = 0; i < s.x.size(); ++i)
        if (std::isfinite(s.y[i]))
          svg += fmt("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"", px(s.x[i]), py(s.y[i])) +
                 color + "\"/>\n";
    const double ly = kTop + 10 + 20 * double(k);
    svg += fmt("<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke-width=\"2\" stroke=\"",
               kWidth - kRight + 15, ly, kWidth - kRight + 40, ly) +
           color + "\"/>\n";
    svg += fmt("<text x=\"%g\" y=\"%g\">", kWidth - kRight + 46, ly + 4) + escape(s.label) +
           "</text>\n";
  }
  return svg + "</svg>\n";
}

}  // namespace cemlm
