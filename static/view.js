// The message list: one <article> per message, the streaming answer, per-message actions
// and the meta line (model, fallback, tokens, cost). Finished assistant text is rendered
// through render.js; everything else goes in as textContent. Owns no server calls.

import { feedbackControls } from "./feedback.js";
import { copyButton, renderMarkdown } from "./render.js";
import { attachmentsElement } from "./attachments.js";

const messagesEl = document.getElementById("messages");
const welcomeEl = document.getElementById("welcome");
const NEAR_BOTTOM_PX = 80;

// Notes for answers that ended other than normally, by finish_reason (live and stored alike;
// "abort": stopped by the user, or cut when the page went away mid-answer).
const FINISH_NOTES = {
  abort: "Stopped.",
  content_filter: "Stopped by the content filter.",
};

function isNearBottom() {
  return messagesEl.scrollHeight - messagesEl.scrollTop - messagesEl.clientHeight < NEAR_BOTTOM_PX;
}

export function scrollToBottom() {
  messagesEl.scrollTop = messagesEl.scrollHeight;
}

// Runs `change` (which may resize the message list) and keeps the newest message in view.
export function keepingBottom(change) {
  const stick = isNearBottom();
  change();
  if (stick) scrollToBottom();
}

export function formatCost(usd) {
  if (usd == null) return null;
  if (usd === 0) return "$0";
  return usd < 0.01 ? `$${usd.toPrecision(2)}` : `$${usd.toFixed(4)}`;
}

export function formatInt(n) {
  return Number(n || 0).toLocaleString("en-US");
}

export function plural(n, word) {
  return `${formatInt(n)} ${word}${Number(n) === 1 ? "" : "s"}`;
}

// The meta line under an assistant message: model, fallback, tokens, cost, notes.
export function metaText(msg) {
  const parts = [];
  if (msg.model) parts.push(msg.model);
  if (msg.fallbackFrom) parts.push(`fallback: ${fallbackText(msg)}`);
  const usage = msg.usage;
  if (usage) {
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    const thinking = usage.completion_tokens_details ? usage.completion_tokens_details.reasoning_tokens : 0;
    parts.push(`${formatInt(usage.prompt_tokens)} in${cached ? ` (${formatInt(cached)} cached)` : ""}`
      + ` \u00b7 ${formatInt(usage.completion_tokens)} out${thinking ? ` (${formatInt(thinking)} thinking)` : ""}`);
    const cost = formatCost(usage.cost_usd);
    if (cost) parts.push(cost);
  } else if (msg.tokens != null) {
    // A stored message keeps only its own (completion) tokens: the live line's "out" figure.
    parts.push(`${formatInt(msg.tokens)} out`);
  }
  return parts.join(" \u00b7 ");
}

// Why another model answered (x-fallback-reason; a stored answer's fallback_reason).
function fallbackText(msg) {
  if (msg.fallbackReason === "busy") return `${msg.fallbackFrom} was busy`;
  if (msg.fallbackReason === "over_budget") return `over budget for ${msg.fallbackFrom}`;
  if (msg.fallbackReason === "unavailable") return `${msg.fallbackFrom} could not be reached`;
  return `instead of ${msg.fallbackFrom}`;
}

// The answer hit the most tokens one answer may have: the request gave no max_tokens, so
// the tier's default applied (the count is the answer's own length).
function cutOffText(msg) {
  const tokens = msg.tokens ?? (msg.usage ? msg.usage.completion_tokens : null);
  const limit = tokens ? `the ${formatInt(tokens)}-token limit` : "the token limit";
  return `Cut off at ${limit} for one answer (this tier's default max_tokens).`;
}

function noteText(msg) {
  if (msg.errorText) return msg.errorText;
  if (msg.finishReason === "length") return cutOffText(msg);
  return FINISH_NOTES[msg.finishReason] || "";
}

// Said in the conversation when the oldest messages were left out to fit the context window.
function droppedText(msg) {
  const context = msg.contextLength ? `${formatInt(msg.contextLength)}-token ` : "";
  return `Earlier messages no longer fit the model's ${context}context: this answer was written`
    + ` without the first ${plural(msg.historyDropped, "message")} of the chat.`;
}

