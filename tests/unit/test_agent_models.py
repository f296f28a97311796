"""Model path resolution on the node: allow/deny prefixes on real paths, GGUF discovery."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from heteroflow.agent import models
from heteroflow.agent.models import ModelPathError, check_allowed, resolve_model_file

pytestmark = pytest.mark.feature("C4")


@pytest.fixture(autouse=True)
def _no_data_models(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep the machine's /data/models out of the lookup."""
    empty = tmp_path / "data-models-empty"
    empty.mkdir()
    monkeypatch.setattr(models, "DATA_MODELS", empty)


def touch(path: Path, data: bytes = b"GGUF") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    return d


def test_absolute_path_inside_allowed_prefix_resolves(allowed: Path) -> None:
    f = touch(allowed / "tiny.gguf")
    assert resolve_model_file(str(f), (str(allowed),), ()) == f.resolve()


def test_absolute_path_in_nested_dir_resolves(allowed: Path) -> None:
    f = touch(allowed / "org" / "family" / "tiny.gguf")
    assert resolve_model_file(str(f), (str(allowed),), ()) == f.resolve()


def test_absolute_path_outside_allowed_prefix_refused(tmp_path: Path, allowed: Path) -> None:
    f = touch(tmp_path / "elsewhere" / "tiny.gguf")
    with pytest.raises(ModelPathError, match="outside the allowed volume prefixes of this node"):
        resolve_model_file(str(f), (str(allowed),), ())


def test_no_allowed_prefixes_refuses_everything(allowed: Path) -> None:
    f = touch(allowed / "tiny.gguf")
    with pytest.raises(ModelPathError, match="outside"):
        resolve_model_file(str(f), (), ())


def test_symlink_inside_allowed_pointing_outside_refused(tmp_path: Path, allowed: Path) -> None:
    secret = touch(tmp_path / "secret" / "weights.gguf")
    link = allowed / "innocent.gguf"
    link.symlink_to(secret)
    assert link.is_file()  # the link itself works; the check must look through it
    with pytest.raises(ModelPathError, match="outside"):
        resolve_model_file(str(link), (str(allowed),), ())


def test_symlinked_directory_inside_allowed_pointing_outside_refused(
    tmp_path: Path, allowed: Path
) -> None:
    touch(tmp_path / "secret" / "weights.gguf")
    (allowed / "dir").symlink_to(tmp_path / "secret", target_is_directory=True)
    with pytest.raises(ModelPathError, match="outside"):
        resolve_model_file(str(allowed / "dir" / "weights.gguf"), (str(allowed),), ())


def test_dotdot_escape_refused(tmp_path: Path, allowed: Path) -> None:
    touch(tmp_path / "secret.gguf")
    sneaky = f"{allowed}/../secret.gguf"
    assert Path(sneaky).is_file()
    with pytest.raises(ModelPathError, match=r"'\.\.'"):
        resolve_model_file(sneaky, (str(allowed),), ())


def test_dotdot_is_refused_even_when_it_stays_inside(allowed: Path) -> None:
    """The create's rule (issue 26: one function): '..' is refused, never resolved."""
    touch(allowed / "a" / "tiny.gguf")
    (allowed / "b").mkdir()
    with pytest.raises(ModelPathError, match=r"'\.\.'"):
        resolve_model_file(f"{allowed}/b/../a/tiny.gguf", (str(allowed),), ())


def test_prefix_is_compared_on_segment_boundaries(tmp_path: Path) -> None:
    prefix = tmp_path / "x" / "models"
    prefix.mkdir(parents=True)
    evil = touch(tmp_path / "x" / "models-evil" / "file")
    assert str(evil).startswith(str(prefix))  # a plain string prefix check would pass it
    with pytest.raises(ModelPathError, match="outside"):
        resolve_model_file(str(evil), (str(prefix),), ())
    with pytest.raises(ModelPathError):
        check_allowed(evil, (str(prefix),), ())


def test_allowed_prefix_with_trailing_slash(allowed: Path) -> None:
    f = touch(allowed / "tiny.gguf")
    assert resolve_model_file(str(f), (str(allowed) + "/",), ()) == f.resolve()


def test_denied_prefix_wins_over_allowed(allowed: Path) -> None:
    private = allowed / "private"
    f = touch(private / "tiny.gguf")
    public = touch(allowed / "public.gguf")
    with pytest.raises(ModelPathError, match="denied"):
        resolve_model_file(str(f), (str(allowed),), (str(private),))
    assert resolve_model_file(str(public), (str(allowed),), (str(private),)) == public.resolve()


