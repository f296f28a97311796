"""llama.cpp engine launcher: ``python -m heteroflow.engines.llamacpp_server <llama-server flags>``.

Owns the command line of HeteroFlow's llama.cpp engine process: it runs llama.cpp's own C++
OpenAI-compatible server in-process through the ``xllamacpp`` wheel (which has no CLI) and takes
a subset of ``llama-server``'s flags under exactly llama-server's spellings, so a command line
built for it also works for a stock ``llama-server``. Parsing mirrors llama.cpp's
``common/arg.cpp``: arguments must match a spelling exactly (no abbreviations, no
``--flag=value``, no ``-t4``), ``_`` in ``--`` flags reads as ``-``, the last occurrence wins.
An unknown flag or bad value exits 2 with an ``error:`` line on stderr naming the flag.

Tool calling: ``--jinja`` (xllamacpp's default, as llama-server's) renders ``tools`` through
the chat template and parses the model's tool calls into ``tool_calls``; ``--no-jinja`` turns
it off. A template that does not mention ``tools`` makes the server ignore them (measured:
format "Content-only", plain text back), so a model needs a tool-aware template, its own or
one passed with ``--chat-template`` / ``--chat-template-file`` (read here, at parse time).

Defaults that differ from llama-server (for small CI machines; pass the flag to override):
``--cache-ram 64`` MiB (llama-server: 8192); ``--ctx-size 4096`` shared by all slots (0 = the
model's trained length); ``--parallel 1``; ``--threads`` = half the CPUs clamped to 1..4 (-1 =
all CPUs); ``--port 8080``, where ``--port 0`` binds an ephemeral port.

When the server is listening, one line ``llama.cpp server listening on http://HOST:PORT`` goes
to stderr; it then serves until SIGTERM/SIGINT and exits 0 within milliseconds (1 if the model
fails to load). llama.cpp logs to stderr at info level (``-lv 0`` silences it): a parent that
pipes stderr must keep draining it or the server stalls.

Routes: ``/health``, ``/v1/models`` (``id`` is the alphabetically first ``--alias``, else the
model path), ``/v1/chat/completions`` and ``/v1/completions`` (with SSE streaming),
``/v1/embeddings`` (only with ``--embeddings``, else 501), ``/metrics`` (only with
``--metrics``, else 501). Measured with xllamacpp 2026.10.11549: chat and text completions keep
working with ``--embeddings`` on, with output identical to a server without it (llama.cpp only
forces ``n_batch = n_ubatch``), so one process serves both. Startup on the tiny test model takes
about 0.1 s after interpreter start.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import FrameType
from typing import Any, Literal, TextIO, cast

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_CTX_SIZE = 4096
DEFAULT_PARALLEL = 1
DEFAULT_CACHE_RAM_MIB = 64
MAX_DEVICES = 128  # llama_max_devices() of the xllamacpp build; -ts may not list more
READY_PREFIX = "llama.cpp server listening on "

GpuLayers = int | Literal["auto", "all"]
SplitMode = Literal["none", "layer", "row", "tensor"]
Pooling = Literal["none", "mean", "cls", "last", "rank"]
_SPLIT_MODES: tuple[SplitMode, ...] = ("none", "layer", "row", "tensor")
_POOLINGS: tuple[Pooling, ...] = ("none", "mean", "cls", "last", "rank")


class LaunchArgsError(ValueError):
    """A command-line argument is unknown, lacks its value, or has an invalid value."""


@dataclass(frozen=True)
class LaunchConfig:
    """Parsed launcher flags; ``None`` means "not given" so the launcher default applies."""

    model: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    aliases: tuple[str, ...] = ()
    ctx_size: int | None = None
    parallel: int | None = None
    threads: int | None = None
    threads_batch: int | None = None
    gpu_layers: GpuLayers = "auto"
    split_mode: SplitMode | None = None
    tensor_split: tuple[float, ...] = ()
    main_gpu: int | None = None
    embedding: bool = False
    pooling: Pooling | None = None
    cache_ram_mib: int | None = None
    batch_size: int | None = None
    ubatch_size: int | None = None
    seed: int | None = None
    ui: bool | None = None
    metrics: bool = False
    verbosity: int | None = None
    chat_template: str | None = None
    jinja: bool | None = None


Converter = Callable[[str, str], object]


def _int(minimum: int, *, also: tuple[int, ...] = (), maximum: int | None = None) -> Converter:
    def convert(flag: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise LaunchArgsError(
                f"invalid value for {flag}: {raw!r} (expected an integer)"
            ) from None
        if value in also or (value >= minimum and (maximum is None or value <= maximum)):
            return value
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        extra = "".join(f" or {v}" for v in also)
        raise LaunchArgsError(f"invalid value for {flag}: {raw!r} (expected {bound}{extra})")

    return convert


def _choice(choices: tuple[str, ...]) -> Converter:
    def convert(flag: str, raw: str) -> str:
        if raw not in choices:
            raise LaunchArgsError(f"invalid value for {flag}: {raw!r} (one of {','.join(choices)})")
        return raw

    return convert


def _csv(flag: str, raw: str) -> tuple[str, ...]:
    items = tuple(item.strip() for item in raw.split(","))
    if not all(items):
        raise LaunchArgsError(f"invalid value for {flag}: {raw!r} (empty item in list)")
    return items


def _file_text(flag: str, raw: str) -> str:
    try:
        with open(raw, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise LaunchArgsError(f"invalid value for {flag}: {raw!r} ({exc.strerror})") from None


def _gpu_layers(flag: str, raw: str) -> GpuLayers:
    if raw in ("auto", "all"):
        return cast(GpuLayers, raw)
    return cast(int, _int(0)(flag + " (or 'auto'/'all')", raw))


def _tensor_split(flag: str, raw: str) -> tuple[float, ...]:
    # llama.cpp splits on ',' or '/'; proportions need not sum to 1, only be non-negative.
    parts = raw.replace("/", ",").split(",")
    try:
        values = tuple(float(part) for part in parts)
    except ValueError:
        values = ()
    if (
        not values
        or len(values) > MAX_DEVICES
        or not all(math.isfinite(v) and v >= 0 for v in values)
        or not any(v > 0 for v in values)
    ):
        raise LaunchArgsError(
            f"invalid value for {flag}: {raw!r} (expected comma-separated non-negative "
            f"proportions such as 3,1; at most {MAX_DEVICES}, at least one above 0)"
        )
    return values


@dataclass(frozen=True)
class _Option:
    spellings: tuple[str, ...]
    field: str
    convert: Converter | None  # None: a switch that takes no value and stores `constant`
    metavar: str = ""
    constant: bool = True


_OPTIONS: tuple[_Option, ...] = (
    _Option(("-m", "--model"), "model", lambda _f, raw: raw, "FNAME"),
    _Option(("--host",), "host", lambda flag, raw: ",".join(_csv(flag, raw)), "HOST"),
    _Option(("--port",), "port", _int(0, maximum=65535), "PORT"),
    _Option(("-a", "--alias"), "aliases", _csv, "STRING"),
    _Option(("-c", "--ctx-size"), "ctx_size", _int(0), "N"),
    _Option(("-np", "--parallel"), "parallel", _int(1, also=(-1,)), "N"),
    _Option(("-t", "--threads"), "threads", _int(1, also=(-1,)), "N"),
    _Option(("-tb", "--threads-batch"), "threads_batch", _int(1, also=(-1,)), "N"),
    _Option(("-ngl", "--gpu-layers", "--n-gpu-layers"), "gpu_layers", _gpu_layers, "N"),
    _Option(
        ("-sm", "--split-mode"), "split_mode", _choice(_SPLIT_MODES), "{none,layer,row,tensor}"
    ),
    _Option(("-ts", "--tensor-split"), "tensor_split", _tensor_split, "N0,N1,N2,..."),
    _Option(("-mg", "--main-gpu"), "main_gpu", _int(0), "INDEX"),
    _Option(("--embedding", "--embeddings"), "embedding", None),
    _Option(("--pooling",), "pooling", _choice(_POOLINGS), "{none,mean,cls,last,rank}"),
    _Option(("-cram", "--cache-ram"), "cache_ram_mib", _int(-1), "N"),
    _Option(("-b", "--batch-size"), "batch_size", _int(1), "N"),
    _Option(("-ub", "--ubatch-size"), "ubatch_size", _int(1), "N"),
    _Option(("-s", "--seed"), "seed", _int(-1, maximum=2**32 - 1), "SEED"),
    _Option(("--ui", "--webui"), "ui", None),
    _Option(("--no-ui", "--no-webui"), "ui", None, constant=False),
    _Option(("--metrics",), "metrics", None),
    _Option(("-lv", "--verbosity", "--log-verbosity"), "verbosity", _int(0), "N"),
    # a Jinja template; unlike llama-server, xllamacpp does not resolve built-in names
    # such as 'gemma' (it would render the word itself), so pass the template text
    _Option(("--chat-template",), "chat_template", lambda _f, raw: raw, "JINJA_TEMPLATE"),
    # read at parse time, so a missing file is an argument error naming the flag
    _Option(
        ("--chat-template-file",), "chat_template", lambda f, raw: _file_text(f, raw),
        "JINJA_TEMPLATE_FILE",
    ),
    # the Jinja engine renders `tools` and parses tool calls (xllamacpp's default: on)
    _Option(("--jinja",), "jinja", None),
    _Option(("--no-jinja",), "jinja", None, constant=False),
)
# Spellings build_argv writes, keyed by each option's first spelling (default: its last one).
_EMIT = {"-m": "-m", "-np": "-np", "-ngl": "-ngl", "-ts": "-ts", "--ui": "--webui"}
_BY_SPELLING = {spelling: option for option in _OPTIONS for spelling in option.spellings}
_HELP = ("-h", "--help", "--usage")


def usage() -> str:
    """The ``--help`` text: every accepted spelling, in llama-server's notation."""
    lines = ["usage: python -m heteroflow.engines.llamacpp_server -m FNAME [options]", ""]
    for option in _OPTIONS:
        lines.append(f"  {', '.join(option.spellings)} {option.metavar}".rstrip())
    lines.append(f"  {', '.join(_HELP)}")
    return "\n".join(lines)


