// Taking conversations out: the chat header's Download menu (the open conversation as Markdown
// or JSON) and the sidebar's "Export all conversations" (every one as one JSON file). Files come
// from the API (GET .../export) and are saved through a Blob and an <a download> click: a plain
// link would not carry the API key the UI holds.

import { announce } from "./announce.js";
import { api } from "./api.js";

const wrapEl = document.getElementById("download");
const toggleEl = document.getElementById("download-toggle");
const menuEl = document.getElementById("download-menu");
const allEl = document.getElementById("export-all");
const REVOKE_AFTER_MS = 60000;  // the browser reads the Blob after the click returns

// Saves `blob` as `filename` through the browser's own download.
function save({ blob, filename }) {
  const url = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  link.hidden = true;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), REVOKE_AFTER_MS);
}

export class Downloads {
  // conversationId(): the open chat's id (null for a new chat); onError(error): shown to the user.
  constructor({ conversationId, onError }) {
    this.conversationId = conversationId;
    this.onError = onError;
    toggleEl.addEventListener("click", () => (this.isOpen ? this.close() : this.open()));
    for (const item of this.items) {
      item.addEventListener("click", () => this.downloadOpen(item.dataset.format));
    }
    menuEl.addEventListener("keydown", (event) => this.onMenuKey(event));
    wrapEl.addEventListener("focusout", (event) => {
      if (!wrapEl.contains(event.relatedTarget)) this.close(false);  // Tab or a click elsewhere
    });
    allEl.addEventListener("click", () => this.downloadAll());
  }

  get items() { return [...menuEl.querySelectorAll("button")]; }
  get isOpen() { return !menuEl.hidden; }

  // Offered only for a stored conversation (a new chat has nothing to download yet).
  showFor(id) {
    this.close(false);
    wrapEl.hidden = !id;
  }

  open() {
    menuEl.hidden = false;
    toggleEl.setAttribute("aria-expanded", "true");
    this.items[0].focus();
  }

  close(refocus = true) {
    if (!this.isOpen) return;
    menuEl.hidden = true;
    toggleEl.setAttribute("aria-expanded", "false");
    if (refocus) toggleEl.focus();
  }

  // Up and Down move between the formats; Escape closes, back on the Download button.
  onMenuKey(event) {
    const items = this.items;
    const at = items.indexOf(document.activeElement);
    if (event.key === "Escape") {
      event.preventDefault();
      event.stopPropagation();  // not also the phone drawer's Escape
      this.close();
    } else if (event.key === "ArrowDown" || event.key === "ArrowUp") {
      event.preventDefault();
      const step = event.key === "ArrowDown" ? 1 : -1;
      items[(at + step + items.length) % items.length].focus();
    }
  }

  async downloadOpen(format) {
    const id = this.conversationId();
    this.close();
    if (!id) return;
    await this.run(toggleEl, () => api.exportConversation(id, format));
  }

  async downloadAll() {
    await this.run(allEl, () => api.exportAll());
  }

  // One download at a time per button; it stays focusable (a disabled button would drop the
  // keyboard focus to <body>) and says it is busy until the file is saved.
  async run(button, fetchFile) {
    if (button.getAttribute("aria-busy") === "true") return;
    button.setAttribute("aria-busy", "true");
    try {
      const file = await fetchFile();
      save(file);
      announce(`Downloaded ${file.filename}`);
    } catch (error) {
      this.onError(error);
    } finally {
      button.removeAttribute("aria-busy");
    }
  }
}
