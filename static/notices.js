// What the user is told when something goes wrong: the error banner (with a Retry button
// and a Retry-After countdown), the offline notice, and the API-key dialog a 401 opens.
// Error texts are built here from the server's OpenAI-style error fields.

import { clearKey, getKey, setKey } from "./api.js";
import { keepingBottom } from "./view.js";

const $ = (id) => document.getElementById(id);
const el = {
  banner: $("banner"), text: $("banner-text"), retry: $("banner-retry"), close: $("banner-close"),
  keyDialog: $("key-dialog"), keyForm: $("key-form"), keyInput: $("key-input"), keyReason: $("key-reason"),
  keyForget: $("key-forget"), openKey: $("open-key"),
};
const OFFLINE_TEXT = "You are offline. Answers resume when the network is back.";
const KEY_NOTE = "The key is kept in this browser's local storage only.";
let countdownTimer = null;

// A sentence for the banner; "{wait}" stands for when a retry may work ("in 5 s", "now").
export function describe(error) {
  if (error.isNetwork) return "Network connection lost. Check the connection, then retry.";
  if (error.isMidStream) return `The answer failed: ${error.message}`;
  const hasWait = error.retryAfterS != null;
  switch (error.status) {
    case 401: return `API key needed: ${keyProblem(error.message)}`;
    case 404: return error.param === "conversation_id" ? "This conversation no longer exists." : error.message;
    case 429:
      if (error.code === "insufficient_quota") return "Over budget: this month's spending limit is reached.";
      return `Rate limited.${hasWait ? " You can retry {wait}." : " Retry in a moment."}`;
    case 503:
      if (error.code === "model_unavailable" || error.code === "model_load_failed") {
        // Not load: the model cannot be reached; another model may well answer.
        const reason = error.message.split(/[;(]/)[0].trim().replace(/[.,]$/, "");
        return `${reason}. Pick another model${hasWait ? ", or retry {wait}" : ""}.`;
      }
      return `The server is busy.${hasWait ? " Retry {wait}." : " Retry in a moment."}`;
    case 400:
      if (error.code === "context_length_exceeded") return tooLongText(error);
      return `The request was rejected: ${error.message}`;
    default: return `Something went wrong (${error.status || "no answer"}): ${error.message}`;
  }
}

// `hasHistory` (set by the sender): false when the message was the chat's first, so the
// message itself is too long, not the conversation.
function tooLongText(error) {
  if (error.hasHistory !== false) {
    return "This conversation is too long for the model. Start a new chat or edit an earlier message.";
  }
  const limit = /maximum context length is (\d+) tokens/.exec(error.message);
  const context = limit ? ` (it reads at most ${Number(limit[1]).toLocaleString("en-US")} tokens)` : "";
  return `Your message is too long for the model${context}. Shorten it, or attach it as a file.`;
}

// The server's 401 text may end in the shell command that creates a key: that is for the
// operator, so the user reads a plain sentence (the full text stays in the key dialog's hint).
function keyProblem(message) {
  const plain = message.split(/\s*(?:Create one with|\(and create keys with):/)[0].trim();
  return plain === message ? message : `${plain} Ask the server's operator for a key.`;
}

export function showBanner(text, { retry = null, isInfo = false, waitS = null } = {}) {
  clearInterval(countdownTimer);
  keepingBottom(() => { el.banner.hidden = false; });
  el.banner.classList.toggle("banner-info", isInfo);
  el.retry.hidden = retry == null;
  el.retry.onclick = retry && (() => { hideBanner(); retry(); });
  const deadline = Date.now() + (waitS || 0) * 1000;
  const paint = () => {
    const left = Math.max(0, Math.ceil((deadline - Date.now()) / 1000));
    el.text.textContent = text.replace("{wait}", left > 0 ? `in ${left} s` : "now");
    el.retry.disabled = left > 0;
    if (left === 0) clearInterval(countdownTimer);
  };
  paint();
  if (waitS) countdownTimer = setInterval(paint, 1000);
}

export function hideBanner() {
  clearInterval(countdownTimer);
  el.banner.hidden = true;
}

// Retrying cannot help with a budget, a bad request or a missing conversation.
export function showError(error, retry) {
  if (error.status === 401) openKeyDialog(error.message);
  // A 400 or 404 repeats as it was, except a conversation busy with another turn (it frees up).
  const isFinal = (error.status === 400 || error.status === 404) && error.code !== "conversation_locked";
  const canRetry = retry != null && error.code !== "insufficient_quota" && !isFinal;
  showBanner(describe(error), { retry: canRetry ? retry : null, waitS: error.retryAfterS });
}

function openKeyDialog(reason) {
  el.keyReason.textContent = reason ? `${keyProblem(reason)} ${KEY_NOTE}` : KEY_NOTE;
  el.keyReason.title = reason || "";  // the server's full text, its command for operators included
  el.keyInput.value = getKey() || "";
  if (!el.keyDialog.open) el.keyDialog.showModal();
}

// Wires the key dialog and the banner's buttons; `onKeyChange` runs after a save or forget.
export function initKeyDialog(onKeyChange) {
  el.keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    const key = el.keyInput.value.trim();
    if (key) setKey(key);
    el.keyDialog.close();
    onKeyChange();
  });
  el.keyForget.addEventListener("click", () => {
    clearKey();
    el.keyInput.value = "";
    el.keyDialog.close();
    onKeyChange();
  });
  el.openKey.addEventListener("click", () => openKeyDialog(null));
  el.close.addEventListener("click", hideBanner);
  window.addEventListener("offline", () => showBanner(OFFLINE_TEXT));
  window.addEventListener("online", () => { if (el.text.textContent === OFFLINE_TEXT) hideBanner(); });
}
