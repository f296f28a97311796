// The console is a client of the management API, like the CLI: the same login, the same
// JWT (kept in sessionStorage: gone when the tab closes), the same answers and errors.
// What a user may see is whatever the API answers them: there is no second check here.

const TOKEN = 'heteroflow.token';
export const API = '/api/v1';

export class ApiError extends Error {
  constructor(status, code, message, field) {
    super(field ? `${message} (${field})` : message);
    this.status = status;
    this.code = code;
    this.field = field || null;
    this.detail = message;
  }
}

function decodePayload(token) {
  try {
    const part = token.split('.')[1].replace(/-/g, '+').replace(/_/g, '/');
    const json = atob(part + '='.repeat((4 - (part.length % 4)) % 4));
    return JSON.parse(decodeURIComponent(Array.from(json,
      (c) => `%${c.charCodeAt(0).toString(16).padStart(2, '0')}`).join('')));
  } catch {
    return null;
  }
}

/** Who is logged in, from the token's claims ({id, name, tenant, role, exp}), or null. The
 *  claims only shape the page (e.g. hide the control panel from members); the API decides. */
export function session() {
  const token = sessionStorage.getItem(TOKEN);
  const p = token ? decodePayload(token) : null;
  if (!p || (p.exp && p.exp * 1000 <= Date.now())) return null;
  return { id: p.sub, name: p.name, tenant: p.tenant, role: p.role, exp: p.exp,
    operator: p.role === 'operator' };
}

export function logout(reason) {
  sessionStorage.removeItem(TOKEN);
  forgetKeys();
  window.dispatchEvent(new CustomEvent('hf-logout', { detail: reason || '' }));
}

function errorFrom(status, data) {
  const e = (data && data.error) || {};
  if (e.message) return new ApiError(status, e.code || '', e.message, e.field);
  if (data && Array.isArray(data.detail)) {
    const d = data.detail[0] || {};
    return new ApiError(status, 'validation_error', d.msg || 'invalid request',
      (d.loc || []).filter((x) => x !== 'body').join('.'));
  }
  if (data && typeof data.detail === 'string') return new ApiError(status, '', data.detail);
  return new ApiError(status, '', `the server answered ${status}`);
}

async function call(method, path, body, accept = 'application/json') {
  const headers = { Accept: accept };
  const token = sessionStorage.getItem(TOKEN);
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method, headers, cache: 'no-store', credentials: 'omit' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let r;
  try {
    r = await fetch(path, init);
  } catch {
    throw new ApiError(0, 'unreachable', 'the server cannot be reached');
  }
  if (r.status === 401 && token) {
    logout('Your session ended: log in again.');
  }
  return r;
}

/** Call the API: the parsed answer, or an ApiError with the API's message and field. */
export async function api(method, path, body) {
  const r = await call(method, path, body);
  if (r.status === 204) return null;
  const type = r.headers.get('content-type') || '';
  const data = type.includes('json') ? await r.json() : await r.text();
  if (!r.ok) throw errorFrom(r.status, data);
  return data;
}

export const get = (path) => api('GET', path);

export async function login(username, password) {
  const r = await call('POST', `${API}/auth/login`, { username, password });
  const data = await r.json().catch(() => ({}));
  if (!r.ok) throw errorFrom(r.status, data);
  sessionStorage.setItem(TOKEN, data.access_token);
  return session();
}

/** Fetch with the token and hand the answer to the browser as a file download. */
export async function download(path, filename, accept) {
  const r = await call('GET', path, undefined, accept);
  if (!r.ok) {
    const type = r.headers.get('content-type') || '';
    throw errorFrom(r.status, type.includes('json') ? await r.json() : null);
  }
  const url = URL.createObjectURL(await r.blob());
  const a = document.createElement('a');
  a.href = url;
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// A key the API just showed (create, rotate) is kept in this tab's memory only, so the
// service's snippets can carry it until the page is reloaded or the user logs out.
const keys = new Map();
export function rememberKey(groupId, key) { keys.set(groupId, key); }
export function knownKey(groupId) { return keys.get(groupId) || ''; }
function forgetKeys() { keys.clear(); }

/** id -> object, for lists the pages join (nodes, tenants, users). */
export function byId(list) {
  return new Map((list || []).map((x) => [x.id, x]));
}

/** GET that answers fallback instead of failing (a member may not read some lists). */
export async function getOr(path, fallback) {
  try {
    return await get(path);
  } catch (e) {
    if (e.status === 401) throw e;
    return fallback;
  }
}
