// The chat header's Share button and its dialog: a link to a read-only snapshot of the open
// conversation (POST /v1/conversations/{id}/shares), shown with a Copy button, a way to revoke
// it, and, once the chat has moved on, a way to update the snapshot under the same link.
// The conversation's newest link is reused: opening the dialog never publishes new turns. The
// button is offered only once the server says links may be made (sharing.enabled).

import { announce } from "./announce.js";
import { api } from "./api.js";
import { copyButton } from "./render.js";
import { confirmAction } from "./sidebar.js";

const openEl = document.getElementById("share-open");
const dialogEl = document.getElementById("share-dialog");
const linkEl = document.getElementById("share-link");
const rowEl = document.getElementById("share-link-row");
const noteEl = document.getElementById("share-note");
const statusEl = document.getElementById("share-status");
const updateEl = document.getElementById("share-update");
const revokeEl = document.getElementById("share-revoke");

function whenText(seconds) {
  return new Date(seconds * 1000).toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
}

export class Shares {
  // conversationId(): the open chat's id (null for a new chat); lastMessageId(): the id of its last
  // stored message; onError(error): shown to the user; onNotice(text): an information banner.
  constructor({ conversationId, lastMessageId, onError, onNotice }) {
    Object.assign(this, { conversationId, lastMessageId, onError, onNotice });
    this.share = null;  // the link the dialog shows
    this.isEnabled = null;  // whether the server lets links be made; null until loadSettings
    this.copyEl = copyButton(() => linkEl.value, "Copy link");
    this.copyEl.className = "btn btn-primary";
    rowEl.append(this.copyEl);
    openEl.addEventListener("click", () => this.open());
    updateEl.addEventListener("click", () => this.update());
    revokeEl.addEventListener("click", () => this.revoke());
    // Escape or Done: back on the Share button (it stays where it was: the same chat is open).
    dialogEl.addEventListener("close", () => { if (!openEl.hidden) openEl.focus(); });
  }

  // Offered only for a stored conversation (a new chat has nothing to share yet).
  showFor(id) {
    if (dialogEl.open) dialogEl.close();
    this.#showButton(id);
  }

  // Asks the server once whether links may be made; unknown (a network failure): offered, and
  // creating one says why if it cannot.
  async loadSettings() {
    try {
      this.isEnabled = await api.sharingEnabled();
    } catch {
      this.isEnabled = true;
    }
    this.#showButton(this.conversationId());
  }

  #showButton(id) {
    openEl.hidden = !id || this.isEnabled !== true;
  }

  // Shows the chat's newest link, made first if it has none.
  async open() {
    const id = this.conversationId();
    if (!id) return;
    await this.busy(openEl, async () => {
      const found = await api.listShares(id);
      const existing = found.data[0];
      this.show(existing || await api.createShare(id), existing ? "" : "Link created.");
      dialogEl.showModal();
      this.copyEl.focus();
    });
  }

  // The snapshot taken again, the link unchanged.
  async update() {
    await this.busy(updateEl, async () => {
      this.show(await api.updateShare(this.share.id), "Updated: the link shows the chat as it is now.");
      this.copyEl.focus();  // the Update button hides itself
    });
  }

  // Every link of the chat (another tab or an API client may have made more than the one shown).
  async revoke() {
    const question = "Revoke this chat's share link? Anyone who has it will no longer be able to read it.";
    if (!(await confirmAction(question, "Revoke"))) return;  // cancelled: the share dialog stays as it was
    await this.busy(revokeEl, async () => {
      const id = this.conversationId();
      let page = await api.listShares(id, 100);
      for (;;) {
        for (const share of page.data) await api.revokeShare(share.id);
        if (!page.has_more) break;
        page = await api.listShares(id, 100);  // revoked ones are gone: the next 100 are first now
      }
      this.share = null;
      dialogEl.close();
      this.onNotice("The share link was revoked: it no longer opens anything.");
    });
  }

  show(share, status) {
    this.share = share;
    linkEl.value = share.url;  // the server's public address for links (sharing.public_base_url), or ours
    const isBehind = share.last_message_id !== this.lastMessageId();
    noteEl.textContent = `Snapshot taken ${whenText(share.snapshot_at)}. Anyone with the link can read it, `
      + `without an API key${isBehind ? "; messages sent since are not in it." : "."}`;
    updateEl.hidden = !isBehind;
    statusEl.textContent = status;
    if (status) announce(status);
  }

  // One request at a time per button; it says it is busy (a disabled button would drop focus).
  async busy(button, run) {
    if (button.getAttribute("aria-busy") === "true") return;
    button.setAttribute("aria-busy", "true");
    try {
      await run();
    } catch (error) {
      if (dialogEl.open) dialogEl.close();
      if (error.code === "sharing_disabled") {  // turned off since the page loaded
        this.isEnabled = false;
        this.#showButton(this.conversationId());
      }
      this.onError(error);
    } finally {
      button.removeAttribute("aria-busy");
    }
  }
}
