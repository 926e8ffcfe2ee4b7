// The conversation list: newest first from the server, paged, with rename (inline) and
// delete (after a confirm dialog). Tells the app through callbacks; keeps no messages.

import { api } from "./api.js";

const listEl = document.getElementById("conversation-list");
const emptyEl = document.getElementById("conversation-empty");
const moreEl = document.getElementById("load-more");
const newChatEl = document.getElementById("new-chat");
const confirmDialog = document.getElementById("confirm-dialog");
const confirmText = document.getElementById("confirm-text");
const confirmOk = document.getElementById("confirm-ok");

export function displayTitle(conversation) {
  return conversation.title || "Untitled";
}

export class Sidebar {
  // callbacks: {onOpen(id), onDeleting(id), onDeleted(id), onRenamed(conversation), onError(error)}
  constructor(callbacks) {
    this.callbacks = callbacks;
    this.items = [];
    this.hasMore = false;
    this.activeId = null;
    moreEl.addEventListener("click", () => this.loadMore());
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
  }

  async loadMore() {
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

  // Puts a conversation first (a new one, or one that just got an answer).
  upsert(conversation) {
    this.items = [conversation, ...this.items.filter((c) => c.id !== conversation.id)];
    this.render();
  }

  remove(id) {
    this.items = this.items.filter((c) => c.id !== id);
    this.render();
  }

  render() {
    listEl.replaceChildren(...this.items.map((c) => this.itemElement(c)));
    emptyEl.hidden = this.items.length > 0;
    moreEl.hidden = !this.hasMore;
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
