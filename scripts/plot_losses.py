#!/usr/bin/env python3
"""Plots a nibble run's training and validation loss as an SVG line chart (standard library only).

  python3 scripts/plot_losses.py RUN_DIR_OR_METRICS_JSONL -o loss.svg [--title "..."] [--ylabel "..."]

Reads SAVE/metrics.jsonl: training lines {"iteration", "lm_loss", ...} (one per step; lm_loss is null for a
step whose loss was not finite, which is left out) and validation lines {"iteration", "val_loss", ...} (every
--eval-interval and at the end). Other lines (quantization statistics) are ignored. The file is appended
to, so when an iteration appears twice (a resumed run) its last line wins. With `nibble finetune` both
losses are the mean over answer tokens.
"""
import argparse
import json
import math
import os
import sys
from xml.sax.saxutils import escape

W, H = 760, 460                      # canvas
L, R, T, B = 78, 24, 48, 58          # plot margins: left, right, top, bottom
TRAIN, VALID = "#1f77b4", "#d62728"  # line colours


def read_metrics(path):
    train, valid = {}, {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                j = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot_losses.py: {path}:{n}: not JSON ({e})")
            if isinstance(j.get("lm_loss"), (int, float)):
                train[j["iteration"]] = float(j["lm_loss"])
            if isinstance(j.get("val_loss"), (int, float)):
                valid[j["iteration"]] = float(j["val_loss"])
    return sorted(train.items()), sorted(valid.items())


def nice_ticks(lo, hi, count=6, min_step=0.0):
    """Round tick values (1, 2 or 5 times a power of ten, at least min_step apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = max(min_step, next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw))
    first, last = math.floor(lo / step), math.ceil(hi / step)
    return [k * step for k in range(first, last + 1)], step


def label(v, step):
    return f"{v:.{max(0, -math.floor(math.log10(step)))}f}"


def polyline(points, sx, sy, colour, width):
    pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    return f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="{width}" stroke-linejoin="round"/>'


def frame(title, xlabel, ylabel, xt, xs, yt, ys, sx, sy, box, title_x):
    """The opening of an SVG chart: canvas, title, grid lines with tick labels, plot border, axis labels.
    box = (width, height, left, right, top, bottom margins); sx, sy map data to pixels."""
    w, h, l, r, t, b = box
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{title_x}" y="26" text-anchor="middle" font-size="15" font-weight="bold">{escape(title)}</text>']
    for v in xt:  # vertical grid lines and x tick labels
        out.append(f'<line x1="{sx(v):.1f}" y1="{t}" x2="{sx(v):.1f}" y2="{h - b}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{sx(v):.1f}" y="{h - b + 18}" text-anchor="middle">{label(v, xs)}</text>')
    for v in yt:  # horizontal grid lines and y tick labels
        out.append(f'<line x1="{l}" y1="{sy(v):.1f}" x2="{w - r}" y2="{sy(v):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{l - 8}" y="{sy(v) + 4:.1f}" text-anchor="end">{label(v, ys)}</text>')
    out.append(f'<rect x="{l}" y="{t}" width="{w - l - r}" height="{h - t - b}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{(l + w - r) / 2}" y="{h - 16}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text x="18" y="{(t + h - b) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 18 {(t + h - b) / 2})">{escape(ylabel)}</text>')
    return out


def svg(train, valid, title, xlabel, ylabel):
    pts = train + valid
    xt, xs = nice_ticks(0, max(x for x, _ in pts), min_step=1)  # iterations are whole
    yt, ys = nice_ticks(min(y for _, y in pts), max(y for _, y in pts))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    sx = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)
    sy = lambda y: H - B - (y - y0) / (y1 - y0) * (H - T - B)
    out = frame(title, xlabel, ylabel, xt, xs, yt, ys, sx, sy, (W, H, L, R, T, B), W / 2)
    legend = []
    if train:
        out.append(polyline(train, sx, sy, TRAIN, 1.5))
        legend.append((TRAIN, f"train ({len(train)} steps)"))
    if valid:
        out.append(polyline(valid, sx, sy, VALID, 2))
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{VALID}"/>' for x, y in valid]
        legend.append((VALID, f"validation ({len(valid)} evaluations)"))
    lx, ly = W - R - 222, T + 12  # legend box, top right
    out.append(f'<rect x="{lx}" y="{ly}" width="210" height="{12 + 20 * len(legend)}" fill="white" '
               'stroke="#999" fill-opacity="0.9"/>')
    for i, (colour, text) in enumerate(legend):
        y = ly + 16 + 20 * i
        out.append(f'<line x1="{lx + 10}" y1="{y}" x2="{lx + 36}" y2="{y}" stroke="{colour}" stroke-width="2.5"/>')
        out.append(f'<text x="{lx + 44}" y="{y + 4}">{escape(text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run folder (nibble --save) or its metrics.jsonl")
    ap.add_argument("-o", "--output", required=True, help="SVG file to write")
    ap.add_argument("--title", default="nibble: loss", help="the chart's title")
    ap.add_argument("--xlabel", default="iteration")
    ap.add_argument("--ylabel", default="loss (mean cross-entropy, nats/token)")
    a = ap.parse_args()
    path = os.path.join(a.run, "metrics.jsonl") if os.path.isdir(a.run) else a.run
    train, valid = read_metrics(path)
    if not train and not valid:
        sys.exit(f"plot_losses.py: {path} holds no lm_loss or val_loss lines")
    with open(a.output, "w", encoding="utf-8") as f:
        f.write(svg(train, valid, a.title, a.xlabel, a.ylabel))
    say = lambda name, s: f"{name} {s[0][1]:.3f} (iteration {s[0][0]}) -> {s[-1][1]:.3f} (iteration {s[-1][0]})"
    print(f"plot_losses: wrote {a.output}: " + "; ".join(say(n, s) for n, s in (("train", train),
                                                                               ("validation", valid)) if s))


if __name__ == "__main__":
    main()
