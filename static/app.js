// The chat UI's entry point: boot (key, models, conversations), moving between chats (the
// address names the open one; Back returns), the send/stop/regenerate/edit flow against the
// public API (the model picker is models.js; a turn's pure helpers, turns.js). The server's stored conversation is the truth;
// after each answer the view is re-synced from it.

import { announce } from "./announce.js";
import { api, getKey, isAbort, streamChat } from "./api.js";
import { Attachments, textOf } from "./attachments.js";
import { icon } from "./icons.js";
import { Downloads } from "./downloads.js";
import { Drawer } from "./drawer.js";
import { Imports } from "./imports.js";
import { ModelPicker } from "./models.js";
import { describe, hideBanner, initKeyDialog, showBanner, showError } from "./notices.js";
import { Shares } from "./shares.js";
import { Sidebar, confirmAction, displayTitle } from "./sidebar.js";
import {
  focusAt, focusPlace, plural, editInPlace, renderMessages, scrollToBottom, setBusy, streamingTarget,
} from "./view.js";
import { fromStored, provisionalTitle, redoNote } from "./turns.js";
import { refreshUsage } from "./usage.js";

const $ = (id) => document.getElementById(id);
const el = {
  input: $("composer-input"), form: $("composer"), send: $("send"), stop: $("stop"), status: $("status"),
  title: $("chat-title"), model: $("model-select"), openKey: $("open-key"),
  thinking: $("thinking-select"), thinkingPicker: $("thinking-picker"),
  newChat: $("new-chat"),
};
$("attach").replaceChildren(icon("paperclip"));
const attachments = new Attachments({
  button: $("attach"), input: $("attach-input"), list: $("attachments"), dropZone: document.querySelector(".main"),
  onChange: () => { el.send.disabled = attachments.isUploading; },
  modelOf: () => picker.current(),
});
const drawer = new Drawer({
  sidebar: $("sidebar"), backdrop: $("sidebar-backdrop"), open: $("open-sidebar"), close: $("close-sidebar"),
  first: el.newChat, behind: document.querySelector(".main"),
});
const SYNC_ATTEMPTS = 5;
const SYNC_RETRY_MS = 300;
const SILENCE_HINT_MS = 30000;  // no byte of the answer for this long: say the server may be stuck

const state = {
  conversationId: null,
  messages: [],       // {role, content, id?, model?, tokens?, usage?, fallbackFrom?, finishReason?, feedback?,
                      //  historyDropped?, contextLength?, errorText?}
  controller: null,   // AbortController of the answer being streamed; null once the view left it
  editingIndex: null, // the user message whose edit box is open (one at a time)
};

const sidebar = new Sidebar({
  onOpen: (id, messageId) => { drawer.close(); openConversation(id, "push", messageId); },
  // The open chat's answer stops before the chat is deleted; then a new chat takes its place.
  onDeleting: (id) => { if (id === state.conversationId) leaveStream(); },
  onDeleted: (id) => { if (id === state.conversationId) newChat("replace"); },
  onRenamed: (c) => { if (c.id === state.conversationId) showTitle(displayTitle(c)); },
  onError: (error) => showError(error, null),
});

const downloads = new Downloads({
  conversationId: () => state.conversationId, onError: (error) => showError(error, null),
});
new Imports({ onImported: () => sidebar.refresh(), onError: (error) => showError(error, null) });
const shares = new Shares({
  conversationId: () => state.conversationId, lastMessageId: () => state.messages.at(-1)?.id,
  onError: (error) => showError(error, null), onNotice: (text) => showBanner(text, { isInfo: true }),
});

// ---- models ----------------------------------------------------------------------------
const picker = new ModelPicker(
  { model: el.model, thinking: el.thinking, thinkingPicker: el.thinkingPicker },
  (text) => { el.input.focus(); send(text); },
);

// ---- conversations ---------------------------------------------------------------------
function showTitle(title) {
  el.title.textContent = title;
  document.title = title === "New chat" ? "Chat" : `${title} \u2013 Chat`;
}

