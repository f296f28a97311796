// Create a service (O2): a model from the nodes' scans (or a path typed in), the engine
// and the cards; a dry run shows what would happen (engine and why, the command, where it
// would run or why it would wait, whether a running service would be reused) before the
// create is allowed; the answer's dedup outcome and the API key (shown once) follow.

import { h, fill, field, modal, secretBox, setOptions } from './dom.js';
import { API, api, getOr, rememberKey } from './api.js';
import * as fmt from './fmt.js';

// the registry's engines when GET /api/v1/engines could not be read
const KNOWN_ENGINES = ['llamacpp', 'vllm', 'sglang', 'trtllm', 'mindie', 'vllm-mtt'];
// H8: how far each capability is proven (GET /api/v1/engines), in words and a tone
const MATURITY = {
  'verified-ci-cpu': ['verified in CI (CPU)', 'ok'],
  'verified-gpu': ['verified on a GPU', 'ok'],
  'built-unverified': ['built, not verified', 'warn'],
};
const LEVEL_WORD = { success: 'Success', info: 'Info', warning: 'Warning', error: 'Error' };

export function banner(level, message, title) {
  return h('div', { class: `banner level-${level}`, dataset: { level } },
    h('strong', {}, `${title || LEVEL_WORD[level] || level}: `), message);
}

function slug(s, re, max) {
  const out = String(s || '').replace(re, '-').replace(/^[^A-Za-z0-9]+/, '').slice(0, max);
  return out.replace(/[-.]+$/, '');
}

/** The capabilities of one engine with their maturity labels (H8). */
export function renderMaturity(engine) {
  if (!engine) return null;
  return h('div', { class: 'maturity', dataset: { engine: engine.name } },
    h('span', { class: 'label' }, `What ${engine.name} can do, and how far it is proven`),
    h('ul', { class: 'maturity-list' }, engine.capabilities.map((c) => {
      const [words, tone] = MATURITY[c.label] || [c.label, 'neutral'];
      return h('li', { dataset: { capability: c.name, label: c.label }, title: c.description },
        h('span', { class: 'mono' }, c.name), ' ',
        h('span', { class: `badge tone-${tone}` }, words));
    })));
}

/** 'HOST:CONTAINER[:ro|rw]' per line -> task.volumes; a line it cannot read -> Error. */
export function parseVolumes(text) {
  return String(text || '').split('\n').map((l) => l.trim()).filter(Boolean).map((line, i) => {
    const parts = line.split(':');
    let mode = 'ro';
    if (parts.length === 3 && (parts[2] === 'ro' || parts[2] === 'rw')) mode = parts.pop();
    if (parts.length !== 2 || !parts[0] || !parts[1]) {
      throw Object.assign(new Error(`Volume line ${i + 1}: write HOST:CONTAINER, optionally :ro or :rw.`),
        { field: 'task.volumes' });
    }
    return { host_path: parts[0], container_path: parts[1], read_only: mode === 'ro' };
  });
}

/** The dry run's plan, in words. */
export function renderPlan(plan) {
  const dl = h('dl', { class: 'kv' },
    h('dt', {}, 'Engine'), h('dd', { dataset: { plan: 'engine' } }, plan.engine || '—'),
    h('dt', {}, 'Why'), h('dd', { dataset: { plan: 'engine-reason' } }, plan.engine_reason || '—'),
    h('dt', {}, 'Image'), h('dd', { class: 'mono' },
      plan.image || 'none: the node runs the engine itself (process runtime)'),
    h('dt', {}, 'Shape'), h('dd', {}, `${plan.task_type}, ${plan.parallelism.replace('_', ' ')}`),
    h('dt', {}, 'Memory'), h('dd', {},
      plan.estimated_gpu_memory_mb ? `${fmt.mib(plan.estimated_gpu_memory_mb)} per GPU`
        : `${fmt.mib(plan.memory_mb)} (CPU)`,
      plan.estimate_detail ? h('small', { class: 'hint block' }, plan.estimate_detail) : null));
  const tasks = h('ol', { class: 'plan-tasks' }, (plan.tasks || []).map((t) => {
    const p = t.placement;
    const where = p
      ? h('p', { class: 'placement', dataset: { plan: 'placement' } }, 'Would run on ',
        h('strong', {}, p.node_name),
        p.gpu_ids.length ? `, cards ${p.gpu_ids.join(', ')}` : ' (CPU)',
        p.host_ports.length ? `, host port ${p.host_ports.join(', ')}` : '')
      : h('p', { class: 'pending-reason', dataset: { plan: 'pending' } },
        h('strong', {}, 'Would wait: '), t.pending_reason || 'no node fits now');
    const c = t.container || {};
    const argv = [...(c.entrypoint || []), ...(c.command || [])];
    const mounts = (c.mounts || []).map((m) => `${m.source} → ${m.target} (${m.read_only ? 'read-only' : 'read-write'})`);
    return h('li', {}, h('h4', {}, `Replica ${t.rank}`, t.gpu_required
      ? ` · ${t.gpu_required} GPU${t.gpu_required > 1 ? 's' : ''}` : ' · CPU'), where,
    t.command_error ? banner('error', t.command_error) : null,
    argv.length ? h('div', {}, h('span', { class: 'label' }, 'Command'),
      h('pre', { class: 'argv', dataset: { plan: 'argv' } }, fmt.shellJoin(argv))) : null,
    mounts.length ? h('div', {}, h('span', { class: 'label' }, 'Mounts'),
      h('pre', { class: 'argv', dataset: { plan: 'mounts' } }, mounts.join('\n'))) : null);
  }));
  return h('section', { class: 'plan', 'aria-label': 'Dry run' },
    h('h3', {}, 'Dry run: what would happen (nothing was created)'),
    plan.dedup ? banner(plan.dedup.level, plan.dedup.message, 'Dedup') : null,
    (plan.warnings || []).map((w) => banner('warning', w)),
    dl,
    plan.tasks && plan.tasks.length ? tasks : null);
}

