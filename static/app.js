// The chat UI's entry point: boot (key, models, conversations), the send/stop/regenerate/
// edit flow against the public API, the model picker and the usage summary. The server's
// stored conversation is the truth; after each answer the view is re-synced from it.

import { api, getKey, isAbort, streamChat } from "./api.js";
import { Attachments, textOf } from "./attachments.js";
import { icon } from "./icons.js";
import { describe, hideBanner, initKeyDialog, showBanner, showError } from "./notices.js";
import { Sidebar, displayTitle } from "./sidebar.js";
import { formatCost, plural, editInPlace, renderMessages, scrollToBottom, setBusy, streamingTarget } from "./view.js";
import { paintWelcome } from "./welcome.js";

const $ = (id) => document.getElementById(id);
const el = {
  input: $("composer-input"), form: $("composer"), send: $("send"), stop: $("stop"), status: $("status"),
  title: $("chat-title"), model: $("model-select"), usage: $("usage-summary"), openKey: $("open-key"),
  thinking: $("thinking-select"), thinkingPicker: $("thinking-picker"),
  newChat: $("new-chat"), sidebar: $("sidebar"), openSidebar: $("open-sidebar"),
  closeSidebar: $("close-sidebar"), backdrop: $("sidebar-backdrop"),
};
$("attach").replaceChildren(icon("paperclip"));
const attachments = new Attachments({
  button: $("attach"), input: $("attach-input"), list: $("attachments"), dropZone: document.querySelector(".main"),
  onChange: () => { el.send.disabled = attachments.isUploading; },
});
const MODEL_STORAGE = "chat.model";
const THINKING_STORAGE = "chat.thinking";
const BRIEF_THINKING_TOKENS = 256;  // "Thinks briefly": the server closes the thinking after this many tokens
const SYNC_ATTEMPTS = 5;
const SYNC_RETRY_MS = 300;

// localStorage may throw (privacy modes); the model choice is then simply not remembered.
function loadSetting(name) {
  try { return localStorage.getItem(name); } catch { return null; }
}

function saveSetting(name, value) {
  try { localStorage.setItem(name, value); } catch { /* not remembered */ }
}

const state = {
  conversationId: null,
  messages: [],       // {role, content, id?, model?, tokens?, usage?, fallbackFrom?, finishReason?, feedback?,
                      //  historyDropped?, contextLength?, errorText?}
  controller: null,   // AbortController of the answer being streamed
  models: new Map(),  // id -> /v1/models entry (max_model_len, description, example_prompts)
};

// A stored message (snake_case finish_reason, fallback_from) in the view's shape. An answer's
// `usage` is the chat completion's, as billed (less the thinking count, which is not stored).
function fromStored(message) {
  const view = { ...message };
  if (message.finish_reason) view.finishReason = message.finish_reason;
  if (message.fallback_from) view.fallbackFrom = message.fallback_from;
  return view;
}

const sidebar = new Sidebar({
  onOpen: (id) => { closeSidebar(); openConversation(id); },
  onDeleted: (id) => { if (id === state.conversationId) newChat(); },
  onRenamed: (c) => { if (c.id === state.conversationId) el.title.textContent = displayTitle(c); },
  onError: (error) => showError(error, null),
});

// ---- models and usage ------------------------------------------------------------------
// Only chat models are offered: a base model (`chat: false`) answers /v1/completions only.
async function loadModels() {
  const data = (await api.models()).data.filter((m) => m.chat !== false);
  state.models = new Map(data.map((m) => [m.id, m]));
  el.model.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
  el.model.disabled = data.length === 0;
  selectModel(loadSetting(MODEL_STORAGE));
  showWelcome();
}

// Puts the picker on `id` where it is offered (the user's own choice, or the model an opened
// conversation used); otherwise leaves it where it is. Never remembered: only the user's
// change in the picker is.
function selectModel(id) {
  if (!state.models.has(id) || el.model.value === id) return;
  el.model.value = id;
  showWelcome();
}

function showWelcome() {
  paintWelcome(state.models.get(el.model.value), (text) => send(text));
  showThinkingChoice();
}

// A reasoning model (/v1/models says `reasoning`) gets a thinking choice; "briefly" only where
// the server can cap its thinking.
function showThinkingChoice() {
  const model = state.models.get(el.model.value);
  const reasoning = model && model.reasoning;
  el.thinkingPicker.hidden = !reasoning;
  const brief = el.thinking.querySelector('option[value="brief"]');
  brief.hidden = brief.disabled = !(reasoning && reasoning.thinking_token_budget);
  const saved = loadSetting(THINKING_STORAGE) || "";
  el.thinking.value = saved === "brief" && brief.disabled ? "" : saved;
}