// `how`: "push" when the user moves to another chat (Back then returns to the one left),
// "replace" when the address only catches up (a new chat got its id, a boot, a deletion).
function setConversation(id, title, how = "replace") {
  state.conversationId = id;
  state.editingIndex = null;
  showTitle(id ? title : "New chat");
  sidebar.setActive(id);
  downloads.showFor(id);
  shares.showFor(id);
  const hash = id ? `#${id}` : "";
  if (window.location.hash === hash) return;
  const url = `${window.location.pathname}${window.location.search}${hash}`;
  if (how === "push") history.pushState(null, "", url);
  else history.replaceState(null, "", url);
}

// Leaving a chat while its answer streams stops reading it: the server stores what was
// written as a stopped answer, and the send in flight sees that it is no longer the view's.
function leaveStream() {
  if (!state.controller) return;
  state.controller.abort();
  state.controller = null;
  setStreaming(false);
}

function newChat(how = "push") {
  leaveStream();
  hideBanner();
  setConversation(null, null, how);
  picker.selectRemembered();  // a new chat starts on the user's model, not the last one opened
  state.messages = [];
  paint();
  el.input.focus();
}

function showConversation(conversation) {
  state.messages = conversation.messages.map((m) => fromStored(m, picker.models));
  // The next turn continues on the model that wrote the last answer, where still offered.
  const lastAnswer = conversation.messages.findLast((m) => m.role === "assistant" && m.model);
  if (lastAnswer) picker.select(lastAnswer.model);
  paint();
  scrollToBottom();
}

// `messageId`: a search hit's message, shown instead of the conversation's end.
async function openConversation(id, how = "replace", messageId = undefined) {
  if (id === state.conversationId && state.controller) return;  // already on screen, answering
  leaveStream();
  try {
    const conversation = await api.getConversation(id);
    hideBanner();
    setConversation(conversation.id, displayTitle(conversation), how);
    showConversation(conversation);
    const index = messageId ? state.messages.findIndex((m) => m.id === messageId) : -1;
    const found = document.querySelector(`#messages article[data-index="${index}"]`);
    if (found) found.scrollIntoView({ block: "center" });
  } catch (error) {
    if (error.status !== 404) {
      showError(error, null);
      setConversation(state.conversationId, el.title.textContent);  // the address names what is on screen
      return;
    }
    sidebar.remove(id);
    newChat("replace");
    showBanner("That conversation was not found: it was deleted, or the link is wrong.");
  }
}

// "Branch": a new chat holding this one up to that message opens; the original stays as it was.
async function branchFrom(messageId) {
  try {
    const conversation = await api.branchConversation(state.conversationId, messageId);
    sidebar.upsert(conversation);
    setConversation(conversation.id, displayTitle(conversation), "push");
    showConversation(conversation);
    el.input.focus();  // the branch is there to be continued
  } catch (error) {
    showError(error, null);
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
    if (!local || local.role !== stored.role) return fromStored(stored, picker.models);
    return { ...local, ...fromStored(stored, picker.models), usage: local.usage || stored.usage };
  });
  showTitle(displayTitle(conversation));
  sidebar.upsert(conversation);
  sidebar.setActive(id);
}

// ---- sending ---------------------------------------------------------------------------
// A title derived from the first message follows that message's edit; one the user chose stays.
async function retitleAfterEdit(id, oldText, newText) {
  const conversation = sidebar.items.find((c) => c.id === id);
  if (!conversation || conversation.title !== provisionalTitle(oldText)) return;
  try {
    sidebar.upsert(await api.renameConversation(id, provisionalTitle(newText)));
  } catch {
    // The old title stays; the user can rename the chat in the list.
  }
}

