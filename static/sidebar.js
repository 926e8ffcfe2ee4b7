// The conversation list: newest first from the server, paged, with rename (inline) and
// delete (after a confirm dialog), and the search box above it: typing shows the conversations
// holding the text (each with its matching text, put in as text), Escape or clearing it brings
// the list back. Tells the app through callbacks; keeps no messages.

import { announce } from "./announce.js";
import { api } from "./api.js";
import { plural } from "./view.js";

const listEl = document.getElementById("conversation-list");
const emptyEl = document.getElementById("conversation-empty");
const moreEl = document.getElementById("load-more");
const newChatEl = document.getElementById("new-chat");
const searchEl = document.getElementById("conversation-search");
const confirmDialog = document.getElementById("confirm-dialog");
const confirmText = document.getElementById("confirm-text");
const confirmOk = document.getElementById("confirm-ok");
const SEARCH_DELAY_MS = 250;  // typing pauses this long before a search is sent

export function displayTitle(conversation) {
  return conversation.title || "Untitled";
}

export class Sidebar {
  // callbacks: {onOpen(id, messageId), onDeleting(id), onDeleted(id), onRenamed(conversation), onError(error)}
  // (messageId: the message a search hit names, else undefined)
  constructor(callbacks) {
    this.callbacks = callbacks;
    this.items = [];
    this.hasMore = false;
    this.activeId = null;
    this.query = "";          // the text the shown hits hold; "" shows the list
    this.hits = [];           // conversations found, each with message_id and snippet
    this.hitsHaveMore = false;
    this.searchTimer = null;
    this.searchCount = 0;     // an answer to an older search (typed on, cleared) is dropped
    moreEl.addEventListener("click", () => this.loadMore());
    searchEl.addEventListener("input", () => this.queueSearch());
    searchEl.addEventListener("keydown", (event) => {
      if (event.key !== "Escape" || !searchEl.value) return;  // empty: Escape closes the phone drawer
      event.preventDefault();
      searchEl.value = "";
      this.queueSearch();
    });
  }

  async refresh() {
    try {
      const page = await api.listConversations(null);
      this.items = page.data;
      this.hasMore = page.has_more;
      this.render();
    } catch (error) {
      this.callbacks.onError(error);
    }
    if (this.query) await this.search(this.query);  // another key: another organisation's hits
  }

  // Typing searches once it pauses; cleared, the list is back at once.
  queueSearch() {
    clearTimeout(this.searchTimer);
    const text = searchEl.value.trim();
    if (text) {
      this.searchTimer = setTimeout(() => this.search(text), SEARCH_DELAY_MS);
      return;
    }
    this.searchCount += 1;
    this.query = "";
    this.hits = [];
    this.render();
  }

  // The first page of hits for `text`, or with `after` (the last hit shown) the next one.
  async search(text, after = null) {
    const count = ++this.searchCount;
    try {
      const page = await api.searchConversations(text, after ? after.id : null);
      if (count !== this.searchCount) return;
      const known = new Set(after ? this.hits.map((c) => c.id) : []);
      this.hits = [...(after ? this.hits : []), ...page.data.filter((c) => !known.has(c.id))];
      this.hitsHaveMore = page.has_more;
      this.query = text;
      this.render();
      const found = this.hits.length;
      if (!after) announce(found ? `${plural(found, "conversation")} found` : "No conversations match");
    } catch (error) {
      if (count === this.searchCount) this.callbacks.onError(error);
    }
  }

  async loadMore() {
    if (this.query) {
      await this.search(this.query, this.hits[this.hits.length - 1]);
      return;
    }
    const last = this.items[this.items.length - 1];
    try {
      const page = await api.listConversations(last ? last.id : null);
      const known = new Set(this.items.map((c) => c.id));
      this.items.push(...page.data.filter((c) => !known.has(c.id)));
      this.hasMore = page.has_more;
      this.render();
    } catch (error) {
      this.callbacks.onError(error);
    }
  }

  setActive(id) {
    this.activeId = id;
    for (const li of listEl.children) {
      const open = li.querySelector(".conv-open");
      if (li.dataset.id === id) open.setAttribute("aria-current", "page");
      else open.removeAttribute("aria-current");
    }
  }

  // Puts a conversation first (a new one, or one that just got an answer); a hit shown for it
  // takes its new title and keeps its place and matching text.
  upsert(conversation) {
    this.items = [conversation, ...this.items.filter((c) => c.id !== conversation.id)];
    this.hits = this.hits.map((h) => (h.id === conversation.id ? { ...h, title: conversation.title } : h));
    this.render();
  }

  remove(id) {
    this.items = this.items.filter((c) => c.id !== id);
    this.hits = this.hits.filter((c) => c.id !== id);
    this.render();
  }

