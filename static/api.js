// The public HTTP API as the UI uses it: JSON calls, the API key and the chat SSE stream.
// Knows nothing about the DOM. Every failure is an ApiFailure carrying the server's
// OpenAI-style error fields, or `isNetwork` when no answer came back at all.

const KEY_STORAGE = "chat.apiKey";
const PAGE_SIZE = 30;

export class ApiFailure extends Error {
  constructor({ status = 0, type = null, code = null, message = "", param = null,
                retryAfterS = null, isNetwork = false, isMidStream = false }) {
    super(message || `HTTP ${status}`);
    this.name = "ApiFailure";
    this.status = status;
    this.type = type;
    this.code = code;
    this.param = param;
    this.retryAfterS = retryAfterS;
    this.isNetwork = isNetwork;
    this.isMidStream = isMidStream;
  }
}

export function isAbort(error) {
  return error != null && error.name === "AbortError";
}

// localStorage may throw (privacy modes, file://); the UI then works without a saved key.
export function getKey() {
  try { return localStorage.getItem(KEY_STORAGE); } catch { return null; }
}

export function setKey(key) {
  try { localStorage.setItem(KEY_STORAGE, key); } catch { /* not persisted */ }
}

export function clearKey() {
  try { localStorage.removeItem(KEY_STORAGE); } catch { /* nothing stored */ }
}

function headers(extra) {
  const result = { ...extra };
  const key = getKey();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

// Retry-After is delta-seconds or an HTTP date (RFC 9110 10.2.3).
export function parseRetryAfter(value) {
  if (!value) return null;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, seconds);
  const date = Date.parse(value);
  return Number.isNaN(date) ? null : Math.max(0, (date - Date.now()) / 1000);
}

async function failureFrom(response) {
  let body = null;
  try { body = await response.json(); } catch { /* not JSON: keep the status text */ }
  const error = (body && body.error) || {};
  return new ApiFailure({
    status: response.status,
    type: error.type ?? null,
    code: error.code ?? null,
    param: error.param ?? null,
    message: error.message || response.statusText || `HTTP ${response.status}`,
    retryAfterS: parseRetryAfter(response.headers.get("Retry-After")),
  });
}

function networkFailure(cause) {
  return new ApiFailure({ isNetwork: true, message: `Network error: ${cause && cause.message ? cause.message : cause}` });
}

// `body`: a value sent as JSON; `jsonFile`: a Blob that holds JSON already, sent as it is.
async function send(path, { method = "GET", body, jsonFile, signal, accept } = {}) {
  const extra = {};
  if (body !== undefined || jsonFile !== undefined) extra["Content-Type"] = "application/json";
  if (accept) extra.Accept = accept;
  let response;
  try {
    response = await fetch(path, {
      method, signal, cache: "no-store", headers: headers(extra),
      body: jsonFile !== undefined ? jsonFile : body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (error) {
    throw isAbort(error) ? error : networkFailure(error);
  }
  if (!response.ok) throw await failureFrom(response);
  return response;
}

async function json(path, options) {
  const response = await send(path, options);
  return response.json();
}

const conv = (id) => `/v1/conversations/${encodeURIComponent(id)}`;

// The name a download is saved as: Content-Disposition's filename* (RFC 6266, UTF-8) where it
// has one, else its plain filename.
export function filenameOf(disposition, fallback) {
  const extended = /filename\*=UTF-8''([^;\s]+)/i.exec(disposition || "");
  if (extended) {
    try { return decodeURIComponent(extended[1]); } catch { /* malformed: the plain name */ }
  }
  const plain = /filename="([^"]*)"/i.exec(disposition || "");
  return plain && plain[1] ? plain[1] : fallback;
}

// A file the API answers with (an export): its body as a Blob and the name it is saved as.
async function download(path, fallbackName) {
  const response = await send(path);
  let blob;
  try {
    blob = await response.blob();
  } catch (error) {
    throw networkFailure(error);  // the body stopped short: never save half a file
  }
  return { blob, filename: filenameOf(response.headers.get("Content-Disposition"), fallbackName) };
}

export const api = {
  models: () => json("/v1/models"),
  listConversations: (afterId) =>
    json(`/v1/conversations?limit=${PAGE_SIZE}${afterId ? `&after=${encodeURIComponent(afterId)}` : ""}`),
  // Our extension of the list: the conversations whose title or messages hold `text`.
  searchConversations: (text, afterId) =>
    json(`/v1/conversations?limit=${PAGE_SIZE}&q=${encodeURIComponent(text)}`
      + `${afterId ? `&after=${encodeURIComponent(afterId)}` : ""}`),
  getConversation: (id) => json(conv(id)),
  createConversation: () => json("/v1/conversations", { method: "POST", body: {} }),
  renameConversation: (id, title) => json(conv(id), { method: "PATCH", body: { title } }),
  deleteConversation: (id) => json(conv(id), { method: "DELETE" }),
  // With `expectedLastId`, the server cuts only a conversation that still ends with that
  // message (else 409 conversation_changed): never a turn another tab stored meanwhile.
  // `feedback` ({message_id, regenerated, edited_prompt}) is recorded only if the cut is made.
  truncateConversation: (id, keepMessages, expectedLastId, feedback) =>
    json(`${conv(id)}/truncate`, {
      method: "POST",
      body: { keep_messages: keepMessages, expected_last_message_id: expectedLastId || undefined, feedback },
    }),
  // Our extension: a new conversation holding a copy of this one up to and including `messageId`.
  branchConversation: (id, messageId) =>
    json(`${conv(id)}/branch`, { method: "POST", body: { message_id: messageId } }),
  usage: () => json("/v1/usage?group_by=model"),
  // Our extension: `format` is "markdown" or "json".
  exportConversation: (id, format) => download(`${conv(id)}/export?format=${encodeURIComponent(format)}`,
    format === "json" ? "conversation.json" : "conversation.md"),
  exportAll: () => download("/v1/conversations/export", "conversations.json"),
  // Our extension: a file either export saved, stored as new conversations (all or none).
  importConversations: (file) => json("/v1/conversations/import", { method: "POST", jsonFile: file }),
  // Our extension: share links, read-only snapshots anyone with the link may read without a key.
  listShares: (id, limit = 1, afterId = undefined) =>
    json(`/v1/shares?limit=${limit}&conversation_id=${encodeURIComponent(id)}`
      + `${afterId ? `&after=${encodeURIComponent(afterId)}` : ""}`),
  // Whether the server lets links be made (sharing.enabled): the link list's X-Sharing-Enabled.
  sharingEnabled: async () => (await send("/v1/shares?limit=1")).headers.get("X-Sharing-Enabled") !== "false",
  createShare: (id) => json(`${conv(id)}/shares`, { method: "POST", body: {} }),
  updateShare: (shareId) => json(`/v1/shares/${encodeURIComponent(shareId)}`, { method: "POST", body: {} }),
  revokeShare: (shareId) => json(`/v1/shares/${encodeURIComponent(shareId)}`, { method: "DELETE" }),
  feedback: (id, messageId, body) =>
    json(`${conv(id)}/messages/${encodeURIComponent(messageId)}/feedback`, { method: "POST", body }),
};

// One parsed SSE item: {comment} for ':' lines, {data} for a complete event.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let dataLines = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline).replace(/\r$/, "");
        buffer = buffer.slice(newline + 1);
        if (line === "") {
          if (dataLines.length) yield { data: dataLines.join("\n") };
          dataLines = [];
        } else if (line.startsWith(":")) {
          yield { comment: line.slice(1).trim() };
        } else if (line.startsWith("data:")) {
          dataLines.push(line.slice(5).replace(/^ /, ""));
        }
      }
    }
    if (dataLines.length) yield { data: dataLines.join("\n") };
  } finally {
    reader.releaseLock();
  }
}

