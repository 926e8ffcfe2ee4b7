// A turn's messages as the chat view holds them: a stored message in the view's shape, the
// title a new chat gets before the server names it, and the note a regenerate or an edit
// leaves on the answer it replaces. Pure functions: app.js owns the state they are given.

// A stored message (snake_case finish_reason, fallback_from, ...) in the view's shape. An
// answer's `usage` is the chat completion's, as billed (its thinking count included).
export function fromStored(message, models) {
  const view = { ...message };
  if (message.finish_reason) view.finishReason = message.finish_reason;
  if (message.fallback_from) view.fallbackFrom = message.fallback_from;
  if (message.fallback_reason) view.fallbackReason = message.fallback_reason;
  if (message.history_messages_dropped) {  // the "earlier messages no longer fit" note, after a reload too
    view.historyDropped = message.history_messages_dropped;
    const model = models.get(message.model);
    view.contextLength = model ? model.max_model_len : null;
  }
  return view;
}

const PROVISIONAL_TITLE_CHARS = 80;

export function provisionalTitle(content) {
  const words = content.split(/\s+/).filter(Boolean).join(" ");
  // As the server derives it (store/conversations.py, title_from), so the two can be compared.
  return words.length <= PROVISIONAL_TITLE_CHARS ? words
    : `${words.slice(0, PROVISIONAL_TITLE_CHARS - 1).trimEnd()}\u2026`;
}

// The note that the user asked for another answer or rewrote the prompt of `answer` (the message
// being replaced; kept with the answer for evaluation: api/feedback.py), for the truncate to record
// with its cut, so that a cut refused (another tab's turn came first) records nothing.
const MAX_EDITED_PROMPT_CHARS = 100000;  // api/feedback.py's: a longer note would refuse the cut

export function redoNote(answer, body) {
  if (!body || !answer || answer.role !== "assistant" || !answer.id) return undefined;
  const note = { message_id: answer.id, ...body };
  if (typeof note.edited_prompt === "string") note.edited_prompt = note.edited_prompt.slice(0, MAX_EDITED_PROMPT_CHARS);
  return note;
}
