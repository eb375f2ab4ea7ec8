// js_on_load of the passage view: bring the first highlighted passage into view each time one is shown.
function show() {
  const body = element.querySelector('.mg-segview-body');
  const mark = element.querySelector('mark.mg-span');
  if (body && mark) body.scrollTop = Math.max(0, mark.offsetTop - body.offsetTop - 24);
}
watch('value', show);
show();
