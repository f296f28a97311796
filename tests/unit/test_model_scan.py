"""Model scan (C10): scan roots, HF / hub-cache / GGUF detection, incremental scans, symlinks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from heteroflow.agent import model_scan
from heteroflow.agent.model_scan import ENV_VAR, ModelScanner, ScannedModel, scan_dirs

pytestmark = pytest.mark.feature("C10")


@pytest.fixture(autouse=True)
def fake_data_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the always-scanned /data/models at a tmp dir so the machine's is never read."""
    data = tmp_path / "data-models"
    monkeypatch.setattr(model_scan, "ALWAYS_SCANNED", data)
    return data


def write(path: Path, size: int = 32) -> Path:
    """A file of ``size`` bytes; a ``.gguf`` one starts with the GGUF magic (the scan
    offers no file that does not: issue 33)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = b"GGUF" if path.suffix == ".gguf" else b""
    path.write_bytes((head + b"x" * size)[:size])
    return path


def hf_dir(path: Path, weights: tuple[str, ...] = ("model.safetensors",)) -> Path:
    write(path / "config.json", 2)
    write(path / "tokenizer_config.json", 3)
    for name in weights:
        write(path / name, 100)
    return path


def by_name(models: list[ScannedModel]) -> dict[str, ScannedModel]:
    return {m.name: m for m in models}


def bump_mtime(path: Path, seconds: float = 10) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime, st.st_mtime + seconds))


# --- scan roots -------------------------------------------------------------------


def test_config_wins_over_env_and_default_and_replaces_them(
    tmp_path: Path, fake_data_models: Path
) -> None:
    env = {ENV_VAR: str(tmp_path / "env")}
    dirs = scan_dirs([str(tmp_path / "cfg")], env, tmp_path / "cache")
    assert dirs == [tmp_path / "cfg", fake_data_models]


def test_env_wins_over_default_and_splits_on_pathsep(
    tmp_path: Path, fake_data_models: Path
) -> None:
    env = {ENV_VAR: os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")])}
    dirs = scan_dirs(None, env, tmp_path / "cache")
    assert dirs == [tmp_path / "a", tmp_path / "b", fake_data_models]


def test_default_cache_dir_when_nothing_configured(tmp_path: Path, fake_data_models: Path) -> None:
    assert scan_dirs(None, {ENV_VAR: " "}, tmp_path / "cache") == [
        tmp_path / "cache", fake_data_models,
    ]
    assert model_scan.default_cache_dir() == Path.home() / ".cache" / "huggingface"


def test_empty_config_list_still_replaces(tmp_path: Path, fake_data_models: Path) -> None:
    assert scan_dirs([], {ENV_VAR: str(tmp_path / "env")}, tmp_path / "c") == [fake_data_models]


def test_existing_hub_subdirs_added_and_duplicates_dropped(
    tmp_path: Path, fake_data_models: Path
) -> None:
    cache = tmp_path / "cache"
    for sub in ("hub", "models/hub", "models"):
        (cache / sub).mkdir(parents=True, exist_ok=True)
    (fake_data_models / "hub").mkdir(parents=True)
    dirs = scan_dirs([str(cache), str(cache / "hub"), str(fake_data_models)], {}, tmp_path)
    assert dirs == [
        cache, cache / "hub", cache / "models" / "hub", cache / "models",
        fake_data_models, fake_data_models / "hub",
    ]


# --- formats ----------------------------------------------------------------------


def test_hf_model_dir(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "root" / "Qwen2.5-0.5B")
    write(model / "training_args.bin", 1000)
    hf_dir(tmp_path / "root" / "Qwen" / "Qwen2.5-7B", weights=("pytorch_model.bin",))
    # config + tokenizer but only training artifacts: not a model
    hf_dir(tmp_path / "root" / "ckpt", weights=("training_args.bin", "optimizer.pt"))
    models = by_name(ModelScanner([tmp_path / "root"]).full())
    assert set(models) == {"Qwen2.5-0.5B", "Qwen/Qwen2.5-7B"}
    small = models["Qwen2.5-0.5B"]
    assert small.format == "hf" and small.path == str(model)
    assert small.files == ("config.json", "model.safetensors", "tokenizer_config.json")
    assert small.size_bytes == 105
    assert small.to_dict()["files"] == list(small.files)


def test_hf_hub_cache_layout(tmp_path: Path) -> None:
    hub = tmp_path / "cache" / "hub"
    repo = hub / "models--Qwen--Qwen2.5-0.5B-Instruct"
    blobs = repo / "blobs"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name, size in (("config.json", 2), ("tokenizer_config.json", 3),
                       ("model.safetensors", 500)):
        write(blobs / f"sha-{name}", size)
        (snap / name).symlink_to(Path("../../blobs") / f"sha-{name}")
    write(repo / "refs" / "main").write_text("abc123")
    hf_dir(repo / "snapshots" / "old000")  # an older revision: not reported
    (hub / "datasets--x--y" / "snapshots").mkdir(parents=True)
    models = ModelScanner(scan_dirs([str(tmp_path / "cache")], {}, tmp_path)).full()
    assert [(m.name, m.path, m.size_bytes) for m in models] == [
        ("Qwen/Qwen2.5-0.5B-Instruct", str(snap), 505)
    ]


def test_sharded_gguf_grouped_and_mmproj_attached(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for i in (1, 2, 3):
        write(root / "big" / f"llama-70b-q4-0000{i}-of-00003.gguf", 100)
    write(root / "big" / "mmproj-f16.gguf", 7)
    write(root / "partial" / "m-00001-of-00002.gguf")  # still downloading
    write(root / "gemma-270m-q4_k_m.gguf", 50)
    write(root / "quants" / "a-q4.gguf")
    write(root / "quants" / "a-q8.gguf")
    models = by_name(ModelScanner([root]).full())
    assert set(models) == {"big", "gemma-270m-q4_k_m", "quants/a-q4", "quants/a-q8"}
    big = models["big"]
    assert big.format == "gguf"
    assert big.path == str(root / "big" / "llama-70b-q4-00001-of-00003.gguf")
    assert big.size_bytes == 307
    assert big.files == (
        "llama-70b-q4-00001-of-00003.gguf", "llama-70b-q4-00002-of-00003.gguf",
        "llama-70b-q4-00003-of-00003.gguf", "mmproj-f16.gguf",
    )
    assert models["gemma-270m-q4_k_m"].path == str(root / "gemma-270m-q4_k_m.gguf")


def test_always_scanned_dir_is_scanned(fake_data_models: Path) -> None:
    write(fake_data_models / "tiny.gguf")
    dirs = scan_dirs([], {}, Path("/nonexistent"))
    assert [m.name for m in ModelScanner(dirs).full()] == ["tiny"]


# --- incremental, symlinks, unreadable ----------------------------------------------


def test_incremental_rescans_only_changed_dirs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    hf_dir(root / "a")
    write(root / "b" / "b.gguf")
    scanner = ModelScanner([root])
    assert {m.name for m in scanner.full()} == {"a", "b"}

    hf_dir(root / "c")  # new model: root's mtime changes
    bump_mtime(root)
    # b.gguf deleted but b's mtime forced back: an unchanged dir is not re-listed
    b_stat = (root / "b").stat()
    (root / "b" / "b.gguf").unlink()
    os.utime(root / "b", ns=(b_stat.st_atime_ns, b_stat.st_mtime_ns))
    assert {m.name for m in scanner.incremental()} == {"a", "b", "c"}

    bump_mtime(root / "b")  # now it changed: the deleted model drops out
    assert {m.name for m in scanner.incremental()} == {"a", "c"}

    for f in (root / "a").iterdir():
        f.unlink()
    (root / "a").rmdir()  # a vanished dir drops its models
    bump_mtime(root, 20)
    assert {m.name for m in scanner.incremental()} == {"c"}
    assert {m.name for m in scanner.full()} == {"c"}


def test_symlinks_out_of_the_root_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    hf_dir(outside / "secret-model")
    write(outside / "secret.gguf")
    root = tmp_path / "root"
    root.mkdir()
    (root / "linked-dir").symlink_to(outside / "secret-model", target_is_directory=True)
    (root / "linked.gguf").symlink_to(outside / "secret.gguf")
    write(root / "inside" / "real.gguf")
    (root / "alias.gguf").symlink_to(root / "inside" / "real.gguf")  # inside: counted
    assert {m.name for m in ModelScanner([root]).full()} == {"inside", "alias"}


def test_unreadable_dir_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    write(root / "locked" / "x.gguf")
    write(root / "open" / "y.gguf")
    real_scandir = os.scandir

    def scandir(path: Path) -> object:  # chmod does not stop root, so refuse here
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with caplog.at_level("DEBUG", logger=model_scan.__name__):
        models = ModelScanner([root, tmp_path / "missing"]).full()
    assert [m.name for m in models] == ["open"]
    assert "locked" in caplog.text


def test_an_empty_or_foreign_gguf_is_not_offered(tmp_path: Path) -> None:
    """Issue 33: the models page listed a 0-byte file like any model, and its "Deploy"
    made a service that failed on its node."""
    root = tmp_path / "models"
    write(root / "good.gguf", 64)
    write(root / "empty.gguf", 0)
    (root / "foreign.gguf").write_bytes(b"PK\x03\x04" + b"x" * 60)  # a zip named .gguf
    assert set(by_name(ModelScanner([root]).full())) == {"good"}

