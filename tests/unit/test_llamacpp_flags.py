"""Flag parsing of the llama.cpp launcher: llama-server's exact spellings, nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.engines.llamacpp_server import (
    DEFAULT_CACHE_RAM_MIB,
    DEFAULT_CTX_SIZE,
    DEFAULT_PARALLEL,
    LaunchArgsError,
    LaunchConfig,
    build_argv,
    build_params,
    main,
    parse_args,
    usage,
)

pytestmark = pytest.mark.feature("H4")

MODEL = ["-m", "/models/tiny.gguf"]

SPELLINGS: list[tuple[list[str], str, Any]] = [
    (["-m", "/x.gguf"], "model", "/x.gguf"),
    (["--model", "/x.gguf"], "model", "/x.gguf"),
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--port", "9000"], "port", 9000),
    (["-a", "tiny"], "aliases", ("tiny",)),
    (["--alias", "tiny,small"], "aliases", ("tiny", "small")),
    (["-c", "2048"], "ctx_size", 2048),
    (["--ctx-size", "0"], "ctx_size", 0),
    (["-np", "2"], "parallel", 2),
    (["--parallel", "-1"], "parallel", -1),
    (["-t", "3"], "threads", 3),
    (["--threads", "-1"], "threads", -1),
    (["-tb", "2"], "threads_batch", 2),
    (["--threads-batch", "4"], "threads_batch", 4),
    (["-ngl", "99"], "gpu_layers", 99),
    (["--gpu-layers", "all"], "gpu_layers", "all"),
    (["--n-gpu-layers", "auto"], "gpu_layers", "auto"),
    (["-sm", "row"], "split_mode", "row"),
    (["--split-mode", "layer"], "split_mode", "layer"),
    (["-ts", "3,1"], "tensor_split", (3.0, 1.0)),
    (["--tensor-split", "0.25,0.75"], "tensor_split", (0.25, 0.75)),
    (["-mg", "1"], "main_gpu", 1),
    (["--main-gpu", "0"], "main_gpu", 0),
    (["--embedding"], "embedding", True),
    (["--embeddings"], "embedding", True),
    (["--pooling", "mean"], "pooling", "mean"),
    (["--pooling", "rank"], "pooling", "rank"),
    (["-cram", "128"], "cache_ram_mib", 128),
    (["--cache-ram", "-1"], "cache_ram_mib", -1),
    (["-b", "256"], "batch_size", 256),
    (["--batch-size", "512"], "batch_size", 512),
    (["-ub", "64"], "ubatch_size", 64),
    (["--ubatch-size", "128"], "ubatch_size", 128),
    (["-s", "42"], "seed", 42),
    (["--seed", "-1"], "seed", -1),
    (["--ui"], "ui", True),
    (["--webui"], "ui", True),
    (["--no-ui"], "ui", False),
    (["--no-webui"], "ui", False),
    (["--metrics"], "metrics", True),
    (["-lv", "0"], "verbosity", 0),
    (["--verbosity", "2"], "verbosity", 2),
    (["--log-verbosity", "4"], "verbosity", 4),
]


@pytest.mark.parametrize(("args", "field", "expected"), SPELLINGS, ids=lambda v: str(v))
def test_every_supported_spelling(args: list[str], field: str, expected: Any) -> None:
    argv = args if field == "model" else MODEL + args
    assert getattr(parse_args(argv), field) == expected


def test_defaults_mean_not_given() -> None:
    assert parse_args(MODEL) == LaunchConfig(model="/models/tiny.gguf")
    config = parse_args(MODEL)
    assert (config.host, config.port, config.gpu_layers) == ("127.0.0.1", 8080, "auto")


def test_underscores_in_long_flags_read_as_dashes_like_llama_cpp() -> None:
    assert parse_args([*MODEL, "--ctx_size", "64", "--n_gpu_layers", "1"]).ctx_size == 64


def test_last_occurrence_wins() -> None:
    assert parse_args([*MODEL, "--port", "1", "--port", "2"]).port == 2


@pytest.mark.parametrize(
    "bad", ["--bogus", "--model-path", "-x", "--n-parallel", "--cache-ram-mib", "positional"]
)
def test_unknown_flag_is_named(bad: str) -> None:
    with pytest.raises(LaunchArgsError, match=f"invalid argument: {bad}$"):
        parse_args([*MODEL, bad, "1"])


def test_main_exits_2_and_names_the_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MODEL, "--frobnicate", "3"]) == 2
    assert "--frobnicate" in capsys.readouterr().err


@pytest.mark.parametrize(
    "abbrev", [["--mod", "/x"], ["--ctx", "8"], ["--embed"], ["--par", "2"], ["--tensor", "1"]]
)
def test_abbreviations_are_rejected(abbrev: list[str]) -> None:
    with pytest.raises(LaunchArgsError, match=abbrev[0]):
        parse_args(MODEL + abbrev)


@pytest.mark.parametrize("glued", [["--port=8080"], ["-t4"], ["-np2"], ["-ngl99"]])
def test_glued_values_are_rejected_like_llama_server(glued: list[str]) -> None:
    with pytest.raises(LaunchArgsError, match="invalid argument"):
        parse_args(MODEL + glued)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("3,1", (3.0, 1.0)), ("1", (1.0,)), ("0.5/0.5", (0.5, 0.5)), ("0,1,0", (0.0, 1.0, 0.0))],
)
def test_tensor_split_accepts_proportions(raw: str, expected: tuple[float, ...]) -> None:
    assert parse_args([*MODEL, "-ts", raw]).tensor_split == expected


@pytest.mark.parametrize(
    "raw", ["", "3,", ",1", "a,b", "3;1", "-1,2", "0,0", "nan,1", "inf", ",".join(["1"] * 129)]
)
def test_tensor_split_format_is_validated(raw: str) -> None:
    with pytest.raises(LaunchArgsError, match="invalid value for -ts"):
        parse_args([*MODEL, "-ts", raw])


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "65536"],
        ["--port", "http"],
        ["-np", "0"],
        ["-ngl", "-1"],
        ["-ngl", "most"],
        ["--pooling", "max"],
        ["-sm", "column"],
        ["-c", "-5"],
        ["-a", "a,,b"],
        ["--seed", "4294967296"],
    ],
)
def test_bad_values_name_the_flag(args: list[str]) -> None:
    with pytest.raises(LaunchArgsError, match=f"invalid value for {args[0]}"):
        parse_args(MODEL + args)


def test_missing_value_and_missing_model() -> None:
    with pytest.raises(LaunchArgsError, match="expected value for argument: --port"):
        parse_args([*MODEL, "--port"])
    with pytest.raises(LaunchArgsError, match="-m/--model"):
        parse_args(["--port", "1"])


def test_help_lists_every_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for args, _, _ in SPELLINGS:
        assert args[0] in out
    assert out.strip() == usage()


ROUNDTRIP = [
    LaunchConfig(model="/m.gguf"),
    LaunchConfig(model="/m.gguf", host="0.0.0.0", port=0, aliases=("b", "a"), parallel=2),
    LaunchConfig(
        model="/models/x y.gguf",
        aliases=("tiny",),
        ctx_size=0,
        parallel=-1,
        threads=-1,
        threads_batch=3,
        gpu_layers="all",
        split_mode="row",
        tensor_split=(3.0, 1.0, 0.125),
        main_gpu=1,
        embedding=True,
        pooling="cls",
        cache_ram_mib=0,
        batch_size=256,
        ubatch_size=64,
        seed=-1,
        ui=False,
        metrics=True,
        verbosity=0,
    ),
    LaunchConfig(model="m", gpu_layers=0, ui=True, seed=0, tensor_split=(0.1, 0.2)),
]


@pytest.mark.parametrize("config", ROUNDTRIP)
def test_build_argv_roundtrips(config: LaunchConfig) -> None:
    assert parse_args(build_argv(config)) == config


def test_build_argv_uses_the_spellings_other_code_expects() -> None:
    config = LaunchConfig(model="/m.gguf", port=9001, aliases=("tiny",), parallel=2)
    head = ["-m", "/m.gguf", "--host", "127.0.0.1", "--port", "9001"]
    assert build_argv(config) == [*head, "--alias", "tiny", "-np", "2"]
    tail = build_argv(LaunchConfig(model="m", ui=False, embedding=True))[-2:]
    assert tail == ["--embeddings", "--no-webui"]


def test_build_params_applies_launcher_defaults_and_mappings() -> None:
    params = build_params(parse_args(MODEL))
    assert params.model.path == "/models/tiny.gguf"
    assert (params.cache_ram_mib, params.n_ctx) == (DEFAULT_CACHE_RAM_MIB, DEFAULT_CTX_SIZE)
    assert params.n_parallel == DEFAULT_PARALLEL
    assert params.cpuparams.n_threads >= 1
    assert params.n_gpu_layers == -1
    assert params.endpoint_metrics is False

    args = ["-ngl", "all", "-ts", "3,1", "--pooling", "mean", "-a", "x", "--no-webui"]
    params = build_params(parse_args(MODEL + args + ["--seed", "7", "-ub", "32", "-sm", "row"]))
    assert params.n_gpu_layers == -2
    assert list(params.tensor_split)[:3] == [3.0, 1.0, 0.0]
    assert int(params.pooling_type) == 1
    assert int(params.split_mode) == 2
    assert params.model_alias == {"x"}
    assert (params.ui, params.sampling.seed, params.n_ubatch) == (False, 7, 32)
