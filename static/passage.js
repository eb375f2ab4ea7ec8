// js_on_load of the passage view: bring the first highlighted passage into view each time one is shown, and the
// view itself when the reader just asked for it (a card, cell or chip sets window.marginaliaOpened), not when a
// page load restores it.
function show() {
  const body = element.querySelector('.mg-segview-body');
  const mark = element.querySelector('mark.mg-span');
  if (body && mark) body.scrollTop = Math.max(0, mark.offsetTop - body.offsetTop - 24);
  if (window.marginaliaOpened && Date.now() - window.marginaliaOpened < 10000) {
    window.marginaliaOpened = 0;
    element.scrollIntoView({block: 'nearest', behavior: 'smooth'});
  }
}
watch('value', show);
show();
