// roofline.svg (roofline.h): hand-written SVG text. Top: a log-log roofline (arithmetic intensity in FLOP
// per byte against TFLOP/s) with the measured copy-bandwidth slope, the BF16 tensor ceiling and the best
// measured GEMM ceiling per operand format; each phase with FLOPs is a circle (area ~ its share of the
// step, colour = its bound), each GEMM call a grey square (hover for its name). Bottom: one bar per phase,
// its time split into the time at its ceilings and the time lost.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include "train/roofline.h"

namespace nb::roofline {

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (const char ch : s) {
    switch (ch) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += ch;
    }
  }
  return o;
}

std::string fmt(const char* f, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, f, args...);
  return buf;
}

const char* colour(const std::string& bound) {
  if (bound == "GEMM") return "#3465a4";
  if (bound == "tensor") return "#75507b";
  if (bound == "memory") return "#f57900";
  return "#888a85";
}

// The plot's log-log frame: decades [lx0, lx1] x [ly0, ly1] onto the pixel box.
struct Frame {
  double lx0 = -1, lx1 = 4, ly0 = -2, ly1 = 4;
  double x0 = 80, x1 = 700, y0 = 50, y1 = 470;
  double x(double ai) const { return x0 + (std::log10(ai) - lx0) / (lx1 - lx0) * (x1 - x0); }
  double y(double t) const { return y1 - (std::log10(t) - ly0) / (ly1 - ly0) * (y1 - y0); }
};

Frame frame_for(const Report& r, double top) {
  Frame f;
  double ai_lo = 1e9, ai_hi = 0, t_lo = 1e9;
  auto see = [&](const Row& x) {
    if (x.flops <= 0 || x.bytes <= 0 || x.ms <= 0) return;
    ai_lo = std::min(ai_lo, x.flops / x.bytes);
    ai_hi = std::max(ai_hi, x.flops / x.bytes);
    t_lo = std::min(t_lo, x.tflops());
  };
  for (const Row& p : r.phases) see(p);
  for (const Row& g : r.gemms) see(g);
  if (ai_hi > 0) {
    f.lx0 = std::min(-1.0, std::floor(std::log10(ai_lo)));
    f.lx1 = std::max(3.0, std::ceil(std::log10(ai_hi * 1.5)));
    f.ly0 = std::min(0.0, std::floor(std::log10(t_lo)));
  }
  f.ly1 = std::max(1.0, std::ceil(std::log10(std::max(top, 1.0) * 1.5)));
  return f;
}

std::string axes(const Frame& f) {
  std::string s = fmt("<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#555\"/>\n",
                      f.x0, f.y0, f.x1 - f.x0, f.y1 - f.y0);
  for (int d = int(f.lx0); d <= int(f.lx1); ++d) {
    const double px = f.x(std::pow(10.0, d));
    s += fmt("<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#ddd\"/>\n", px, f.y0, px, f.y1);
    s += fmt("<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n", px, f.y1 + 16, std::pow(10.0, d));
  }
  for (int d = int(f.ly0); d <= int(f.ly1); ++d) {
    const double py = f.y(std::pow(10.0, d));
    s += fmt("<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", f.x0, py, f.x1, py);
    s += fmt("<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n", f.x0 - 6, py + 4, std::pow(10.0, d));
  }
  s += fmt("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">arithmetic intensity (FLOP/byte)</text>\n",
           (f.x0 + f.x1) / 2, f.y1 + 36);
  s += fmt("<text x=\"20\" y=\"%.0f\" transform=\"rotate(-90 20 %.0f)\" text-anchor=\"middle\">TFLOP/s</text>\n",
           (f.y0 + f.y1) / 2, (f.y0 + f.y1) / 2);
  return s;
}

// One roof: the copy-bandwidth slope up to the ridge, then flat at `tflops`.
std::string roof(const Frame& f, double tflops, double gbs, const std::string& label, const char* dash) {
  if (tflops <= 0 || gbs <= 0) return "";
  const double lo = std::pow(10.0, f.lx0), hi = std::pow(10.0, f.lx1), ridge = tflops * 1000.0 / gbs;
  const double start_t = gbs * lo / 1000.0;
  std::string s =
      fmt("<polyline fill=\"none\" stroke=\"#2e3436\" stroke-width=\"1.5\" stroke-dasharray=\"%s\" points=\"%.1f,%.1f "
          "%.1f,%.1f %.1f,%.1f\"/>\n",
          dash, f.x(lo), f.y(start_t), f.x(ridge), f.y(tflops), f.x(hi), f.y(tflops));
  s += fmt("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" font-size=\"10\">%s</text>\n", f.x1 - 4, f.y(tflops) - 4,
           esc(label).c_str());
  return s;
}

