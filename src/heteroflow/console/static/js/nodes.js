// Nodes and cards: every node the user may use, its status and last heartbeat, and each
// card (vendor, model, memory, temperature, utilisation when reported) with the replicas
// that hold a share of it.

import { h, fill, poll, pageHead, table, badge, setText } from './dom.js';
import { API, get, getOr } from './api.js';
import * as fmt from './fmt.js';
import { nodeCharts } from './charts.js'; // issue 33: the live series

/** card key "node/index" -> [{label, share}] from the replicas the user can see. */
function holders(groups) {
  const out = new Map();
  for (const g of groups) {
    for (const t of fmt.liveTasks(g)) {
      const shared = g.task_type === 'inference' && t.gpu_required === 1
        && g.parallelism !== 'tensor_parallel';
      for (const i of t.gpu_ids || []) {
        const key = `${t.node_id}/${i}`;
        if (!out.has(key)) out.set(key, []);
        out.get(key).push({ label: `${g.name} · ${t.name}`, group: g.id,
          share: shared ? `${g.gpu_memory_utilization} %` : 'whole card' });
      }
    }
  }
  return out;
}

function utilisation(card) {
  for (const k of ['utilization_percent', 'utilization_gpu', 'gpu_utilization', 'utilization']) {
    if (typeof card[k] === 'number') return `${Math.round(card[k])} %`;
  }
  return '—';
}

function makePanel(n) {
  const refs = { name: h('span'), status: h('span'), hb: h('span'), facts: h('dl', { class: 'kv' }),
    cards: h('div') };
  const live = nodeCharts(n.id);
  const el = h('section', { class: 'panel node', dataset: { node: n.id } },
    h('h2', {}, refs.name, ' ', refs.status),
    h('p', { class: 'note' }, 'Last heartbeat ', refs.hb), refs.facts, refs.cards, live.el);
  return { el, refs, sig: '', live };
}

function updatePanel(p, n, held) {
  setText(p.refs.name, n.name);
  badge(n.status, p.refs.status);
  setText(p.refs.hb, `${fmt.ago(n.last_heartbeat_at)} (${fmt.time(n.last_heartbeat_at)})`);
  const cards = n.gpus || [];
  const sig = JSON.stringify([n, cards.map((c) => held.get(`${n.id}/${c.index}`) || [])],
    (k, v) => (k === 'last_heartbeat_at' || k === 'host_ports_in_use' ? undefined : v));
  if (sig === p.sig) return;
  p.sig = sig;
  const engines = Object.entries(n.engines || {}).map(([e, v]) => (v ? `${e} ${v}` : e));
  fill(p.refs.facts,
    h('dt', {}, 'Address'), h('dd', { class: 'mono' }, n.address || '—'),
    h('dt', {}, 'Runtime'), h('dd', {}, n.runtime || '—'),
    h('dt', {}, 'CPU'), h('dd', {}, `${n.cpu_count} cores, ${fmt.num(n.cpu_percent, 0)} % busy`),
    h('dt', {}, 'Memory'), h('dd', {}, `${fmt.mib(n.memory_available_mb)} free of ${fmt.mib(n.memory_total_mb)}`),
    h('dt', {}, 'Engines'), h('dd', {}, engines.join(', ') || '—'),
    h('dt', {}, 'Models'), h('dd', {}, String((n.models || []).length)),
    h('dt', {}, 'Registered'), h('dd', {}, fmt.time(n.registered_at)));
  if (!cards.length) {
    fill(p.refs.cards, h('p', { class: 'note' }, 'No GPU cards: CPU work only.'));
    return;
  }
  fill(p.refs.cards, table(`Cards of ${n.name}`,
    ['Card', 'Vendor', 'Model', 'Memory used', 'Temperature', 'Utilisation', 'Held by'],
    cards.map((c) => {
      const used = c.memory_total_mb ? Math.round((100 * c.memory_used_mb) / c.memory_total_mb) : 0;
      const by = held.get(`${n.id}/${c.index}`) || [];
      return [String(c.index), c.vendor || '—', c.model || '—',
        `${fmt.mib(c.memory_used_mb)} of ${fmt.mib(c.memory_total_mb)} (${used} %)`,
        c.temperature_c === null || c.temperature_c === undefined ? '—' : `${c.temperature_c} °C`,
        utilisation(c),
        by.length ? h('ul', { class: 'plain' }, by.map((x) => h('li', {},
          h('a', { href: `#/services/${x.group}` }, x.label), ` — ${x.share}`))) : 'free'];
    })));
}

export function nodesPage(main) {
  const list = h('div', { class: 'nodes' });
  const error = h('p', { class: 'form-error', role: 'alert' });
  const empty = h('p', { class: 'empty', hidden: true }, 'No node has registered yet.');
  main.append(pageHead('Nodes and cards'), error, empty, list);
  const panels = new Map();
  async function refresh() {
    try {
      const [nodes, groups] = await Promise.all([get(`${API}/nodes`),
        getOr(`${API}/task-groups`, [])]);
      const held = holders(groups);
      nodes.sort((a, b) => a.name.localeCompare(b.name));
      const seen = new Set();
      for (const n of nodes) {
        seen.add(n.id);
        let p = panels.get(n.id);
        if (!p) { p = makePanel(n); panels.set(n.id, p); list.append(p.el); }
        updatePanel(p, n, held);
      }
      for (const [id, p] of panels) if (!seen.has(id)) { p.live.stop(); p.el.remove(); panels.delete(id); }
      empty.hidden = nodes.length > 0;
      setText(error, '');
      main.dataset.loaded = 'true';
    } catch (e) {
      if (e.status !== 401) setText(error, `Could not load the nodes: ${e.message}`);
      main.dataset.loaded = 'true';
    }
  }
  const stop = poll(refresh, 3000);
  return () => { stop(); for (const p of panels.values()) p.live.stop(); };
}
