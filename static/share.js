// The page a share link opens (/share/<token>): reads the snapshot from GET /v1/shared/<token>
// (no key; nothing else is sent) and shows it read-only through the chat's own rendering
// (view.js; an answer's Markdown through render.js's sanitiser), under a note that it is a
// snapshot and when it was taken. Attachments come by name only: a link never carries a file.

import { chipElement } from "./attachments.js";
import { messageElement } from "./view.js";

const titleEl = document.getElementById("shared-title");
const noteEl = document.getElementById("shared-note");
const messagesEl = document.getElementById("messages");
const TOKEN_PATH = /^\/share\/([A-Za-z0-9_-]{1,128})$/;
const NOT_FOUND_TEXT = "Nothing is shared at this link: it may be mistyped, or its owner stopped sharing it.";

// The server holds each address to so many reads of links a minute (sharing.reads_per_minute).
function tooManyReadsText(retryAfter) {
  const seconds = Math.max(1, Math.ceil(Number(retryAfter) || 60));
  return `Too many shared conversations were opened from your network just now. `
    + `Reload the page in ${seconds} second${seconds === 1 ? "" : "s"}.`;
}

function takenText(seconds) {
  const when = new Date(seconds * 1000).toLocaleString(undefined, { dateStyle: "long", timeStyle: "short" });
  return `A read-only snapshot of a conversation, taken ${when}. Messages added after that are not shown.`;
}

// A message's attachments, by name: the files themselves are not part of a share.
function attachmentList(names) {
  const list = document.createElement("ul");
  list.className = "msg-attachments shared-attachment-list";
  list.setAttribute("aria-label", "Attachments");
  for (const name of names) {
    const item = document.createElement("li");
    item.append(chipElement(name, "not shared"));
    list.append(item);
  }
  return list;
}

function showMessages(messages) {
  messages.forEach((message, index) => {
    const view = {
      role: message.role, content: message.content, model: message.model || null,
      finishReason: message.finish_reason || null,
      // An empty parts list hides the empty bubble of a message that was attachments only.
      parts: message.attachments ? [] : undefined,
    };
    const article = messageElement(view, index, {});  // no actions: Copy only
    if (message.attachments) article.querySelector(".msg-foot").before(attachmentList(message.attachments));
    messagesEl.append(article);
  });
}

// Resolves with the snapshot, or with {problem} saying why there is none.
async function readSnapshot() {
  const match = TOKEN_PATH.exec(window.location.pathname);
  if (!match) return { problem: NOT_FOUND_TEXT };
  let response;
  try {
    response = await fetch(`/v1/shared/${match[1]}`, { cache: "no-store", credentials: "omit" });
  } catch {
    return { problem: "The conversation could not be loaded: check the connection, then reload the page." };
  }
  if (response.status === 404) return { problem: NOT_FOUND_TEXT };
  if (response.status === 429) return { problem: tooManyReadsText(response.headers.get("Retry-After")) };
  if (!response.ok) return { problem: `The server could not show it (HTTP ${response.status}). Try again later.` };
  return response.json();
}

async function load() {
  const snapshot = await readSnapshot();
  if (snapshot.problem) {
    titleEl.textContent = "No shared conversation";
    noteEl.textContent = snapshot.problem;
  } else {
    const title = snapshot.title || "Untitled";
    titleEl.textContent = title;
    document.title = `${title} \u2013 Shared conversation`;
    noteEl.textContent = takenText(snapshot.created_at);
    showMessages(snapshot.messages);
  }
  document.body.classList.add("ready");
}

load();
