// Building the page safely. Every value that came from the API reaches the DOM as a text
// node or a property (textContent, value), never as markup: nothing here parses HTML.

const PROPS = new Set(['value', 'checked', 'disabled', 'selected', 'hidden', 'open', 'readOnly',
  'required', 'multiple', 'htmlFor', 'tabIndex', 'min', 'max', 'step', 'type', 'id', 'name']);
const FORBIDDEN = /^(on|style$|srcdoc$|innerhtml$|outerhtml$)/i;

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

function setProps(el, props) {
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') el.setAttribute('class', v);
    else if (k === 'dataset') Object.assign(el.dataset, v);
    else if (k === 'on') for (const [ev, fn] of Object.entries(v)) el.addEventListener(ev, fn);
    else if (k === 'href') el.setAttribute('href', safeHref(v));
    else if (FORBIDDEN.test(k)) throw new Error(`refusing to set ${k}`);
    else if (PROPS.has(k)) el[k] = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
}

// Links the console makes point inside it (#/...), at this origin, or at a blob it made.
function safeHref(v) {
  const s = String(v);
  return /^(#|\/(?!\/)|blob:)/.test(s) ? s : '#';
}

/** An element: h('a', {href: '#/x', class: 'k', on: {click}}, 'text', child, [more]). */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  setProps(el, props);
  append(el, children);
  return el;
}

const SVG_NS = 'http://www.w3.org/2000/svg';
/** An SVG element; attributes are presentation attributes (CSP allows no style="..."). */
export function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (FORBIDDEN.test(k)) throw new Error(`refusing to set ${k}`);
    if (v !== undefined && v !== null) el.setAttribute(k, String(v));
  }
  append(el, children);
  return el;
}

/** Replace an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** Set text only when it changed: a refresh that changes nothing moves nothing. */
export function setText(el, value) {
  const s = value === null || value === undefined ? '' : String(value);
  if (el.textContent !== s) el.textContent = s;
}

let uid = 0;
/** A fresh id for label/aria wiring. */
export function newId(prefix = 'hf') {
  uid += 1;
  return `${prefix}-${uid}`;
}

/** A labelled form field: {wrap, input}. kind: 'input' | 'select' | 'textarea'. */
export function field(label, props = {}, kind = 'input', hint = '') {
  const id = props.id || newId('f');
  const input = h(kind, { ...props, id });
  const hintEl = hint ? h('small', { class: 'hint', id: `${id}-hint` }, hint) : null;
  if (hintEl) input.setAttribute('aria-describedby', hintEl.id);
  const wrap = h('div', { class: 'field' }, h('label', { htmlFor: id }, label), input, hintEl);
  return { wrap, input };
}

/** A <select>'s options from [value, text] pairs, keeping the selection when it still exists. */
export function setOptions(select, pairs) {
  const keep = select.value;
  fill(select, pairs.map(([v, t]) => h('option', { value: v }, t)));
  if (pairs.some(([v]) => v === keep)) select.value = keep;
}

// ----- status badges -----
const TONE = {
  running: 'ok', completed: 'neutral', stopped: 'neutral', online: 'ok',
  pending: 'wait', scheduling: 'wait', scheduled: 'wait', starting: 'wait', waking: 'wait',
  sleeping: 'sleep', stopping: 'warn', draining: 'warn', offline: 'bad', failed: 'bad',
  rolling: 'wait', recreating: 'wait', rolling_back: 'warn', done: 'ok',
};
export function tone(status) {
  return TONE[status] || 'neutral';
}
/** A status as a coloured badge that says it in words too. */
export function badge(status, el) {
  const b = el || h('span');
  b.className = `badge tone-${tone(status)}`;
  setText(b, status || 'unknown');
  return b;
}

// ----- toasts (one polite live region; errors are assertive) -----
export function toast(message, level = 'info') {
  const host = document.getElementById(level === 'error' ? 'alerts' : 'toasts');
  if (!host) return;
  const t = h('div', { class: `toast level-${level}` }, message);
  host.append(t);
  setTimeout(() => t.remove(), level === 'error' ? 10000 : 5000);
}

