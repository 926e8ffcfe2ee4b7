// Narrow screens: the conversation list slides over the chat as a drawer with a backdrop.
// While it is shown, Tab stays inside it and Escape closes it, handing focus back to the
// button that opened it. On wide screens the list is always shown and none of this applies.

const FOCUSABLE = "button:not([disabled]), [href], input:not([disabled]), select:not([disabled]), "
  + "textarea:not([disabled]), [tabindex]:not([tabindex='-1'])";

export class Drawer {
  // elements: {sidebar, backdrop, open (the ☰ button), close (its × button), first (focused on open)}
  constructor({ sidebar, backdrop, open, close, first }) {
    Object.assign(this, { sidebar, backdrop, opener: open, first });
    open.addEventListener("click", () => this.open());
    close.addEventListener("click", () => this.close());
    backdrop.addEventListener("click", () => this.close());
    document.addEventListener("keydown", (event) => {
      if (!this.isOpen) return;
      if (event.key === "Escape") this.close();
      else if (event.key === "Tab") this.#trapTab(event);
    });
  }

  get isOpen() { return this.sidebar.classList.contains("open"); }

  open() {
    this.sidebar.classList.add("open");
    this.backdrop.hidden = false;
    this.opener.setAttribute("aria-expanded", "true");
    this.first.focus();
  }

  close() {
    if (!this.isOpen) return;
    const hadFocus = this.sidebar.contains(document.activeElement);
    this.sidebar.classList.remove("open");
    this.backdrop.hidden = true;
    this.opener.setAttribute("aria-expanded", "false");
    if (hadFocus) this.opener.focus();  // else the focus would fall to <body> with the drawer
  }

  // The chat behind the backdrop is out of reach for the mouse; keep it so for the keyboard.
  #trapTab(event) {
    const items = [...this.sidebar.querySelectorAll(FOCUSABLE)].filter((e) => e.offsetParent !== null);
    if (!items.length) return;
    const first = items[0];
    const last = items[items.length - 1];
    const inside = this.sidebar.contains(document.activeElement);
    if (event.shiftKey && (document.activeElement === first || !inside)) {
      event.preventDefault();
      last.focus();
    } else if (!event.shiftKey && (document.activeElement === last || !inside)) {
      event.preventDefault();
      first.focus();
    }
  }
}
