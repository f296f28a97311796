// Service detail (O3): its replicas with node and cards, the event timeline (faults
// marked), the rolling-update state and its failure reason, the API key (masked prefix,
// rotation: the new key shown once), live task logs, the actions the API offers, and
// ready-to-paste OpenAI SDK and curl snippets.

import { h, fill, badge, setText, poll, pageHead, field, confirmDialog, toast, secretBox,
  copyButton, setOptions, table, modal } from './dom.js';
import { API, api, get, getOr, byId, rememberKey, knownKey } from './api.js';
import * as fmt from './fmt.js';
import { liveCharts } from './charts.js'; // issue 33: the live series
import { MAX_REPLICAS, scaleTo, openRangeDialog } from './scaling.js';

const LOG_KEEP_CHARS = 400000; // the log view keeps the newest ~400 kB

function section(title, ...body) {
  const id = `sec-${title.toLowerCase().replace(/[^a-z]+/g, '-')}`;
  return h('section', { class: 'panel', 'aria-labelledby': id },
    h('h2', { id }, title), ...body);
}

function snippets(base, model, key) {
  const k = key || 'YOUR_API_KEY';
  const python = [
    'from openai import OpenAI',
    '',
    `client = OpenAI(base_url="${base}", api_key="${k}")`,
    'reply = client.chat.completions.create(',
    `    model="${model}",`,
    '    messages=[{"role": "user", "content": "Hello!"}],',
    ')',
    'print(reply.choices[0].message.content)',
  ].join('\n');
  const body = JSON.stringify({ model, messages: [{ role: 'user', content: 'Hello!' }] });
  const curl = [
    `curl ${base}/chat/completions \\`,
    `  -H "Authorization: Bearer ${k}" \\`,
    '  -H "Content-Type: application/json" \\',
    `  -d '${body.replace(/'/g, "'\\''")}'`,
  ].join('\n');
  return { python, curl };
}

