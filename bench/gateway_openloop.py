"""The gateway at a given arrival rate (issue 31 item 2): ``MODE=openloop bash bench/gateway.sh``.

A closed loop (wrk, N connections as fast as they go) measures a saturated proxy's queue.
Users arrive at a rate. This script measures latency the way they see it: the shared
harness's fake engine (``../shared/bench/gateway/fake_engine.py``) behind nginx (one
worker, the harness's config) and behind HeteroFlow's gateway as deployed
(``bench/gateway_slot.py``: key auth, RPM/TPM limits in Redis when
``HETEROFLOW_REDIS_URL`` is set, usage, least_connections), pinned as the harness pins
them (the proxy alone on ``CPU_GW``; backend and generator on ``CPU_BACKEND``/``CPU_LOAD``).

1. nginx's capacity, closed loop (32 connections, as the harness's c=32 cell), non-stream
   and stream (16 chunks), with the same generator; our gateway's too, for the reader.
2. For each fraction (25 %, 50 %, 80 % of nginx's capacity) and each of non-stream and
   stream: direct, nginx and the gateway, interleaved, at that fixed rate with
   ``bench/openloop`` (requests on a schedule, latency from each request's intended send
   time: a stall is charged to every request scheduled during it).

Prints a table; the last line is one JSON object: ``added_p50_ms_at_50pct``,
``added_p99_ms_at_50pct``, ``added_p99_ms_at_80pct`` (gateway minus direct, same rate,
same run; every fraction has its keys), ``nginx_added_…`` beside them, ``stream_…`` for
streams, ``errors`` (all cells, all targets), the rates used and the capacities.

    .venv/bin/python bench/gateway_openloop.py --harness ../shared/bench/gateway \\
        --out bench/results/openloop-x --duration 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OURS = "heteroflow"
MODEL = "fake-model"
_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- processes


class Procs:
    """Processes started here, each in its own process group; all stopped on exit."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], cpu: str, env: dict[str, str] | None = None) -> int:
        if shutil.which("taskset"):
            argv = ["taskset", "-c", cpu, *argv]  # taskset execs: the pid is the process's
        with (self.logs / f"{name}.log").open("wb") as log:
            p = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.started.append(p)
        return p.pid

    def stop_all(self) -> None:
        for p in reversed(self.started):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)  # the group created for it above
        for p in reversed(self.started):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{d}/stat").read_text()
                parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out = {pid}
    grew = True
    while grew:
        kids = {p for p, pp in parent.items() if pp in out and p not in out}
        out |= kids
        grew = bool(kids)
    return sorted(out)


def _cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / _TICKS


def _machine_busy_s() -> float:
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / _TICKS


# ---------------------------------------------------------------- http


def _post(url: str, body: dict[str, Any], key: str) -> tuple[int | None, bytes]:
    # loopback http only: every base URL is built here from 127.0.0.1 and a port
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")  # noqa: S310
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), bytes(e.read())
    except OSError as e:
        return None, str(e).encode()


def _ready(base: str, key: str, bodies: dict[str, dict[str, Any]], timeout: float) -> str | None:
    """None once a non-stream and a stream request succeed, else the last failure."""
    deadline = time.monotonic() + timeout
    detail = "not tried"
    while time.monotonic() < deadline:
        st, raw = _post(base + "/v1/chat/completions", bodies["nonstream"], key)
        st2, raw2 = _post(base + "/v1/chat/completions", bodies["stream"], key)
        if st == 200 and b'"choices"' in raw and st2 == 200 and b"[DONE]" in raw2:
            return None
        detail = f"status {st}/{st2}: {raw[:200]!r}"
        time.sleep(0.5)
    return detail