std::string roofs(const Report& r, const Frame& f) {
  const Ceilings& c = r.ceilings;
  std::string s = "<g clip-path=\"url(#plot)\">\n";
  s += roof(f, c.tensor_tflops, c.copy_gbs, fmt("BF16 8192^3 GEMM %.0f TFLOP/s", c.tensor_tflops), "none");
  std::map<std::string, double> best;  // per operand format: the best measured GEMM ceiling
  for (const auto& [key, t] : c.gemm_tflops) {
    const std::string call = key.substr(key.find(' ') + 1), format = call.substr(0, call.find(' '));
    best[format] = std::max(best[format], t);
  }
  for (const auto& [format, t] : best)
    if (std::fabs(t - c.tensor_tflops) > 0.02 * c.tensor_tflops)
      s += roof(f, t, c.copy_gbs, fmt("best %s GEMM %.0f TFLOP/s", format.c_str(), t), "6,3");
  s += fmt("<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\" transform=\"rotate(%.1f %.1f %.1f)\">copy %.0f GB/s</text>\n",
           f.x(std::pow(10.0, f.lx0)) + 20, f.y(c.copy_gbs * std::pow(10.0, f.lx0) / 1000.0) - 20, -35.0,
           f.x(std::pow(10.0, f.lx0)) + 20, f.y(c.copy_gbs * std::pow(10.0, f.lx0) / 1000.0) - 20, c.copy_gbs);
  return s + "</g>\n";
}

std::string points(const Report& r, const Frame& f) {
  std::string s;
  for (const Row& g : r.gemms) {
    if (g.flops <= 0 || g.bytes <= 0 || g.ms <= 0) continue;
    s +=
        fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"6\" height=\"6\" fill=\"#babdb6\" stroke=\"#555\"><title>%s: %s, "
            "%.0f TFLOP/s of %.0f</title></rect>\n",
            f.x(g.flops / g.bytes) - 3, f.y(g.tflops()) - 3, esc(g.parent).c_str(), esc(g.name).c_str(), g.tflops(),
            g.ceiling_tflops);
  }
  for (const Row& p : r.phases) {
    if (p.flops <= 0 || p.bytes <= 0 || p.ms <= 0) continue;
    const double px = f.x(p.flops / p.bytes), py = f.y(p.tflops());
    const double rad = 3.0 + 14.0 * std::sqrt(r.step_ms > 0 ? p.ms / r.step_ms : 0.0);
    s +=
        fmt("<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%.1f\" fill=\"%s\" fill-opacity=\"0.6\" stroke=\"#222\"><title>%s: "
            "%.2f ms, %.1f TFLOP/s, %.0f GB/s</title></circle>\n",
            px, py, rad, colour(p.bound), esc(p.name).c_str(), p.ms, p.tflops(), p.gbs());
    s += fmt("<text x=\"%.1f\" y=\"%.1f\" font-size=\"10\">%s</text>\n", px + rad + 2, py + 3, esc(p.name).c_str());
  }
  return s;
}

std::string bars(const Report& r, double top) {
  std::string s =
      fmt("<text x=\"10\" y=\"%.0f\" font-weight=\"bold\">time per phase (ms per step): at the ceilings "
          "(green) and lost (red)</text>\n",
          top);
  const double x0 = 280, width = 520, scale = r.step_ms > 0 ? width / r.step_ms : 0;
  double y = top + 12;
  for (const Row& p : r.phases) {
    const double ideal = std::max(0.0, std::min(p.ms, p.ideal_ms)), lost = std::max(0.0, p.ms - ideal);
    s += fmt("<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\" font-size=\"11\">%s</text>\n", x0 - 6, y + 11,
             esc(p.name).c_str());
    s += fmt("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.2f\" height=\"13\" fill=\"#73d216\"/>\n", x0, y, ideal * scale);
    s += fmt("<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"13\" fill=\"#cc0000\"/>\n", x0 + ideal * scale, y,
             lost * scale);
    s += fmt("<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">%.2f ms, lost %.1f%%</text>\n",
             x0 + (ideal + lost) * scale + 6, y + 11, p.ms, 100.0 * p.lost_share);
    y += 18;
  }
  return s;
}

}  // namespace

std::string to_svg(const Report& r) {
  double top = r.ceilings.tensor_tflops;
  for (const auto& [key, t] : r.ceilings.gemm_tflops) top = std::max(top, t);
  for (const Row& p : r.phases) top = std::max(top, p.tflops());
  const Frame f = frame_for(r, top);
  const double bars_top = f.y1 + 70, height = bars_top + 30 + 18.0 * double(r.phases.size());
  std::string s = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s +=
      fmt("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"960\" height=\"%.0f\" viewBox=\"0 0 960 %.0f\" "
          "font-family=\"sans-serif\" font-size=\"12\">\n",
          height, height);
  s += fmt(
      "<defs><clipPath id=\"plot\"><rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\"/></clipPath></defs>\n",
      f.x0, f.y0, f.x1 - f.x0, f.y1 - f.y0);
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s +=
      fmt("<text x=\"10\" y=\"24\" font-weight=\"bold\">roofline of the step: %s (%.1f ms per step, %.1f%% lost to "
          "the distance from the ceilings)</text>\n",
          esc(r.title).c_str(), r.step_ms, 100.0 * r.lost_share());
  s += axes(f) + roofs(r, f) + points(r, f) + bars(r, bars_top);
  s += "</svg>\n";
  return s;
}

}  // namespace nb::roofline
