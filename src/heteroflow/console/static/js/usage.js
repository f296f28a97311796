// Usage: tokens (and GPU time where the server reports it) per tenant, member, service,
// model or key, over a period, optionally per hour or day; a bar chart drawn here as SVG,
// the numbers in a table, and the same report as CSV.

import { h, svg, fill, field, setOptions, pageHead, table, setText, toast } from './dom.js';
import { API, get, getOr, byId, download } from './api.js';
import * as fmt from './fmt.js';

const PERIODS = [['1', 'Last 24 hours'], ['7', 'Last 7 days'], ['30', 'Last 30 days']];
const GROUPS = [['service', 'Service'], ['tenant', 'Tenant'], ['member', 'Member'],
  ['model', 'Model'], ['endpoint', 'API key (endpoint)']];
const BUCKETS = [['', 'No (totals)'], ['hour', 'Per hour'], ['day', 'Per day']];
// a number at a sensible precision: 12,345 · 3.25 · 0.0042
function nice(x) {
  if (!x) return '0';
  const a = Math.abs(x);
  if (a >= 100) return fmt.num(x);
  if (a >= 1) return fmt.num(x, 2);
  return String(Number(x.toPrecision(2)));
}
const MEASURES = [
  ['total_tokens', 'Tokens', (v) => nice(v)],
  ['requests', 'Requests', (v) => nice(v)],
  ['gpu_running_card_seconds', 'GPU card-hours (running)', (v) => nice(v / 3600)],
  ['gpu_sleeping_card_seconds', 'GPU card-hours (asleep)', (v) => nice(v / 3600)],
  ['running_task_seconds', 'Replica-hours (running)', (v) => nice(v / 3600)],
];
const COLUMN_OF = { service: 'service_id', tenant: 'tenant_id', member: 'member_id',
  model: 'model', endpoint: 'endpoint_id' };
const SERIES = 6; // stacked series shown by name; the rest is "other"

function chart(rows, keyOf, bucket, measure, label, fmtValue) {
  const W = 900;
  const H = 260;
  const pad = { l: 70, r: 10, t: 10, b: 46 };
  const totals = new Map();
  for (const r of rows) totals.set(keyOf(r), (totals.get(keyOf(r)) || 0) + (r[measure] || 0));
  const top = [...totals.entries()].sort((a, b) => b[1] - a[1]).slice(0, SERIES).map(([k]) => k);
  const seriesOf = (r) => (top.includes(keyOf(r)) ? keyOf(r) : 'other');
  const xs = bucket ? [...new Set(rows.map((r) => r[bucket]))].sort() : top;
  const stacks = new Map(xs.map((x) => [x, new Map()]));
  for (const r of rows) {
    const x = bucket ? r[bucket] : keyOf(r);
    if (!stacks.has(x)) continue;
    const s = stacks.get(x);
    s.set(seriesOf(r), (s.get(seriesOf(r)) || 0) + (r[measure] || 0));
  }
  const max = Math.max(0, ...[...stacks.values()].map((s) => [...s.values()].reduce((a, b) => a + b, 0)));
  const plotW = W - pad.l - pad.r;
  const plotH = H - pad.t - pad.b;
  const slot = xs.length ? plotW / xs.length : plotW;
  const bw = Math.min(slot * 0.7, 56); // a bar: at most 56 px wide, centred in its slot
  const y = (v) => (max ? (v / max) * plotH : 0);
  const series = [...top, 'other'];
  const g = svg('g', {});
  // axis and three gridlines with their values
  for (const f of [0, 0.5, 1]) {
    const yy = pad.t + plotH - f * plotH;
    g.append(svg('line', { x1: pad.l, x2: W - pad.r, y1: yy, y2: yy, class: 'gridline' }),
      svg('text', { x: pad.l - 6, y: yy + 4, 'text-anchor': 'end', class: 'tick' }, fmtValue(f * max)));
  }
  xs.forEach((x, i) => {
    let base = pad.t + plotH;
    const s = stacks.get(x);
    for (const name of series) {
      const v = s.get(name) || 0;
      if (!v) continue;
      const hgt = y(v);
      base -= hgt;
      g.append(svg('rect', { x: pad.l + i * slot + (slot - bw) / 2, y: base, width: Math.max(1, bw),
        height: Math.max(hgt, 0.5), class: `series-${series.indexOf(name) % (SERIES + 1)}` },
      svg('title', {}, `${bucket ? `${x} · ` : ''}${label(name)}: ${fmtValue(v)}`)));
    }
    const every = Math.ceil(xs.length / 12);
    if (i % every === 0) {
      const text = bucket ? String(x).slice(5) : label(x); // 12-01, 12-01 05
      g.append(svg('text', { x: pad.l + i * slot + slot / 2, y: H - pad.b + 16, 'text-anchor': 'middle',
        class: 'tick' }, text.length > 16 ? `${text.slice(0, 15)}…` : text));
    }
  });
  const legend = h('ul', { class: 'legend' }, series.filter((s) => s !== 'other' || rows.some((r) => seriesOf(r) === 'other'))
    .map((s) => h('li', {}, svg('svg', { width: 12, height: 12, 'aria-hidden': 'true' },
      svg('rect', { width: 12, height: 12, class: `series-${series.indexOf(s) % (SERIES + 1)}` })), label(s))));
  return h('figure', { class: 'chart' },
    svg('svg', { viewBox: `0 0 ${W} ${H}`, role: 'img', class: 'bars',
      'aria-label': `Bar chart of ${MEASURES.find((m) => m[0] === measure)[1].toLowerCase()}` }, g),
    bucket ? legend : null);
}

