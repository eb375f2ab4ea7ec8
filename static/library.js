// js_on_load of the library: Open / Continue / Delete on a reading (trigger 'click' with the action and the
// session id). Delete asks once more on the button itself ("Delete? click again") rather than in a dialog.
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
  trigger('click', {action: action, session: reading.dataset.session});
});