function actionsFor(index) {
  if (state.controller) return {};
  const msg = state.messages[index];
  const isLast = index === state.messages.length - 1;
  // While an edit box is open the other edits and Regenerate wait: they would discard it.
  const actions = { isLocked: state.editingIndex != null };
  if (msg.role === "user") actions.onEdit = () => editMessage(index);
  if (isLast && (msg.role === "assistant" || msg.role === "user")) actions.onRegenerate = () => regenerate();
  if (isLast && msg.role === "assistant" && msg.finishReason === "length") actions.onContinue = () => send("Continue");
  if (msg.role === "assistant" && msg.id && state.conversationId) {
    actions.onBranch = () => branchFrom(msg.id);
    actions.feedback = {
      conversationId: state.conversationId, message: msg,
      onSaved: (feedback) => { msg.feedback = feedback; paint(); },
      onError: (error) => showError(error, null),
    };
  }
  return actions;
}

// A repaint replaces the message buttons: focus goes to the same button of the same message
// (Good answer, with its new state; a closed edit or comment box hands it to its button).
// Where that one is gone or locked (the Regenerate just clicked, an example prompt), focus
// that would fall to <body> goes to the message box instead.
function paint() {
  const focused = document.activeElement;
  const wasInList = Boolean(focused && focused.closest && focused.closest("#messages"));
  const place = focusPlace(focused);
  renderMessages(state.messages, actionsFor);
  if (!wasInList || (focused.isConnected && !focused.closest("[hidden]"))) return;
  if (!focusAt(place)) el.input.focus();
}