def test_denied_prefix_segment_boundary(allowed: Path) -> None:
    f = touch(allowed / "private-not" / "tiny.gguf")
    got = resolve_model_file(str(f), (str(allowed),), (str(allowed / "private"),))
    assert got == f.resolve()


def test_directory_resolves_to_the_gguf_inside(allowed: Path) -> None:
    d = allowed / "gemma"
    f = touch(d / "gemma.gguf")
    touch(d / "README.md")
    assert resolve_model_file(str(d), (str(allowed),), ()) == f.resolve()


def test_directory_prefers_first_shard(allowed: Path) -> None:
    d = allowed / "big"
    touch(d / "aaa-mmproj.gguf")  # sorts before the shards
    touch(d / "big-00002-of-00002.gguf")
    first = touch(d / "big-00001-of-00002.gguf")
    assert resolve_model_file(str(d), (str(allowed),), ()) == first.resolve()


def test_directory_without_gguf_is_an_error(allowed: Path) -> None:
    d = allowed / "empty"
    touch(d / "model.safetensors")
    with pytest.raises(ModelPathError, match=r"no \.gguf"):
        resolve_model_file(str(d), (str(allowed),), ())


def test_missing_absolute_file_says_it_does_not_exist(allowed: Path) -> None:
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_file(str(allowed / "nope.gguf"), (str(allowed),), ())


def test_missing_file_outside_allow_list_is_refused_not_probed(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match="outside"):
        resolve_model_file(str(tmp_path / "nowhere" / "nope.gguf"), (str(tmp_path / "m"),), ())


def test_empty_model_path_is_an_error(allowed: Path) -> None:
    with pytest.raises(ModelPathError, match="no model_path"):
        resolve_model_file("", (str(allowed),), ())


def test_relative_name_found_with_gguf_suffix(allowed: Path) -> None:
    f = touch(allowed / "tiny.gguf")
    assert resolve_model_file("tiny", (str(allowed),), ()) == f.resolve()


def test_relative_name_exact_file(allowed: Path) -> None:
    f = touch(allowed / "tiny.gguf")
    assert resolve_model_file("tiny.gguf", (str(allowed),), ()) == f.resolve()


def test_relative_name_searches_every_allowed_dir(tmp_path: Path, allowed: Path) -> None:
    second = tmp_path / "more-models"
    f = touch(second / "other.gguf")
    assert resolve_model_file("other", (str(allowed), str(second)), ()) == f.resolve()


def test_relative_name_in_data_models(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    data = tmp_path / "data" / "models"
    f = touch(data / "shared.gguf")
    monkeypatch.setattr(models, "DATA_MODELS", data)
    assert resolve_model_file("shared", (), ()) == f.resolve()


def test_relative_name_directory_resolves_to_gguf(allowed: Path) -> None:
    f = touch(allowed / "qwen" / "qwen-00001-of-00003.gguf")
    touch(allowed / "qwen" / "qwen-00002-of-00003.gguf")
    assert resolve_model_file("qwen", (str(allowed),), ()) == f.resolve()


def test_relative_name_not_found(allowed: Path) -> None:
    with pytest.raises(ModelPathError, match="not found"):
        resolve_model_file("missing-model", (str(allowed),), ())


def test_relative_dotdot_refused(tmp_path: Path, allowed: Path) -> None:
    touch(tmp_path / "secret.gguf")
    with pytest.raises(ModelPathError):
        resolve_model_file("../secret", (str(allowed),), ())
    with pytest.raises(ModelPathError):
        resolve_model_file("sub/../../secret.gguf", (str(allowed),), ())


def test_relative_symlink_escape_refused(tmp_path: Path, allowed: Path) -> None:
    secret = touch(tmp_path / "secret" / "w.gguf")
    (allowed / "w.gguf").symlink_to(secret)
    with pytest.raises(ModelPathError, match="outside"):
        resolve_model_file("w", (str(allowed),), ())


def test_relative_name_under_denied_prefix_refused(allowed: Path) -> None:
    touch(allowed / "private" / "p.gguf")
    with pytest.raises(ModelPathError, match="denied"):
        resolve_model_file("private/p", (str(allowed),), (str(allowed / "private"),))


def test_check_allowed_returns_real_path(tmp_path: Path, allowed: Path) -> None:
    f = touch(allowed / "real.gguf")
    link = allowed / "alias.gguf"
    link.symlink_to(f)
    got = check_allowed(link, (str(allowed),), ())
    assert got == Path(os.path.realpath(f))
    assert got.name == "real.gguf"
