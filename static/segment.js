// js_on_load of the "Now reading" view: keep the highlighted segment in view.
function show() {
  const body = element.querySelector('.mg-segview-body');
  const current = element.querySelector('.mg-current');
  if (body && current) body.scrollTop = Math.max(0, current.offsetTop - body.offsetTop - 24);
}
watch('value', show);
show();