/** Open the dialog; model: a scanned model ({node_id, path, ...}) to start from. */
export async function openCreateDialog({ model = null, onCreated = null } = {}) {
  const [nodes, catalog] = await Promise.all([getOr(`${API}/nodes`, []),
    getOr(`${API}/engines`, [])]);
  const byEngine = new Map(catalog.map((e) => [e.name, e]));
  const models = [];
  for (const n of nodes) {
    for (const m of n.models || []) models.push({ ...m, node_id: n.id, node_name: n.name });
  }
  const engines = new Set(catalog.length ? catalog.map((e) => e.name) : KNOWN_ENGINES);
  for (const n of nodes) for (const e of Object.keys(n.engines || {})) engines.add(e);
  const anyGpu = nodes.some((n) => (n.gpus || []).length > 0);

  const pick = field('Scanned model', {}, 'select',
    models.length ? 'The models the nodes found in their model folders.'
      : 'No node reported a model: type a path below.');
  setOptions(pick.input, [['', '— choose a scanned model —'],
    ...models.map((m, i) => [String(i),
      `${m.name} · ${m.format || '?'} · ${fmt.bytes(m.size_bytes)} · ${m.node_name}`])]);
  const name = field('Service name', { required: true, maxlength: 63,
    pattern: '[A-Za-z0-9][A-Za-z0-9._\\-]{0,62}', autocomplete: 'off' }, 'input',
  'Letters, digits, “.”, “_”, “-”.');
  const modelName = field('Model name', { maxlength: 256, autocomplete: 'off' }, 'input',
    'What clients put in “model”.');
  const path = field('Model path', { maxlength: 4096, autocomplete: 'off', class: 'mono' },
    'input', 'An absolute path inside a node’s allowed folders, or a file name in its model folders.');
  const engine = field('Engine', {}, 'select', 'Auto: the platform picks one the node can run.');
  setOptions(engine.input, [['', 'auto'], ...[...engines].sort().map((e) => [e, e])]);
  const gpus = field('GPUs per replica', { type: 'number', min: 0, max: 64, step: 1,
    value: anyGpu ? '1' : '0', required: true }, 'input', anyGpu ? '' : 'No node reports a GPU: 0 runs on CPU.');
  const args = field('Extra engine arguments', { autocomplete: 'off', class: 'mono' }, 'input',
    'Optional, separated by spaces, e.g. -c 4096.');
  const volumes = field('Volumes', { rows: 2, autocomplete: 'off', class: 'mono',
    placeholder: '/data/loras:/mnt/loras' }, 'textarea',
  'Optional, one per line: HOST:CONTAINER, read-only unless :rw. Docker nodes only.');
  const preemptible = h('input', { type: 'checkbox', checked: true, id: 'create-preemptible' });
  const preemptWrap = h('div', { class: 'field' }, h('label', { htmlFor: 'create-preemptible' },
    preemptible, ' Higher-priority work may stop it (preemptible)'));
  const maturity = h('div', { class: 'maturity-area', 'aria-live': 'polite' });
  function showMaturity(name) { fill(maturity, renderMaturity(byEngine.get(name))); }
  engine.input.addEventListener('change', () => showMaturity(engine.input.value));

  const formError = h('div', { class: 'form-error', role: 'alert' });
  const previewArea = h('div', { class: 'preview', 'aria-live': 'polite' });
  const previewBtn = h('button', { type: 'button' }, 'Preview (dry run)');
  const createBtn = h('button', { type: 'submit', class: 'primary', disabled: true }, 'Create');
  const cancel = h('button', { type: 'button' }, 'Cancel');
  const staleNote = h('p', { class: 'note' }, 'Preview first: Create is enabled once the dry run for these values has been shown.');
  const form = h('form', { class: 'create-form', novalidate: true },
    h('div', { class: 'form-grid' }, pick.wrap, name.wrap, modelName.wrap, path.wrap,
      engine.wrap, gpus.wrap, args.wrap, volumes.wrap, preemptWrap),
    maturity,
    formError, previewArea, staleNote,
    h('div', { class: 'actions' }, cancel, previewBtn, createBtn));
  const dlg = modal('New service', form);
  dlg.classList.add('wide');
  cancel.addEventListener('click', () => dlg.close());

  let nameTouched = false;
  name.input.addEventListener('input', () => { nameTouched = true; });
  function choose(m) {
    if (!m) return;
    modelName.input.value = slug(m.name, /[^A-Za-z0-9._:/@+-]+/g, 256);
    path.input.value = m.path;
    if (!nameTouched || !name.input.value) {
      name.input.value = slug(m.name.toLowerCase(), /[^a-z0-9._-]+/g, 63) || 'service';
    }
    invalidate();
  }
  pick.input.addEventListener('change', () => choose(models[Number(pick.input.value)]));

  const inputs = { name: name.input, model_name: modelName.input, 'task.model_path': path.input,
    'task.engine': engine.input, 'task.gpu_required': gpus.input, 'task.engine_args': args.input,
    'task.volumes': volumes.input, 'task.preemptible': preemptible };
  function body() {
    const b = { name: name.input.value.trim(), task: {
      model_path: path.input.value.trim(), gpu_required: Number(gpus.input.value || 0) } };
    if (modelName.input.value.trim()) b.model_name = modelName.input.value.trim();
    if (engine.input.value) b.task.engine = engine.input.value;
    const extra = args.input.value.split(/\s+/).filter(Boolean);
    if (extra.length) b.task.engine_args = extra;
    const mounts = parseVolumes(volumes.input.value);
    if (mounts.length) b.task.volumes = mounts;
    if (!preemptible.checked) b.task.preemptible = false;
    return b;
  }
  let previewed = null;
  function invalidate() {
    let now = null;
    try { now = JSON.stringify(body()); } catch { now = null; }
    const same = previewed !== null && previewed === now;
    createBtn.disabled = !same;
    staleNote.hidden = same;
  }
  form.addEventListener('input', invalidate);
  form.addEventListener('change', invalidate);
  if (model) { // one-click deploy from the Models page
    const i = models.findIndex((m) => m.node_id === model.node_id && m.path === model.path);
    if (i >= 0) { pick.input.value = String(i); choose(models[i]); }
  }

  function showError(e) {
    for (const el of Object.values(inputs)) el.removeAttribute('aria-invalid');
    fill(formError, e.message);
    const el = inputs[e.field] || (String(e.field || '').startsWith('task.volumes')
      ? volumes.input : null);
    if (el) { el.setAttribute('aria-invalid', 'true'); el.focus(); }
  }
  function checkLocal() {
    if (!name.input.checkValidity()) {
      showError({ message: 'A service name is needed: letters, digits, “.”, “_”, “-”.', field: 'name' });
      return false;
    }
    return true;
  }

  previewBtn.addEventListener('click', async () => {
    if (!checkLocal()) return;
    previewBtn.disabled = true;
    fill(formError);
    try {
      const b = body();
      const plan = await api('POST', `${API}/task-groups?dry_run=true`, b);
      fill(previewArea, renderPlan(plan));
      showMaturity(plan.engine);
      previewArea.scrollIntoView({ block: 'nearest', behavior: 'smooth' });
      previewed = JSON.stringify(b);
      invalidate();
    } catch (e) {
      fill(previewArea);
      previewed = null;
      invalidate();
      showError(e);
    } finally {
      previewBtn.disabled = false;
    }
  });

  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    if (createBtn.disabled || !checkLocal()) return;
    createBtn.disabled = true;
    try {
      const r = await api('POST', `${API}/task-groups`, body());
      if (r.api_key) rememberKey(r.id, r.api_key);
      showResult(dlg, form, r);
      if (onCreated) onCreated(r);
    } catch (e) {
      showError(e);
      createBtn.disabled = false;
    }
  });
  return dlg;
}

function showResult(dlg, form, r) {
  const d = r.dedup;
  const outcome = d ? banner(d.level, d.message, d.reused ? 'Reused' : undefined)
    : banner('success', `Created ${r.name} (${r.id}); it is ${r.status} and starts on its node now.`);
  // another tenant's service reused: no service of yours to open (its id is not shown)
  const open = r.id
    ? h('a', { href: `#/services/${r.id}`, class: 'button primary' }, 'Open the service') : null;
  const close = h('button', { type: 'button' }, 'Close');
  if (open) open.addEventListener('click', () => dlg.close());
  close.addEventListener('click', () => dlg.close());
  const result = h('div', { class: 'create-result', 'aria-live': 'polite' }, outcome,
    (r.warnings || []).map((w) => banner('warning', w)),
    r.api_key ? secretBox('API key', r.api_key,
      'Shown once: copy it now. It is not shown again; rotate it on the service’s page if it is lost.')
      : h('p', { class: 'note' }, 'This service has no API key (API access is off).'),
    h('div', { class: 'actions' }, close, open));
  form.replaceWith(result);
  (result.querySelector('input.secret') || open || close).focus();
}
