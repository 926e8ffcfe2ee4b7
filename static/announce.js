// The one visually hidden status region (#announcer) that screen readers read out politely:
// a short line once an answer is finished, a copy's result. Never the streamed tokens: read
// one by one they would drown out everything else.

const regionEl = document.getElementById("announcer");
const REFILL_MS = 100;  // emptied first, then filled: the same line twice is still read twice
let refillTimer = null;

export function announce(text) {
  clearTimeout(refillTimer);
  regionEl.textContent = "";
  refillTimer = setTimeout(() => { regionEl.textContent = text; }, REFILL_MS);
}
