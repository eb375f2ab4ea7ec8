// js_on_load of the library: Open / Continue / Delete on a reading (trigger 'click' with the action and the
// session id). Delete asks once more on the button itself ("Delete? click again") rather than in a dialog.
const OPEN_DEBOUNCE_MS = 250;
element.addEventListener('click', function (e) {
  const button = e.target.closest('button.mg-lib-btn');
  if (!button) return;
  const reading = button.closest('.mg-reading');
  if (!reading) return;
  const action = button.dataset.action;
  if (action === 'delete' && button.dataset.armed !== '1') {
    button.dataset.armed = '1';
    button.textContent = 'Delete? Click again';
    return;
  }
  const session = reading.dataset.session;
  if (action === 'open') {
    // Open is debounced: a second Open pressed while the first is still on its way would be dropped by the
    // event queue (the panel would stay on the first); within OPEN_DEBOUNCE_MS only the last one is sent.
    clearTimeout(element.marginaliaOpen);
    element.marginaliaOpen = setTimeout(function () { trigger('click', {action: action, session: session}); },
                                        OPEN_DEBOUNCE_MS);
    return;
  }
  trigger('click', {action: action, session: session});
});
