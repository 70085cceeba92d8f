// Small canvas charts for the dashboard: lines over rounds, a min-median-max band, grouped bars.
// No library: everything is drawn with the 2D context. Each chart sets data-points on its canvas to the number
// of data points it drew (0: "no data yet"), which tests and curious operators can read.
"use strict";

const PflCharts = (() => {
  const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
    "#4b5563", "#65a30d"];
  const PAD = { left: 52, right: 12, top: 10, bottom: 36 };
  const INK = "#6b7280";
  const GRID = "#e5e7eb";

  // The canvas sized to its box in device pixels; returns the context (in CSS pixels) and the plot's size.
  function setup(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(200, canvas.clientWidth);
    const h = Math.max(120, canvas.clientHeight);
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h, pw: w - PAD.left - PAD.right, ph: h - PAD.top - PAD.bottom };
  }

  function empty(canvas, g, text) {
    g.ctx.fillStyle = INK;
    g.ctx.textAlign = "center";
    g.ctx.fillText(text || "no data yet", g.w / 2, g.h / 2);
    canvas.dataset.points = "0";
  }

  // "Nice" tick values covering [lo, hi].
  function ticks(lo, hi, n) {
    if (hi <= lo) hi = lo + 1;
    const raw = (hi - lo) / n;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toFixed(10));
    return out;
  }

  function axes(g, x0, x1, y0, y1, fmtY, xTicks, xLabel) {
    const { ctx, pw, ph } = g;
    const X = (x) => PAD.left + (x1 === x0 ? pw / 2 : ((x - x0) / (x1 - x0)) * pw);
    const Y = (y) => PAD.top + ph - ((y - y0) / (y1 - y0 || 1)) * ph;
    ctx.strokeStyle = GRID;
    ctx.fillStyle = INK;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const v of ticks(y0, y1, 4)) {
      ctx.beginPath();
      ctx.moveTo(PAD.left, Math.round(Y(v)) + 0.5);
      ctx.lineTo(PAD.left + pw, Math.round(Y(v)) + 0.5);
      ctx.stroke();
      ctx.fillText(fmtY(v), PAD.left - 6, Y(v));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const v of xTicks) ctx.fillText(String(v), X(v), PAD.top + ph + 6);
    if (xLabel) {
      ctx.textAlign = "right";
      ctx.fillText(xLabel, PAD.left + pw, PAD.top + ph + 21);
    }
    return { X, Y };
  }

  function roundTicks(x0, x1) {
    return ticks(x0, x1, Math.min(8, Math.max(1, x1 - x0))).filter((v) => Number.isInteger(v));
  }

  // series: [{name, color, points: [[round, value], ...]}]; opts: {yMin, yMax, fmtY}
  function lines(canvas, series, opts) {
    const g = setup(canvas);
    const pts = series.flatMap((s) => s.points);
    if (!pts.length) return empty(canvas, g);
    const xs = pts.map((p) => p[0]);
    const ys = pts.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    const y0 = opts.yMin !== undefined ? opts.yMin : Math.min(...ys);
    const y1 = opts.yMax !== undefined ? opts.yMax : Math.max(...ys);
    const { X, Y } = axes(g, x0, x1, y0, y1, opts.fmtY, roundTicks(x0, x1), "round");
    const ctx = g.ctx;
    series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      ctx.strokeStyle = color;
      ctx.fillStyle = color;
      ctx.lineWidth = s.width || 2;
      ctx.setLineDash(s.dash || []);
      ctx.beginPath();
      s.points.forEach(([x, y], j) => (j ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
      ctx.stroke();
      ctx.setLineDash([]);
      if (!s.noDots) for (const [x, y] of s.points) { ctx.beginPath(); ctx.arc(X(x), Y(y), 2.5, 0, 2 * Math.PI); ctx.fill(); }
    });
    canvas.dataset.points = String(pts.length);
  }

  // rows: [{round, min, median, max, mean}] -> a shaded band from min to max, the median solid, the mean dashed.
  function band(canvas, rows, opts) {
    const g = setup(canvas);
    if (!rows.length) return empty(canvas, g);
    const x0 = rows[0].round, x1 = rows[rows.length - 1].round;
    const { X, Y } = axes(g, x0, x1, opts.yMin, opts.yMax, opts.fmtY, roundTicks(x0, x1), "round");
    const ctx = g.ctx;
    ctx.fillStyle = "rgba(37, 99, 235, 0.15)";
    ctx.beginPath();
    rows.forEach((r, j) => (j ? ctx.lineTo(X(r.round), Y(r.max)) : ctx.moveTo(X(r.round), Y(r.max))));
    for (let j = rows.length - 1; j >= 0; j--) ctx.lineTo(X(rows[j].round), Y(rows[j].min));
    ctx.closePath();
    ctx.fill();
    for (const r of rows) { // whiskers: each round's min..max
      ctx.strokeStyle = "rgba(37, 99, 235, 0.5)";
      ctx.lineWidth = 1;
      ctx.beginPath();
      ctx.moveTo(X(r.round), Y(r.min));
      ctx.lineTo(X(r.round), Y(r.max));
      ctx.stroke();
    }
    lineOver(ctx, rows.map((r) => [X(r.round), Y(r.median)]), "#1d4ed8", []);
    lineOver(ctx, rows.map((r) => [X(r.round), Y(r.mean)]), "#111827", [4, 3]);
    canvas.dataset.points = String(rows.length);
  }

  function lineOver(ctx, pts, color, dash) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.setLineDash(dash);
    ctx.beginPath();
    pts.forEach(([x, y], j) => (j ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
    ctx.stroke();
    ctx.setLineDash([]);
  }

  // labels: category names; groups: [{name, color, values (one per label)}]; opts: {fmtY, yMax}
  function bars(canvas, labels, groups, opts) {
    const g = setup(canvas);
    const vals = groups.flatMap((s) => s.values);
    if (!labels.length || !vals.length) return empty(canvas, g);
    const y1 = opts.yMax !== undefined ? opts.yMax : Math.max(1, ...vals);
    const { ctx, pw, ph } = g;
    const Y = (y) => PAD.top + ph - (y / y1) * ph;
    axes(g, 0, 1, 0, y1, opts.fmtY, [], opts.xLabel);
    const slot = pw / labels.length;
    const bw = Math.max(2, Math.min(28, (slot * 0.8) / groups.length));
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const every = Math.ceil(labels.length / Math.max(1, Math.floor(pw / 44)));
    labels.forEach((lab, i) => {
      const cx = PAD.left + slot * (i + 0.5);
      groups.forEach((s, k) => {
        const v = s.values[i] || 0;
        ctx.fillStyle = s.color || PALETTE[k % PALETTE.length];
        const x = cx - (bw * groups.length) / 2 + k * bw;
        ctx.fillRect(x, Y(v), bw - 1, PAD.top + ph - Y(v));
      });
      ctx.fillStyle = INK;
      if (i % every === 0) ctx.fillText(String(lab).slice(0, 12), cx, PAD.top + ph + 6);
    });
    canvas.dataset.points = String(vals.length);
  }

  return { PALETTE, lines, band, bars };
})();
