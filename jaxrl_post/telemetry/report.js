// Draws the run report's plots as inline SVG from the JSON in #report-data.
// No libraries, nothing fetched. Every plot element gets data-points = the number of data
// points it drew (0: nothing to draw), which the browser test reads.
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var W = 560, H = 230, L = 62, R = 12, T = 10, B = 30;
  var COLORS = ["#2f6fdd", "#e0662f", "#2e9e5b", "#a245c4", "#c9a227", "#1fa3b3", "#d63a6a",
                "#6b7484", "#7a5c2e", "#4b4fc4"];
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var tip = document.getElementById("tip");
  function onsetsOf(names) {  // The steps where the alarms a plot is about fired.
    return (data.fired || []).filter(function (f) {
      return (names || []).indexOf(f.alarm) >= 0;
    }).map(function (f) { return f.step; });
  }

  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function text(parent, x, y, s, attrs) {
    var t = el("text", Object.assign({x: x, y: y, "font-size": 11, fill: "#4a5263"}, attrs || {}),
               parent);
    t.textContent = s;
    return t;
  }
  function fmt(v, bytes) {
    if (bytes) {
      var units = ["B", "KB", "MB", "GB", "TB"], i = 0;
      while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
      return (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3)) + " " + units[i];
    }
    var a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e6 || a < 1e-3) return v.toExponential(2);
    if (a >= 1000) return (v / 1000).toPrecision(3) + "k";
    return +v.toPrecision(3) + "";
  }
  function tickLabel(v, step, bytes) {
    // Enough decimals to tell neighbouring ticks apart (4.705, 4.710, ...).
    if (bytes || Math.abs(v) >= 1000 || Math.abs(step) < 1e-4) return fmt(v, bytes);
    var decimals = Math.max(0, Math.ceil(-Math.log10(step) - 1e-9));
    return v.toFixed(Math.min(decimals, 6));
  }
  function ticks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; }
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    var err = (hi - lo) / n / step;
    step *= err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1;
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
    return out;
  }
  function extent(values, pad) {
    var lo = Infinity, hi = -Infinity;
    values.forEach(function (v) { if (v < lo) lo = v; if (v > hi) hi = v; });
    if (lo === Infinity) return [0, 1];
    if (lo === hi) { var d = Math.abs(lo) * 0.1 || 1; return [lo - d, hi + d]; }
    var p = (hi - lo) * (pad || 0);
    return [lo - p, hi + p];
  }
  function frame(div) {
    var svg = el("svg", {viewBox: "0 0 " + W + " " + H, role: "img"});
    div.appendChild(svg);
    return svg;
  }
  function axes(svg, xs, ys, bytes) {
    var x = function (v) { return L + (v - xs[0]) / (xs[1] - xs[0] || 1) * (W - L - R); };
    var y = function (v) { return H - B - (v - ys[0]) / (ys[1] - ys[0] || 1) * (H - T - B); };
    var yt = ticks(ys[0], ys[1], 5);
    yt.forEach(function (v) {
      el("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#eceff3"}, svg);
      text(svg, L - 6, y(v) + 4, tickLabel(v, yt.length > 1 ? yt[1] - yt[0] : 1, bytes),
           {"text-anchor": "end"});
    });
    ticks(xs[0], xs[1], 6).forEach(function (v) {
      if (v !== Math.round(v)) return;
      el("line", {x1: x(v), x2: x(v), y1: H - B, y2: H - B + 4, stroke: "#9aa3b2"}, svg);
      text(svg, x(v), H - B + 16, fmt(v), {"text-anchor": "middle"});
    });
    el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#9aa3b2"}, svg);
    text(svg, W - R, H - 2, "step", {"text-anchor": "end"});
    return {x: x, y: y};
  }
  function markOnsets(svg, s, xs, plot) {
    onsetsOf(plot.alarms).forEach(function (step) {
      if (step < xs[0] || step > xs[1]) return;
      el("line", {x1: s.x(step), x2: s.x(step), y1: T, y2: H - B, stroke: "#d63a3a",
                  "stroke-dasharray": "3 3", "stroke-width": 1, class: "alarm-onset"}, svg);
    });
  }
  function legend(div, names) {
    var box = document.createElement("div");
    box.className = "legend";
    names.forEach(function (name, i) {
      var span = document.createElement("span");
      var sw = document.createElement("i");
      sw.style.background = COLORS[i % COLORS.length];
      span.appendChild(sw);
      span.appendChild(document.createTextNode(name));
      box.appendChild(span);
    });
    div.appendChild(box);
  }
  function note(div, s) {
    var p = document.createElement("div");
    p.className = "note";
    p.textContent = s;
    div.appendChild(p);
  }
  function hover(svg, div, s, xs, rows) {
    // rows: function(step) -> list of "name value" lines for the nearest step.
    svg.addEventListener("mousemove", function (ev) {
      var box = svg.getBoundingClientRect();
      var px = (ev.clientX - box.left) / box.width * W;
      var step = xs[0] + (px - L) / (W - L - R) * (xs[1] - xs[0]);
      var lines = rows(step);
      if (!lines.length) { tip.style.display = "none"; return; }
      tip.innerHTML = "";
      lines.forEach(function (line) {
        var d = document.createElement("div");
        d.textContent = line;
        tip.appendChild(d);
      });
      tip.style.left = (ev.clientX + 12) + "px";
      tip.style.top = (ev.clientY + 12) + "px";
      tip.style.display = "block";
    });
    svg.addEventListener("mouseleave", function () { tip.style.display = "none"; });
  }
  function nearest(points, step) {
    var best = null, dist = Infinity;
    points.forEach(function (p) {
      var d = Math.abs(p[0] - step);
      if (d < dist) { dist = d; best = p; }
    });
    return best;
  }

  function drawLines(div, plot) {
    var series = plot.series || [];
    var all = [];
    series.forEach(function (s) { all = all.concat(s.points); });
    if (!all.length) { note(div, "nothing logged yet"); return 0; }
    var svg = frame(div);
    var xs = extent(all.map(function (p) { return p[0]; }));
    if (xs[1] - xs[0] < 1) xs = [xs[0], xs[0] + 1];
    var ys = extent(all.map(function (p) { return p[1]; }), 0.05);
    var nonneg = all.every(function (p) { return p[1] >= 0; });
    if (nonneg && (plot.bytes || ys[0] < (ys[1] - ys[0]))) ys[0] = 0;  // Start at 0.
    var s = axes(svg, xs, ys, plot.bytes);
    markOnsets(svg, s, xs, plot);
    var drawn = 0, downsampled = [];
    series.forEach(function (ser, i) {
      var color = COLORS[i % COLORS.length];
      var d = ser.points.map(function (p, j) {
        return (j ? "L" : "M") + s.x(p[0]).toFixed(1) + " " + s.y(p[1]).toFixed(1);
      }).join("");
      el("path", {d: d, fill: "none", stroke: color, "stroke-width": 1.6,
                  "stroke-linejoin": "round", class: "series"}, svg);
      if (ser.points.length <= 60) {
        ser.points.forEach(function (p) {
          el("circle", {cx: s.x(p[0]), cy: s.y(p[1]), r: 2.4, fill: color}, svg);
        });
      }
      drawn += ser.points.length;
      if (ser.of > ser.points.length) {
        downsampled.push(ser.name + ": " + ser.of + " steps as " + ser.points.length +
                         " min/max points");
      }
    });
    hover(svg, div, s, xs, function (step) {
      var out = [];
      series.forEach(function (ser) {
        var p = nearest(ser.points, step);
        if (p) out.push(ser.name + " @" + p[0] + ": " + fmt(p[1], plot.bytes));
      });
      return out;
    });
    legend(div, series.map(function (ser) { return ser.name; }));
    if (downsampled.length) note(div, "downsampled (bucket min and max): " + downsampled.join("; "));
    return drawn;
  }

  function drawStacked(div, plot) {
    var st = plot.stack, names = Object.keys(st.values);
    if (!st.steps.length || !names.length) { note(div, "nothing logged yet"); return 0; }
    var svg = frame(div);
    var n = st.steps.length, tops = new Array(n).fill(0), layers = [];
    names.forEach(function (name) {
      var base = tops.slice();
      for (var j = 0; j < n; j++) tops[j] += st.values[name][j];
      layers.push({base: base, top: tops.slice()});
    });
    var xs = extent(st.steps);
    if (xs[1] - xs[0] < 1) xs = [xs[0] - 0.5, xs[0] + 0.5];
    // A first step that compiles everything can take 30x a later one: the scale follows the
    // typical steps, and steps above it are drawn clipped and listed under the plot.
    var sorted = tops.slice().sort(function (a, b) { return a - b; });
    var typical = sorted[Math.floor(0.98 * (sorted.length - 1))];
    var top = sorted[sorted.length - 1];
    var clipped = top > 3 * typical && sorted.length >= 10;
    var ymax = clipped ? typical * 1.6 : top * 1.05;
    var s = axes(svg, xs, [0, ymax]);
    var clamp = function (v) { return Math.min(v, ymax); };
    markOnsets(svg, s, xs, plot);
    layers.forEach(function (layer, i) {
      var up = st.steps.map(function (step, j) {
        return (j ? "L" : "M") + s.x(step).toFixed(1) + " " + s.y(clamp(layer.top[j])).toFixed(1);
      }).join("");
      var down = st.steps.map(function (step, j) { return j; }).reverse().map(function (j) {
        return "L" + s.x(st.steps[j]).toFixed(1) + " " + s.y(clamp(layer.base[j])).toFixed(1);
      }).join("");
      var color = COLORS[i % COLORS.length];
      if (n === 1) {  // One step: a bar.
        el("rect", {x: s.x(st.steps[0]) - 20, width: 40, y: s.y(layer.top[0]),
                    height: Math.max(0, s.y(layer.base[0]) - s.y(layer.top[0])), fill: color},
           svg);
      } else {
        el("path", {d: up + down + "Z", fill: color, "fill-opacity": 0.85, stroke: "none",
                    class: "series"}, svg);
      }
    });
    hover(svg, div, s, xs, function (step) {
      var j = 0, dist = Infinity;
      st.steps.forEach(function (x, k) { if (Math.abs(x - step) < dist) { dist = Math.abs(x - step); j = k; } });
      var out = ["step " + fmt(st.steps[j]) + ": " + fmt(tops[j]) + " s"];
      names.forEach(function (name, i) {
        out.push((plot.labels[i] || name) + ": " + fmt(st.values[name][j]) + " s");
      });
      return out;
    });
    legend(div, plot.labels);
    if (st.of > n) note(div, st.of + " steps as " + n + " bucket means");
    if (clipped) {
      var over = [];
      st.steps.forEach(function (step, j) {
        if (tops[j] > ymax) over.push("step " + fmt(step) + ": " + fmt(tops[j]) + " s");
      });
      note(div, "off the scale (clipped): " + over.slice(0, 8).join(", ") +
           (over.length > 8 ? " and " + (over.length - 8) + " more" : ""));
    }
    return n * names.length;
  }

  function drawBars(div, plot) {
    var h = plot.hist, bars = h.bars || [];
    if (!bars.length) { note(div, "no ratio histogram logged yet"); return 0; }
    var svg = frame(div);
    var bins = h.bins, width = (h.hi - h.lo) / bins;
    var fractions = bars.map(function (b) {
      var total = b.values.reduce(function (a, v) { return a + v; }, 0) || 1;
      return b.values.map(function (v) { return v / total; });
    });
    var top = 0;
    fractions.forEach(function (f) { f.forEach(function (v) { if (v > top) top = v; }); });
    var s = axes(svg, [0, bins], [0, top * 1.08 || 1]);
    svg.querySelectorAll("text").forEach(function (t) {  // Bin edges, not step numbers.
      if (t.getAttribute("y") == H - B + 16 || t.textContent === "step") t.remove();
    });
    for (var k = 0; k <= bins; k += 2) {
      var edge = h.lo + k * width;
      text(svg, s.x(k), H - B + 16, (k === 0 ? "<" : k === bins ? ">" : "") + edge.toFixed(2),
           {"text-anchor": "middle"});
    }
    text(svg, W - R, H - 2, "ratio", {"text-anchor": "end"});
    var drawn = 0, group = bars.length;
    fractions.forEach(function (f, i) {
      f.forEach(function (v, k) {
        var x0 = s.x(k) + 1 + i * (s.x(1) - s.x(0) - 2) / group;
        el("rect", {x: x0, width: Math.max(1, (s.x(1) - s.x(0) - 2) / group), y: s.y(v),
                    height: Math.max(0, s.y(0) - s.y(v)), fill: COLORS[i % COLORS.length],
                    class: "bar"}, svg);
        drawn++;
      });
    });
    el("line", {x1: s.x((1 - h.lo) / width), x2: s.x((1 - h.lo) / width), y1: T, y2: H - B,
                stroke: "#1d2330", "stroke-dasharray": "2 3"}, svg);
    legend(div, bars.map(function (b) { return b.name + " (fraction of tokens)"; }));
    note(div, "outer bins also count every ratio beyond them; dashed: ratio 1");
    return drawn;
  }

  function drawAlarms(div, plot) {
    var tl = plot.timeline;
    if (!tl.judged) { note(div, "no alarm metrics logged yet"); return 0; }
    var rowH = 22, top = 8, h = top + tl.alarms.length * rowH + 36;
    var svg = el("svg", {viewBox: "0 0 " + W + " " + h, role: "img"});
    div.appendChild(svg);
    var xs = tl.steps[1] > tl.steps[0] ? tl.steps : [tl.steps[0] - 0.5, tl.steps[0] + 0.5];
    var L2 = 130;
    var x = function (v) { return L2 + (v - xs[0]) / (xs[1] - xs[0]) * (W - L2 - R); };
    tl.alarms.forEach(function (a, i) {
      var y = top + i * rowH;
      el("rect", {x: L2, y: y + 3, width: W - L2 - R, height: rowH - 6, fill: "#eef6ef"}, svg);
      text(svg, L2 - 6, y + rowH / 2 + 4, a.name, {"text-anchor": "end"});
      a.episodes.forEach(function (e) {
        var x0 = x(e[0] - 0.5 < xs[0] ? xs[0] : e[0] - 0.5);
        var x1 = x(e[1] + 0.5 > xs[1] ? xs[1] : e[1] + 0.5);
        el("rect", {x: x0, y: y + 3, width: Math.max(2, x1 - x0), height: rowH - 6,
                    fill: "#d63a3a", class: "episode"}, svg);
      });
    });
    var axisY = top + tl.alarms.length * rowH + 4;
    el("line", {x1: L2, x2: W - R, y1: axisY, y2: axisY, stroke: "#9aa3b2"}, svg);
    ticks(xs[0], xs[1], 6).forEach(function (v) {
      if (v !== Math.round(v)) return;
      text(svg, x(v), axisY + 14, fmt(v), {"text-anchor": "middle"});
    });
    text(svg, W - R, axisY + 26, "step", {"text-anchor": "end"});
    var fired = data.fired || [];
    note(div, fired.length ? fired.length + " alarm(s) fired (red: while the condition held; " +
         "dashed red lines on the other plots: onsets)" :
         "no alarm fired in the " + tl.judged + " steps judged (green: clear)");
    if (fired.length) {  // One row per alarm: how often, and the steps where it fired.
      var table = document.createElement("table");
      table.className = "fired";
      table.innerHTML = "<tr><th>alarm</th><th>fired</th><th>at steps</th></tr>";
      tl.alarms.forEach(function (a) {
        var steps = fired.filter(function (f) { return f.alarm === a.name; })
                         .map(function (f) { return f.step; });
        if (!steps.length) return;
        var tr = document.createElement("tr");
        [a.name, steps.length + "x", steps.join(", ")].forEach(function (v) {
          var td = document.createElement("td");
          td.textContent = v;
          tr.appendChild(td);
        });
        table.appendChild(tr);
      });
      div.appendChild(table);
    }
    return tl.judged;
  }

  var DRAW = {lines: drawLines, stacked: drawStacked, bars: drawBars, alarms: drawAlarms};
  data.plots.forEach(function (plot) {
    var div = document.getElementById("plot-" + plot.id);
    try {
      div.setAttribute("data-points", String(DRAW[plot.kind](div, plot)));
    } catch (e) {
      div.setAttribute("data-points", "0");
      note(div, "could not draw: " + e);
      console.error("plot " + plot.id + ": " + e);
    }
  });
  document.body.setAttribute("data-rendered", "true");
})();