// ----- copying -----
export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const ta = h('textarea', { class: 'offscreen', readOnly: true, value: text });
    document.body.append(ta);
    ta.select();
    const ok = document.execCommand('copy');
    ta.remove();
    return ok;
  }
}

/** A "Copy" button for what getText() returns; says it copied. */
export function copyButton(getText, label = 'Copy') {
  const b = h('button', { type: 'button', class: 'small' }, label);
  b.addEventListener('click', async () => {
    const ok = await copyText(getText());
    toast(ok ? 'Copied to the clipboard' : 'Could not copy: select the text and copy it',
      ok ? 'success' : 'warning');
  });
  return b;
}

/** A secret shown once: a read-only field with a copy button and the warning. */
export function secretBox(label, secret, note) {
  const f = field(label, { value: secret, readOnly: true, class: 'mono secret',
    spellcheck: 'false', autocomplete: 'off' });
  f.input.addEventListener('focus', () => f.input.select());
  return h('div', { class: 'secret-box' },
    h('div', { class: 'row' }, f.wrap, copyButton(() => secret)),
    h('p', { class: 'note' }, note));
}

// ----- dialogs -----
/** A modal <dialog> (native focus trap, Escape closes); removed from the page when closed. */
export function modal(title, ...body) {
  const titleId = newId('dlg');
  const close = h('button', { type: 'button', class: 'icon', 'aria-label': 'Close the dialog' }, '×');
  const dlg = h('dialog', { class: 'modal', 'aria-labelledby': titleId },
    h('header', {}, h('h2', { id: titleId }, title), close), ...body);
  close.addEventListener('click', () => dlg.close());
  dlg.addEventListener('close', () => dlg.remove());
  document.body.append(dlg);
  dlg.showModal();
  return dlg;
}

/** Ask before something that cannot be undone; resolves true when confirmed. */
export function confirmDialog(title, message, confirmLabel, danger = true) {
  return new Promise((resolve) => {
    let answer = false;
    const yes = h('button', { type: 'button', class: danger ? 'danger' : 'primary' }, confirmLabel);
    const no = h('button', { type: 'button' }, 'Cancel');
    const dlg = modal(title, h('p', {}, message), h('div', { class: 'actions' }, no, yes));
    yes.addEventListener('click', () => { answer = true; dlg.close(); });
    no.addEventListener('click', () => dlg.close());
    dlg.addEventListener('close', () => resolve(answer));
    no.focus();
  });
}

/** Run fn now and then every ms after it finished (no overlap; paused while hidden). */
export function poll(fn, ms) {
  let stopped = false;
  let timer = null;
  const tick = async () => {
    if (stopped) return;
    if (!document.hidden) {
      try { await fn(); } catch (e) { console.warn(e); }
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

/** A page's heading row: the h1 (focused after navigation) and optional controls. */
export function pageHead(title, ...controls) {
  return h('div', { class: 'page-head' },
    h('h1', { tabIndex: -1, class: 'page-title' }, title),
    h('div', { class: 'controls' }, ...controls));
}

/** A table from column titles and rows of cells (cells: text or nodes), in a box that
 *  scrolls sideways on its own when the table is wider than the window (the page never
 *  does); the box takes the keyboard focus so that it can be scrolled without a mouse. */
export function table(caption, columns, rows, cls = '') {
  return h('div', { class: 'table-scroll', role: 'region', tabIndex: 0,
    'aria-label': caption || 'Table' },
  h('table', { class: `grid ${cls}` },
    caption ? h('caption', { class: 'sr-only' }, caption) : null,
    h('thead', {}, h('tr', {}, columns.map((c) => h('th', { scope: 'col' }, c)))),
    h('tbody', {}, rows.map((r) => h('tr', {}, r.map((c) => h('td', {}, c)))))));
}
