// Small line icons drawn as inline SVG (stroke in the text colour), so that they look the same
// on every system: emoji glyphs show as empty boxes where no emoji font is installed.

const SVG_NS = "http://www.w3.org/2000/svg";
const THUMB = "M7 10v10H4V10h3zM7 10l4-7c1.5 0 2.5 1 2.2 2.6L12.6 9H19a2 2 0 0 1 2 2.3l-1.2 7A2 2 0 0 1 17.8 20H7";
const PATHS = {
  "thumb-up": { d: THUMB },
  "thumb-down": { d: THUMB, transform: "rotate(180 12 12)" },
  paperclip: { d: "M20 11.5l-8 8a5 5 0 0 1-7-7l8.5-8.5a3.5 3.5 0 0 1 5 5L10 17.5a2 2 0 0 1-3-3L14.5 7" },
};

// name: a key of PATHS -> an <svg> element, hidden from screen readers (label the button).
export function icon(name) {
  const { d, transform } = PATHS[name];
  const svg = document.createElementNS(SVG_NS, "svg");
  for (const [key, value] of Object.entries({
    viewBox: "0 0 24 24", width: "16", height: "16", fill: "none", stroke: "currentColor",
    "stroke-width": "2", "stroke-linecap": "round", "stroke-linejoin": "round", "aria-hidden": "true",
    class: "icon",
  })) {
    svg.setAttribute(key, value);
  }
  const path = document.createElementNS(SVG_NS, "path");
  path.setAttribute("d", d);
  if (transform) path.setAttribute("transform", transform);
  svg.append(path);
  return svg;
}