async function editMessage(index) {
  state.editingIndex = index;
  const later = state.messages.length - index - 2;  // messages after this one's answer
  let text = state.messages[index].content;
  for (;;) {
    paint();  // locks the other buttons; again after a "no", to reopen the edit with its text
    text = await editInPlace(index, text);
    if (text == null || later <= 0) break;
    const question = `Sending this edit removes the ${plural(later, "later message")} of this chat.`;
    if (await confirmAction(question, "Remove and send")) break;
  }
  state.editingIndex = null;
  if (text == null) { paint(); return; }  // focus goes back to this message's Edit button
  await send(contentOf(state.messages[index], text), index, { edited_prompt: text });
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
  picker.setDisabled(isStreaming);
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

// Puts a message that was not sent back into the composer: its text, where the box is still
// empty, and its attachments' chips.
function giveBack(content) {
  if (!el.input.value) {
    el.input.value = textOf(content);
    autoGrow();
  }
  attachments.restore(content);
}

// Readies the stored conversation for the new message: creates it (a new chat) or truncates
// it to `keep` messages (regenerate, edit). Resolves false when the send must not go on.
async function prepare(content, keep, redo, signal) {
  if (!state.conversationId) {
    const created = await api.createConversation();
    // Stopped (or left) while it was created: leave no empty chat behind.
    if (signal.aborted) { await deleteQuietly(created.id); return false; }
    // The server titles it from the first message once stored; show the same meanwhile.
    created.title = created.title || provisionalTitle(textOf(content));
    setConversation(created.id, displayTitle(created));
    sidebar.upsert(created);
    sidebar.setActive(created.id);
    return true;
  }
  if (keep >= state.messages.length) return true;
  if (redo && !(await isInStep(state.conversationId))) return false;
  const last = state.messages[state.messages.length - 1];
  await api.truncateConversation(state.conversationId, keep, last && last.id, redoNote(state.messages[keep + 1], redo));
  if (keep === 0 && redo && redo.edited_prompt != null) {
    await retitleAfterEdit(state.conversationId, state.messages[0].content, redo.edited_prompt);
  }
  return true;
}

// Another tab may have added turns since this view was read, and truncating by this view's
// count would delete them: reload the view instead and say so.
async function isInStep(id) {
  const stored = await api.getConversation(id);
  const theirs = stored.messages[stored.messages.length - 1];
  const mine = state.messages[state.messages.length - 1];
  if (stored.messages.length === state.messages.length && theirs && mine && theirs.id === mine.id) return true;
  reloadChanged(id, stored);
  return false;
}

function reloadChanged(id, stored) {
  if (id !== state.conversationId) return;
  showConversation(stored);
  showBanner("This chat changed in another tab or window and was reloaded here; nothing was removed.",
             { isInfo: true });
}

async function deleteQuietly(id) {
  try {
    await api.deleteConversation(id);
  } catch {
    // Left empty on the server; it still shows in the list and can be deleted there.
    await sidebar.refresh();
  }
  sidebar.remove(id);
}

// The chat was deleted (in the sidebar, another tab or by the server): move to a new chat
// and keep the message for it.
function conversationGone(id, content) {
  sidebar.remove(id);
  if (id === state.conversationId) newChat("replace");
  giveBack(content);
  showBanner("This chat was deleted (perhaps in another tab). Your message is back in the box: send it to start a new chat.");
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
  const conversationId = state.conversationId;
  const isCurrent = () => state.controller === controller;
  const done = () => { if (isCurrent()) { state.controller = null; setStreaming(false); paint(); } };
  let isReady = false;
  try {
    isReady = await prepare(content, keep, redo, controller.signal);
  } catch (error) {
    done();
    if (error.status === 404 && conversationId) conversationGone(conversationId, content);
    else if (error.code === "conversation_changed" && conversationId) {
      // Another tab stored a turn while this one cut: nothing was cut. An edit's text goes back
      // in the box, and the view shows what is stored now.
      if (redo && redo.edited_prompt != null) giveBack(content);
      try { reloadChanged(conversationId, await api.getConversation(conversationId)); } catch { /* kept */ }
    } else showError(error, () => send(content, keepMessages, redo));
    return;
  }
  if (!isReady || controller.signal.aborted) {
    if (!redo) giveBack(content);  // stopped before the answer was asked for: nothing was sent
    if (isReady && isCurrent()) await syncQuietly(state.conversationId);
    done();
    return;
  }
  const outcome = await streamAnswer(state.conversationId, content, keep, controller);
  if (!isCurrent()) return;  // the user moved to another chat; the server keeps what it had
  await afterAnswer(content, { isNew, keep, keepMessages, outcome });
  done();
  announceAnswer(outcome);
  refreshUsage();
}

// Said once per answer in the status region, not token by token. A failure or the content
// filter is the banner's to say (role=alert): said twice, it would only be noise.
const ANSWER_ENDINGS = { abort: "Answer stopped.", length: "Answer cut off at the token limit." };

function announceAnswer(outcome) {
  const last = state.messages[state.messages.length - 1];
  if (outcome.failure || !last || last.role !== "assistant" || last.finishReason === "content_filter") return;
  announce(ANSWER_ENDINGS[last.finishReason] || "Answer complete.");
}

async function syncQuietly(id) {
  try { await syncFromServer(id, 0); } catch { /* the view keeps what it had */ }
}

async function afterAnswer(content, { isNew, keep, keepMessages, outcome }) {
  const id = state.conversationId;
  const failure = outcome.failure;
  if (failure && failure.status === 404 && failure.param === "conversation_id") {
    conversationGone(id, content);
    return;
  }
  if (isNew && outcome.isRefused) {
    await deleteQuietly(id);
    setConversation(null, null);
    state.messages = [];
  } else {
    await finishTurn(id, outcome);
  }
  const retry = () => {
    if (el.input.value === textOf(content)) el.input.value = "";
    attachments.clear();
    send(content, isNew && outcome.isRefused ? null : keep);
  };
  if (failure) showError(failure, retry);
  // The answer arrived and is stored; only re-reading the chat failed: no Retry, which would
  // send the message again.
  else if (outcome.syncFailure && outcome.syncFailure.isNetwork) {
    showBanner("The answer is saved, but the connection dropped before the chat could be re-read. Reload once it is back.");
  } else if (outcome.syncFailure) showError(outcome.syncFailure, null);
}

// Streams the answer to `content`; resolves with {expected, failure, isRefused}: how many
// messages the server should now hold, the error if any, and whether it refused before
// storing anything (then the message goes back into the composer).
async function streamAnswer(conversationId, content, keep, controller) {
  const answer = { role: "assistant", content: "", model: null, isStreaming: true };
  const sent = { role: "user", content: textOf(content), parts: Array.isArray(content) ? content : undefined };
  state.messages = [...state.messages.slice(0, keep), sent, answer];
  paint();
  el.status.textContent = "Waiting for the model\u2026";
  const target = streamingTarget(keep + 1);
  const outcome = { expected: keep + 2, failure: null, isRefused: false };
  const silence = silenceWatch();
  try {
    const result = await streamChat({
      model: picker.value || null, content, conversationId, signal: controller.signal,
      options: picker.thinkingOptions(),
      onComment: (comment) => { silence.reset(); onComment(comment); },
      onDelta: (text) => { silence.reset(); el.status.textContent = ""; answer.content += text; target.append(text); },
      onReasoning: (text) => {
        silence.reset();
        el.status.textContent = "Thinking\u2026";
        answer.reasoning = (answer.reasoning || "") + text;
        target.appendReasoning(text);
      },
    });
    const model = picker.models.get(result.model);
    Object.assign(answer, { model: result.model, usage: result.usage, fallbackFrom: result.fallbackFrom,
                            fallbackReason: result.fallbackReason, finishReason: result.finishReason,
                            historyDropped: result.historyDropped, contextLength: model ? model.max_model_len : null });
  } catch (error) {
    if (isAbort(error)) {
      answer.finishReason = "abort";  // as the server stores it: the same note live and after a reload
      outcome.expected = keep + (answer.content ? 2 : 1);
    } else {
      error.hasHistory = keep > 0;  // a first message too long is the message's fault, not the chat's
      outcome.failure = error;
      answer.errorText = describe(error).replace("{wait}", "in a moment");
      outcome.isRefused = Boolean(error.status) && !error.isMidStream;
      outcome.expected = outcome.isRefused ? keep : 0;
      if (outcome.isRefused) giveBack(content);
    }
  } finally {
    silence.stop();
    answer.isStreaming = false;
    el.stop.disabled = true;  // still busy until the view is re-synced with the server
  }
  return outcome;
}

// The status line says so when the answer stops arriving for SILENCE_HINT_MS (a hung server
// or a dead connection that never closes); any byte of the stream resets it.
function silenceWatch() {
  let timer = null;
  const reset = () => {
    clearTimeout(timer);
    timer = setTimeout(() => {
      el.status.textContent = "The server is not responding. Keep waiting, or press Stop.";
    }, SILENCE_HINT_MS);
  };
  reset();
  return { reset, stop: () => clearTimeout(timer) };
}

async function finishTurn(conversationId, outcome) {
  try {
    await syncFromServer(conversationId, outcome.expected);
  } catch (error) {
    if (outcome.failure) return;
    outcome.syncFailure = error;
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

// Grows with the text up to the max-height in style.css (a share of the window, so that at
// 200% zoom the chat above keeps room); past it the box scrolls.
function autoGrow() {
  el.input.style.height = "auto";
  el.input.style.height = `${el.input.scrollHeight}px`;
}

el.input.addEventListener("input", autoGrow);
// The Stop button hides itself: keep the keyboard in the message box, not on <body>.
el.stop.addEventListener("click", () => { stop(); el.input.focus(); });
el.newChat.addEventListener("click", () => { drawer.close(); newChat(); });

// ---- boot ------------------------------------------------------------------------------
async function boot() {
  hideBanner();
  el.openKey.textContent = getKey() ? "Change API key\u2026" : "Use an API key\u2026";
  try {
    await picker.load();
  } catch (error) {
    showError(error, boot);
    return;
  }
  await sidebar.refresh();
  refreshUsage();
  attachments.loadLimits();
  shares.loadSettings();
  await followAddress();
  document.body.classList.add("ready");
}

// The hash only selects a stored conversation; nothing from the URL is ever sent.
async function followAddress() {
  const id = window.location.hash.slice(1);
  if (/^[\w-]{1,100}$/.test(id)) await openConversation(id);
  else newChat("replace");
}

initKeyDialog(boot);

// Back and Forward: show the chat the address names (a stream of the one left stops).
window.addEventListener("hashchange", () => {
  if (window.location.hash.slice(1) !== (state.conversationId || "")) followAddress();
});

boot();
