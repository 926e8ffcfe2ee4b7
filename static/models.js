// The model picker and its thinking choice: the chat models /v1/models offers (a base model,
// `chat: false`, answers /v1/completions only), the user's remembered choice, and the options a
// send carries for a reasoning model. It owns no conversation: app.js says which model to show.

import { api } from "./api.js";
import { paintWelcome } from "./welcome.js";

const MODEL_STORAGE = "chat.model";
const THINKING_STORAGE = "chat.thinking";
const BRIEF_THINKING_TOKENS = 256;  // "Thinks briefly": the server closes the thinking after this many tokens

// localStorage may throw (privacy modes); the choice is then simply not remembered.
function loadSetting(name) {
  try { return localStorage.getItem(name); } catch { return null; }
}

function saveSetting(name, value) {
  try { localStorage.setItem(name, value); } catch { /* not remembered */ }
}

export class ModelPicker {
  // el: {model (select), thinking (select), thinkingPicker}; onPrompt(text): a welcome example was picked.
  constructor(el, onPrompt) {
    this.el = el;
    this.onPrompt = onPrompt;
    this.models = new Map();  // id -> /v1/models entry (max_model_len, description, example_prompts)
    el.model.addEventListener("change", () => { saveSetting(MODEL_STORAGE, el.model.value); this.showWelcome(); });
    el.thinking.addEventListener("change", () => saveSetting(THINKING_STORAGE, el.thinking.value));
  }

  get value() { return this.el.model.value; }

  current() { return this.models.get(this.el.model.value); }

  async load() {
    const data = (await api.models()).data.filter((m) => m.chat !== false);
    this.models = new Map(data.map((m) => [m.id, m]));
    this.el.model.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    this.el.model.disabled = data.length === 0;
    this.selectRemembered();
    this.showWelcome();
  }

  // Puts the picker on `id` where it is offered (the model an opened conversation used);
  // otherwise leaves it where it is. Never remembered: only the user's change in the picker is.
  select(id) {
    if (!this.models.has(id) || this.el.model.value === id) return;
    this.el.model.value = id;
    this.showWelcome();
  }

  selectRemembered() { this.select(loadSetting(MODEL_STORAGE)); }

  showWelcome() {
    paintWelcome(this.current(), this.onPrompt);
    this.showThinkingChoice();
  }

  // A reasoning model (/v1/models says `reasoning`) gets a thinking choice; "briefly" only where
  // the server can cap its thinking.
  showThinkingChoice() {
    const reasoning = this.current()?.reasoning;
    this.el.thinkingPicker.hidden = !reasoning;
    const brief = this.el.thinking.querySelector('option[value="brief"]');
    brief.hidden = brief.disabled = !(reasoning && reasoning.thinking_token_budget);
    const saved = loadSetting(THINKING_STORAGE) || "";
    this.el.thinking.value = saved === "brief" && brief.disabled ? "" : saved;
  }

  thinkingOptions() {
    if (this.el.thinkingPicker.hidden) return {};
    if (this.el.thinking.value === "off") return { reasoning_effort: "none" };
    if (this.el.thinking.value === "brief") return { thinking_token_budget: BRIEF_THINKING_TOKENS };
    return {};
  }

  setDisabled(disabled) { this.el.model.disabled = this.el.thinking.disabled = disabled; }
}
