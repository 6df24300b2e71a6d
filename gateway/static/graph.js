// The workflow graph as SVG: columns by dependency depth, nodes coloured by
// state through CSS classes (no inline styles: the CSP forbids them).

const SVG = "http://www.w3.org/2000/svg";
const W = 200, H = 52, GX = 60, GY = 22, PAD = 16;

function el(name, attrs, text) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function levels(nodes) {
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const depth = new Map();
  const visit = (id, seen) => {
    if (depth.has(id)) return depth.get(id);
    if (seen.has(id)) return 0;
    seen.add(id);
    const n = byId.get(id);
    const d = n && n.needs.length ? 1 + Math.max(...n.needs.filter((x) => byId.has(x)).map((x) => visit(x, seen)), -1) : 0;
    depth.set(id, d);
    return d;
  };
  nodes.forEach((n) => visit(n.id, new Set()));
  return depth;
}

export function elapsed(node, now) {
  if (!node.started_at_ms) return "";
  const end = node.finished_at_ms || now;
  const s = Math.max(0, Math.round((end - node.started_at_ms) / 1000));
  return s < 60 ? `${s}s` : `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
}

export function drawGraph(nodes, now) {
  const depth = levels(nodes);
  const cols = new Map();
  for (const n of nodes) {
    const d = depth.get(n.id) || 0;
    if (!cols.has(d)) cols.set(d, []);
    cols.get(d).push(n);
  }
  const pos = new Map();
  let maxRows = 1;
  for (const [d, list] of cols) {
    maxRows = Math.max(maxRows, list.length);
    list.forEach((n, i) => pos.set(n.id, { x: PAD + d * (W + GX), y: PAD + i * (H + GY) }));
  }
  const width = PAD * 2 + Math.max(1, cols.size) * (W + GX) - GX;
  const height = PAD * 2 + maxRows * (H + GY) - GY;
  const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, width, height, class: "graph",
                          role: "img", "aria-label": "workflow graph" });
  const edges = el("g", { class: "edges" });
  for (const n of nodes) {
    for (const need of n.needs) {
      const a = pos.get(need), b = pos.get(n.id);
      if (!a || !b) continue;
      const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x, y2 = b.y + H / 2, mx = (x1 + x2) / 2;
      edges.append(el("path", { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`, class: "edge" }));
    }
  }
  svg.append(edges);
  for (const n of nodes) {
    const p = pos.get(n.id);
    const g = el("g", { class: `node state-${n.state}`, "data-node": n.id, "data-state": n.state,
                        transform: `translate(${p.x},${p.y})` });
    g.append(el("title", {}, `${n.id} (${n.kind}): ${n.state}${n.error ? " — " + n.error : ""}`));
    g.append(el("rect", { width: W, height: H, rx: 8, ry: 8 }));
    g.append(el("text", { x: 10, y: 20, class: "label" }, n.id));
    const t = elapsed(n, now);
    g.append(el("text", { x: 10, y: 40, class: "sub" }, `${n.kind} · ${n.state.replace("_", " ")}${t ? " · " + t : ""}`));
    svg.append(g);
  }
  return svg;
}
