"""Docs that run as written (issue 12): every fenced block of README.md and docs/*.md.

One ``heteroflow up --demo tiny --port 0`` serves the whole module; the blocks run in
the order of the files (README.md, then docs/*.md by name) and of the blocks in them,
one test per block, so a later block may use what an earlier one made. Each block is:

* **shell** (``bash``, ``sh``, ``shell``, ``console``): one bash process per block, each
  logical command (``\\``-continued lines joined) in turn, stdout and stderr together,
  its stdin one line: ``$NEW_PASSWORD`` (what a user types at a prompt). Every command
  must exit 0 — or N where the block is marked ``<!-- docs-test: exit N -->`` or the
  command ends with ``# → exit N``. Double-quoted strings in a ``# → …`` comment must
  appear in the command's output, and so must the words of a ``text`` block that follows
  the block (its last command's sample output; words with a digit or "…" are left out:
  ids, ports, times).
* **python**: run with this interpreter; must exit 0.
* **request** (``http``, or ``json`` whose first line is ``METHOD /path``): sent to the
  server with an operator's token (``/v1/…``: the demo's API key) in place of whatever
  ``Authorization`` the docs show; the answer must be 2xx, or N where marked
  ``<!-- docs-test: status N -->``.
* **schema** (``json`` marked ``<!-- docs-test: schema NAME -->``): parsed by the code
  that reads that document (``SCHEMAS`` below).
* **skip**: ``<!-- docs-test: skip (REASON) -->`` right before the block; the reason is
  required and shows in pytest's summary. Any other block fails its test, so a new block
  cannot silently escape.

What the docs write and what runs here (commands run in a scratch directory with
``.venv/bin`` first on PATH and ``HOME`` a temporary one whose ``~/.heteroflow`` is the
server's data directory; ``HETEROFLOW_*`` from the caller's environment are dropped):

* ``http://127.0.0.1:3333`` becomes the server's real address;
* the Gemma demo of ``./scripts/up`` is the tiny one here: ``gemma-3-270m-q4_k_m.gguf``
  becomes ``heteroflow-tiny.gguf`` and ``gemma-3-270m`` becomes ``heteroflow-tiny``;
* ``sk-…`` is the demo's API key (``$KEY``); ``tg-…``, ``task-…``, ``ep-…``, ``tn-…``,
  ``usr-…``, ``sg-…``, ``mr-…``, ``rc-…``, ``ht-…`` are the id of that kind printed last by
  an earlier command or answer; ``{id}`` in a request path the same for the collection it names;
* the environment holds ``HETEROFLOW_PASSWORD`` (the admin password, read by
  ``heteroflow login``), ``TOKEN`` (an operator's JWT), ``KEY``, ``NEW_PASSWORD``,
  ``HETEROFLOW_URL``, and ``HETEROFLOW_DATA_DIR`` / ``HETEROFLOW_CLI_DIR`` (the data
  directory: ``migrate``, ``rotate-jwt-secret`` and ``reset-password`` act on the live
  database, and the CLI uses the login ``up`` wrote).

After a block that revoked the tokens (``rotate-jwt-secret``) the test logs in again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest

from tests.docs_blocks import Command, Plan, all_plans, parse, request_of, sample_words
from tests.docs_blocks import plan as plan_blocks

pytestmark = pytest.mark.e2e

PLANS = all_plans()
NEW_PASSWORD = "docs-test-new-password-1"
VENV_BIN = str(Path(sys.executable).parent)
ID_KINDS = ("tg", "task", "ep", "tn", "usr", "sg", "mr", "rc", "ht")
# "{id}" after these path segments is the last id of that kind
COLLECTIONS = {
    "task-groups": "tg",
    "tasks": "task",
    "endpoints": "ep",
    "tenants": "tn",
    "users": "usr",
    "sharing-groups": "sg",
    "model-routes": "mr",
    "registry-credentials": "rc",
    "hub-tokens": "ht",
}
NAMES = (
    ("http://127.0.0.1:3333", "{base}"),
    ("gemma-3-270m-q4_k_m.gguf", "heteroflow-tiny.gguf"),
    ("gemma-3-270m", "heteroflow-tiny"),
)
BLOCK_TIMEOUT_S = 120
TOOLS = ("curl", "jq")  # used by the docs, not installed by HeteroFlow
# bash: the last id of a kind in the transcript of everything printed so far
HF_LAST = (
    'hf_last() { grep -oE "\\b$1-[0-9a-f]{12}\\b" "$DOCS_TRANSCRIPT" | tail -n 1 | '
    'grep . || echo "$1-none-printed-yet"; }'
)


def _node_config(data: Any, _: Path) -> None:
    from heteroflow.agent.config import NodeConfig

    NodeConfig.from_dict(data)


def _routes_file(data: Any, tmp: Path) -> None:
    from heteroflow.gateway.routing.routes_file import load_routes

    path = tmp / "routes.json"
    path.write_text(json.dumps(data))
    # the variable an external backend's key comes from, as its operator would set it
    previous = os.environ.get("PROVIDER_KEY")
    os.environ["PROVIDER_KEY"] = "sk-provider-test"
    try:
        load_routes(path, 1)
    finally:
        if previous is None:
            del os.environ["PROVIDER_KEY"]
        else:
            os.environ["PROVIDER_KEY"] = previous


def _audit_page(data: Any, _: Path) -> None:
    from heteroflow.schemas.audit import AuditPage

    AuditPage.model_validate(data)


SCHEMAS: dict[str, Callable[[Any, Path], None]] = {
    "node-config": _node_config,  # the agent's HETEROFLOW_AGENT_CONFIG_FILE
    "routes-file": _routes_file,  # heteroflow gateway --routes FILE
    "audit-page": _audit_page,  # GET /api/v1/audit
}


# ---- the server ----------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}


@dataclass
class Docs:
    """The live ``up`` and what the blocks share."""

    proc: subprocess.Popen[bytes]
    log: Path
    data: Path
    work: Path
    transcript: Path
    base: str = ""
    key: str = ""
    password: str = ""
    token: str = ""

    def up_tail(self, n: int = 30) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "----- heteroflow up (last lines) -----\n" + "\n".join(lines[-n:])

    def env(self) -> dict[str, str]:
        stdin = self.work / ".stdin"
        stdin.write_text(NEW_PASSWORD + "\n")
        return {
            **_clean_env(),
            "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
            "HOME": str(self.data.parent),
            "HETEROFLOW_DATA_DIR": str(self.data),
            "HETEROFLOW_CLI_DIR": str(self.data),
            "HETEROFLOW_PASSWORD": self.password,
            "HETEROFLOW_URL": self.base,
            "TOKEN": self.token,
            "KEY": self.key,
            "NEW_PASSWORD": NEW_PASSWORD,
            "DOCS_TRANSCRIPT": str(self.transcript),
            "DOCS_OUT": str(self.work / ".out"),
            "DOCS_STDIN": str(stdin),
        }

    def record(self, text: str) -> None:
        with self.transcript.open("a") as f:
            f.write(text + "\n")

    def last_id(self, kind: str) -> str:
        found = re.findall(rf"\b{kind}-[0-9a-f]{{12}}\b", self.transcript.read_text())
        return found[-1] if found else f"{kind}-none-printed-yet"

    def rewrite(self, text: str, *, in_shell: bool) -> str:
        for written, real in NAMES:
            text = text.replace(written, real.format(base=self.base))
        key = "$KEY" if in_shell else self.key
        text = re.sub(r"\bsk-(…|\.\.\.)", lambda _: key, text)

        def an_id(m: re.Match[str]) -> str:
            kind = m.group(1)
            return f"$(hf_last {kind})" if in_shell else self.last_id(kind)

        return re.sub(rf"\b({'|'.join(ID_KINDS)})-…", an_id, text)

    def login(self) -> None:
        """A fresh operator token for the test, and the CLI logged in as admin."""
        r = httpx.post(
            self.base + "/api/v1/auth/login",
            json={"username": "admin", "password": self.password},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        self.token = r.json()["access_token"]
        if not self.token_works(self.cli_token()):
            cli = subprocess.run(
                ["heteroflow", "login", "--server", self.base, "--username", "admin"],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert cli.returncode == 0, cli.stdout + cli.stderr

    def cli_token(self) -> str:
        try:
            return str(json.loads((self.data / "cli.json").read_text()).get("token", ""))
        except (OSError, ValueError):
            return ""

    def token_works(self, token: str) -> bool:
        if not token:
            return False
        r = httpx.get(
            self.base + "/api/v1/tenants",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        return r.status_code == 200


def _wait_ready(docs: Docs, timeout_s: float = 90) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = docs.log.read_text(errors="replace")
        if "Press Ctrl-C" in text or docs.proc.poll() is not None:
            break
        time.sleep(0.2)
    assert "Press Ctrl-C" in text, f"heteroflow up did not get ready:\n{text}"
    return text


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Docs]:
    root = tmp_path_factory.mktemp("docs")
    home, work = root / "home", root / "work"
    data = home / ".heteroflow"
    data.mkdir(parents=True)
    work.mkdir()
    log = root / "up.log"
    env = {
        **_clean_env(),
        "HOME": str(home),
        "HETEROFLOW_CLI_DIR": str(data),
        # a rotated JWT secret is seen at once (not within 2 s): the test logs in again
        "HETEROFLOW_JWT_SECRET_CACHE_S": "0",
        # a service a request block created is placed before the next block's `status`
        # looks (a task still waiting for its first round counts as pending there)
        "HETEROFLOW_SCHEDULER_INTERVAL_S": "0.2",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "heteroflow.cli",
                "up",
                "--demo",
                "tiny",
                "--port",
                "0",
                "--data-dir",
                str(data),
                "--threads",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
    d = Docs(proc, log, data, work, root / "transcript.txt")
    d.transcript.write_text("")
    try:
        text = _wait_ready(d)
        base = re.search(r"server on (http://127\.0\.0\.1:\d+)", text)
        key = re.search(r"API key[^:\n]*: (sk-[0-9a-f-]{36})", text)
        password = re.search(r"admin password \(shown once\): (\S+)", text)
        assert base and key and password, text
        d.base, d.key, d.password = base.group(1), key.group(1), password.group(1)
        d.login()
        yield d
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ---- the blocks ----------------------------------------------------------------------


def _check_output(c: Command, rc: int, output: str, expected_rc: int) -> list[str]:
    problems = []
    if rc != expected_rc:
        problems.append(f"exit {rc}, the docs expect {expected_rc}")
    for text in c.expect:
        if text not in output:
            problems.append(f"the docs say the output shows {text!r}")
    missing = [w for w in sample_words(c.sample) if w not in output]
    if missing:
        problems.append(f"words of the sample output not printed: {missing}")
    return problems


def run_shell(docs: Docs, plan: Plan) -> None:
    for tool in TOOLS:
        used = any(re.search(rf"(^|[|(;]\s*){tool} ", c.source, re.M) for c in plan.commands)
        if used and shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed on this machine")
    script = ["set -o pipefail", HF_LAST]
    for i, c in enumerate(plan.commands):
        script += [
            f"printf '\\n@@docs-test-begin {i}\\n'",
            "{",
            docs.rewrite(c.source, in_shell=True),
            '} > "$DOCS_OUT" 2>&1 < "$DOCS_STDIN"',
            "rc=$?",
            'cat "$DOCS_OUT"; cat "$DOCS_OUT" >> "$DOCS_TRANSCRIPT"',
            f"printf '\\n@@docs-test-end {i} %d\\n' \"$rc\"",
            # later commands build on this one: stop at the first wrong exit status
            f'[ "$rc" -eq {0 if c.exit_code is None else c.exit_code} ] || exit 0',
        ]
    try:
        proc = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            env=docs.env(),
            cwd=docs.work,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        fail(f"{plan.block.where}: the block ran past {BLOCK_TIMEOUT_S} s:\n{exc.stdout!r}")
    failures = []
    for i, c in enumerate(plan.commands):
        m = re.search(
            rf"@@docs-test-begin {i}\n(.*?)\n@@docs-test-end {i} (\d+)\n", proc.stdout, re.S
        )
        if m is None:
            failures.append(f"(not run: {plan.block.path}:{c.line} and what follows it)")
            break
        output, rc = m.group(1), int(m.group(2))
        problems = _check_output(c, rc, output, 0 if c.exit_code is None else c.exit_code)
        if problems:
            failures.append(
                f"{plan.block.path}:{c.line}: {c.source}\n  "
                + "\n  ".join(problems)
                + "\n  output:\n"
                + _indent(output[-3000:])
            )
    if proc.stderr.strip():
        failures.append(f"the block's shell said:\n{_indent(proc.stderr[-2000:])}")
    if failures:
        fail("\n\n".join(failures) + "\n\n" + docs.up_tail())


def run_python(docs: Docs, plan: Plan) -> None:
    code = docs.rewrite(plan.block.text, in_shell=False)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=docs.env(),
        cwd=docs.work,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    docs.record(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        fail(f"{plan.block.where}: exit {proc.returncode}\n{code}\n{proc.stdout}{proc.stderr}")


def _path(docs: Docs, path: str) -> str:
    def one(m: re.Match[str]) -> str:
        kind = COLLECTIONS.get(m.group(1))
        if kind is None:
            fail(f"no id kind for {{id}} after /{m.group(1)}/ in {path}: see COLLECTIONS")
        return f"/{m.group(1)}/{docs.last_id(kind)}"

    return re.sub(r"/([a-z-]+)/\{id\}", one, path)


def run_request(docs: Docs, plan: Plan) -> None:
    req = request_of(docs.rewrite(plan.block.text, in_shell=False))
    path = _path(docs, req.path)
    credential = docs.key if path.startswith("/v1/") else docs.token
    headers = {k: v for k, v in req.headers.items() if k.lower() != "authorization"}
    headers["Authorization"] = f"Bearer {credential}"
    body = json.loads(req.body) if req.body else None
    r = httpx.request(req.method, docs.base + path, headers=headers, json=body, timeout=60)
    docs.record(r.text)
    marker = plan.block.marker
    where = f"{plan.block.where}: {req.method} {path}"
    expected = int(marker.arg) if marker is not None and marker.kind == "status" else None
    ok = r.status_code == expected if expected else 200 <= r.status_code < 300
    if not ok:
        fail(f"{where} → {r.status_code} (the docs expect {expected or '2xx'}): {r.text}")
    if r.content:
        try:
            r.json()
        except ValueError:
            fail(f"{where}: the answer is not JSON: {r.text[:300]}")


def run_schema(docs: Docs, plan: Plan) -> None:
    validate = SCHEMAS.get(plan.reason)
    if validate is None:
        fail(f"{plan.block.where}: no schema named {plan.reason!r}; known: {sorted(SCHEMAS)}")
    try:
        validate(json.loads(plan.block.text), docs.work)
    except Exception as exc:  # the reader's own error names the field
        fail(f"{plan.block.where}: not a valid {plan.reason}: {type(exc).__name__}: {exc}")


def fail(message: str) -> NoReturn:
    """A block's failure: the message only (the runner's locals hold tokens)."""
    pytest.fail(message, pytrace=False)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


RUNNERS: dict[str, Callable[[Docs, Plan], None]] = {
    "shell": run_shell,
    "python": run_python,
    "request": run_request,
    "schema": run_schema,
}


def _param(p: Plan) -> Any:
    if p.kind == "skip":
        reason = f"docs {p.block.where}: {p.reason}"
        return pytest.param(p, id=p.test_id, marks=pytest.mark.skip(reason=reason))
    return pytest.param(p, id=p.test_id)


def test_the_docs_have_blocks_and_the_parser_sees_them() -> None:
    """A parser that found nothing would pass everything."""
    kinds = [p.kind for p in PLANS]
    assert kinds.count("shell") >= 5 and kinds.count("request") >= 2, kinds
    assert sum(p.samples for p in PLANS) >= 1


MARKDOWN = """\
<!-- docs-test: skip (needs a second machine) -->
```bash
heteroflow agent
```

