// Starts Swagger UI on the API reference page (/api/v1/docs). A file of its own, not an
// inline script: the page's Content-Security-Policy runs scripts of this origin only.
// The bundle (./swagger-ui/swagger-ui-bundle.js) is loaded before this by the page.
/* global SwaggerUIBundle */
const root = document.getElementById('swagger-ui');
window.ui = SwaggerUIBundle({
  url: root.dataset.openapi,
  domNode: root,
  layout: 'BaseLayout',
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  validatorUrl: null, // never ask a public validator about this API
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
});
