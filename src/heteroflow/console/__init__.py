"""The web console: a no-build single-page app (plain ES modules, one CSS file, one
index.html) under ``static/``, served by the server (api/routes/console.py) and talking
to the same JSON API as the CLI. Nothing here is Python but this marker: the folder is
package data (pyproject's ``[tool.setuptools.package-data]``). See docs/console.md."""
