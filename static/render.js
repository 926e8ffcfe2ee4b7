// Markdown to safe DOM. marked renders (raw HTML escaped to text, code highlighted), then
// DOMPurify sanitises the finished HTML string LAST, right before innerHTML. Remote images
// are never loaded: they become links the user may open. Copy buttons are plain DOM nodes.

import { announce } from "./announce.js";

const { marked, DOMPurify, hljs } = window;

const HTML_ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const MAX_AUTO_HIGHLIGHT_CHARS = 20000;
// An answer's headings sit under its "Assistant" <h3>: its "#" is an <h4>, and deeper ones
// stop at <h6>, so the page's outline stays whole.
const HEADING_LEVEL_SHIFT = 3;

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => HTML_ESCAPES[c]);
}

function highlighted(text, lang) {
  if (lang && hljs.getLanguage(lang)) {
    return { html: hljs.highlight(text, { language: lang, ignoreIllegals: true }).value, lang };
  }
  if (text.length <= MAX_AUTO_HIGHLIGHT_CHARS) {
    const auto = hljs.highlightAuto(text);
    return { html: auto.value, lang: lang || auto.language || "" };
  }
  return { html: escapeHtml(text), lang };
}

// One Marked instance of our own so the global defaults stay untouched.
const markdown = new marked.Marked({
  gfm: true,
  breaks: false,
  renderer: {
    // Raw HTML in model output is shown as text, never parsed (markdown-it's html:false).
    html(token) {
      const text = escapeHtml(token.text);
      return token.block ? `<p class="raw-html">${text}</p>\n` : text;
    },
    // A task list's box: <input> is not chat content (the sanitiser drops it), a glyph is.
    checkbox({ checked }) {
      return `<span class="task-box" role="img" aria-label="${checked ? "done" : "not done"}">${checked ? "\u2611" : "\u2610"}</span>`;
    },
    heading({ tokens, depth }) {
      const level = Math.min(depth + HEADING_LEVEL_SHIFT, 6);
      return `<h${level}>${this.parser.parseInline(tokens)}</h${level}>\n`;
    },
    code(token) {
      const lang = ((token.lang || "").trim().split(/\s+/)[0] || "").toLowerCase();
      const safeLang = /^[\w+#.-]{1,32}$/.test(lang) ? lang : "";
      const { html, lang: shown } = highlighted(token.text, safeLang);
      return `<pre data-lang="${escapeHtml(shown)}"><code class="hljs">${html}</code></pre>\n`;
    },
  },
});

// A private DOMPurify instance so our hooks cannot leak into other callers.
const purifier = DOMPurify(window);
const PURIFY_CONFIG = {
  USE_PROFILES: { html: true },
  // Inline styles would only trip the CSP; media, forms and frames are not chat content.
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "option", "audio", "video",
                "source", "track", "picture", "iframe", "object", "embed", "link", "meta", "base"],
  FORBID_ATTR: ["style", "srcset", "action", "formaction", "ping", "background", "poster"],
  ALLOW_DATA_ATTR: false,
  ADD_ATTR: ["data-lang"],
  SANITIZE_NAMED_PROPS: true,
};

export function isInlineImage(src) {
  return /^data:image\/[a-z0-9.+-]+[;,]/i.test(src);
}

purifier.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
  if (node.tagName === "IMG") {
    const src = node.getAttribute("src") || "";
    if (!isInlineImage(src)) {
      // Loading it would tell a third party that (and what) this user read: keep it inert.
      node.removeAttribute("src");
      node.setAttribute("data-blocked-src", src);
    }
  }
});

// Only an absolute http(s) address is offered as a link: an empty or relative src would
// otherwise resolve to this app itself.
function httpUrl(text) {
  try {
    const url = new URL(text);
    return url.protocol === "http:" || url.protocol === "https:" ? url : null;
  } catch {
    return null;
  }
}

function blockedImagePlaceholder(img) {
  const src = img.getAttribute("data-blocked-src") || "";
  const alt = img.getAttribute("alt") || "";
  const url = httpUrl(src);
  if (!url) return document.createTextNode(alt);  // nothing to open: the alt text is all there is
  const label = `Image not loaded${alt ? `: ${alt}` : ""} (${url.host})`;
  const node = document.createElement("a");
  node.className = "blocked-image";
  node.textContent = label;
  node.href = url.href;
  node.target = "_blank";
  node.rel = "noopener noreferrer nofollow";
  node.title = `Open ${url.href} in a new tab`;
  return node;
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

// `ariaLabel`: says what is copied ("Copy message 3") where the same label shows many times.
// The result is shown on the button and said in the status region (a label change is not).
export function copyButton(getText, label = "Copy", ariaLabel = null) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "btn btn-small btn-ghost copy-button";
  button.textContent = label;
  if (ariaLabel) button.setAttribute("aria-label", ariaLabel);
  button.addEventListener("click", async () => {
    let result = "Copied";
    try {
      await copyText(getText());
    } catch {
      result = "Copy failed";
    }
    button.textContent = result;
    announce(result);
    setTimeout(() => { button.textContent = label; }, 1500);
  });
  return button;
}

function decorateCodeBlocks(container) {
  for (const pre of container.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    const head = document.createElement("div");
    head.className = "code-head";
    const lang = document.createElement("span");
    lang.className = "code-lang";
    lang.textContent = pre.getAttribute("data-lang") || "text";
    head.append(lang, copyButton(() => (code || pre).textContent, "Copy code"));
    // The <pre> is what scrolls sideways: the keyboard must reach it to scroll it.
    pre.tabIndex = 0;
    pre.setAttribute("role", "region");
    pre.setAttribute("aria-label", `Code, ${lang.textContent}`);
    const wrap = document.createElement("div");
    wrap.className = "code-block";
    pre.replaceWith(wrap);
    wrap.append(head, pre);
  }
}

// Replaces the container's content with the rendered, sanitised Markdown of `text`.
export function renderMarkdown(container, text) {
  const clean = purifier.sanitize(markdown.parse(text), PURIFY_CONFIG);
  container.innerHTML = clean;
  for (const img of container.querySelectorAll("img[data-blocked-src]")) {
    img.replaceWith(blockedImagePlaceholder(img));
  }
  for (const table of container.querySelectorAll("table")) {
    const scroller = document.createElement("div");
    scroller.className = "table-scroll";
    // A wide table scrolls sideways in it: reachable and named as a code block's <pre> is.
    scroller.tabIndex = 0;
    scroller.setAttribute("role", "region");
    scroller.setAttribute("aria-label", "Table");
    table.replaceWith(scroller);
    scroller.append(table);
  }
  decorateCodeBlocks(container);
}