# ---------------------------------------------------------------- the run


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out: Path = a.out
        self.procs = Procs(self.out)
        self.binary = Path(
            subprocess.run(
                [sys.executable, str(ROOT / "bench/openloop/build.py")],
                capture_output=True, text=True, check=True,
            ).stdout.strip()
        )  # fmt: skip
        base = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello to the benchmark"}],
        }
        self.bodies: dict[str, dict[str, Any]] = {
            "nonstream": {**base, "max_tokens": a.max_tokens},
            "stream": {
                **base, "max_tokens": a.stream_tokens, "stream": True,
                "stream_options": {"include_usage": True},
            },
        }  # fmt: skip
        self.body_files = {}
        for mode, body in self.bodies.items():
            path = self.out / f"body-{mode}.json"
            path.write_text(json.dumps(body))
            self.body_files[mode] = path
        self.targets: dict[str, dict[str, Any]] = {}
        self.backend_pids: list[int] = []
        self.results: list[dict[str, Any]] = []

    def start(self) -> None:
        a = self.a
        backend_url = f"http://127.0.0.1:{a.backend_port}"
        be = self.procs.start(
            "backend",
            [a.bench_python, str(a.harness / "fake_engine.py"), "--port", str(a.backend_port),
             "--loop", "asyncio", "--keepalive-timeout", "300"],
            a.cpu_backend,
        )  # fmt: skip
        self.backend_pids = [be]
        self.targets["direct"] = {"base": backend_url, "key": "sk-fake", "pids": []}
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if Path(nginx).exists():
            run = self.out / "nginx"
            for d in (
                "",
                "nginx-body",
                "nginx-proxy",
                "nginx-fastcgi",
                "nginx-uwsgi",
                "nginx-scgi",
            ):
                (run / d).mkdir(parents=True, exist_ok=True)
            conf = (a.harness / "conf" / "nginx.conf.tmpl").read_text()
            conf = conf.replace("@RUNDIR@", str(run)).replace("@PORT@", str(a.nginx_port))
            (run / "nginx.conf").write_text(
                conf.replace("@BACKEND@", f"127.0.0.1:{a.backend_port}")
            )
            ng = self.procs.start(
                "nginx",
                [nginx, "-p", str(run), "-c", str(run / "nginx.conf"), "-g", "daemon off;"],
                a.cpu_gw,
            )  # fmt: skip
            self.targets["nginx"] = {
                "base": f"http://127.0.0.1:{a.nginx_port}",
                "key": "sk-fake",
                "pids": [ng],
            }
        else:
            print(
                "nginx is not installed (apt-get install nginx-light): no nginx column",
                file=sys.stderr,
            )
        gw = self.procs.start(
            OURS,
            [sys.executable, str(ROOT / "bench/gateway_slot.py"), "--port", str(a.gateway_port),
             "--upstream", backend_url + "/v1", "--key", a.key, "--workdir", str(self.out)],
            a.cpu_gw,
        )  # fmt: skip
        self.targets[OURS] = {
            "base": f"http://127.0.0.1:{a.gateway_port}",
            "key": a.key,
            "pids": [gw],
        }
        for name, t in list(self.targets.items()):
            failed = _ready(t["base"], t["key"], self.bodies, a.start_timeout)
            if failed is not None:
                if name in ("direct", OURS):
                    raise SystemExit(f"{name} did not answer: {failed} (logs in {self.out})")
                print(f"{name} did not answer ({failed}): no {name} column", file=sys.stderr)
                del self.targets[name]

    def load(
        self, target: str, mode: str, rate: float, conns: int, duration: float, label: str
    ) -> dict[str, Any]:
        """One cell: the generator against ``target``, with CPU accounting around it."""
        t = self.targets[target]
        argv = [str(self.binary), "--url", t["base"] + "/v1/chat/completions",
                "--rate", f"{rate:.3f}", "--connections", str(conns),
                "--duration", str(duration), "--timeout", str(self.a.timeout),
                "--body", str(self.body_files[mode]),
                "--header", f"Authorization: Bearer {t['key']}",
                "--expect", "[DONE]" if mode == "stream" else '"choices"',
                "--label", label]  # fmt: skip
        if shutil.which("taskset"):
            argv = ["taskset", "-c", self.a.cpu_load, *argv]
        gw_pids = [p for pid in t["pids"] for p in _tree(pid)]
        be_pids = [p for pid in self.backend_pids for p in _tree(pid)]
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        gw0, be0, m0, t0 = _cpu_s(gw_pids), _cpu_s(be_pids), _machine_busy_s(), time.monotonic()
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=duration + self.a.timeout + 60
        )
        gw1, be1, m1, t1 = _cpu_s(gw_pids), _cpu_s(be_pids), _machine_busy_s(), time.monotonic()
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        gen = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"the generator failed (rc {proc.returncode}): {proc.stderr[-500:]}")
        res: dict[str, Any] = json.loads(lines[-1])
        done = int(res["requests"]) or 1
        res.update(
            target=target, stream=mode == "stream",
            gw_cpu_ms_per_req=round((gw1 - gw0) * 1000 / done, 4) if gw_pids else None,
            be_cpu_ms_per_req=round((be1 - be0) * 1000 / done, 4),
            gen_cpu_ms_per_req=round(gen * 1000 / done, 4),
            other_cpu_pct=round(100 * ((m1 - m0) - (gw1 - gw0) - (be1 - be0) - gen) / (t1 - t0), 1),
        )  # fmt: skip
        return res

    def capacity(self, target: str, mode: str) -> float:
        res = self.load(
            target, mode, 0, self.a.cap_connections, self.a.cap_duration, f"capacity/{mode}"
        )
        res["cell"] = f"capacity/{mode}"
        self.results.append(res)
        print(f"[openloop] capacity {mode:9s} {target:10s} {res['rps']:9.1f} req/s "
              f"errors={res['errors']}", file=sys.stderr)  # fmt: skip
        return float(res["rps"])

    def run(self) -> dict[str, Any]:
        a = self.a
        for name in self.targets:  # warm every target up (unrecorded)
            for mode in ("nonstream", "stream"):
                self.load(name, mode, 0, 32, a.warmup, "warmup")
        # the rates are fractions of the anchor's capacity: nginx's (the issue's), or with
        # --anchor heteroflow our own (below our saturation on a machine where nginx's is
        # beyond one gateway process's)
        base = "nginx" if "nginx" in self.targets else "direct"
        anchor = OURS if a.anchor == OURS else base
        caps = {t: {m: self.capacity(t, m) for m in ("nonstream", "stream")} for t in (base, OURS)}
        rates: dict[str, dict[int, float]] = {"nonstream": {}, "stream": {}}
        for mode in ("nonstream", "stream"):
            for pct in a.fractions:
                rate = round(caps[anchor][mode] * pct / 100, 1)
                rates[mode][pct] = rate
                for name in self.targets:  # interleaved: noise hits every column alike
                    res = self.load(name, mode, rate, a.connections, a.duration, f"{mode}/{pct}pct")
                    res["cell"], res["pct"] = f"{mode}/{pct}pct", pct
                    self.results.append(res)
                    lat = res["lat_ms"]
                    print(f"[openloop] {mode:9s} {pct:3d}% {rate:8.1f}/s {name:10s} "
                          f"got {res['rps']:8.1f}/s p50={lat['p50']:.2f} p99={lat['p99']:.2f} "
                          f"max={lat['max']:.1f} err={res['errors']} "
                          f"cpu/req={res['gw_cpu_ms_per_req']} other%={res['other_cpu_pct']}",
                          file=sys.stderr)  # fmt: skip
        with (self.out / "results.jsonl").open("w") as f:
            for r in self.results:
                f.write(json.dumps(r) + "\n")
        return summarize(self.results, anchor, caps, rates)


