// The fleet overview (issue 33): cards in use by tenant (by commitment), services by
// state, the last faults — GET /fleet/overview, a member's of their own tenant only.

import { h, fill, poll, pageHead, table, setText } from './dom.js';
import { API, get } from './api.js';
import * as fmt from './fmt.js';

export function fleetPage(main) {
  const cards = h('div');
  const states = h('div');
  const faults = h('div');
  const error = h('p', { class: 'form-error', role: 'alert' });
  const section = (title, body) => h('section', { class: 'panel' }, h('h2', {}, title), body);
  main.append(pageHead('Fleet overview'), error,
    h('div', { class: 'columns' }, section('Cards in use by tenant', cards),
      section('Services by state', states)),
    section('Last faults', faults));
  async function refresh() {
    try {
      const r = await get(`${API}/fleet/overview`);
      fill(cards, r.cards_by_tenant.length
        ? table('Cards in use by tenant', ['Tenant', 'Cards (by commitment)'],
          r.cards_by_tenant.map((c) => [c.tenant_id || '—', fmt.num(c.cards, 2)]))
        : h('p', { class: 'note' }, 'No card is committed now.'));
      const st = Object.entries(r.services_by_state);
      fill(states, st.length
        ? table('Services by state', ['State', 'Services'], st.map(([k, n]) => [k, String(n)]))
        : h('p', { class: 'note' }, 'No service.'));
      fill(faults, r.last_faults.length
        ? table('Last faults', ['When', 'Fault', 'Service', 'Message'], r.last_faults.map((f) => [
          fmt.time(f.at), f.kind,
          f.service_id ? h('a', { href: `#/services/${f.service_id}` }, f.service_id) : '—',
          fmt.firstLine(f.message || '')]))
        : h('p', { class: 'note' }, 'No fault recorded.'));
      setText(error, '');
    } catch (e) {
      if (e.status !== 401) setText(error, `Could not load the overview: ${e.message}`);
    }
    main.dataset.loaded = 'true';
  }
  return poll(refresh, 5000);
}
