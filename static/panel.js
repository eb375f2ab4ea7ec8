// js_on_load of the margin panel (a gr.HTML). Gradio provides: element, trigger, props, watch.
// The panel's HTML comes from the server (app/render.py); this script only
//  - sends a reader's relevant/irrelevant flip to the server (trigger 'click' with the data),
//  - shows the flip at once and keeps showing it until a server render agrees (a render already on its
//    way when the reader clicked must not undo the flip on screen),
//  - scrolls to a card when its cell in the reading map is clicked,
//  - keeps the newest card in view while margins stream in, unless the reader scrolled away.
const pending = new Map();  // "session|index" -> "1" | "0"
let stick = true;

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
}

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
  }
});

element.addEventListener('scroll', function (e) {
  const list = e.target;
  if (list && list.classList && list.classList.contains('mg-cards')) {
    stick = list.scrollTop + list.clientHeight >= list.scrollHeight - 48;
  }
}, true);

watch('value', reapply);