# ---------------------------------------------------------------- summary


def _lat(results: list[dict[str, Any]], cell: str, target: str, q: str) -> float | None:
    for r in results:
        if r.get("cell") == cell and r["target"] == target:
            return float(r["lat_ms"][q])
    return None


def _added(results: list[dict[str, Any]], cell: str, target: str, q: str) -> float | None:
    ours, direct = _lat(results, cell, target, q), _lat(results, cell, "direct", q)
    return None if ours is None or direct is None else round(ours - direct, 3)


def summarize(
    results: list[dict[str, Any]],
    anchor: str,
    caps: dict[str, dict[str, float]],
    rates: dict[str, dict[int, float]],
) -> dict[str, Any]:
    """The last JSON line: what each proxy adds over direct at each rate, same run.
    ``caps``: closed-loop capacity per target and mode (req/s); ``rates``: per mode, the
    rate run at each percentage of ``anchor``'s capacity."""
    out: dict[str, Any] = {"capacity_anchor": anchor}
    for mode, prefix in (("nonstream", ""), ("stream", "stream_")):
        for pct in rates[mode]:
            cell = f"{mode}/{pct}pct"
            for q in ("p50", "p99"):
                out[f"{prefix}added_{q}_ms_at_{pct}pct"] = _added(results, cell, OURS, q)
            for q in ("p50", "p99"):
                out[f"{prefix}nginx_added_{q}_ms_at_{pct}pct"] = _added(results, cell, "nginx", q)
            out[f"{prefix}max_ms_at_{pct}pct"] = _lat(results, cell, OURS, "max")
            ours = [r for r in results if r.get("cell") == cell and r["target"] == OURS]
            if ours:
                out[f"{prefix}cpu_ms_per_req_at_{pct}pct"] = ours[0]["gw_cpu_ms_per_req"]
                out[f"{prefix}achieved_rps_at_{pct}pct"] = ours[0]["rps"]
    cells = [r for r in results if "pct" in r]
    out["errors"] = sum(int(r["errors"]) for r in cells)
    out["errors_by_target"] = {
        t: sum(int(r["errors"]) for r in cells if r["target"] == t)
        for t in dict.fromkeys(r["target"] for r in cells)
    }
    for target, name in (("nginx", "nginx"), ("direct", "direct"), (OURS, "gateway")):
        if target in caps:
            out[f"{name}_capacity_rps"] = caps[target]["nonstream"]
            out[f"{name}_stream_capacity_rps"] = caps[target]["stream"]
    out["rates_rps"] = {str(p): v for p, v in rates["nonstream"].items()}
    out["stream_rates_rps"] = {str(p): v for p, v in rates["stream"].items()}
    return out