<!-- docs-test: exit 1 -->
```bash
heteroflow services show tg-000000000000    # → "not found"
heteroflow status \\
    --json                                  # → exit 2: "ok", "error"
```

```text
what is wrong (1):
```

<!-- docs-test: skip () -->
```bash
true
```

<!-- docs-test: sometimes -->
```bash
true
```

```console
$ heteroflow nodes
NAME  STATUS
```

```json
{"a": 1}
```

<!-- docs-test: status 404 -->
```http
GET /api/v1/tasks/task-000000000000
Authorization: Bearer <token>
```

```
untagged
```
"""


def test_the_parser_reads_markers_commands_and_samples(tmp_path: Path) -> None:
    (tmp_path / "x.md").write_text(MARKDOWN)
    plans = plan_blocks(parse(tmp_path / "x.md", tmp_path))
    got = [(p.block.line, p.kind) for p in plans]
    assert got == [
        (2, "skip"),
        (7, "shell"),
        (18, "problem"),  # a skip without its reason
        (23, "problem"),  # an unknown marker
        (27, "shell"),
        (32, "problem"),  # JSON that is neither a request nor marked with a schema
        (37, "request"),
        (42, "problem"),  # no language
    ], got
    skip, shell, no_reason, unknown, console, json_doc, http, untagged = plans
    assert skip.reason == "needs a second machine"
    show, status = shell.commands
    assert (show.line, show.exit_code, show.expect) == (8, 1, ("not found",))
    assert (status.line, status.exit_code, status.expect) == (9, 2, ("ok", "error"))
    assert status.source.endswith('# → exit 2: "ok", "error"')
    assert shell.samples == 1 and sample_words(status.sample) == ["what", "is", "wrong"]
    assert "reason" in no_reason.reason and "sometimes" in unknown.reason
    assert [(c.source, c.sample) for c in console.commands] == [
        ("heteroflow nodes", "NAME  STATUS")
    ]
    req = request_of(http.block.text)
    assert (req.method, req.path, req.body) == ("GET", "/api/v1/tasks/task-000000000000", "")
    assert http.block.marker is not None and http.block.marker.arg == "404"
    assert "schema" in json_doc.reason and "no language" in untagged.reason


@pytest.mark.parametrize("plan", [_param(p) for p in PLANS])
def test_block(plan: Plan, request: pytest.FixtureRequest) -> None:
    if plan.kind == "problem":
        fail(f"{plan.block.where}: {plan.reason}")
    docs: Docs = request.getfixturevalue("docs")
    RUNNERS[plan.kind](docs, plan)
    if plan.kind == "shell" and not docs.token_works(docs.token):
        docs.login()  # the block revoked the tokens (rotate-jwt-secret)
