// Bringing conversations in: the sidebar's "Import conversations" picks a .json file that an
// export saved (one conversation, or all of them) and posts it as it is to
// POST /v1/conversations/import, which checks it whole and stores all of it or nothing.

import { api, ApiFailure } from "./api.js";
import { showBanner } from "./notices.js";
import { plural } from "./view.js";

const buttonEl = document.getElementById("import-conversations");
const inputEl = document.getElementById("import-input");

export class Imports {
  // onImported(result): after the file's conversations are stored; onError(error): shown to the user.
  constructor({ onImported, onError }) {
    this.onImported = onImported;
    this.onError = onError;
    buttonEl.addEventListener("click", () => { if (!this.isBusy) inputEl.click(); });
    inputEl.addEventListener("change", () => this.importPicked());
  }

  get isBusy() { return buttonEl.getAttribute("aria-busy") === "true"; }

  // One import at a time; the button stays focusable (as the downloads' do) and says it is busy.
  async importPicked() {
    const file = inputEl.files[0];
    inputEl.value = "";  // picking the same file again is a change too
    if (!file || this.isBusy) return;
    buttonEl.setAttribute("aria-busy", "true");
    try {
      const result = await api.importConversations(file);
      // They keep their own dates, so they may land far down the list: the banner says they came.
      showBanner(`Imported ${plural(result.num_conversations, "conversation")} from ${file.name}.`, { isInfo: true });
      await this.onImported(result);
    } catch (error) {
      this.onError(readable(error, file.name));
    } finally {
      buttonEl.removeAttribute("aria-busy");
    }
  }
}

// A file the server cannot read as an export is a 400 naming a field ("'messages' must be an
// array..."): said first in the user's words, the server's reason after it. A full storage keeps
// its own message (it says what to delete).
function readable(error, fileName) {
  if (!(error instanceof ApiFailure) || error.status !== 400 || error.code === "conversation_quota_exceeded") {
    return error;
  }
  const message = `${fileName} is not a conversation export this chat can read (${error.message})`;
  return new ApiFailure({ ...error, message });
}
