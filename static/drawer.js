// Narrow screens: the conversation list slides over the chat as a drawer with a backdrop.
// While it is shown, the chat behind it is inert, Tab stays inside it and Escape closes it,
// handing focus back to the button that opened it. A modal dialog opened from it (confirm,
// API key) keeps the keyboard to itself. On wide screens the list is always shown and none
// of this applies.

const FOCUSABLE = "button:not([disabled]), [href], input:not([disabled]), select:not([disabled]), "
  + "textarea:not([disabled]), [tabindex]:not([tabindex='-1'])";
const NARROW = "(max-width: 760px)";  // style.css's phone layout

// A modal <dialog> is open (its own Escape closes it, and Tab must move inside it), or the key
// was pressed in one.
function isForDialog(event) {
  const target = event.target instanceof Element ? event.target : null;
  return Boolean(document.querySelector("dialog[open]") || (target && target.closest("dialog")));
}

export class Drawer {
  // elements: {sidebar, backdrop, open (the ☰ button), close (its × button), first (focused on open),
  //            behind (the chat: inert while the drawer covers it)}
  constructor({ sidebar, backdrop, open, close, first, behind }) {
    Object.assign(this, { sidebar, backdrop, opener: open, first, behind });
    open.addEventListener("click", () => this.open());
    close.addEventListener("click", () => this.close());
    backdrop.addEventListener("click", () => this.close());
    document.addEventListener("keydown", (event) => {
      if (!this.isOpen || isForDialog(event)) return;
      // defaultPrevented: an Escape already used inside the drawer (a rename cancelled).
      if (event.key === "Escape" && !event.defaultPrevented) this.close();
      else if (event.key === "Tab") this.#trapTab(event);
    });
    // Widened past the phone layout (a turned tablet): the list is a column again, nothing is behind it.
    window.matchMedia(NARROW).addEventListener("change", (event) => { if (!event.matches) this.#hide(); });
  }

  get isOpen() { return this.sidebar.classList.contains("open"); }

  open() {
    this.sidebar.classList.add("open");
    this.backdrop.hidden = false;
    this.behind.inert = true;
    this.opener.setAttribute("aria-expanded", "true");
    this.first.focus();
  }

  close() {
    if (!this.isOpen) return;
    const hadFocus = this.sidebar.contains(document.activeElement);
    this.#hide();
    if (hadFocus) this.opener.focus();  // else the focus would fall to <body> with the drawer
  }

  #hide() {
    this.sidebar.classList.remove("open");
    this.backdrop.hidden = true;
    this.behind.inert = false;  // first: the opener, in the chat, takes the focus next
    this.opener.setAttribute("aria-expanded", "false");
  }

  // The chat behind the backdrop is inert; Tab past either end of the list wraps around
  // instead of leaving for the browser's own controls.
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