export function usagePage(main, _p, ctx) {
  const period = field('Period', {}, 'select');
  setOptions(period.input, PERIODS);
  period.input.value = '7';
  const group = field('Group by', {}, 'select');
  setOptions(group.input, ctx.session.operator ? GROUPS : GROUPS.filter(([g]) => g !== 'tenant'));
  const bucket = field('Over time', {}, 'select');
  setOptions(bucket.input, BUCKETS);
  bucket.input.value = 'day';
  const measure = field('Chart', {}, 'select');
  setOptions(measure.input, MEASURES.slice(0, 2).map(([k, t]) => [k, t]));
  const csv = h('button', { type: 'button' }, 'Export CSV');
  const controls = h('form', { class: 'toolbar', 'aria-label': 'Usage report' },
    period.wrap, group.wrap, bucket.wrap, measure.wrap, csv);
  const error = h('p', { class: 'form-error', role: 'alert' });
  const summary = h('p', { class: 'summary', 'aria-live': 'polite' });
  const chartHost = h('div', { class: 'chart-host' });
  const tableHost = h('div');
  main.append(pageHead('Usage'), controls, error, summary, chartHost, tableHost);

  let names = { service: new Map(), tenant: new Map(), member: new Map(), endpoint: new Map() };
  async function loadNames() {
    const [groups, tenants, users, eps] = await Promise.all([getOr(`${API}/task-groups`, []),
      getOr(`${API}/tenants`, []), getOr(`${API}/users`, []), getOr(`${API}/gateway/endpoints`, [])]);
    const nameMap = (list, key) => new Map([...byId(list)].map(([id, x]) => [id, x[key]]));
    names = { service: nameMap(groups, 'name'), tenant: nameMap(tenants, 'name'),
      member: nameMap(users, 'username'), endpoint: nameMap(eps, 'name') };
    names.member.set(ctx.session.id, ctx.session.name);
  }

  function query(extra = '') {
    const start = new Date(Date.now() - Number(period.input.value) * 86400000);
    const by = [group.input.value, bucket.input.value].filter(Boolean).join(',');
    return `${API}/usage?group_by=${by}&start=${encodeURIComponent(start.toISOString())}&gpu=true${extra}`;
  }

  let last = null;
  async function load() {
    try {
      const rep = await get(query());
      // a service created since the names were read is named; one still unknown was deleted
      if ((rep.rows || []).some((r) => r.service_id && !names.service.has(r.service_id))) {
        await loadNames().catch(() => {});
      }
      last = rep;
      draw();
      setText(error, '');
      main.dataset.loaded = 'true';
    } catch (e) {
      if (e.status !== 401) setText(error, `Could not load the usage: ${e.message}`);
      main.dataset.loaded = 'true';
    }
  }

  function draw() {
    const rep = last;
    const by = group.input.value;
    const col = COLUMN_OF[by];
    const b = bucket.input.value;
    const hasGpu = 'gpu_running_card_seconds' in (rep.total || {});
    const keep = measure.input.value;
    setOptions(measure.input, (hasGpu ? MEASURES : MEASURES.slice(0, 2)).map(([k, t]) => [k, t]));
    if ([...measure.input.options].some((o) => o.value === keep)) measure.input.value = keep;
    const [mKey, , mFmt] = MEASURES.find((m) => m[0] === measure.input.value);
    const label = (id) => (id === 'other' ? 'other' : id === null || id === undefined ? '(none)'
      : (names[by] && names[by].get(id)) || (by === 'service' && id ? `${id} (deleted)` : id));
    const t = rep.total || {};
    setText(summary, `${fmt.num(t.requests)} requests, ${fmt.num(t.total_tokens)} tokens`
      + `${hasGpu ? `, ${nice((t.gpu_running_card_seconds || 0) / 3600)} GPU card-hours running,`
        + ` ${nice((t.running_task_seconds || 0) / 3600)} replica-hours` : ''} in the period.`);
    const rows = rep.rows || [];
    if (!rows.length) {
      fill(chartHost, h('p', { class: 'empty' }, 'Nothing recorded in this period.'));
      fill(tableHost);
      return;
    }
    fill(chartHost, rows.some((r) => r[mKey]) ? chart(rows, (r) => r[col], b, mKey, label, mFmt)
      : h('p', { class: 'empty' }, `No ${MEASURES.find((m) => m[0] === mKey)[1].toLowerCase()} in this period: see the table for the rest.`));
    const cols = [GROUPS.find((g) => g[0] === by)[1], ...(b ? [b === 'hour' ? 'Hour (UTC)' : 'Day (UTC)'] : []),
      'Requests', 'Prompt tokens', 'Completion tokens', 'Total tokens',
      ...(hasGpu ? ['GPU card-h running', 'GPU card-h asleep', 'Replica-h running'] : [])];
    const sorted = rows.slice().sort((x, y) => (b ? String(y[b]).localeCompare(String(x[b])) : 0)
      || (y.total_tokens - x.total_tokens));
    fill(tableHost, table('Usage', cols, sorted.map((r) => [label(r[col]), ...(b ? [r[b]] : []),
      fmt.num(r.requests), fmt.num(r.prompt_tokens), fmt.num(r.completion_tokens),
      fmt.num(r.total_tokens), ...(hasGpu ? [
        r.gpu_running_card_seconds === null ? '—' : nice(r.gpu_running_card_seconds / 3600),
        r.gpu_sleeping_card_seconds === null ? '—' : nice(r.gpu_sleeping_card_seconds / 3600),
        r.running_task_seconds === null ? '—' : nice(r.running_task_seconds / 3600)] : [])]),
    'numbers'));
  }

  for (const f of [period, group, bucket]) f.input.addEventListener('change', load);
  measure.input.addEventListener('change', () => last && draw());
  controls.addEventListener('submit', (ev) => ev.preventDefault());
  csv.addEventListener('click', async () => {
    csv.disabled = true;
    try {
      const day = new Date().toISOString().slice(0, 10);
      await download(query('&format=csv'), `heteroflow-usage-${group.input.value}-${day}.csv`, 'text/csv');
    } catch (e) {
      toast(`CSV export: ${e.message}`, 'error');
    } finally {
      csv.disabled = false;
    }
  });
  loadNames().catch(() => {}).finally(load);
  const timer = setInterval(load, 30000);
  return () => clearInterval(timer);
}
