// Formatting and the few facts the console derives from what the API answers.

export function bytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return '—';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = Number(n);
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v >= 100 || i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
}

export function mib(n) {
  return n ? bytes(n * 1024 * 1024) : '—';
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return '—';
  let s = Math.max(0, Math.floor(seconds));
  const d = Math.floor(s / 86400); s -= d * 86400;
  const hh = Math.floor(s / 3600); s -= hh * 3600;
  const mm = Math.floor(s / 60); s -= mm * 60;
  if (d) return `${d}d ${hh}h`;
  if (hh) return `${hh}h ${String(mm).padStart(2, '0')}m`;
  if (mm) return `${mm}m ${String(s).padStart(2, '0')}s`;
  return `${s}s`;
}

export function parseTime(iso) {
  const t = iso ? Date.parse(iso) : NaN;
  return Number.isNaN(t) ? null : t;
}

export function ago(iso) {
  const t = parseTime(iso);
  return t === null ? '—' : `${duration((Date.now() - t) / 1000)} ago`;
}

/** Local date and time, to the second: 2026-12-01 14:05:09. */
export function time(iso) {
  const t = parseTime(iso);
  if (t === null) return '—';
  const d = new Date(t);
  const p = (x) => String(x).padStart(2, '0');
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} `
    + `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

export function num(n, digits = 0) {
  if (n === null || n === undefined) return '—';
  return Number(n).toLocaleString('en-US', { maximumFractionDigits: digits });
}

const LIVE = new Set(['pending', 'scheduled', 'starting', 'running', 'sleeping', 'waking',
  'stopping']);
/** The group's replicas that are not over (stopped / failed / completed). */
export function liveTasks(group) {
  return (group.tasks || []).filter((t) => LIVE.has(t.status));
}

/** The version an image tag names (vllm/vllm-openai:v0.11.2 -> 0.11.2), like the server's
 *  core/recipe.image_tag_version; '' when the tag is not a version. */
export function imageVersion(image) {
  const last = (image || '').split('@')[0].split('/').pop();
  if (!last.includes(':')) return '';
  const tag = last.slice(last.lastIndexOf(':') + 1);
  return /^v?\d+(\.\d+)*([.+-][0-9A-Za-z.+-]*)?$/.test(tag) ? tag.replace(/^v/, '') : '';
}

function imageTag(image) {
  const last = (image || '').split('@')[0].split('/').pop();
  return last.includes(':') ? last.slice(last.lastIndexOf(':') + 1) : '';
}

/** "vllm 0.11.2": the engine the platform recognised (from the image or the template)
 *  and its version — the image tag's, else what the node reported for that engine,
 *  else the tag as it is. */
export function engineLabel(group, nodesById) {
  const t = liveTasks(group)[0] || (group.tasks || [])[0];
  if (!t) return '—';
  const engine = t.engine || (t.image ? 'custom image' : '—');
  const reported = ((nodesById && nodesById.get(t.node_id)) || {}).engines || {};
  const version = imageVersion(t.image) || reported[t.engine] || imageTag(t.image);
  return version ? `${engine} ${version}` : engine;
}

/** Cards per replica × replicas: "2 (1 × 2)", "0 (CPU)". */
export function gpuCount(group) {
  const t = (group.tasks || [])[0];
  const per = t ? t.gpu_required : 0;
  const n = group.current_replicas || 0;
  if (!per) return '0 (CPU)';
  return n > 1 ? `${per * n} (${per} × ${n})` : String(per);
}

/** The shape of a service. `split` is N independent copies of the model (its world_size
 *  is the replica count; one-click services are made split so that they can scale):
 *  shown only when there is more than one copy — one copy is a single replica. */
export function parallelism(group) {
  const p = group.parallelism || 'single';
  if (p === 'split') return group.world_size > 1 ? `split × ${group.world_size} replicas` : 'single';
  return group.world_size > 1 ? `${p.replace('_', ' ')} × ${group.world_size}` : p.replace('_', ' ');
}

/** A port in Docker's direction, as the CLI writes it: host→container; a port not
 *  booked on a host yet is its container port alone. */
export function port(p) {
  return p.host_port ? `${p.host_port}→${p.container_port}` : String(p.container_port);
}

export function replicaRange(group) {
  return `min ${group.min_replicas} · now ${group.current_replicas} · max ${group.max_replicas}`;
}

export function autoscale(group) {
  const p = group.scale_policy || {};
  if (!p.enabled) return 'off';
  return `on · ${p.metric || 'inflight'}${p.target ? ` ${p.target}` : ''}`;
}

/** Seconds since the earliest running replica became ready; null when none runs. */
export function uptimeSeconds(group) {
  const starts = (group.tasks || []).filter((t) => t.status === 'running')
    .map((t) => parseTime(t.running_at)).filter((x) => x !== null);
  if (!starts.length) return null;
  return (Date.now() - Math.min(...starts)) / 1000;
}

/** Shell-quote an argv for display (and for pasting). */
export function shellJoin(argv) {
  return (argv || []).map((a) => (/^[A-Za-z0-9_@%+=:,./-]+$/.test(a) ? a
    : `'${String(a).replace(/'/g, "'\\''")}'`)).join(' ');
}

/** The first line of a message (cards show one line; the detail the whole). */
export function firstLine(s) {
  return (s || '').split('\n')[0];
}

/** Why a service is not running, in its own words or its first waiting replica's (a
 *  pending replica's message is the scheduler's reason, e.g. InsufficientResources: ...). */
export function why(group) {
  if (group.status === 'running') return '';
  const t = liveTasks(group).find((x) => x.status !== 'running' && x.status_message);
  return (t && t.status_message) || group.status_message || '';
}
