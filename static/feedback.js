// Feedback under each stored answer: thumbs up / down and an optional comment, saved through
// POST /v1/conversations/{id}/messages/{id}/feedback (api/feedback.py); they come back with
// the conversation, so they show again after a reload.

import { api } from "./api.js";
import { icon } from "./icons.js";

// label: the button's text, or an element (an icon) to show instead. action: its data-action,
// by which a repaint puts focus back on it (view.js, focusAt).
function toggle({ action, label, ariaLabel }, isPressed, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "btn btn-small btn-ghost feedback-button";
  button.dataset.action = action;
  button.append(label);
  button.setAttribute("aria-label", ariaLabel);
  button.setAttribute("aria-pressed", isPressed ? "true" : "false");
  button.addEventListener("click", onClick);
  return button;
}

function commentForm(current, onSave, onCancel) {
  const form = document.createElement("form");
  form.className = "feedback-form";
  form.dataset.action = "comment";  // stands in for the Comment button until saved or cancelled
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
  form.addEventListener("keydown", (event) => {
    if (event.key === "Escape") { event.preventDefault(); onCancel(); }
  });
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
    toggle({ action: "good", label: icon("thumb-up"), ariaLabel: "Good answer" }, current.rating === 1, () => rate(1)),
    toggle({ action: "bad", label: icon("thumb-down"), ariaLabel: "Bad answer" }, current.rating === -1, () => rate(-1)),
  );
  const commentLabel = current.comment ? "Comment \u2713" : "Comment";
  const commentButton = toggle({ action: "comment", label: commentLabel, ariaLabel: "Comment on this answer" },
                               Boolean(current.comment), () => {
    const cancel = () => { form.replaceWith(commentButton); commentButton.focus(); };
    const form = commentForm(current.comment, (comment) => save({ comment }), cancel);
    commentButton.replaceWith(form);
  });
  wrap.append(commentButton);
  return wrap;
}