function thinkingOptions() {
  if (el.thinkingPicker.hidden) return {};
  if (el.thinking.value === "off") return { reasoning_effort: "none" };
  if (el.thinking.value === "brief") return { thinking_token_budget: BRIEF_THINKING_TOKENS };
  return {};
}

el.model.addEventListener("change", () => { saveSetting(MODEL_STORAGE, el.model.value); showWelcome(); });
el.thinking.addEventListener("change", () => saveSetting(THINKING_STORAGE, el.thinking.value));

function usageLine(row) {
  const tokens = (row.prompt_tokens || 0) + (row.completion_tokens || 0);
  const cost = formatCost(Number(row.cost_usd || 0));
  return `${plural(row.num_requests ?? row.requests ?? 0, "request")} \u00b7 ${plural(tokens, "token")} \u00b7 ${cost}`;
}

// "of $5.00 budget" when the organisation has a monthly budget; near or past it, highlighted.
function budgetNote(budget) {
  if (!budget || budget.budget_usd == null) return "";
  const limit = Number(budget.budget_usd);
  const spent = Number(budget.month_spend_usd || 0);
  el.usage.classList.toggle("usage-near-limit", spent >= 0.8 * limit);
  return ` of ${limit === 0 ? "$0" : `$${limit.toFixed(2)}`} budget`;
}

async function refreshUsage() {
  try {
    const { data, total, budget } = await api.usage();
    el.usage.classList.remove("usage-near-limit");
    el.usage.textContent = `This month: ${usageLine(total)}${budgetNote(budget)}`;
    el.usage.title = data.map((row) => `${row.model}: ${usageLine(row)}`).join("\n");
  } catch {
    el.usage.textContent = "This month: usage unavailable";
  }
}

// ---- conversations ---------------------------------------------------------------------
function setConversation(id, title) {
  state.conversationId = id;
  el.title.textContent = id ? title : "New chat";
  sidebar.setActive(id);
  const hash = id ? `#${id}` : "";
  if (window.location.hash !== hash) history.replaceState(null, "", `${window.location.pathname}${hash}`);
}

function newChat() {
  if (state.controller) return;
  hideBanner();
  setConversation(null, null);
  selectModel(loadSetting(MODEL_STORAGE));  // a new chat starts on the user's model, not the last one opened
  state.messages = [];
  paint();
  el.input.focus();
}

async function openConversation(id) {
  if (state.controller) return;
  try {
    const conversation = await api.getConversation(id);
    hideBanner();
    setConversation(conversation.id, displayTitle(conversation));
    state.messages = conversation.messages.map(fromStored);
    // The next turn continues on the model that wrote the last answer, where still offered.
    const lastAnswer = conversation.messages.findLast((m) => m.role === "assistant" && m.model);
    if (lastAnswer) selectModel(lastAnswer.model);
    paint();
    scrollToBottom();
  } catch (error) {
    showError(error, null);
    if (error.status === 404) newChat();
  }
}

// Re-reads the stored conversation; keeps live-only details (notes, the live usage with its
// thinking count) of messages that are still there. An aborted answer is stored a moment
// after the abort, so wait for `expectedCount` messages a few times before giving up.
async function syncFromServer(id, expectedCount) {
  let conversation = null;
  for (let attempt = 0; attempt < SYNC_ATTEMPTS; attempt += 1) {
    conversation = await api.getConversation(id);
    if (conversation.messages.length >= expectedCount) break;
    await new Promise((r) => setTimeout(r, SYNC_RETRY_MS));
  }
  if (id !== state.conversationId) return;
  state.messages = conversation.messages.map((stored, i) => {
    const local = state.messages[i];
    if (!local || local.role !== stored.role) return fromStored(stored);
    return { ...local, ...fromStored(stored), usage: local.usage || stored.usage };
  });
  el.title.textContent = displayTitle(conversation);
  sidebar.upsert(conversation);
  sidebar.setActive(id);
}

// ---- sending ---------------------------------------------------------------------------
const PROVISIONAL_TITLE_CHARS = 80;

function provisionalTitle(content) {
  const words = content.split(/\s+/).filter(Boolean).join(" ");
  return words.length <= PROVISIONAL_TITLE_CHARS ? words : `${words.slice(0, PROVISIONAL_TITLE_CHARS - 1)}\u2026`;
}