class _HelpRequested(Exception):
    pass


def parse_args(argv: list[str]) -> LaunchConfig:
    """Parse llama-server style flags; raises :class:`LaunchArgsError` naming the bad flag."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        key = arg.replace("_", "-") if arg.startswith("--") else arg
        if key in _HELP:
            raise _HelpRequested
        option = _BY_SPELLING.get(key)
        if option is None:
            raise LaunchArgsError(f"invalid argument: {arg}")
        if option.convert is None:
            values[option.field] = option.constant
            i += 1
            continue
        if i + 1 >= len(argv):
            raise LaunchArgsError(f"expected value for argument: {arg}")
        values[option.field] = option.convert(arg, argv[i + 1])
        i += 2
    if "model" not in values:
        raise LaunchArgsError("missing required argument: -m/--model")
    return LaunchConfig(**values)


def _format(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(_format(item) for item in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def build_argv(config: LaunchConfig) -> list[str]:
    """Flags (without interpreter and module) that :func:`parse_args` maps back to ``config``.

    Model, host and port are always emitted, other flags only when they differ from their
    "not given" value; each flag is written with its ``_EMIT`` spelling, else its last one.
    """
    defaults = {f.name: f.default for f in fields(LaunchConfig)}
    argv: list[str] = []
    emitted: set[str] = set()  # a field two options set (--chat-template[-file]) is written once
    for option in _OPTIONS:
        value = getattr(config, option.field)
        always = option.field in ("model", "host", "port")
        if option.field in emitted or (not always and value == defaults[option.field]):
            continue
        spelling = _EMIT.get(option.spellings[0], option.spellings[-1])
        if option.convert is not None:
            argv += [spelling, _format(value)]
        elif value == option.constant:
            argv.append(spelling)
        else:
            continue
        emitted.add(option.field)
    return argv


def default_threads() -> int:
    """Half the CPUs clamped to 1..4: leaves room for the HTTP threads and sibling engines."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


