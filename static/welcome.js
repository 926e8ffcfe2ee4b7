// The empty chat: the selected model's one-line description (its card's first line, from
// /v1/models) and up to three example prompts it answers well; clicking one sends it.

const welcomeEl = document.getElementById("welcome");
const descriptionEl = document.getElementById("welcome-description");
const examplesEl = document.getElementById("welcome-examples");

export function paintWelcome(model, onPick) {
  const description = model && model.description;
  descriptionEl.textContent = description || "";
  descriptionEl.hidden = !description;
  const prompts = (model && model.example_prompts) || [];
  examplesEl.replaceChildren(...prompts.map((text) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "btn example-prompt";
    button.textContent = text;
    button.addEventListener("click", () => onPick(text));
    return button;
  }));
  examplesEl.hidden = prompts.length === 0;
  welcomeEl.classList.toggle("has-examples", prompts.length > 0);
}
