"""Soak: HeteroFlow's standalone gateway under C concurrent streams for D seconds.

Starts the harness's fake backend (core 1) and the gateway exactly as the bench slot
does (core 0; key auth, limits in Redis when HETEROFLOW_REDIS_URL is set, usage, least
connections), drives it with the harness's load.py (streams, C clients), samples the
gateway's RSS every 5 s, and writes one JSON object: errors, and the RSS growth from the
end of the warm-up (a tenth of the run, at most 60 s) to the end.

    python bench/gateway_soak.py --harness ../shared/bench/gateway \\
        --bench-python /tmp/venv-bench/bin/python --duration 600 --out soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-bench-soak"


def pinned(cpu: int, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *argv] if shutil.which("taskset") else argv


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=2).is_success:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"not ready within {timeout:.0f} s: {url}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--harness", required=True)
    p.add_argument("--bench-python", required=True)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--concurrency", type=int, default=450)
    p.add_argument("--stream-tokens", type=int, default=16)
    p.add_argument("--backend-port", type=int, default=18100)
    p.add_argument("--port", type=int, default=18091)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    harness, out = Path(a.harness), Path(a.out)
    work = out.parent / "soak"
    work.mkdir(parents=True, exist_ok=True)
    backend = start(
        pinned(1, [a.bench_python, str(harness / "fake_engine.py"), "--port", str(a.backend_port)]),
        work / "backend.log",
    )
    gateway = start(
        pinned(
            0,
            [
                sys.executable,
                str(ROOT / "bench" / "gateway_slot.py"),
                "--port",
                str(a.port),
                "--upstream",
                f"http://127.0.0.1:{a.backend_port}/v1",
                "--key",
                KEY,
                "--workdir",
                str(work),
            ],
        ),
        work / "gateway.log",
    )
    samples: list[tuple[float, int]] = []
    done = threading.Event()
    try:
        wait_ready(f"http://127.0.0.1:{a.port}/v1/models")

        def sample() -> None:
            t0 = time.monotonic()
            while not done.wait(5.0):
                samples.append((round(time.monotonic() - t0, 1), rss_kb(gateway.pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        load = subprocess.run(
            pinned(
                1,
                [
                    a.bench_python,
                    str(harness / "load.py"),
                    "--url",
                    f"http://127.0.0.1:{a.port}/v1/chat/completions",
                    "--key",
                    KEY,
                    "--stream",
                    "--max-tokens",
                    str(a.stream_tokens),
                    "-c",
                    str(a.concurrency),
                    "-d",
                    str(a.duration),
                ],
            ),
            capture_output=True,
            text=True,
            timeout=a.duration + 120,
            check=False,
        )
        done.set()
        sampler.join(10)
        res = json.loads(load.stdout.strip().splitlines()[-1])
    finally:
        done.set()
        stop(gateway)
        stop(backend)
    warm_s = min(60.0, a.duration / 10)
    after = [kb for t, kb in samples if t >= warm_s] or [kb for _, kb in samples]
    start_kb, end_kb = after[0], after[-1]
    report = {
        "soak_s": a.duration,
        "concurrency": a.concurrency,
        "ok": res.get("ok"),
        "errors": res.get("errors"),
        "error_kinds": res.get("error_kinds"),
        "rps": res.get("rps"),
        "rss_mb_after_warmup": round(start_kb / 1024, 1),
        "rss_mb_end": round(end_kb / 1024, 1),
        "rss_growth_pct": round(100.0 * (end_kb - start_kb) / start_kb, 2) if start_kb else None,
        "rss_samples_kb": samples,
    }
    out.write_text(json.dumps(report))
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples_kb"}))


if __name__ == "__main__":
    main()
