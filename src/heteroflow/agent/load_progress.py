"""How far a loading engine has got, read on the node (FEATURES D5): the samples
``core.loading`` judges.

One Protocol, ``ProgressSource``, gives a ``LoadSample`` for an engine: the bytes it has
read from storage and the CPU time it used (``LoadMeter``: the process runtime sums
``read_bytes`` of ``/proc/<pid>/io`` and the CPU times over the engine's process tree;
the Docker runtime reads the container's block-I/O counters — cgroup v1 ``blkio`` or v2
``io.stat``, the disk of the model's host path when the counters name it — and its CPU
usage from one one-shot stats call), whether its log moved (the runtime's log tail,
compared with the last look: a repeated identical line is no news), and what the engine
says in its own words (``core.engines.load_words``).

``model_size`` is the model's size on this node (a GGUF file and its split siblings, a
model folder's safetensors / pt weights), the numerator of the expected load time; the
node's read rate, its denominator, is kept in the agent's work dir (``read_rate_from``,
``keep_read_rate``) so that an agent restart does not forget what the node measured.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.models import (
    DATA_MODELS,
    ModelPathError,
    model_prefixes,
    resolve_model_file,
)
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import Runtime
from heteroflow.core.engines.load_words import words_for
from heteroflow.core.loading import LoadSample, ReadRate
from heteroflow.private_files import private_file
from heteroflow.schemas.nodes import TaskAssignment

log = logging.getLogger(__name__)

#: Log lines compared between two looks.
TAIL_LINES = 40
#: The node's measured read rate, in the agent's work dir.
READ_RATE_FILE = "load_read_rate.json"
_SPLIT = re.compile(r"^(?P<stem>.+)-\d{5}-of-(?P<total>\d{5})\.gguf$")
_WEIGHTS = (("*.safetensors",), ("*.bin", "*.pt", "*.pth"))


@dataclass(frozen=True, slots=True)
class Usage:
    """What an engine has used since it started; None: not known here."""

    read_bytes: int | None = None  # from storage (page-cache hits are not counted)
    cpu_s: float | None = None  # CPU seconds, user + system


class LoadMeter(Protocol):
    """What an engine has read from storage and its CPU time, as its runtime counts."""

    def usage(self, task_id: str, disk: str | None) -> Usage:
        """``Usage()`` when the runtime cannot tell (no such engine, no counters)."""
        ...


class NoMeter:
    """A runtime that counts nothing (test stand-ins): nothing is ever known."""

    def usage(self, task_id: str, disk: str | None) -> Usage:
        return Usage()


class ProcessMeter:
    """``read_bytes`` of ``/proc/<pid>/io`` and the CPU times, summed over the engine's
    process tree (with the reaped children's CPU)."""

    def __init__(self, runtime: ProcessRuntime) -> None:
        self.runtime = runtime

    def usage(self, task_id: str, disk: str | None) -> Usage:
        pid = self.runtime.pid(task_id)
        if pid is None:
            return Usage()
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return Usage()
        read, cpu = 0, 0.0
        for proc in tree:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    cpu += times.user + times.system + times.children_user
                    cpu += times.children_system
                    read += int(proc.io_counters().read_bytes)
            except (psutil.Error, AttributeError):  # gone meanwhile, or no counters here
                continue
        return Usage(read, cpu)


class DockerMeter:
    """The container's block-I/O read counters and CPU usage from the Engine (``GET
    /containers/{id}/stats?stream=false&one-shot=true``): reads of the model's disk when
    the counters name it, else of every disk."""

    def __init__(self, client: Any) -> None:
        self.client = client
        # an Engine older than API 1.41 has no one-shot stats: the plain call then (it
        # waits for a second CPU sample, about a second, which the load's sampling affords)
        self._one_shot = _api_at_least(str(getattr(client.api, "_version", "")), (1, 41))

    def usage(self, task_id: str, disk: str | None) -> Usage:
        try:
            if self._one_shot:
                stats = self.client.api.stats(task_id, stream=False, one_shot=True)
            else:
                stats = self.client.api.stats(task_id, stream=False)
        except Exception as exc:  # gone, or an Engine error: not known this time
            log.debug("stats of %s not read: %s", task_id, exc)
            return Usage()
        total_ns = ((stats.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
        cpu = total_ns / 1e9 if isinstance(total_ns, int | float) else None
        entries = (stats.get("blkio_stats") or {}).get("io_service_bytes_recursive")
        if entries is None:
            return Usage(None, cpu)
        reads = [e for e in entries if str(e.get("op", "")).lower() == "read"]
        on_disk = [e for e in reads if f"{e.get('major')}:{e.get('minor')}" == disk]
        return Usage(sum(int(e.get("value", 0)) for e in (on_disk or reads)), cpu)


def _api_at_least(version: str, least: tuple[int, int]) -> bool:
    """Whether a Docker API version ("1.41") is at least ``least``; unknown: yes."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= least


def meter_for(runtime: Runtime) -> LoadMeter:
    """The meter of a runtime: its own counters, or none (a test's stand-in)."""
    if isinstance(runtime, ProcessRuntime):
        return ProcessMeter(runtime)
    client = getattr(runtime, "client", None)
    if runtime.name == "docker" and client is not None and hasattr(client, "api"):
        return DockerMeter(client)
    return NoMeter()


class ProgressSource(Protocol):
    """What the agent samples of a loading engine (one Protocol for every engine)."""

    def sample(
        self, t: TaskAssignment, at: float, health_detail: str, disk: str | None
    ) -> LoadSample: ...

    def forget(self, task_id: str) -> None: ...


class EngineProgress:
    """The bytes from the runtime's meter, the log's movement from its tail, and the
    engine family's own words on both."""

    def __init__(self, runtime: Runtime, meter: LoadMeter | None = None) -> None:
        self.runtime = runtime
        self.meter = meter if meter is not None else meter_for(runtime)
        self._tails: dict[str, tuple[str, int]] = {}

    def sample(
        self, t: TaskAssignment, at: float, health_detail: str, disk: str | None
    ) -> LoadSample:
        words = words_for(t.engine)
        try:
            tail = self.runtime.log_tail(t.id, TAIL_LINES)
        except Exception as exc:
            log.debug("log of %s not read: %s", t.id, exc)
            tail = None
        mark = None
        if tail is not None:
            last, mark = self._tails.get(t.id, ("", 0))
            mark += tail != last
            self._tails[t.id] = (tail, mark)
        used = self.meter.usage(t.id, disk)
        return LoadSample(
            at=at,
            read_bytes=used.read_bytes,
            log_mark=mark,
            fraction=words.fraction(tail) if tail else None,
            says_loading=words.says_loading(health_detail),
            cpu_s=used.cpu_s,
        )

    def forget(self, task_id: str) -> None:
        self._tails.pop(task_id, None)


@dataclass(frozen=True, slots=True)
class ModelSize:
    """The model's weights on this node (None: not known here, e.g. a hub id) and the
    disk they are on (``major:minor`` of the whole disk, None when not a block device)."""

    bytes: int | None
    disk: str | None = None


def _disk_of(path: Path) -> str | None:
    """``major:minor`` of the whole disk holding ``path`` (a partition's parent disk)."""
    try:
        dev = path.stat().st_dev
    except OSError:
        return None
    major, minor = os.major(dev), os.minor(dev)
    node = Path(f"/sys/dev/block/{major}:{minor}")
    try:
        if (node / "partition").exists():
            return (node.resolve().parent / "dev").read_text().strip()
    except OSError:
        return None
    return f"{major}:{minor}" if node.exists() else None


def weight_files(path: Path) -> list[Path]:
    """The files an engine reads its weights from: a GGUF and its split siblings, or a
    folder's safetensors (else its pt / bin files, else its single GGUF)."""
    if path.is_file():
        m = _SPLIT.match(path.name)
        if m is None:
            return [path]
        return sorted(path.parent.glob(f"{m['stem']}-*-of-{m['total']}.gguf"))
    if not path.is_dir():
        return []
    for patterns in _WEIGHTS:
        found = sorted({f for p in patterns for f in path.glob(p) if f.is_file()})
        if found:
            return found
    ggufs = sorted(path.glob("*.gguf"))
    return weight_files(ggufs[0]) if len(ggufs) == 1 else []


def _model_path(t: TaskAssignment, runtime: str, config: NodeConfig) -> Path | None:
    if not t.model_path:
        return None
    if runtime == "process":
        # a model fetched into the cache passes as its launch did (issue 29): its size
        # sets the load's expected time, and its load teaches the node's read rate
        allowed, denied = model_prefixes(
            t.model_path, t.model_fetched, config.allowed_volume_prefixes,
            config.denied_volume_prefixes,
        )
        try:
            return resolve_model_file(t.model_path, allowed, denied)
        except ModelPathError:
            return None
    path = Path(t.model_path)
    return path if path.is_absolute() else DATA_MODELS / t.model_path.strip("/")


def model_size(t: TaskAssignment, runtime: str, config: NodeConfig) -> ModelSize:
    """The size of the task's model on this node, and its disk (see ``ModelSize``)."""
    path = _model_path(t, runtime, config)
    files = weight_files(path) if path is not None else []
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            return ModelSize(None)
    if not files or total <= 0:
        return ModelSize(None)
    return ModelSize(total, _disk_of(files[0]))


def read_rate_from(path: Path, default: ReadRate) -> ReadRate:
    """The node's read rate as last measured here (``default`` when none was, or the file
    cannot be read)."""
    try:
        data = json.loads(path.read_text())
        bps = float(data["bps"])
    except (OSError, ValueError, KeyError, TypeError):
        return default
    return ReadRate(bps, True) if bps > 0 and data.get("measured") is True else default


def keep_read_rate(path: Path, rate: ReadRate) -> None:
    """Write the node's measured read rate (owner-only, replaced whole)."""
    tmp = private_file(path.with_name(f".{path.name}.tmp"))
    tmp.write_text(json.dumps({"bps": round(rate.bps), "measured": rate.measured}))
    os.replace(tmp, path)