function applyChunk(result, chunk, onDelta, onReasoning) {
  if (chunk.model) result.model = chunk.model;
  if (chunk.usage) result.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    const reasoning = choice.delta && choice.delta.reasoning_content;
    if (reasoning && onReasoning) onReasoning(reasoning);
    const text = choice.delta && choice.delta.content;
    if (text) onDelta(text);
    if (choice.finish_reason) result.finishReason = choice.finish_reason;
  }
}

// Streams one new user message into a stored conversation. Calls onDelta(text) per content
// delta, onReasoning(text) per reasoning_content delta (a reasoning model's thinking) and
// onComment(text) per SSE comment (queue position, heartbeat). Resolves with
// {model, fallbackFrom, fallbackReason, finishReason, usage, historyDropped}; rejects with an AbortError when `signal`
// aborts (the server then aborts the generation) or an ApiFailure.
export async function streamChat({ model, content, conversationId, signal, onDelta, onReasoning, onComment,
                                   options }) {
  const body = {
    ...options,  // further request fields (a reasoning model's thinking choice)
    messages: [{ role: "user", content }],
    stream: true,
    stream_options: { include_usage: true },
    conversation_id: conversationId,
  };
  if (model) body.model = model;
  const response = await send("/v1/chat/completions", { method: "POST", body, signal, accept: "text/event-stream" });
  const result = { model: null, fallbackFrom: response.headers.get("x-fallback-from"), finishReason: null, usage: null,
                   fallbackReason: response.headers.get("x-fallback-reason"),  // "busy", "over_budget" or absent
                   historyDropped: Number(response.headers.get("x-history-messages-dropped") || 0) };
  let isDone = false;
  try {
    for await (const event of sseEvents(response.body)) {
      if (event.comment !== undefined) {
        if (onComment) onComment(event.comment);
      } else if (event.data === "[DONE]") {
        isDone = true;
        break;
      } else {
        const chunk = JSON.parse(event.data);
        if (chunk.error) throw new ApiFailure({ ...streamError(chunk.error), isMidStream: true });
        applyChunk(result, chunk, onDelta, onReasoning);
      }
    }
  } catch (error) {
    if (isAbort(error) || error instanceof ApiFailure) throw error;
    throw networkFailure(error);
  }
  if (!isDone) throw networkFailure("the answer stream ended before it was complete");
  return result;
}

function streamError(error) {
  return { status: 200, type: error.type ?? null, code: error.code ?? null, param: error.param ?? null,
           message: error.message || "The answer failed." };
}
