// js_on_load of the margin panel (a gr.HTML). Gradio provides: element, trigger, props, watch.
// The panel's HTML comes from the server (app/render.py); this script only
//  - sends a reader's relevant/irrelevant flip to the server (trigger 'click' with the data),
//  - shows the flip at once and keeps showing it until a server render agrees (a render already on its
//    way when the reader clicked must not undo the flip on screen),
//  - scrolls to a card when its cell in the reading map is clicked,
//  - keeps the newest card in view while margins stream in, unless the reader scrolled away,
//  - opens a margin's passage (trigger 'select' with the segment index) when its card or map cell is clicked,
//  - keyboard: j / k next / previous margin, r / x mark it relevant / irrelevant, o or Enter open its passage
//    (ignored while typing in a field). The chosen card keeps its outline across server renders.
const pending = new Map();  // "session|index" -> "1" | "0"
let stick = true;
let focused = null;  // segment index of the card chosen with the keyboard or a click

function cell(index) {
  return element.querySelector('.mg-cell[data-index="' + index + '"]');
}

function apply(card, mark) {
  card.dataset.mark = mark;
  card.dataset.effective = mark;
  card.querySelectorAll('button.mg-flip').forEach(function (b) {
    b.setAttribute('aria-pressed', String(b.dataset.mark === mark));
  });
  const c = cell(card.dataset.index);
  if (c) {
    c.dataset.state = mark === '1' ? 'relevant' : 'irrelevant';
    c.dataset.flipped = '1';
  }
}

function recount() {
  const kept = element.querySelector('.mg-kept');
  if (!kept) return;
  const cards = element.querySelectorAll('.mg-card[data-state="done"]');
  let n = 0;
  cards.forEach(function (c) {
    if (c.dataset.effective !== '0' && !c.querySelector('.mg-text .mg-empty')) n += 1;
  });
  kept.textContent = String(n);
}

function follow() {
  const list = element.querySelector('.mg-cards');
  if (list && stick && element.querySelector('.mg-card[data-state="writing"]')) {
    list.scrollTop = list.scrollHeight;
  }
}

function reapply() {
  const panel = element.querySelector('.mg-panel');
  if (!panel) return;
  const session = panel.dataset.session;
  for (const [key, mark] of Array.from(pending)) {
    const [s, index] = key.split('|');
    if (s !== session) { pending.delete(key); continue; }
    const card = element.querySelector('.mg-card[data-index="' + index + '"]');
    if (!card) continue;
    if (card.dataset.mark === mark) pending.delete(key);  // the server has it
    else apply(card, mark);
  }
  recount();
  follow();
  outline();
}

function outline() {
  element.querySelectorAll('.mg-card[data-focused]').forEach(function (c) { c.removeAttribute('data-focused'); });
  if (focused === null) return;
  const card = element.querySelector('#mg-card-' + focused);
  if (card) card.dataset.focused = '1';
}

function openPassage(index) {
  const panel = element.querySelector('.mg-panel');
  if (!panel) return;
  focused = Number(index);
  outline();
  window.marginaliaOpened = Date.now();  // static/passage.js brings the passage into view
  trigger('select', {session: panel.dataset.session, index: Number(index)});
}

function flip(card, mark) {
  const button = card.querySelector('button.mg-flip[data-mark="' + mark + '"]');
  if (button) button.click();
}

function move(step) {
  const cards = Array.from(element.querySelectorAll('.mg-card[data-state="done"]'));
  if (!cards.length) return;
  const at = cards.findIndex(function (c) { return Number(c.dataset.index) === focused; });
  const next = at === -1 ? (step > 0 ? 0 : cards.length - 1) : Math.min(cards.length - 1, Math.max(0, at + step));
  focused = Number(cards[next].dataset.index);
  outline();
  stick = false;
  cards[next].scrollIntoView({block: 'nearest'});
}

document.addEventListener('keydown', function (e) {
  if (e.ctrlKey || e.metaKey || e.altKey) return;
  const t = e.target;
  if (t && (t.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(t.tagName))) return;
  if (!element.isConnected || !element.querySelector('.mg-card')) return;
  const card = focused === null ? null : element.querySelector('#mg-card-' + focused);
  if (e.key === 'j' || e.key === 'ArrowDown' && e.shiftKey) { move(1); e.preventDefault(); }
  else if (e.key === 'k' || e.key === 'ArrowUp' && e.shiftKey) { move(-1); e.preventDefault(); }
  else if (e.key === 'r' && card) { flip(card, '1'); e.preventDefault(); }
  else if (e.key === 'x' && card) { flip(card, '0'); e.preventDefault(); }
  else if ((e.key === 'o' || e.key === 'Enter') && card && !(t && t.tagName === 'BUTTON')) {
    openPassage(focused); e.preventDefault();
  }
});

element.addEventListener('click', function (e) {
  const button = e.target.closest('button.mg-flip');
  if (button) {
    if (button.disabled) return;
    const card = button.closest('.mg-card');
    const panel = element.querySelector('.mg-panel');
    const mark = button.dataset.mark;
    if (!card || !panel || card.dataset.mark === mark) return;
    pending.set(panel.dataset.session + '|' + card.dataset.index, mark);
    apply(card, mark);
    recount();
    trigger('click', {session: panel.dataset.session, index: Number(card.dataset.index), mark: mark === '1'});
    return;
  }
  const c = e.target.closest('.mg-cell');
  if (c) {
    const card = element.querySelector('#mg-card-' + c.dataset.index);
    if (card) card.scrollIntoView({block: 'nearest', behavior: 'smooth'});
    openPassage(c.dataset.index);
    return;
  }
  const card = e.target.closest('.mg-card');
  if (card && !e.target.closest('button')) openPassage(card.dataset.index);
});

element.addEventListener('scroll', function (e) {
  const list = e.target;
  if (list && list.classList && list.classList.contains('mg-cards')) {
    stick = list.scrollTop + list.clientHeight >= list.scrollHeight - 48;
  }
}, true);

watch('value', reapply);