function actionsFor(index) {
  if (state.controller) return {};
  const msg = state.messages[index];
  const isLast = index === state.messages.length - 1;
  const actions = {};
  if (msg.role === "user") actions.onEdit = () => editMessage(index);
  if (isLast && (msg.role === "assistant" || msg.role === "user")) actions.onRegenerate = () => regenerate();
  if (isLast && msg.role === "assistant" && msg.finishReason === "length") actions.onContinue = () => send("Continue");
  if (msg.role === "assistant" && msg.id && state.conversationId) {
    actions.feedback = {
      conversationId: state.conversationId, message: msg,
      onSaved: (feedback) => { msg.feedback = feedback; paint(); },
      onError: (error) => showError(error, null),
    };
  }
  return actions;
}

// Records, before the turn is truncated, that the user asked for another answer or rewrote
// the prompt of the answer at `index` (kept with the answer for evaluation: api/feedback.py).
async function noteRedo(index, body) {
  const answer = state.messages[index];
  if (!answer || answer.role !== "assistant" || !answer.id || !state.conversationId) return;
  try {
    await api.feedback(state.conversationId, answer.id, body);
  } catch {
    // Feedback is best effort: the user's regenerate or edit goes ahead without it.
  }
}

function paint() {
  renderMessages(state.messages, actionsFor);
}

async function editMessage(index) {
  const content = await editInPlace(index, state.messages[index].content);
  if (content == null) { paint(); return; }
  await send(contentOf(state.messages[index], content), index, { edited_prompt: content });
}

// What a stored user message is sent again as: its parts when it had attachments.
function contentOf(msg, text = msg.content) {
  if (!msg.parts) return text;
  return [...(text ? [{ type: "text", text }] : []), ...msg.parts.filter((p) => p.type !== "text")];
}

function regenerate() {
  const lastUser = state.messages.map((m) => m.role).lastIndexOf("user");
  if (lastUser < 0) return;
  send(contentOf(state.messages[lastUser]), lastUser, { regenerated: true });
}

function setStreaming(isStreaming) {
  el.send.hidden = isStreaming;
  el.stop.hidden = !isStreaming;
  el.stop.disabled = false;
  el.model.disabled = el.thinking.disabled = isStreaming;
  el.newChat.disabled = isStreaming;
  setBusy(isStreaming);
  if (!isStreaming) el.status.textContent = "";
}

// ": queued position=N wait_s=M" while the request waits for the model (M: estimated seconds).
function onComment(comment) {
  const queued = /^queued position=(\d+)(?: wait_s=(\d+))?/.exec(comment);
  if (queued) {
    const wait = queued[2] === undefined ? "" : `, about ${Math.max(1, Number(queued[2]))} s`;
    el.status.textContent = `Queued (position ${queued[1]}${wait})\u2026`;
  } else if (comment === "processing") el.status.textContent = "Reading your message\u2026";
}

// Sends `content` as the next user message. `keepMessages` (regenerate, edit, retry) first
// truncates the stored conversation to that many messages, so the server and view agree.
// `redo` (regenerate, edit): the feedback recorded on the answer being replaced, first.
async function send(content, keepMessages = null, redo = null) {
  if (state.controller || (typeof content === "string" ? !content.trim() : !content.length)) return;
  hideBanner();
  const keep = keepMessages ?? state.messages.length;
  const controller = new AbortController();
  state.controller = controller;
  setStreaming(true);
  const isNew = !state.conversationId;
  try {
    if (isNew) {
      const created = await api.createConversation();
      // The server titles it from the first message once stored; show the same meanwhile.
      created.title = created.title || provisionalTitle(textOf(content));
      setConversation(created.id, displayTitle(created));
      sidebar.upsert(created);
      sidebar.setActive(created.id);
    } else if (keep < state.messages.length) {
      if (redo) await noteRedo(keep + 1, redo);
      await api.truncateConversation(state.conversationId, keep);
    }
  } catch (error) {
    state.controller = null;
    setStreaming(false);
    showError(error, () => send(content, keepMessages));
    return;
  }
  const outcome = await streamAnswer(state.conversationId, content, keep, controller);
  const retry = () => {
    if (el.input.value === content) el.input.value = "";
    send(content, isNew && outcome.isRefused ? null : keep);
  };
  try {
    if (isNew && outcome.isRefused) {
      await discardConversation(state.conversationId);
    } else {
      await finishTurn(state.conversationId, outcome);
    }
  } finally {
    state.controller = null;
    setStreaming(false);
    paint();
  }
  if (outcome.failure) showError(outcome.failure, retry);
  refreshUsage();
}

