// js_on_load of the page tab: scroll the page image so the first highlighted box is in view (data-focus is its
// top as a fraction of the page's height). The tab may be hidden when a page arrives: scroll when it shows.
function show() {
  const page = element.querySelector('.mg-page[data-focus]');
  const box = element.querySelector('.mg-page-scroll');
  const img = element.querySelector('.mg-page-img');
  if (!page || !box || !img || !img.clientHeight) return;
  box.scrollTop = Math.max(0, Number(page.dataset.focus) * img.clientHeight - 80);
}
watch('value', show);
new ResizeObserver(show).observe(element);
show();