# Optional LaunchConfig fields copied verbatim onto CommonParams when given.
_PLAIN_PARAMS = {
    "main_gpu": "main_gpu",
    "batch_size": "n_batch",
    "ubatch_size": "n_ubatch",
    "ui": "ui",
    "verbosity": "verbosity",
}


def build_params(config: LaunchConfig) -> Any:
    """Map ``config`` (plus the launcher defaults) onto an ``xllamacpp.CommonParams``."""
    import xllamacpp  # deferred: parsing and argv building must not load the native library

    params = xllamacpp.CommonParams()
    params.model.path = config.model
    params.hostnames = list(_csv("--host", config.host))
    params.port = config.port
    if config.aliases:
        params.model_alias = set(config.aliases)
    params.n_ctx = DEFAULT_CTX_SIZE if config.ctx_size is None else config.ctx_size
    params.n_parallel = DEFAULT_PARALLEL if config.parallel is None else config.parallel
    threads = default_threads() if config.threads is None else config.threads
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = (
        threads if config.threads_batch is None else config.threads_batch
    )
    params.n_gpu_layers = {"auto": -1, "all": -2}.get(str(config.gpu_layers), config.gpu_layers)
    if config.split_mode is not None:
        params.split_mode = xllamacpp.llama_split_mode(_SPLIT_MODES.index(config.split_mode))
    if config.tensor_split:
        width = len(params.tensor_split)
        params.tensor_split = list(config.tensor_split) + [0.0] * (width - len(config.tensor_split))
    if config.pooling is not None:
        params.pooling_type = xllamacpp.llama_pooling_type(_POOLINGS.index(config.pooling))
    if config.seed is not None:
        params.sampling.seed = config.seed & 0xFFFFFFFF  # -1 is LLAMA_DEFAULT_SEED (random)
    params.cache_ram_mib = (
        DEFAULT_CACHE_RAM_MIB if config.cache_ram_mib is None else config.cache_ram_mib
    )
    params.embedding = config.embedding
    params.endpoint_metrics = config.metrics
    if config.chat_template is not None:
        params.chat_template = config.chat_template
    if config.jinja is not None:
        params.use_jinja = config.jinja
    for field, attr in _PLAIN_PARAMS.items():
        if (value := getattr(config, field)) is not None:
            setattr(params, attr, value)
    return params


