// Attachments of the next message: the attach button, drag-and-drop, thumbnails, uploads to
// /v1/files with progress, size errors before any byte is sent, and the parts the message
// then carries. Also draws a stored message's attachments (thumbnails, file names).

import { getKey } from "./api.js";

const IMAGE_TYPES = ["image/png", "image/jpeg", "image/gif", "image/webp"];
const DEFAULT_MAX_FILE_BYTES = 20 * 1024 * 1024;
const MAX_ATTACHMENTS = 8;
// What the server reads (README, "Files and images"): images, PDFs and text files. Other
// files still upload (a text file may lack a known type) but are flagged before sending.
const TEXT_TYPES = ["application/json", "application/xml", "application/javascript", "application/x-yaml",
                    "application/x-sh", "application/toml", "application/x-python", "application/sql"];
const TEXT_EXTENSIONS = /\.(txt|md|markdown|csv|tsv|json|jsonl|xml|ya?ml|toml|ini|cfg|log|html?|css|js|mjs|ts|tsx|jsx|py|rb|go|rs|java|kt|c|h|cc|cpp|hpp|cs|php|sh|bash|sql|r|swift|tex|rst|org|srt|vtt)$/i;

function authHeaders() {
  const key = getKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

export function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KB`;
  return `${(n / 1024 / 1024).toFixed(1)} MB`;
}

// data: URLs only (the page's CSP allows data: images, not blob:).
function readAsDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

// POST /v1/files with upload progress (fetch has none); resolves with the File object.
function uploadFile(file, purpose, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/v1/files");
    for (const [name, value] of Object.entries(authHeaders())) xhr.setRequestHeader(name, value);
    xhr.upload.onprogress = (event) => { if (event.lengthComputable) onProgress(event.loaded / event.total); };
    xhr.onload = () => {
      let body = null;
      try { body = JSON.parse(xhr.responseText); } catch { /* not JSON */ }
      if (xhr.status === 200 && body) resolve(body);
      else reject(new Error((body && body.error && body.error.message) || `Upload failed (HTTP ${xhr.status}).`));
    };
    xhr.onerror = () => reject(new Error("Upload failed: the network is unreachable."));
    const form = new FormData();
    form.append("purpose", purpose);
    form.append("file", file, file.name);
    xhr.send(form);
  });
}

// One attachment's chip: its name and a detail line (a size, a state); share.js names a
// shared message's attachments with it too.
export function chipElement(name, detail) {
  const chip = document.createElement("div");
  chip.className = "attachment";
  const label = document.createElement("span");
  label.className = "attachment-name";
  label.textContent = name;
  label.title = name;
  const info = document.createElement("span");
  info.className = "attachment-detail small muted";
  info.textContent = detail;
  chip.append(label, info);
  return chip;
}

function thumbnail(src, alt) {
  const img = document.createElement("img");
  img.className = "attachment-thumb";
  img.alt = alt;
  img.src = src;
  return img;
}

function isReadable(file) {
  return IMAGE_TYPES.includes(file.type) || file.type === "application/pdf" || /\.pdf$/i.test(file.name)
    || file.type.startsWith("text/") || TEXT_TYPES.includes(file.type) || TEXT_EXTENSIONS.test(file.name);
}

// Whether a /v1/models entry takes images: `vision` or `input_modalities` where the server
// says; null (unknown, no warning) where it does not.
function takesImages(model) {
  if (!model) return null;
  if (typeof model.vision === "boolean") return model.vision;
  if (Array.isArray(model.input_modalities)) return model.input_modalities.includes("image");
  return null;
}

// Why the server will likely refuse `file` for `model`, or null.
function warningFor(file, isImage, model) {
  if (isImage && takesImages(model) === false) return `${model.id} cannot read images: pick a vision model.`;
  if (!isReadable(file)) return "Not a file type the server reads (text, PDF or image).";
  return null;
}

export class Attachments {
  // elements: {button, input, list, dropZone}; onChange() after any change (to update Send);
  // modelOf(): the selected model's /v1/models entry (to warn about images it cannot read).
  constructor({ button, input, list, dropZone, onChange, modelOf }) {
    this.button = button;
    this.input = input;
    this.list = list;
    this.items = [];  // {file, isImage, progress, fileId, error, chip}
    this.taken = [];  // the items of the last message sent, for restore() if it is refused
    this.maxFileBytes = DEFAULT_MAX_FILE_BYTES;
    this.onChange = onChange || (() => {});
    this.modelOf = modelOf || (() => null);
    button.addEventListener("click", () => input.click());
    input.addEventListener("change", () => { this.add([...input.files]); input.value = ""; });
    dropZone.addEventListener("dragover", (event) => {
      if (!event.dataTransfer || ![...event.dataTransfer.types].includes("Files")) return;
      event.preventDefault();
      dropZone.classList.add("dropping");
    });
    dropZone.addEventListener("dragleave", () => dropZone.classList.remove("dropping"));
    dropZone.addEventListener("drop", (event) => {
      dropZone.classList.remove("dropping");
      if (!event.dataTransfer || !event.dataTransfer.files.length) return;
      event.preventDefault();
      this.add([...event.dataTransfer.files]);
    });
  }

  // The server's per-upload limit, read from the file list's X-Max-File-Bytes header.
  async loadLimits() {
    try {
      const response = await fetch("/v1/files?limit=1", { headers: authHeaders(), cache: "no-store" });
      const limit = Number(response.headers.get("X-Max-File-Bytes"));
      if (limit > 0) this.maxFileBytes = limit;
    } catch { /* keep the default */ }
  }

  add(files) {
    for (const file of files) {
      if (this.items.length >= MAX_ATTACHMENTS) break;
      const item = { file, isImage: IMAGE_TYPES.includes(file.type), progress: 0, fileId: null, error: null };
      item.chip = chipElement(file.name, formatBytes(file.size));
      this.items.push(item);
      this.list.append(item.chip);
      this.#decorate(item);
      const warning = warningFor(file, item.isImage, this.modelOf());
      if (warning) this.#warn(item, warning);
      if (file.size > this.maxFileBytes) {
        this.#fail(item, `Too large: ${formatBytes(file.size)}; the limit is ${formatBytes(this.maxFileBytes)}.`);
      } else {
        this.#upload(item);
      }
    }
    this.list.hidden = this.items.length === 0;
    this.onChange();
  }

  async #decorate(item) {
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "btn btn-icon attachment-remove";
    remove.setAttribute("aria-label", `Remove ${item.file.name}`);
    remove.textContent = "\u00d7";
    remove.addEventListener("click", () => this.#remove(item));
    const bar = document.createElement("progress");
    bar.className = "attachment-progress";
    bar.max = 1;
    bar.value = 0;
    item.bar = bar;
    item.chip.append(bar, remove);
    if (item.isImage) item.chip.prepend(thumbnail(await readAsDataUrl(item.file), item.file.name));
  }

  async #upload(item) {
    try {
      const purpose = item.isImage ? "vision" : "user_data";
      const stored = await uploadFile(item.file, purpose, (p) => { item.progress = p; item.bar.value = p; });
      item.fileId = stored.id;
      item.bar.value = 1;
      item.chip.classList.add("uploaded");
      item.chip.dataset.fileId = stored.id;
    } catch (error) {
      this.#fail(item, error.message);
    }
    this.onChange();
  }

  #warn(item, message) {
    item.warning = message;
    item.chip.classList.add("attachment-warn");
    item.chip.querySelector(".attachment-detail").textContent = message;
    item.chip.setAttribute("role", "alert");
  }

  #fail(item, message) {
    item.error = message;
    item.chip.classList.add("attachment-error");
    item.chip.querySelector(".attachment-detail").textContent = message;
    item.chip.setAttribute("role", "alert");
  }

  // Its × button goes with it: the keyboard moves to the chip that took its place, else the
  // one before, else the Attach button (never <body>).
  #remove(item) {
    const position = this.items.indexOf(item);
    const hadFocus = item.chip.contains(document.activeElement);
    this.items = this.items.filter((other) => other !== item);
    item.chip.remove();
    this.list.hidden = this.items.length === 0;
    if (hadFocus) {
      const near = this.items[Math.min(position, this.items.length - 1)];
      (near ? near.chip.querySelector(".attachment-remove") : this.button).focus();
    }
    this.onChange();
  }

  get isUploading() { return this.items.some((i) => !i.fileId && !i.error); }

  get hasReady() { return this.items.some((i) => i.fileId); }

  // The message content: `text` alone, or text + the uploaded attachments as parts. Clears the list.
  take(text) {
    const ready = this.items.filter((i) => i.fileId);
    this.taken = ready;
    this.clear();
    if (!ready.length) return text;
    const parts = text ? [{ type: "text", text }] : [];
    for (const item of ready) {
      parts.push(item.isImage
        ? { type: "image_url", image_url: { file_id: item.fileId } }
        : { type: "file", file: { file_id: item.fileId } });
    }
    return parts;
  }

  clear() {
    this.items = [];
    this.list.replaceChildren();
    this.list.hidden = true;
    this.onChange();
  }

  // Puts back the chips of the last message sent whose files `content` still names (a send
  // that was refused or stopped before it left), unless they are already shown.
  restore(content) {
    if (!Array.isArray(content)) return;
    const ids = new Set(content.map((p) => (p.image_url || p.file || {}).file_id).filter(Boolean));
    const back = this.taken.filter((i) => ids.has(i.fileId) && !this.items.includes(i));
    for (const item of back) {
      this.items.push(item);
      this.list.append(item.chip);
    }
    this.list.hidden = this.items.length === 0;
    this.onChange();
  }
}

// The text of a message's content (a string, or text parts joined).
export function textOf(content) {
  if (typeof content === "string") return content;
  return content.filter((p) => p.type === "text").map((p) => p.text).join("");
}

async function fileInfo(fileId) {
  const response = await fetch(`/v1/files/${encodeURIComponent(fileId)}`, { headers: authHeaders(), cache: "no-store" });
  if (!response.ok) throw new Error("gone");
  return response.json();
}

async function fileDataUrl(fileId) {
  const response = await fetch(`/v1/files/${encodeURIComponent(fileId)}/content`, { headers: authHeaders() });
  if (!response.ok) throw new Error("gone");
  return readAsDataUrl(await response.blob());
}

// The attachments of a stored or sent message (its non-text parts), filled in as they load.
export function attachmentsElement(parts) {
  const row = document.createElement("div");
  row.className = "msg-attachments";
  for (const part of parts) {
    if (part.type === "image_url") {
      const ref = part.image_url || {};
      const chip = chipElement("Image", "");
      chip.classList.add("attachment-image");
      row.append(chip);
      if (ref.url && ref.url.startsWith("data:image/")) chip.prepend(thumbnail(ref.url, "Attached image"));
      else if (ref.file_id) {
        chip.dataset.fileId = ref.file_id;
        fileDataUrl(ref.file_id).then((src) => chip.prepend(thumbnail(src, "Attached image")))
          .catch(() => { chip.querySelector(".attachment-detail").textContent = "no longer available"; });
      }
    } else if (part.type === "file" && part.file && part.file.file_id) {
      const chip = chipElement(part.file.file_id, "");
      chip.dataset.fileId = part.file.file_id;
      row.append(chip);
      fileInfo(part.file.file_id).then((info) => {
        chip.querySelector(".attachment-name").textContent = info.filename;
        chip.querySelector(".attachment-detail").textContent = formatBytes(info.bytes);
      }).catch(() => { chip.querySelector(".attachment-detail").textContent = "no longer available"; });
    } else if (part.type === "file" && part.file && typeof part.file.file_data === "string") {
      // Sent inline by an API client (file_data, a document block): its size from the base64 text.
      const data = part.file.file_data;
      const base64 = data.slice(data.indexOf(",") + 1);
      row.append(chipElement(part.file.filename || "document", `${formatBytes(Math.floor(base64.length * 3 / 4))}, sent inline`));
    }
  }
  return row;
}
