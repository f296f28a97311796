// Models (O4): what each node found in its model folders, with a one-click deploy that
// opens the create dialog with the model filled in.

import { h, fill, poll, pageHead, table, badge, setText } from './dom.js';
import { API, get } from './api.js';
import * as fmt from './fmt.js';
import { openCreateDialog } from './create.js';

export function modelsPage(main) {
  const host = h('div');
  const error = h('p', { class: 'form-error', role: 'alert' });
  main.append(pageHead('Models'),
    h('p', { class: 'note' }, 'The models each node reports from its model folders, rescanned '
      + 'as it runs, and the models it fetched into its cache (from a hub, a URL, or another '
      + 'node: fleet://). Deploy opens “New service” with the model filled in.'), error, host);
  let sig = '';
  async function refresh() {
    try {
      const nodes = await get(`${API}/nodes`);
      const next = JSON.stringify(nodes.map((n) => [n.id, n.name, n.status, n.models]));
      main.dataset.loaded = 'true';
      setText(error, '');
      if (next === sig) return;
      sig = next;
      const withModels = nodes.filter((n) => (n.models || []).length);
      if (!withModels.length) {
        fill(host, h('p', { class: 'empty' }, 'No node reported a model yet. A node scans the '
          + 'folders in its model_scan_dirs (node config) and reports what it finds.'));
        return;
      }
      fill(host, withModels.map((n) => h('section', { class: 'panel' },
        h('h2', {}, n.name, ' ', badge(n.status)),
        table(`Models on ${n.name}`,
          ['Model', 'Format', 'Size', 'Files', 'Path or source', 'State', 'Modified', ''],
          n.models.map((m) => {
            const deploy = h('button', { type: 'button', class: 'small primary',
              'aria-label': `Deploy ${m.name} from ${n.name}` }, 'Deploy');
            deploy.addEventListener('click', () => openCreateDialog({
              model: { ...m, node_id: n.id } }));
            // issue 29: a model the node fetched into its cache names its source and its
            // revision; fleet://<key> deploys that copy on any node (copied from here)
            const state = m.source
              ? h('span', {}, badge(m.state || 'complete'),
                m.revision ? h('span', { class: 'mono', title: m.revision },
                  ` ${m.revision.slice(0, 12)}`) : '',
                m.key ? h('div', { class: 'mono clip', title: `fleet://${m.key}` },
                  `fleet://${m.key}`) : '')
              : 'on disk';
            const size = m.state === 'downloading'
              ? `${fmt.bytes(m.size_bytes)} so far` : fmt.bytes(m.size_bytes);
            return [h('strong', {}, m.name), m.format || '—', size,
              String((m.files || []).length), h('span', { class: 'mono clip', title: m.path }, m.path),
              state, m.mtime ? fmt.time(new Date(m.mtime * 1000).toISOString()) : '—', deploy];
          })))));
    } catch (e) {
      if (e.status !== 401) setText(error, `Could not load the models: ${e.message}`);
      main.dataset.loaded = 'true';
    }
  }
  return poll(refresh, 10000);
}
