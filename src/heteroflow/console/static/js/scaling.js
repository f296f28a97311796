// A service's replicas (issue 33): the count, and the range it may move in with
// autoscaling on or off. The same two routes and the same rule as the CLI's
// `services scale` and `services autoscale`: PUT .../scale-policy sets the range and the
// policy (a field left out keeps its stored value), PUT .../scale the count. A count
// outside the range widens the range first when autoscaling is off (the range is then
// only where a count may be); with autoscaling on the range is the autoscaler's, and it
// is never moved behind its back: the user is told to widen it.

import { h, field, setOptions, modal, setText } from './dom.js';
import { API, api } from './api.js';

export const MAX_REPLICAS = 64;
const METRICS = [
  ['inflight', 'requests in flight per replica'],
  ['tokens_per_s', 'tokens per second per replica'],
  ['queue', 'requests waiting in the engine per replica'],
  ['kv_cache', 'KV-cache use in percent (1-100)'],
];

export function autoscalingOn(g) {
  return Boolean((g.scale_policy || {}).enabled);
}

/** Scale ``g`` to ``n`` replicas; resolves to the toast's text. */
export async function scaleTo(g, n) {
  const lo = g.min_replicas;
  const hi = g.max_replicas;
  let widened = '';
  if (n < lo || n > hi) {
    if (autoscalingOn(g)) {
      throw new Error(`${n} replica(s) is outside the autoscaling range ${lo}-${hi}: `
        + 'widen it under “Replica range…”, or turn autoscaling off there');
    }
    const min = Math.min(lo, n);
    const max = Math.max(hi, n);
    await api('PUT', `${API}/task-groups/${g.id}/scale-policy`,
      { enabled: false, min_replicas: min, max_replicas: max });
    widened = ` (range widened to ${min}-${max}, autoscaling off)`;
  }
  await api('PUT', `${API}/task-groups/${g.id}/scale`, { replicas: n });
  return `Scaling to ${n} replica(s)${widened}`;
}

/** The dialog that edits the range and the autoscaling policy; ``onSaved`` after a save. */
export function openRangeDialog(g, onSaved) {
  const p = g.scale_policy || {};
  const num = (value) => ({ type: 'number', min: 1, max: MAX_REPLICAS, step: 1, required: true,
    class: 'narrow', value: String(value) });
  const min = field('Min replicas', num(g.min_replicas));
  const max = field('Max replicas', num(g.max_replicas));
  const on = h('input', { type: 'checkbox', id: `autoscale-${g.id}`, checked: autoscalingOn(g) });
  const metric = field('Metric', {}, 'select', 'What the autoscaler keeps near the target.');
  setOptions(metric.input, METRICS.map(([k, text]) => [k, `${k}: ${text}`]));
  metric.input.value = p.metric || 'inflight';
  const target = field('Target per replica', { type: 'number', min: 0, step: 'any',
    class: 'narrow', value: p.target ? String(p.target) : '' });
  const policy = h('div', { class: 'form-grid' }, metric.wrap, target.wrap);
  const showPolicy = () => { policy.hidden = !on.checked; };
  on.addEventListener('change', showPolicy);
  showPolicy();
  const err = h('p', { class: 'form-error', role: 'alert' });
  const save = h('button', { type: 'submit', class: 'primary' }, 'Save');
  const cancel = h('button', { type: 'button' }, 'Cancel');
  const form = h('form', {},
    h('p', { class: 'note' }, `Now ${g.current_replicas} replica(s). With autoscaling off the `
      + 'range only bounds Scale; with it on the autoscaler moves the count within it.'),
    h('div', { class: 'form-grid' }, min.wrap, max.wrap),
    h('label', { class: 'check', htmlFor: on.id }, on, 'Autoscaling'),
    policy, err, h('div', { class: 'actions' }, cancel, save));
  const dlg = modal(`Replica range of ${g.name}`, form);
  cancel.addEventListener('click', () => dlg.close());
  min.input.focus();
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const body = { enabled: on.checked, min_replicas: Number(min.input.value),
      max_replicas: Number(max.input.value) };
    if (on.checked) {
      body.metric = metric.input.value;
      if (target.input.value !== '') body.target = Number(target.input.value);
    }
    save.disabled = true;
    try {
      await api('PUT', `${API}/task-groups/${g.id}/scale-policy`, body);
      dlg.close();
      onSaved(`Replicas ${body.min_replicas}-${body.max_replicas}, autoscaling `
        + `${body.enabled ? `on (${body.metric})` : 'off'}`);
    } catch (e) {
      setText(err, e.message);
      save.disabled = false;
    }
  });
  return dlg;
}
