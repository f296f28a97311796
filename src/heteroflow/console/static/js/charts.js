// Live charts (issue 33): a service's series from GET /task-groups/{id}/series, drawn as
// plain SVG lines (no library), refreshed every few seconds without reloading the page;
// the autoscaler's and rolling updates' events are marked on the time axis; a table of
// each replica's load now (in flight against its slots, tokens/s, queue, prefix hits).

import { h, svg, fill, setText, poll, field, setOptions } from './dom.js';
import { API, get } from './api.js';
import * as fmt from './fmt.js';

const RANGES = [['15m', 'Last 15 minutes'], ['1h', 'Last hour'], ['6h', 'Last 6 hours'],
  ['24h', 'Last 24 hours']];
// one chart per entry: its title, unit, and the metrics drawn as lines (series-N colours)
const CHARTS = [
  ['requests', 'Requests/s', '', ['requests_per_s']],
  ['latency', 'Latency (ms)', 'ms', ['latency_p50_ms', 'latency_p95_ms']],
  ['ttft', 'Time to first token (ms)', 'ms', ['ttft_p50_ms', 'ttft_p95_ms']],
  ['tokens', 'Tokens/s', '', ['tokens_per_s']],
  ['errors', 'Errors/s', '', ['errors_4xx_per_s', 'errors_429_per_s', 'errors_5xx_per_s',
    'client_left_per_s']],
  ['load', 'In flight · engine queue', '', ['in_flight', 'queue']],
  ['replicas', 'Replicas', '', ['replicas']],
];
const LABEL = { latency_p50_ms: 'p50', latency_p95_ms: 'p95', ttft_p50_ms: 'p50',
  ttft_p95_ms: 'p95', errors_4xx_per_s: '4xx', errors_429_per_s: '429', errors_5xx_per_s: '5xx',
  client_left_per_s: 'client left', in_flight: 'in flight', queue: 'queue',
  cpu_percent: 'CPU', memory_percent: 'memory', memory_used_mb: 'used', memory_total_mb: 'total',
  committed_pct: 'committed', temperature_c: '°C', utilisation_pct: 'utilisation' };
const W = 420;
const H = 150;
const PAD = { l: 46, r: 8, t: 8, b: 20 };

function short(v) {
  if (v === null || v === undefined) return '—';
  const a = Math.abs(v);
  if (a >= 1000) return fmt.num(v);
  if (a >= 10) return fmt.num(v, 1);
  return String(Number(v.toPrecision(2)));
}

/** One line chart: times (ms), {metric: values}, the events' times, the range. */
export function lineChart(id, title, times, values, metrics, events, from, to) {
  const plotW = W - PAD.l - PAD.r;
  const plotH = H - PAD.t - PAD.b;
  const all = metrics.flatMap((m) => (values[m] || []).filter((v) => v !== null));
  const max = Math.max(0, ...all);
  const top = max > 0 ? max * 1.1 : 1;
  const x = (t) => PAD.l + ((t - from) / Math.max(1, to - from)) * plotW;
  const y = (v) => PAD.t + plotH - (v / top) * plotH;
  const g = svg('g', {});
  for (const f of [0, 0.5, 1]) {
    const yy = PAD.t + plotH - f * plotH;
    g.append(svg('line', { x1: PAD.l, x2: W - PAD.r, y1: yy, y2: yy, class: 'gridline' }),
      svg('text', { x: PAD.l - 4, y: yy + 4, 'text-anchor': 'end', class: 'tick' }, short(f * top)));
  }
  g.append(svg('text', { x: PAD.l, y: H - 4, class: 'tick' }, fmt.time(new Date(from).toISOString())),
    svg('text', { x: W - PAD.r, y: H - 4, 'text-anchor': 'end', class: 'tick' }, 'now'));
  for (const ev of events) {
    const t = Date.parse(ev.at);
    if (t < from || t > to) continue;
    g.append(svg('line', { x1: x(t), x2: x(t), y1: PAD.t, y2: PAD.t + plotH, class: 'event-mark' },
      svg('title', {}, `${fmt.time(ev.at)} ${ev.kind}: ${ev.message || `${ev.from} → ${ev.to}`}`)));
  }
  metrics.forEach((m, i) => {
    const pts = [];
    (values[m] || []).forEach((v, k) => { if (v !== null) pts.push(`${x(times[k]).toFixed(1)},${y(v).toFixed(1)}`); });
    if (pts.length) {
      g.append(svg('polyline', { points: pts.join(' '), class: `line line-${i}` },
        svg('title', {}, LABEL[m] || m)));
    }
  });
  const last = metrics.map((m) => (values[m] || []).filter((v) => v !== null).slice(-1)[0]);
  const legend = h('ul', { class: 'legend' }, metrics.map((m, i) => h('li', {},
    svg('svg', { width: 12, height: 4, 'aria-hidden': 'true' },
      svg('rect', { width: 12, height: 4, class: `swatch-${i}` })),
    `${metrics.length > 1 ? `${LABEL[m] || m} ` : ''}${short(last[i])}`)));
  const el = svg('svg', { viewBox: `0 0 ${W} ${H}`, role: 'img', class: 'spark',
    'aria-label': `${title}, last ${short(last[0])}`, 'data-testid': `chart-${id}`,
    'data-max': String(max), 'data-points': String(all.length) }, g);
  return h('figure', { class: 'chart' }, h('figcaption', {}, title), el, legend);
}

