// Feedback under each stored answer: thumbs up / down and an optional comment, saved through
// POST /v1/conversations/{id}/messages/{id}/feedback (api/feedback.py); they come back with
// the conversation, so they show again after a reload.

import { api } from "./api.js";
import { icon } from "./icons.js";

// label: the button's text, or an element (an icon) to show instead.
function toggle(label, ariaLabel, isPressed, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "btn btn-small btn-ghost feedback-button";
  button.append(label);
  button.setAttribute("aria-label", ariaLabel);
  button.setAttribute("aria-pressed", isPressed ? "true" : "false");
  button.addEventListener("click", onClick);
  return button;
}

function commentForm(current, onSave, onCancel) {
  const form = document.createElement("form");
  form.className = "feedback-form";
  const area = document.createElement("textarea");
  area.rows = 2;
  area.maxLength = 2000;
  area.value = current || "";
  area.placeholder = "What was good or wrong about this answer? (optional)";
  area.setAttribute("aria-label", "Comment on this answer");
  const save = document.createElement("button");
  save.type = "submit";
  save.className = "btn btn-primary btn-small";
  save.textContent = "Save comment";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.className = "btn btn-ghost btn-small";
  cancel.textContent = "Cancel";
  cancel.addEventListener("click", onCancel);
  form.addEventListener("submit", (event) => { event.preventDefault(); onSave(area.value.trim() || null); });
  form.append(area, save, cancel);
  setTimeout(() => area.focus(), 0);
  return form;
}

// {conversationId, message, onSaved(feedback), onError(error)} -> the controls' element.
export function feedbackControls({ conversationId, message, onSaved, onError }) {
  const wrap = document.createElement("span");
  wrap.className = "feedback";
  const current = message.feedback || {};
  const save = async (body) => {
    try {
      onSaved(await api.feedback(conversationId, message.id, body));
    } catch (error) {
      onError(error);
    }
  };
  const rate = (value) => save({ rating: current.rating === value ? null : value });
  wrap.append(
    toggle(icon("thumb-up"), "Good answer", current.rating === 1, () => rate(1)),
    toggle(icon("thumb-down"), "Bad answer", current.rating === -1, () => rate(-1)),
  );
  const commentButton = toggle(current.comment ? "Comment \u2713" : "Comment", "Comment on this answer",
                               Boolean(current.comment), () => {
    const form = commentForm(current.comment, (comment) => save({ comment }), () => form.replaceWith(commentButton));
    commentButton.replaceWith(form);
  });
  wrap.append(commentButton);
  return wrap;
}