  render() {
    const shown = this.query ? this.hits : this.items;
    listEl.replaceChildren(...shown.map((c) => (this.query ? this.hitElement(c) : this.itemElement(c))));
    emptyEl.textContent = this.query ? "No conversations match." : "No conversations yet.";
    emptyEl.hidden = shown.length > 0;
    moreEl.hidden = !(this.query ? this.hitsHaveMore : this.hasMore);
  }

  // A search hit: its title and the text around the match (both as text, never HTML); opening
  // it shows the message that matched.
  hitElement(hit) {
    const li = document.createElement("li");
    li.className = "conv-item conv-hit";
    li.dataset.id = hit.id;
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-open";
    open.dir = "auto";
    const title = document.createElement("span");
    title.className = "conv-hit-title";
    title.textContent = displayTitle(hit);
    open.append(title);
    if (hit.snippet) {
      const snippet = document.createElement("span");
      snippet.className = "conv-snippet";
      snippet.textContent = hit.snippet;
      open.append(snippet);
    }
    open.title = displayTitle(hit);
    if (hit.id === this.activeId) open.setAttribute("aria-current", "page");
    open.addEventListener("click", () => this.callbacks.onOpen(hit.id, hit.message_id || undefined));
    li.append(open);
    return li;
  }

  itemElement(conversation) {
    const li = document.createElement("li");
    li.className = "conv-item";
    li.dataset.id = conversation.id;
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-open";
    open.dir = "auto";
    open.textContent = displayTitle(conversation);
    open.title = displayTitle(conversation);
    if (conversation.id === this.activeId) open.setAttribute("aria-current", "page");
    open.addEventListener("click", () => this.callbacks.onOpen(conversation.id));
    const rename = iconButton("\u270E", `Rename ${displayTitle(conversation)}`, "conv-rename");
    rename.addEventListener("click", () => this.startRename(li, conversation));
    const remove = iconButton("\u2715", `Delete ${displayTitle(conversation)}`, "conv-delete");
    remove.addEventListener("click", () => this.confirmDelete(conversation));
    li.append(open, rename, remove);
    return li;
  }

  startRename(li, conversation) {
    const input = document.createElement("input");
    input.type = "text";
    input.className = "conv-title-input";
    input.value = conversation.title || "";
    input.maxLength = 200;
    input.setAttribute("aria-label", "New title");
    li.replaceChildren(input);
    input.focus();
    input.select();
    let isDone = false;
    const finish = async (save) => {
      if (isDone) return;
      isDone = true;
      const title = input.value.trim();
      if (save && title && title !== conversation.title) {
        try {
          const updated = await api.renameConversation(conversation.id, title);
          Object.assign(conversation, updated);
          this.callbacks.onRenamed(conversation);
        } catch (error) {
          this.callbacks.onError(error);
        }
      }
      this.render();
      const again = listEl.querySelector(`li[data-id="${CSS.escape(conversation.id)}"] .conv-rename`);
      if (again) again.focus();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") { event.preventDefault(); finish(true); }
      if (event.key === "Escape") { event.preventDefault(); finish(false); }
    });
    input.addEventListener("blur", () => finish(true));
  }

  async confirmDelete(conversation) {
    if (!(await confirmAction(`Delete \u201c${displayTitle(conversation)}\u201d? This cannot be undone.`))) return;
    const position = this.items.findIndex((c) => c.id === conversation.id);
    this.callbacks.onDeleting(conversation.id);
    try {
      await api.deleteConversation(conversation.id);
    } catch (error) {
      if (error.status !== 404) {
        this.callbacks.onError(error);
        return;
      }
    }
    this.remove(conversation.id);
    this.callbacks.onDeleted(conversation.id);
    this.focusNear(position);
  }

  // After a deletion its button is gone: focus the chat that took its place in the list, else
  // the one before it, else New chat (never <body>).
  focusNear(position) {
    const buttons = listEl.querySelectorAll(".conv-open");
    const near = buttons[Math.min(Math.max(position, 0), buttons.length - 1)];
    (near || newChatEl).focus();
  }
}

function iconButton(symbol, label, className) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = `btn btn-icon btn-small ${className}`;
  button.textContent = symbol;
  button.setAttribute("aria-label", label);
  button.title = label;
  return button;
}

// A modal <dialog> instead of window.confirm (which blocks and cannot be styled).
export function confirmAction(text, okLabel = "Delete") {
  confirmText.textContent = text;
  confirmOk.textContent = okLabel;
  confirmDialog.returnValue = "";
  confirmDialog.showModal();
  return new Promise((resolve) => {
    confirmDialog.addEventListener("close", () => resolve(confirmDialog.returnValue === "ok"), { once: true });
  });
}