// Streams the answer to `content`; resolves with {expected, failure, isRefused}: how many
// messages the server should now hold, the error if any, and whether it refused before
// storing anything (then the text goes back into the composer).
async function streamAnswer(conversationId, content, keep, controller) {
  const answer = { role: "assistant", content: "", model: null, isStreaming: true };
  const sent = { role: "user", content: textOf(content), parts: Array.isArray(content) ? content : undefined };
  state.messages = [...state.messages.slice(0, keep), sent, answer];
  paint();
  el.status.textContent = "Waiting for the model\u2026";
  const target = streamingTarget(keep + 1);
  const outcome = { expected: keep + 2, failure: null, isRefused: false };
  try {
    const result = await streamChat({
      model: el.model.value || null, content, conversationId, signal: controller.signal, onComment,
      options: thinkingOptions(),
      onDelta: (text) => { el.status.textContent = ""; answer.content += text; target.append(text); },
      onReasoning: (text) => {
        el.status.textContent = "Thinking\u2026";
        answer.reasoning = (answer.reasoning || "") + text;
        target.appendReasoning(text);
      },
    });
    const model = state.models.get(result.model);
    Object.assign(answer, { model: result.model, usage: result.usage, fallbackFrom: result.fallbackFrom,
                            finishReason: result.finishReason, historyDropped: result.historyDropped,
                            contextLength: model ? model.max_model_len : null });
  } catch (error) {
    if (isAbort(error)) {
      answer.finishReason = "abort";  // as the server stores it: the same note live and after a reload
      outcome.expected = keep + (answer.content ? 2 : 1);
    } else {
      outcome.failure = error;
      answer.errorText = describe(error).replace("{s}", "a moment");
      outcome.isRefused = Boolean(error.status) && !error.isMidStream;
      outcome.expected = outcome.isRefused ? keep : 0;
      if (outcome.isRefused && !el.input.value) el.input.value = textOf(content);
    }
  } finally {
    answer.isStreaming = false;
    el.stop.disabled = true;  // still busy until the view is re-synced with the server
  }
  return outcome;
}

async function discardConversation(id) {
  try {
    await api.deleteConversation(id);
  } catch {
    // Left empty on the server; it still shows in the list and can be deleted there.
    await sidebar.refresh();
  }
  sidebar.remove(id);
  setConversation(null, null);
  state.messages = [];
}

async function finishTurn(conversationId, outcome) {
  try {
    await syncFromServer(conversationId, outcome.expected);
  } catch (error) {
    outcome.failure = outcome.failure || error;
  }
  const last = state.messages[state.messages.length - 1];
  if (!outcome.failure && last && last.finishReason === "content_filter") {
    showBanner("The answer was stopped by the content filter.", { isInfo: true });
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

el.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = el.input.value;
  if ((!text.trim() && !attachments.hasReady) || state.controller || attachments.isUploading) return;
  el.input.value = "";
  autoGrow();
  send(attachments.take(text));
});

el.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    el.form.requestSubmit();
  } else if (event.key === "Escape" && state.controller) {
    stop();
  }
});

function autoGrow() {
  el.input.style.height = "auto";
  el.input.style.height = `${Math.min(el.input.scrollHeight, 240)}px`;
}

el.input.addEventListener("input", autoGrow);
el.stop.addEventListener("click", stop);
el.newChat.addEventListener("click", () => { closeSidebar(); newChat(); });

// ---- narrow screens: the sidebar slides over the chat ----------------------------------
function openSidebar() {
  el.sidebar.classList.add("open");
  el.backdrop.hidden = false;
  el.openSidebar.setAttribute("aria-expanded", "true");
  el.newChat.focus();
}

function closeSidebar() {
  if (!el.sidebar.classList.contains("open")) return;
  el.sidebar.classList.remove("open");
  el.backdrop.hidden = true;
  el.openSidebar.setAttribute("aria-expanded", "false");
}

el.openSidebar.addEventListener("click", openSidebar);
el.closeSidebar.addEventListener("click", () => { closeSidebar(); el.openSidebar.focus(); });
el.backdrop.addEventListener("click", closeSidebar);
document.addEventListener("keydown", (event) => { if (event.key === "Escape") closeSidebar(); });

// ---- boot ------------------------------------------------------------------------------
async function boot() {
  hideBanner();
  el.openKey.textContent = getKey() ? "Change API key\u2026" : "Use an API key\u2026";
  try {
    await loadModels();
  } catch (error) {
    showError(error, boot);
    return;
  }
  await sidebar.refresh();
  refreshUsage();
  attachments.loadLimits();
  // The hash only selects a stored conversation; nothing from the URL is ever sent.
  const id = window.location.hash.slice(1);
  if (/^[\w-]{1,100}$/.test(id)) await openConversation(id);
  else newChat();
  document.body.classList.add("ready");
}

initKeyDialog(boot);

window.addEventListener("hashchange", () => {
  const id = window.location.hash.slice(1);
  if (id && id !== state.conversationId) openConversation(id);
});

boot();
