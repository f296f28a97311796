// The console's shell: login, navigation, and a hash router (#/services, #/services/<id>,
// #/models, #/nodes, #/fleet, #/usage, #/admin). Each page is a function that fills <main> and
// returns what stops its refresh timers when the user leaves it.

import { h, fill, field, toast } from './dom.js';
import { session, login, logout } from './api.js';
import { servicesPage } from './services.js';
import { detailPage } from './detail.js';
import { modelsPage } from './models.js';
import { nodesPage } from './nodes.js';
import { usagePage } from './usage.js';
import { adminPage } from './admin.js';
import { fleetPage } from './fleet.js'; // issue 33

const PAGES = [
  { re: /^#\/services\/([A-Za-z0-9._-]+)$/, page: detailPage, nav: '#/services' },
  { re: /^#\/services$/, page: servicesPage, nav: '#/services', title: 'Services' },
  { re: /^#\/models$/, page: modelsPage, nav: '#/models', title: 'Models' },
  { re: /^#\/nodes$/, page: nodesPage, nav: '#/nodes', title: 'Nodes and cards' },
  { re: /^#\/usage$/, page: usagePage, nav: '#/usage', title: 'Usage' },
  { re: /^#\/fleet$/, page: fleetPage, nav: '#/fleet', title: 'Fleet overview' },
  { re: /^#\/admin$/, page: adminPage, nav: '#/admin', title: 'Control panel', operator: true },
];
const NAV = [
  ['#/services', 'Services'], ['#/models', 'Models'], ['#/nodes', 'Nodes'],
  ['#/fleet', 'Fleet'], ['#/usage', 'Usage'], ['#/admin', 'Control panel', true],
];

const main = document.getElementById('main');
const nav = document.getElementById('nav');
const who = document.getElementById('who');
let leave = null;
let loginMessage = '';

function shell(s) {
  fill(nav, h('ul', {}, NAV.filter(([, , op]) => !op || s.operator).map(([href, text]) =>
    h('li', {}, h('a', { href, dataset: { nav: href } }, text)))));
  nav.hidden = false;
  const out = h('button', { type: 'button', class: 'small' }, 'Log out');
  out.addEventListener('click', () => logout(''));
  fill(who, h('span', { class: 'user' }, s.name, ' ', h('span', { class: 'role' }, s.role)), out);
}

function loginPage() {
  nav.hidden = true;
  delete main.dataset.loaded;
  fill(who);
  document.title = 'Log in · HeteroFlow';
  const user = field('User name', { autocomplete: 'username', required: true, name: 'username' });
  const pass = field('Password', { type: 'password', autocomplete: 'current-password',
    required: true, name: 'password' });
  const error = h('p', { class: 'form-error', role: 'alert' }, loginMessage);
  const submit = h('button', { type: 'submit', class: 'primary' }, 'Log in');
  const form = h('form', { class: 'login', 'aria-labelledby': 'login-title' },
    h('h1', { id: 'login-title', tabIndex: -1 }, 'Log in to HeteroFlow'),
    h('p', { class: 'note' }, 'Your HeteroFlow user: the same as for the CLI and the API.'),
    user.wrap, pass.wrap, error, submit);
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    submit.disabled = true;
    error.textContent = '';
    try {
      await login(user.input.value, pass.input.value);
      loginMessage = '';
      if (!/^#\//.test(location.hash)) location.hash = '#/services';
      render();
    } catch (e) {
      error.textContent = e.status === 401 || e.status === 400
        ? 'Wrong user name or password.' : e.message;
      pass.input.select();
    } finally {
      submit.disabled = false;
    }
  });
  fill(main, form);
  user.input.focus();
}

function render() {
  if (leave) { leave(); leave = null; }
  const s = session();
  if (!s) { loginPage(); return; }
  shell(s);
  const hash = location.hash;
  const route = PAGES.find((p) => p.re.test(hash));
  if (!route) { location.replace('#/services'); return; }
  for (const a of nav.querySelectorAll('a')) {
    if (a.dataset.nav === route.nav) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  fill(main);
  delete main.dataset.loaded; // each page sets it once it has shown the API's answer
  if (route.operator && !s.operator) {
    main.append(h('h1', { tabIndex: -1 }, route.title),
      h('p', {}, 'The control panel is for platform operators.'));
    return;
  }
  document.title = `${route.title || 'Service'} · HeteroFlow`;
  const params = hash.match(route.re).slice(1);
  leave = route.page(main, params, { session: s }) || null;
  const h1 = main.querySelector('h1');
  if (h1 && document.activeElement === document.body) h1.focus({ preventScroll: true });
}

window.addEventListener('hashchange', () => {
  if (/^#\//.test(location.hash)) render(); // "#main" (the skip link) is no page
});
window.addEventListener('hf-logout', (ev) => {
  loginMessage = ev.detail || '';
  if (ev.detail) toast(ev.detail, 'warning');
  render();
});
document.getElementById('openai-base').textContent = `${location.origin}/v1`;
render();