export function detailPage(main, [groupId], ctx) {
  const refs = { status: h('span'), message: h('p', { class: 'status-message' }),
    facts: h('dl', { class: 'kv' }), rollout: h('div'), replicas: h('div'),
    key: h('div'), snippetsHost: h('div'), timeline: h('ol', { class: 'timeline' }),
    newKey: h('div', { 'aria-live': 'polite' }) };
  const title = h('span', {}, groupId);
  const error = h('p', { class: 'form-error', role: 'alert' });

  // ----- actions -----
  const act = {
    sleep: h('button', { type: 'button' }, 'Sleep'),
    wake: h('button', { type: 'button' }, 'Wake'),
    stop: h('button', { type: 'button' }, 'Stop'),
    start: h('button', { type: 'button' }, 'Start'),
    update: h('button', { type: 'button' }, 'Update…'),
    del: h('button', { type: 'button', class: 'danger' }, 'Delete'),
  };
  const scale = field('Replicas', { type: 'number', min: 1, max: MAX_REPLICAS, step: 1, class: 'narrow' });
  const scaleBtn = h('button', { type: 'button' }, 'Scale');
  const rangeBtn = h('button', { type: 'button' }, 'Replica range…');
  const scaleForm = h('div', { class: 'inline-form' }, scale.wrap, scaleBtn, rangeBtn);
  const actions = h('div', { class: 'actions', role: 'group', 'aria-label': 'Actions' },
    act.sleep, act.wake, act.stop, act.start, act.update, scaleForm, act.del);

  // ----- logs -----
  const logPick = field('Replica', {}, 'select');
  const follow = h('input', { type: 'checkbox', id: 'log-follow', checked: true });
  const logPre = h('pre', { class: 'log', tabIndex: 0, 'aria-label': 'Task log',
    dataset: { testid: 'log' } });
  const logNote = h('p', { class: 'note' });

  // ----- key -----
  const rotateBtn = h('button', { type: 'button' }, 'Rotate key');

  const live = liveCharts(groupId);
  const back = h('a', { href: '#/services', class: 'back' }, '← Services');
  main.append(back,
    pageHead(h('span', { class: 'title-row' }, title, refs.status), actions),
    refs.message, error,
    h('div', { class: 'columns' },
      section('Overview', refs.facts, refs.rollout),
      section('API access', refs.key, rotateBtn, refs.newKey, refs.snippetsHost)),
    section('Replicas', refs.replicas),
    section('Live', live.el),
    h('div', { class: 'columns' },
      section('Logs', h('div', { class: 'row' }, logPick.wrap,
        h('label', { class: 'check', htmlFor: 'log-follow' }, follow, 'Follow (live)')),
      logPre, logNote),
      section('Timeline', h('p', { class: 'note' }, 'Newest first; faults are marked.'),
        refs.timeline)));

  let group = null;
  let nodes = new Map();
  let endpoint = null;
  let gone = false;
  let eventsSeen = -1;
  let snippetKey = null;

  function renderFacts(g) {
    const facts = [
      ['Model route', g.model_name || '—'],
      ['Engine', fmt.engineLabel(g, nodes)],
      ['GPUs', fmt.gpuCount(g)],
      ['Parallelism', fmt.parallelism(g)],
      ['Replicas', fmt.replicaRange(g)],
      ['Autoscale', fmt.autoscale(g)],
      ['API access', g.enable_api ? 'on' : 'off'],
      ['Uptime', (() => { const s = fmt.uptimeSeconds(g); return s === null ? '—' : fmt.duration(s); })()],
      ['Desired', g.desired],
      ['Generation', g.current_generation],
      ['Priority', `${g.priority} (${g.priority_class})`],
      ['Idle sleep', g.idle_timeout_minutes ? `after ${g.idle_timeout_minutes} min` : 'off'],
      ['Created', fmt.time(g.created_at)],
      ['Labels', Object.entries(g.labels || {}).map(([k, v]) => `${k}=${v}`).join(', ') || '—'],
    ];
    if (refs.facts.children.length !== facts.length * 2) {
      fill(refs.facts, facts.map(([k]) => [h('dt', {}, k), h('dd', {})]));
    }
    facts.forEach(([, v], i) => setText(refs.facts.children[i * 2 + 1], v));
  }

  function renderRollout(g) {
    const state = g.rolling_update_state;
    if (!state) {
      fill(refs.rollout, h('p', { class: 'note' }, 'Rolling update: none has run.'));
      return;
    }
    const failed = state === 'failed';
    fill(refs.rollout, h('div', { class: `rollout${failed ? ' failed' : ''}` },
      h('h3', {}, 'Rolling update ', badge(state)),
      h('p', { dataset: { testid: 'rollout-message' } },
        failed ? h('strong', {}, 'Why it failed: ') : null, g.rolling_update_message || '—')));
  }

  let replicasSig = '';
  function renderReplicas(g) {
    // re-drawn only when something shown changed (a refresh keeps selections and scroll)
    const sig = JSON.stringify([(g.tasks || []).map((t) => [t.id, t.status, t.draining,
      t.node_id, t.gpu_ids, t.ports, t.status_message, t.launch_argv]),
    [...nodes.values()].map((n) => n.name)]);
    if (sig === replicasSig) return;
    replicasSig = sig;
    const row = (t) => {
      const node = nodes.get(t.node_id);
      const ports = (t.ports || []).map(fmt.port).join(', ');
      return [
        h('span', { class: 'mono' }, t.name), String(t.generation),
        badge(t.draining ? 'draining' : t.status),
        node ? node.name : (t.node_id || '—'),
        t.gpu_ids && t.gpu_ids.length ? t.gpu_ids.join(', ') : (t.gpu_required ? '—' : 'CPU'),
        ports || '—',
        h('span', { class: 'clip', title: t.status_message || '' }, fmt.firstLine(t.status_message) || '—'),
        t.launch_argv && t.launch_argv.length
          ? h('details', {}, h('summary', {}, 'command'), h('pre', { class: 'argv' }, fmt.shellJoin(t.launch_argv)))
          : '—',
      ];
    };
    const order = (a, b) => a.rank - b.rank || b.generation - a.generation;
    const live = fmt.liveTasks(g).sort(order);
    const liveIds = new Set(live.map((t) => t.id));
    const ended = (g.tasks || []).filter((t) => !liveIds.has(t.id)).sort(order);
    const cols = ['Replica', 'Gen', 'Status', 'Node', 'Cards', 'Ports', 'Message', 'Command'];
    const wasOpen = refs.replicas.querySelector('details.ended[open]') !== null;
    fill(refs.replicas,
      live.length ? table('Replicas', cols, live.map(row))
        : h('p', { class: 'note' }, 'No replica runs or waits now.'),
      ended.length ? h('details', { class: 'ended', open: wasOpen },
        h('summary', {}, `${ended.length} ended replica(s): stopped, failed or replaced`),
        table('Ended replicas', cols, ended.map(row))) : null);
    // the log picker lists every replica, newest generation first
    const choices = (g.tasks || []).slice().sort((a, b) => b.generation - a.generation
      || a.rank - b.rank).map((t) => [t.id, `${t.name} (gen ${t.generation}, ${t.status})`]);
    setOptions(logPick.input, choices);
    if (!logTask && choices.length) pollLogs(); // the first replica's log at once
  }

  function renderKey() {
    if (!group.enable_api) {
      fill(refs.key, h('p', { class: 'note' }, 'API access is off for this service.'));
      rotateBtn.hidden = true;
      return;
    }
    rotateBtn.hidden = !endpoint;
    fill(refs.key, endpoint ? h('dl', { class: 'kv' },
      h('dt', {}, 'Endpoint'), h('dd', { class: 'mono' }, endpoint.id),
      h('dt', {}, 'Key'), h('dd', { class: 'mono', dataset: { testid: 'key-prefix' } }, endpoint.key_prefix),
      h('dt', {}, 'Limits'), h('dd', {}, [
        endpoint.rpm_limit ? `${endpoint.rpm_limit} req/min` : '',
        endpoint.tpm_limit ? `${endpoint.tpm_limit} tokens/min` : '',
        endpoint.quota_tokens ? `${fmt.num(endpoint.quota_tokens)} tokens/${endpoint.quota_period}` : '',
      ].filter(Boolean).join(', ') || 'none'))
      : h('p', { class: 'note' }, 'No endpoint (no key) for this service.'));
  }

  function renderSnippets() {
    const key = knownKey(groupId);
    const sig = `${group.model_name}|${key}`;
    if (sig === snippetKey) return;
    snippetKey = sig;
    const base = `${location.origin}/v1`;
    const s = snippets(base, group.model_name, key);
    fill(refs.snippetsHost,
      h('h3', {}, 'Call it'),
      h('p', { class: 'note' }, key ? 'With the key just shown (this tab only).'
        : 'Put the service’s API key where it says YOUR_API_KEY.'),
      h('dl', { class: 'kv' }, h('dt', {}, 'Base URL'),
        h('dd', { class: 'mono', dataset: { testid: 'base-url' } }, base),
        h('dt', {}, 'Model'), h('dd', { class: 'mono' }, group.model_name)),
      h('div', { class: 'snippet' }, h('div', { class: 'row' }, h('h4', {}, 'Python (OpenAI SDK)'),
        copyButton(() => s.python, 'Copy Python')), h('pre', { dataset: { testid: 'snippet-python' } }, s.python)),
      h('div', { class: 'snippet' }, h('div', { class: 'row' }, h('h4', {}, 'curl'),
        copyButton(() => s.curl, 'Copy curl')), h('pre', { dataset: { testid: 'snippet-curl' } }, s.curl)));
  }

  function renderActions(g) {
    const inference = g.task_type === 'inference';
    act.sleep.disabled = !(inference && g.status === 'running');
    act.wake.disabled = !(inference && ['sleeping', 'waking'].includes(g.status));
    act.stop.hidden = g.desired === 'stopped';
    // a failed service (recovery gave up) is started again too: its header says so
    act.start.hidden = g.desired !== 'stopped' && g.status !== 'failed';
    act.update.disabled = ['rolling', 'recreating', 'rolling_back'].includes(g.rolling_update_state);
    scaleForm.hidden = !inference || g.parallelism === 'pipeline';
    // a count outside the range widens it when autoscaling is off (scaling.js, as the CLI)
    if (document.activeElement !== scale.input) scale.input.value = g.current_replicas;
  }

  async function refresh() {
    if (gone) return;
    try {
      const [g, ns, eps, events] = await Promise.all([
        get(`${API}/task-groups/${groupId}`),
        getOr(`${API}/nodes`, []),
        getOr(`${API}/gateway/endpoints`, []),
        get(`${API}/task-groups/${groupId}/events`),
      ]);
      group = g;
      nodes = byId(ns);
      endpoint = eps.find((e) => e.group_id === groupId) || null;
      setText(title, g.name);
      document.title = `${g.name} · HeteroFlow`;
      badge(g.status, refs.status);
      setText(refs.message, fmt.why(g) || g.status_message || '');
      renderFacts(g);
      renderRollout(g);
      renderReplicas(g);
      renderKey();
      renderSnippets();
      renderActions(g);
      renderTimeline(events);
      setText(error, '');
      main.dataset.loaded = 'true';
    } catch (e) {
      if (e.status === 404) {
        gone = true;
        setText(error, 'This service does not exist (any more), or it is not yours to see.');
      } else if (e.status !== 401) {
        setText(error, `Could not load the service: ${e.message}`);
      }
      main.dataset.loaded = 'true'; // what the API said is on the page
    }
  }

  function renderTimeline(events) {
    if (events.length === eventsSeen) return;
    eventsSeen = events.length;
    fill(refs.timeline, events.slice().reverse().map((e) => {
      const fault = e.kind.startsWith('fault.') || e.to_status === 'failed'
        || /failed|rollback/.test(e.kind);
      return h('li', { class: fault ? 'event fault' : 'event', dataset: { kind: e.kind } },
        h('time', { dateTime: e.created_at }, fmt.time(e.created_at)),
        h('span', { class: 'kind' }, fault ? `⚠ ${e.kind}` : e.kind),
        e.from_status || e.to_status ? h('span', { class: 'change' },
          `${e.from_status || '∅'} → ${e.to_status || '∅'}`) : null,
        e.task_id ? h('span', { class: 'mono task' }, e.task_id) : null,
        h('p', { class: 'msg' }, e.message || ''));
    }));
  }

  // ----- live logs: poll with the cursor the API answers -----
  let logTask = null;
  let cursor = 0;
  let logText = '';
  let logBusy = false;
  async function pollLogs() {
    if (logBusy) return;
    logBusy = true;
    try { await readLogs(); } finally { logBusy = false; }
  }
  async function readLogs() {
    const task = logPick.input.value;
    if (!task) return;
    if (task !== logTask) { logTask = task; cursor = 0; logText = ''; logPre.textContent = ''; }
    if (!follow.checked && cursor > 0) return;
    let more = true;
    let rounds = 0;
    while (more && rounds < 5) {
      const page = await get(`${API}/tasks/${task}/logs?after=${cursor}&limit=200`);
      if (task !== logPick.input.value) return;
      const text = page.chunks.map((c) => c.text).join('');
      cursor = page.next || cursor;
      more = page.chunks.length === 200;
      rounds += 1;
      if (text) {
        logText = (logText + text).slice(-LOG_KEEP_CHARS);
        const stick = logPre.scrollTop + logPre.clientHeight >= logPre.scrollHeight - 24;
        logPre.append(text);
        if (logPre.textContent.length > LOG_KEEP_CHARS * 1.5) logPre.textContent = logText;
        if (follow.checked && stick) logPre.scrollTop = logPre.scrollHeight;
      }
    }
    setText(logNote, logText ? '' : 'No output yet.');
  }
  logPick.input.addEventListener('change', () => pollLogs());
  follow.addEventListener('change', () => { if (follow.checked) logPre.scrollTop = logPre.scrollHeight; });

  // ----- actions -----
  async function run(btn, what, fn) {
    btn.disabled = true;
    try {
      const msg = await fn();
      if (msg) toast(msg, 'success');
    } catch (e) {
      toast(`${what}: ${e.message}`, 'error');
    } finally {
      btn.disabled = false;
      refresh();
    }
  }
  act.sleep.addEventListener('click', () => run(act.sleep, 'Sleep', async () => {
    const r = await api('POST', `${API}/task-groups/${groupId}/sleep`);
    return `Sleeping: ${r.slept.length} replica(s)${r.skipped.length ? `, ${r.skipped.length} skipped` : ''}`;
  }));
  act.wake.addEventListener('click', () => run(act.wake, 'Wake', async () => {
    const r = await api('POST', `${API}/task-groups/${groupId}/wake`);
    return `Wake: ${(r.results || []).map((x) => `${x.branch}${x.message ? ` (${x.message})` : ''}`).join('; ') || 'nothing to wake'}`;
  }));
  act.stop.addEventListener('click', async () => {
    if (!await confirmDialog('Stop the service?', `Every replica of ${group ? group.name : groupId} stops; Start brings it back.`, 'Stop')) return;
    run(act.stop, 'Stop', async () => { await api('POST', `${API}/task-groups/${groupId}/stop`); return 'Stopping'; });
  });
  act.start.addEventListener('click', () => run(act.start, 'Start', async () => {
    await api('POST', `${API}/task-groups/${groupId}/start`);
    return 'Starting';
  }));
  scaleBtn.addEventListener('click', () => run(scaleBtn, 'Scale',
    () => scaleTo(group, Number(scale.input.value))));
  rangeBtn.addEventListener('click', () => group && openRangeDialog(group, (msg) => {
    toast(msg, 'success');
    refresh();
  }));
  act.update.addEventListener('click', () => {
    const current = ((group && fmt.liveTasks(group)[0]) || {}).image || '';
    const strategy = field('Strategy', {}, 'select',
      'Rolling: new replicas start beside the old, which drain; recreate: stop all, then start all.');
    setOptions(strategy.input, [['rolling', 'rolling'], ['recreate', 'recreate']]);
    const image = field('Image', { class: 'mono', autocomplete: 'off', value: current }, 'input',
      'The engine image of the new generation.');
    const args = field('Engine arguments', { class: 'mono', autocomplete: 'off' }, 'input',
      'Replace the current ones (separated by spaces); empty: keep them.');
    const batch = field('Batch size', { type: 'number', min: 1, max: 64, value: '1', class: 'narrow' },
      'input', 'Rolling: replicas replaced at a time.');
    const err = h('p', { class: 'form-error', role: 'alert' });
    const go = h('button', { type: 'submit', class: 'primary' }, 'Start the update');
    const cancel = h('button', { type: 'button' }, 'Cancel');
    const form = h('form', {}, h('div', { class: 'form-grid' }, strategy.wrap, batch.wrap,
      image.wrap, args.wrap), err, h('div', { class: 'actions' }, cancel, go));
    const dlg = modal(`Update ${group ? group.name : groupId}`, form);
    cancel.addEventListener('click', () => dlg.close());
    form.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const body = { strategy: strategy.input.value, batch_size: Number(batch.input.value || 1) };
      if (image.input.value.trim() && image.input.value.trim() !== current) body.image = image.input.value.trim();
      const extra = args.input.value.split(/\s+/).filter(Boolean);
      if (extra.length) body.engine_args = extra;
      go.disabled = true;
      try {
        await api('PUT', `${API}/task-groups/${groupId}/update`, body);
        dlg.close();
        toast('Update started: its progress is under Overview', 'success');
        refresh();
      } catch (e) {
        setText(err, e.message);
        go.disabled = false;
      }
    });
  });
  act.del.addEventListener('click', async () => {
    const name = group ? group.name : groupId;
    if (!await confirmDialog('Delete the service?', `${name}: its replicas stop, its routes and its API key are deleted. This cannot be undone.`, 'Delete')) return;
    try {
      await api('DELETE', `${API}/task-groups/${groupId}`);
      toast(`Deleted ${name}`, 'success');
      location.hash = '#/services';
    } catch (e) {
      toast(`Delete: ${e.message}`, 'error');
    }
  });
  rotateBtn.addEventListener('click', async () => {
    if (!endpoint) return;
    if (!await confirmDialog('Rotate the API key?', 'A new key is made and shown once; the current key stops working within a few seconds.', 'Rotate', false)) return;
    rotateBtn.disabled = true;
    try {
      const r = await api('PATCH', `${API}/gateway/endpoints/${endpoint.id}`, { rotate_key: true });
      rememberKey(groupId, r.api_key);
      endpoint = r;
      fill(refs.newKey, secretBox('New API key', r.api_key,
        'Shown once: copy it now. The old key no longer works.'));
      renderKey();
      renderSnippets();
      refs.newKey.querySelector('input').focus();
    } catch (e) {
      toast(`Rotate: ${e.message}`, 'error');
    } finally {
      rotateBtn.disabled = false;
    }
  });

  const stops = [poll(refresh, 2500), poll(pollLogs, 1500), live.stop];
  return () => stops.forEach((s) => s());
}