function noteElement(text, isWarning) {
  const noteEl = document.createElement("p");
  noteEl.className = `msg-note${isWarning ? " msg-note-warn" : ""}`;
  noteEl.textContent = text;
  return noteEl;
}

// `action` names the button among its message's (data-action), so that a repaint can give
// focus back to its twin. `isLocked`: shown but disabled while an edit box is open (it would
// discard the edit).
function actionButton({ action, label, ariaLabel }, onClick, isLocked) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "btn btn-small btn-ghost";
  button.dataset.action = action;
  button.textContent = label;
  button.setAttribute("aria-label", ariaLabel);
  button.addEventListener("click", onClick);
  if (isLocked) {
    button.disabled = true;
    button.title = "Save or cancel the open edit first";
  }
  return button;
}

function fillBody(body, msg) {
  body.replaceChildren();
  body.dir = "auto";  // a right-to-left message reads right to left
  body.hidden = !msg.content && msg.role === "user" && Boolean(msg.parts);  // attachments only: no empty bubble
  if (msg.role === "assistant" && !msg.isStreaming) {
    body.classList.add("markdown");
    renderMarkdown(body, msg.content);
  } else {
    body.classList.remove("markdown");
    body.textContent = msg.content;
  }
}

function roleLabel(role) {
  return { user: "You", assistant: "Assistant", system: "System" }[role] || role;
}

// Builds one message; `actions` = {onEdit?, onRegenerate?, onContinue?, onBranch?, feedback?, isLocked?}
// for the buttons it may show (feedback: the arguments of feedbackControls).
export function messageElement(msg, index, actions) {
  const article = document.createElement("article");
  article.className = `msg msg-${msg.role}`;
  article.dataset.index = String(index);
  const role = document.createElement("h3");
  role.className = "msg-role";
  role.textContent = roleLabel(msg.role);
  const body = document.createElement("div");
  body.className = "msg-body";
  fillBody(body, msg);
  article.append(role);
  if (msg.historyDropped) article.append(noteElement(droppedText(msg), false));
  if (msg.role === "assistant" && msg.reasoning) article.append(reasoningElement(msg.reasoning, Boolean(msg.isStreaming)));
  article.append(body);
  if (msg.parts && msg.parts.some((p) => p.type !== "text")) article.append(attachmentsElement(msg.parts));
  const note = noteText(msg);
  if (note) article.append(noteElement(note, Boolean(msg.errorText) || msg.finishReason === "content_filter"));
  const footer = document.createElement("div");
  footer.className = "msg-foot";
  if (msg.role === "assistant" && !msg.isStreaming) {
    const meta = document.createElement("span");
    meta.className = "msg-meta";
    meta.textContent = metaText(msg);
    footer.append(meta);
  }
  const buttons = document.createElement("span");
  buttons.className = "msg-actions";
  if (!msg.isStreaming && msg.content) {
    const copy = copyButton(() => msg.content, "Copy", `Copy message ${index + 1}`);
    copy.dataset.action = "copy";
    buttons.append(copy);
  }
  const locked = Boolean(actions.isLocked);
  if (actions.onEdit) {
    buttons.append(actionButton({ action: "edit", label: "Edit", ariaLabel: `Edit message ${index + 1}` },
                                actions.onEdit, locked));
  }
  if (actions.onContinue) {
    buttons.append(actionButton({ action: "continue", label: "Continue", ariaLabel: "Continue the answer" },
                                actions.onContinue, locked));
  }
  if (actions.onRegenerate) {
    const label = msg.role === "assistant" ? "Regenerate" : "Retry";
    buttons.append(actionButton({ action: "regenerate", label, ariaLabel: `${label} the answer` },
                                actions.onRegenerate, locked));
  }
  if (actions.onBranch) {
    buttons.append(actionButton({ action: "branch", label: "Branch",
                                  ariaLabel: `Branch from message ${index + 1}` },
                                actions.onBranch, locked));
  }
  if (actions.feedback) buttons.append(feedbackControls(actions.feedback));
  footer.append(buttons);
  article.append(footer);
  return article;
}

