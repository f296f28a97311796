// Control panel (O5, operators): the platform switches, tenants and their quotas, users,
// and sharing groups. Every change is one API call; the API checks the caller's role.

import { h, fill, field, setOptions, pageHead, table, toast, modal, confirmDialog,
  setText } from './dom.js';
import { API, api, get, getOr, byId } from './api.js';
import * as fmt from './fmt.js';

const SWITCHES = [
  ['inference_dedup_enabled', 'Reuse a running service',
    'A create for a model and image that already run answers with that service (a new key '
    + 'and route to it) instead of starting another engine.'],
  ['cross_tenant_dedup_enabled', 'Reuse across the tenants of a sharing group',
    'With reuse on, a tenant may also be given a service of another tenant of its sharing group.'],
];
const QUOTAS = [
  ['quota_cards', 'GPU cards', 'cards'], ['quota_services', 'Services', 'services'],
  ['quota_replicas', 'Replicas', 'replicas'], ['quota_cpu_memory_mb', 'CPU memory (MB)', 'cpu_memory_mb'],
];

function section(title, ...body) {
  return h('section', { class: 'panel' }, h('h2', {}, title), ...body);
}

function limit(v) {
  return v ? fmt.num(v) : 'no limit';
}

export function adminPage(main) {
  const error = h('p', { class: 'form-error', role: 'alert' });
  const switches = h('div', { class: 'switches' });
  const tenantsHost = h('div');
  const usersHost = h('div');
  const groupsHost = h('div');

  // ----- create forms -----
  const tName = field('Name', { required: true, pattern: '[A-Za-z0-9][A-Za-z0-9._\\-]{0,62}', autocomplete: 'off' });
  const tCeiling = field('Priority ceiling', { type: 'number', min: 0, max: 1000, value: '100' });
  const tGroup = field('Sharing group', {}, 'select');
  const tForm = h('form', { class: 'toolbar', 'aria-label': 'New tenant' }, tName.wrap, tCeiling.wrap,
    tGroup.wrap, h('button', { type: 'submit', class: 'primary' }, 'Create tenant'));
  const uName = field('User name', { required: true, autocomplete: 'off' });
  const uPass = field('Password', { type: 'password', required: true, minlength: 8, autocomplete: 'new-password' });
  const uRole = field('Role', {}, 'select');
  setOptions(uRole.input, [['member', 'member'], ['tenant_admin', 'tenant admin'], ['operator', 'operator']]);
  const uTenant = field('Tenant', {}, 'select');
  const uForm = h('form', { class: 'toolbar', 'aria-label': 'New user' }, uName.wrap, uPass.wrap,
    uRole.wrap, uTenant.wrap, h('button', { type: 'submit', class: 'primary' }, 'Create user'));
  const gName = field('Name', { required: true, autocomplete: 'off' });
  const gForm = h('form', { class: 'toolbar', 'aria-label': 'New sharing group' }, gName.wrap,
    h('button', { type: 'submit', class: 'primary' }, 'Create sharing group'));

  main.append(pageHead('Control panel'), error,
    section('Platform switches', switches),
    section('Tenants', tenantsHost, h('h3', {}, 'New tenant'), tForm),
    section('Users', usersHost, h('h3', {}, 'New user'), uForm),
    section('Sharing groups', h('p', { class: 'note' },
      'Tenants of one sharing group may share GPU cards (and, with the switch above, services).'),
    groupsHost, h('h3', {}, 'New sharing group'), gForm));

  let tenants = [];
  let groups = [];

  async function act(what, fn) {
    try {
      await fn();
      toast(what, 'success');
      await reload();
      return true;
    } catch (e) {
      toast(`${what}: ${e.message}`, 'error');
      return false;
    }
  }

  function renderSwitches(settings) {
    fill(switches, SWITCHES.map(([key, label, hint]) => {
      const id = `switch-${key}`;
      const input = h('input', { type: 'checkbox', role: 'switch', id, checked: !!settings[key],
        'aria-describedby': `${id}-hint`, dataset: { setting: key } });
      input.addEventListener('change', async () => {
        input.disabled = true;
        try {
          const r = await api('PUT', `${API}/platform-settings`, { [key]: input.checked });
          input.checked = !!r[key];
          toast(`${label}: ${r[key] ? 'on' : 'off'}`, 'success');
        } catch (e) {
          input.checked = !input.checked;
          toast(`${label}: ${e.message}`, 'error');
        } finally {
          input.disabled = false;
        }
      });
      return h('div', { class: 'switch' }, input,
        h('label', { htmlFor: id }, label), h('small', { class: 'hint', id: `${id}-hint` }, hint));
    }));
  }

  function editTenant(t) {
    const ceiling = field('Priority ceiling', { type: 'number', min: 0, max: 1000, value: String(t.priority_ceiling) });
    const quotas = QUOTAS.map(([k, label]) => [k, field(label, { type: 'number', min: 0,
      value: String(t[k] || 0) }, 'input', '0: no limit')]);
    const tokens = field('Tokens', { type: 'number', min: 0, value: String(t.quota_tokens || 0) }, 'input', '0: no limit');
    const period = field('Per', {}, 'select');
    setOptions(period.input, [['', '—'], ['day', 'day'], ['month', 'month']]);
    period.input.value = t.quota_token_period || '';
    const sg = field('Sharing group', {}, 'select');
    setOptions(sg.input, [['', 'none'], ...groups.map((g) => [g.id, g.name])]);
    sg.input.value = t.sharing_group_id || '';
    const own = h('input', { type: 'checkbox', id: 'edit-own', checked: t.members_see_own });
    const err = h('p', { class: 'form-error', role: 'alert' });
    const save = h('button', { type: 'submit', class: 'primary' }, 'Save');
    const cancel = h('button', { type: 'button' }, 'Cancel');
    const form = h('form', {}, h('div', { class: 'form-grid' }, ceiling.wrap,
      quotas.map(([, f]) => f.wrap), tokens.wrap, period.wrap, sg.wrap),
    h('div', { class: 'check' }, own, h('label', { htmlFor: 'edit-own' },
      'Members see only the services they created')),
    err, h('div', { class: 'actions' }, cancel, save));
    const dlg = modal(`Tenant ${t.name}`, form);
    cancel.addEventListener('click', () => dlg.close());
    form.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const body = { priority_ceiling: Number(ceiling.input.value),
        quota_tokens: Number(tokens.input.value || 0),
        quota_token_period: period.input.value || null,
        sharing_group_id: sg.input.value || null, members_see_own: own.checked };
      if (!body.quota_tokens && !body.quota_token_period) delete body.quota_token_period;
      for (const [k, f] of quotas) body[k] = Number(f.input.value || 0);
      try {
        await api('PATCH', `${API}/tenants/${t.id}`, body);
        dlg.close();
        toast(`Saved tenant ${t.name}`, 'success');
        reload();
      } catch (e) {
        setText(err, e.message);
      }
    });
  }

  async function reload() {
    try {
      const [settings, ts, users, gs] = await Promise.all([get(`${API}/platform-settings`),
        get(`${API}/tenants`), get(`${API}/users`), get(`${API}/sharing-groups`)]);
      tenants = ts;
      groups = gs;
      const quotaUse = new Map(await Promise.all(ts.map(async (t) =>
        [t.id, await getOr(`${API}/tenants/${t.id}/quota`, null)])));
      renderSwitches(settings);
      const tById = byId(ts);
      const gById = byId(gs);
      fill(tenantsHost, table('Tenants', ['Tenant', 'Priority ceiling', 'Sharing group',
        ...QUOTAS.map(([, l]) => l), 'Tokens', 'Members see', ''], ts.map((t) => {
        const edit = h('button', { type: 'button', class: 'small', 'aria-label': `Edit tenant ${t.name}` }, 'Edit');
        edit.addEventListener('click', () => editTenant(t));
        const q = quotaUse.get(t.id);
        return [h('span', {}, h('strong', {}, t.name), h('br'), h('small', { class: 'mono' }, t.id)),
          String(t.priority_ceiling), t.sharing_group_id ? (gById.get(t.sharing_group_id) || {}).name || t.sharing_group_id : '—',
          ...QUOTAS.map(([k, , u]) => `${q ? `${fmt.num(q.usage[u], 1)} of ` : ''}${limit(t[k])}`),
          t.quota_tokens ? `${fmt.num(t.quota_tokens)} / ${t.quota_token_period}` : 'no limit',
          t.members_see_own ? 'their own' : 'the tenant’s', edit];
      })));
      setOptions(tGroup.input, [['', 'none'], ...gs.map((g) => [g.id, g.name])]);
      setOptions(uTenant.input, ts.map((t) => [t.id, t.name]));
      fill(usersHost, table('Users', ['User', 'Role', 'Tenant', 'Created'], users.map((u) => [
        h('strong', {}, u.username), u.role, (tById.get(u.tenant_id) || {}).name || u.tenant_id || '—',
        fmt.time(u.created_at)])));
      fill(groupsHost, gs.length ? gs.map((g) => {
        const pick = field(`Add a tenant to ${g.name}`, {}, 'select');
        const free = ts.filter((t) => !t.sharing_group_id);
        setOptions(pick.input, free.map((t) => [t.id, t.name]));
        const add = h('button', { type: 'button', class: 'small', disabled: !free.length }, 'Add');
        add.addEventListener('click', () => act(`Added to ${g.name}`, () =>
          api('POST', `${API}/sharing-groups/${g.id}/tenants`, { tenant_id: pick.input.value })));
        const del = h('button', { type: 'button', class: 'small danger' }, `Delete ${g.name}`);
        del.addEventListener('click', async () => {
          if (await confirmDialog('Delete the sharing group?', `${g.name} (it must have no tenants).`, 'Delete')) {
            act(`Deleted ${g.name}`, () => api('DELETE', `${API}/sharing-groups/${g.id}`));
          }
        });
        return h('div', { class: 'sharing-group' }, h('h3', {}, g.name, ' ', h('small', { class: 'mono' }, g.id)),
          g.tenants.length ? h('ul', { class: 'plain' }, g.tenants.map((t) => {
            const rm = h('button', { type: 'button', class: 'small', 'aria-label': `Remove ${t.name} from ${g.name}` }, 'Remove');
            rm.addEventListener('click', () => act(`Removed ${t.name} from ${g.name}`, () =>
              api('DELETE', `${API}/sharing-groups/${g.id}/tenants/${t.id}`)));
            return h('li', {}, t.name, ' ', rm);
          })) : h('p', { class: 'note' }, 'No tenants.'),
          h('div', { class: 'row' }, pick.wrap, add, del));
      }) : h('p', { class: 'note' }, 'No sharing groups.'));
      setText(error, '');
      main.dataset.loaded = 'true';
    } catch (e) {
      if (e.status !== 401) setText(error, `Could not load the control panel: ${e.message}`);
      main.dataset.loaded = 'true';
    }
  }

  tForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const body = { name: tName.input.value.trim(), priority_ceiling: Number(tCeiling.input.value || 100) };
    if (tGroup.input.value) body.sharing_group_id = tGroup.input.value;
    if (await act(`Created tenant ${body.name}`, () => api('POST', `${API}/tenants`, body))) tForm.reset();
  });
  uForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const body = { username: uName.input.value.trim(), password: uPass.input.value,
      role: uRole.input.value, tenant_id: uTenant.input.value || undefined };
    if (await act(`Created user ${body.username}`, () => api('POST', `${API}/users`, body))) uForm.reset();
  });
  gForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const body = { name: gName.input.value.trim() };
    if (await act(`Created sharing group ${body.name}`, () => api('POST', `${API}/sharing-groups`, body))) gForm.reset();
  });
  reload();
  return () => {};
}