def _or_dash(v: Any) -> str:
    return "-" if v is None else str(v)


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| cell | target | asked /s | got /s | p50 | p90 | p99 | p99.9 | max | +p50 | +p99 "
        "| errors | CPU ms/req | queued max | other CPU % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "pct" not in r:
            continue
        lat = r["lat_ms"]
        a50 = _added(results, r["cell"], r["target"], "p50")
        a99 = _added(results, r["cell"], r["target"], "p99")
        base = r["target"] == "direct"
        rows.append(
            f"| {r['cell']} | {r['target']} | {r['rate']:.0f} | {r['rps']:.0f} | {lat['p50']:.2f} "
            f"| {lat['p90']:.2f} | {lat['p99']:.2f} | {lat['p999']:.2f} | {lat['max']:.2f} "
            f"| {'(base)' if base else f'{a50:+.2f}'} | {'(base)' if base else f'{a99:+.2f}'} "
            f"| {r['errors']} | {_or_dash(r['gw_cpu_ms_per_req'])} "
            f"| {r['queued_max']} | {max(0.0, r['other_cpu_pct']):.0f} |"
        )  # fmt: skip
    caps = [r for r in results if r.get("cell", "").startswith("capacity/")]
    rows.append("")
    rows += [f"closed-loop capacity ({r['connections']} connections) {r['cell']} {r['target']}: "
             f"{r['rps']:.0f} req/s, p99 {r['lat_ms']['p99']:.2f} ms" for r in caps]  # fmt: skip
    return "\n".join(rows)


# ---------------------------------------------------------------- main


@contextlib.contextmanager
def _stopping(bench: Bench) -> Iterator[None]:
    def _sig(signum: int, _frame: object) -> None:
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, _sig)
    try:
        yield
    finally:
        bench.procs.stop_all()


def _default_bench_python() -> str:
    # the harness's own venv (run.sh makes it) when there is one
    venv = Path(os.environ.get("BENCH_VENV") or "/tmp/venv-bench") / "bin" / "python"  # noqa: S108
    return str(venv) if venv.exists() else sys.executable  # ours has uvicorn and httptools


def main() -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--harness", type=Path, default=ROOT.parent / "shared/bench/gateway")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--duration", type=float, default=float(env("DUR") or 10), help="s per point")
    p.add_argument(
        "--fractions", default=env("FRACTIONS") or "25,50,80", help="%% of nginx's capacity"
    )
    p.add_argument("--connections", type=int, default=int(env("OL_CONNS") or 64))
    p.add_argument(
        "--anchor", choices=["nginx", OURS], default=env("ANCHOR") or "nginx",
        help="whose closed-loop capacity the fractions are of",
    )  # fmt: skip
    p.add_argument("--cap-connections", type=int, default=32)
    p.add_argument("--cap-duration", type=float, default=None, help="default: --duration")
    p.add_argument("--warmup", type=float, default=float(env("WARMUP") or 2))
    p.add_argument(
        "--timeout", type=float, default=15.0, help="per request, from its intended time"
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=16)
    p.add_argument("--key", default=env("GATEWAY_KEY") or "sk-bench-heteroflow")
    p.add_argument("--gateway-port", type=int, default=int(env("GATEWAY_PORT") or 18090))
    p.add_argument("--backend-port", type=int, default=int(env("BACKEND_PORT") or 18000))
    p.add_argument("--nginx-port", type=int, default=int(env("NGINX_PORT") or 18080))
    p.add_argument("--cpu-gw", default=env("CPU_GW") or "0")
    p.add_argument("--cpu-backend", default=env("CPU_BACKEND") or "1")
    p.add_argument("--cpu-load", default=env("CPU_LOAD") or "1")
    p.add_argument("--bench-python", default=_default_bench_python())
    p.add_argument("--start-timeout", type=float, default=90)
    a = p.parse_args()
    a.fractions = [int(x) for x in a.fractions.replace(" ", ",").split(",") if x]
    a.cap_duration = a.cap_duration or a.duration
    a.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(a)
    with _stopping(bench):
        bench.start()
        summary = bench.run()
    meta = {
        "nproc": os.cpu_count(), "loadavg_end": Path("/proc/loadavg").read_text().strip(),
        "pinning": {"gateway": a.cpu_gw, "backend": a.cpu_backend, "generator": a.cpu_load},
        "duration_s": a.duration, "connections": a.connections,
    }  # fmt: skip
    (a.out / "meta.json").write_text(json.dumps(meta, indent=2))
    text = table(bench.results)
    (a.out / "table.md").write_text(text + "\n")
    print(text)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