// Replaces the whole list. `actionsFor(index)` returns the actions of message `index`.
export function renderMessages(messages, actionsFor) {
  const stick = isNearBottom();
  messagesEl.replaceChildren();
  welcomeEl.hidden = messages.length > 0;
  messagesEl.append(welcomeEl);
  messages.forEach((msg, i) => messagesEl.append(messageElement(msg, i, actionsFor(i))));
  if (stick || messages.length === 0) scrollToBottom();
}

// Where focus was in the list, as {index, action}: the message and the button (or the open
// form standing in for one, data-action too) it was on; null elsewhere.
export function focusPlace(element) {
  const article = element && element.closest ? element.closest("#messages article[data-index]") : null;
  const acting = article && element.closest("[data-action]");
  return acting ? { index: article.dataset.index, action: acting.dataset.action } : null;
}

// Focuses the enabled, shown button at `place` after a repaint; false where there is none.
export function focusAt(place) {
  const button = place && messagesEl.querySelector(
    `article[data-index="${CSS.escape(place.index)}"] button[data-action="${CSS.escape(place.action)}"]`);
  if (!button || button.disabled || button.closest("[hidden]")) return false;
  button.focus();
  return document.activeElement === button;
}

// A reasoning model's thinking, folded above its answer (open while it streams). Plain text.
function reasoningElement(text, isOpen) {
  const details = document.createElement("details");
  details.className = "msg-reasoning";
  details.open = isOpen;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const pre = document.createElement("div");
  pre.className = "msg-reasoning-text";
  pre.textContent = text;
  details.append(summary, pre);
  return details;
}

// The element of the answer being streamed: text nodes that only ever grow.
export function streamingTarget(index) {
  const article = messagesEl.querySelector(`article[data-index="${index}"]`);
  const body = article.querySelector(".msg-body");
  const text = document.createTextNode("");
  body.replaceChildren(text);
  body.classList.add("streaming");
  let reasoning = null;
  const grow = (node, delta) => {
    const stick = isNearBottom();
    node.appendData(delta);
    if (stick) scrollToBottom();
  };
  return {
    append(delta) { grow(text, delta); },
    appendReasoning(delta) {
      if (!reasoning) {
        const details = reasoningElement("", true);
        body.before(details);
        reasoning = document.createTextNode("");
        details.querySelector(".msg-reasoning-text").append(reasoning);
      }
      grow(reasoning, delta);
    },
  };
}

// Turns a user message into an inline editor; resolves with the new text or null.
export function editInPlace(index, original) {
  const article = messagesEl.querySelector(`article[data-index="${index}"]`);
  const body = article.querySelector(".msg-body");
  const form = document.createElement("form");
  form.className = "edit-form";
  form.dataset.action = "edit";  // stands in for the Edit button: focus goes back to it after
  const area = document.createElement("textarea");
  area.value = original;
  area.setAttribute("aria-label", "Edit message");
  const save = document.createElement("button");
  save.type = "submit";
  save.className = "btn btn-primary btn-small";
  save.textContent = "Save & send";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.className = "btn btn-ghost btn-small";
  cancel.textContent = "Cancel";
  const row = document.createElement("div");
  row.className = "edit-actions";
  row.append(cancel, save);
  form.append(area, row);
  body.replaceWith(form);
  article.querySelector(".msg-foot").hidden = true;
  const fit = () => {
    area.style.height = "auto";
    area.style.height = `${Math.min(area.scrollHeight + 4, 320)}px`;
  };
  area.addEventListener("input", fit);
  fit();
  area.focus();
  return new Promise((resolve) => {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      resolve(area.value.trim() ? area.value : null);
    });
    cancel.addEventListener("click", () => resolve(null));
    area.addEventListener("keydown", (event) => {
      if (event.key === "Escape") resolve(null);
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
  });
}

export function setBusy(isBusy) {
  messagesEl.setAttribute("aria-busy", isBusy ? "true" : "false");
}