function replicaTable(rows) {
  if (!rows.length) return h('p', { class: 'note' }, 'No replica holds resources now.');
  const head = ['Replica', 'Status', 'In flight / slots', 'Tokens/s', 'Engine queue', 'KV cache',
    'p95 latency', 'Capacity', 'Prefix-cache hits'];
  return h('table', { class: 'grid', dataset: { testid: 'replica-load' } },
    h('thead', {}, h('tr', {}, head.map((c) => h('th', { scope: 'col' }, c)))),
    h('tbody', {}, rows.map((r) => h('tr', {},
      h('td', { class: 'mono' }, r.name),
      h('td', {}, r.status),
      h('td', {}, r.slots ? `${r.in_flight} / ${r.slots}` : `${r.in_flight} / —`),
      h('td', {}, short(r.tokens_per_s)),
      h('td', {}, r.queue === null ? 'n/a' : short(r.queue)),
      h('td', {}, r.kv_use === null ? 'n/a' : `${Math.round(r.kv_use * 100)} %`),
      h('td', {}, r.latency_p95_ms === null ? '—' : `${short(r.latency_p95_ms)} ms`),
      h('td', { title: "the gateways' estimate: time per completion token at its load" },
        r.ms_per_token === null ? '—' : `${short(r.ms_per_token)} ms/token`),
      h('td', { title: r.prefix_hit_rate === null ? 'the engine reports no prefix-cache counters' : '' },
        r.prefix_hit_rate === null ? 'n/a' : `${Math.round(r.prefix_hit_rate * 100)} %`)))));
}

/** The "Live" section of a service page: { el, stop }. */
export function liveCharts(groupId) {
  const range = field('Range', {}, 'select');
  setOptions(range.input, RANGES);
  const grid = h('div', { class: 'chart-grid' });
  const replicas = h('div');
  const note = h('p', { class: 'note', 'aria-live': 'polite' });
  const el = h('div', { class: 'live', dataset: { testid: 'live' } },
    h('div', { class: 'row' }, range.wrap, note), grid,
    h('h3', {}, 'Replicas now'), replicas);

  async function refresh() {
    const since = range.input.value;
    const r = await get(`${API}/task-groups/${groupId}/series?since=${since}`);
    const to = Date.parse(r.until);
    const from = Date.parse(r.since);
    const times = r.times.map((t) => Date.parse(t));
    fill(grid, CHARTS.map(([id, title, , metrics]) =>
      lineChart(id, title, times, r.values, metrics, r.events, from, to)));
    fill(replicas, replicaTable(r.replicas));
    setText(note, times.length ? `${times.length} points, every ${r.step} s; updated ${fmt.time(r.until)}`
      : 'No points yet: the server samples every 10 s.');
    el.dataset.loaded = 'true';
  }
  range.input.addEventListener('change', () => refresh());
  const stop = poll(refresh, 5000);
  return { el, stop };
}

/** A node's live charts (GET /nodes/{id}/series): CPU and memory, and per card its
 * memory and what the scheduler committed of it; { el, stop }. */
export function nodeCharts(nodeId) {
  const grid = h('div', { class: 'chart-grid', dataset: { testid: `node-live-${nodeId}` } });
  async function refresh() {
    const r = await get(`${API}/nodes/${nodeId}/series?since=1h`);
    const to = Date.parse(r.node.until);
    const from = Date.parse(r.node.since);
    const at = (s) => s.times.map((t) => Date.parse(t));
    const charts = [lineChart('node', 'CPU · memory (%)', at(r.node), r.node.values,
      ['cpu_percent', 'memory_percent'], [], from, to)];
    for (const c of r.cards) {
      const card = c.key.split('/').pop();
      charts.push(lineChart(`card-${card}-memory`, `Card ${card}: memory used · total (MiB)`, at(c),
        c.values, ['memory_used_mb', 'memory_total_mb'], [], from, to));
      charts.push(lineChart(`card-${card}-committed`,
        `Card ${card}: committed (%) · temperature (°C) · utilisation (%)`, at(c), c.values,
        ['committed_pct', 'temperature_c', 'utilisation_pct'], [], from, to));
    }
    fill(grid, charts);
  }
  const stop = poll(refresh, 10000);
  return { el: grid, stop };
}