def api_keys_from_env() -> list[str]:
    """llama-server's ``LLAMA_API_KEY`` (comma-separated keys), taken out of the
    environment so nothing this process starts inherits it. The agent gives an engine its
    key this way, never on the command line (C14)."""
    return [k for k in os.environ.pop("LLAMA_API_KEY", "").split(",") if k]


def serve(config: LaunchConfig, log: TextIO = sys.stderr) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit status (0, or 1 on failure)."""
    import xllamacpp

    # A signal's handler only writes a byte to a pipe the main thread reads: it runs in the
    # main thread wherever that thread is, so one that took a lock (a threading.Event's)
    # deadlocked when the next signal interrupted it holding that lock — and an agent
    # killed hard sends a burst of SIGTERMs (PR_SET_PDEATHSIG fires once per thread of the
    # agent the engine is handed to as they die): the engine outlived its agent for good.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already says "stop"
            os.write(wake_w, b"\0")

    # Installed before loading so a signal during a long model load still ends the process.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if not os.path.isfile(config.model):
        print(f"error: model file not found: {config.model}", file=log, flush=True)
        return 1
    params = build_params(config)
    keys = api_keys_from_env()
    if keys:
        params.api_keys = keys
    try:
        server = xllamacpp.Server(params)
    except RuntimeError as exc:
        print(f"error: llama.cpp failed to start on {config.model}: {exc}", file=log, flush=True)
        return 1
    # xllamacpp.Server returns once the model is loaded and the socket is listening.
    address = str(server.listening_address)
    print(f"{READY_PREFIX}{address}", file=log, flush=True)
    os.read(wake_r, 1)  # until a signal (one that came while loading is already there)
    del server  # the destructor stops the HTTP loop and frees the model in about a millisecond
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv`` (default ``sys.argv[1:]``), then :func:`serve`."""
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
    except _HelpRequested:
        print(usage())
        return 0
    except LaunchArgsError as exc:
        print(f"llamacpp_server: error: {exc}\n(see --help)", file=sys.stderr)
        return 2
    return serve(config)


if __name__ == "__main__":
    raise SystemExit(main())
