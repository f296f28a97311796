// Services (O1): a card per service, refreshed in place every 2.5 s. A card is made once
// and only its texts change afterwards, so a refresh never moves anything on the page.

import { h, badge, setText, poll, pageHead } from './dom.js';
import { API, get, getOr, byId } from './api.js';
import * as fmt from './fmt.js';
import { openCreateDialog } from './create.js';

const FACTS = [
  ['gpus', 'GPUs', fmt.gpuCount],
  ['parallelism', 'Parallelism', fmt.parallelism],
  ['replicas', 'Replicas', fmt.replicaRange],
  ['autoscale', 'Autoscale', fmt.autoscale],
  ['api', 'API access', (g) => (g.enable_api ? `on${g.endpoint ? ` · ${g.endpoint}` : ''}` : 'off')],
  ['engine', 'Engine', (g, nodes) => fmt.engineLabel(g, nodes)],
  ['uptime', 'Uptime', (g) => {
    const s = fmt.uptimeSeconds(g);
    return s === null ? '—' : fmt.duration(s);
  }],
];

function makeCard(g) {
  const titleId = `card-${g.id}`;
  const refs = {
    name: h('a', { href: `#/services/${g.id}` }),
    status: h('span'),
    model: h('span', { class: 'mono' }),
    why: h('p', { class: 'why' }),
  };
  const dl = h('dl', { class: 'facts' });
  for (const [key, label] of FACTS) {
    refs[key] = h('dd', { dataset: { fact: key } });
    dl.append(h('div', {}, h('dt', {}, label), refs[key]));
  }
  const el = h('article', { class: 'card service-card', role: 'listitem',
    'aria-labelledby': titleId, dataset: { id: g.id } },
  h('header', {}, h('h2', { id: titleId }, refs.name), refs.status),
  h('p', { class: 'model' }, h('span', { class: 'label' }, 'Model route '), refs.model),
  dl, refs.why);
  return { el, refs };
}

function updateCard(card, g, nodes) {
  const { refs } = card;
  setText(refs.name, g.name);
  badge(g.status, refs.status);
  setText(refs.model, g.model_name || '—');
  for (const [key, , value] of FACTS) setText(refs[key], value(g, nodes));
  const why = fmt.why(g);
  setText(refs.why, fmt.firstLine(why));
  refs.why.title = why;
  card.el.dataset.status = g.status;
}

export function servicesPage(main, _params, ctx) {
  const list = h('div', { class: 'cards', role: 'list', 'aria-label': 'Services' });
  const empty = h('p', { class: 'empty', hidden: true },
    ctx.session.operator ? 'No services yet: create one with “New service”.'
      : 'Your tenant has no services yet: create one with “New service”.');
  const stamp = h('p', { class: 'stamp', 'aria-hidden': 'true' });
  const error = h('p', { class: 'form-error', role: 'alert' });
  const create = h('button', { type: 'button', class: 'primary' }, 'New service');
  main.append(pageHead('Services', stamp, create), error, empty, list);

  const cards = new Map();
  let nodes = new Map();
  let rounds = 0;
  async function refresh() {
    try {
      if (rounds % 8 === 0) nodes = byId(await getOr(`${API}/nodes`, []));
      rounds += 1;
      const groups = await get(`${API}/task-groups`);
      groups.sort((a, b) => a.name.localeCompare(b.name) || a.id.localeCompare(b.id));
      const seen = new Set();
      let before = null;
      for (const g of groups) {
        seen.add(g.id);
        let card = cards.get(g.id);
        if (!card) {
          card = makeCard(g);
          cards.set(g.id, card);
        }
        updateCard(card, g, nodes);
        // keep the order by name without re-inserting cards that are already in place
        const want = before ? before.el.nextSibling : list.firstChild;
        if (want !== card.el) list.insertBefore(card.el, want);
        before = card;
      }
      for (const [id, card] of cards) {
        if (!seen.has(id)) { card.el.remove(); cards.delete(id); }
      }
      empty.hidden = groups.length > 0;
      main.dataset.loaded = 'true';
      setText(error, '');
      setText(stamp, `updated ${fmt.time(new Date().toISOString()).slice(11)}`);
    } catch (e) {
      if (e.status !== 401) setText(error, `Could not load the services: ${e.message}`);
      main.dataset.loaded = 'true'; // what the API said is on the page
    }
  }
  const stop = poll(refresh, 2500);
  create.addEventListener('click', () => openCreateDialog({ onCreated: refresh }));
  return stop;
}
