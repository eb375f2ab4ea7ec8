// js_on_load of the answers (a gr.HTML): a click on a "Segment N" chip, or on an inline citation in an
// answer's text, opens that margin's passage
// (trigger 'select' with the segment index; the server knows which session is open).
element.addEventListener('click', function (e) {
  const chip = e.target.closest('.mg-chip[data-index], .mg-cite[data-index]');
  if (!chip) return;
  window.marginaliaOpened = Date.now();  // static/passage.js brings the passage into view
  trigger('select', {index: Number(chip.dataset.index)});
});
