"""What task.model_path may name (issue 29): parsing, refusals naming the field, and cache
keys that are directory names, stable per source and distinct per revision."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from heteroflow.core.errors import ValidationFailed
from heteroflow.core.model_sources import (
    FIELD,
    MAX_KEY_CHARS,
    ModelSource,
    SourceKind,
    parse_model_source,
)
from heteroflow.models.fetch.manifest import Manifest, ManifestFile, safe_relative

KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@pytest.mark.parametrize(
    ("text", "kind", "location", "revision", "archive"),
    [
        ("/data/models/qwen.gguf", SourceKind.PATH, "/data/models/qwen.gguf", None, ""),
        ("qwen.gguf", SourceKind.PATH, "qwen.gguf", None, ""),
        ("hf://Qwen/Qwen2.5-0.5B", SourceKind.HF, "Qwen/Qwen2.5-0.5B", "main", ""),
        ("hf://org/name@v1.0", SourceKind.HF, "org/name", "v1.0", ""),
        ("hf://org/name@refs/pr/1", SourceKind.HF, "org/name", "refs/pr/1", ""),
        ("modelscope://qwen/Qwen2-7B", SourceKind.MODELSCOPE, "qwen/Qwen2-7B", "master", ""),
        ("https://example.com/m/x.gguf", SourceKind.URL, "https://example.com/m/x.gguf",
         None, ""),
        ("https://EXAMPLE.com/m/x.tar.gz", SourceKind.URL, "https://example.com/m/x.tar.gz",
         None, ".tar.gz"),
        ("https://example.com/x.ZIP", SourceKind.URL, "https://example.com/x.ZIP", None,
         ".zip"),
        ("http://127.0.0.1:8080/x.tgz", SourceKind.URL, "http://127.0.0.1:8080/x.tgz",
         None, ".tgz"),
        ("http://[::1]/x.bin", SourceKind.URL, "http://[::1]/x.bin", None, ""),
        ("http://localhost/x.bin", SourceKind.URL, "http://localhost/x.bin", None, ""),
        ("fleet://qwen2.5-7b", SourceKind.FLEET, "qwen2.5-7b", None, ""),
    ],
)
def test_accepted_sources(
    text: str, kind: SourceKind, location: str, revision: str | None, archive: str
) -> None:
    s = parse_model_source(text)
    assert (s.kind, s.location, s.revision, s.archive) == (kind, location, revision, archive)
    assert s.remote is (kind is not SourceKind.PATH)
    assert parse_model_source(s.text) == s  # the canonical text parses back to itself


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "is empty"),
        ("s3://bucket/model", "unknown scheme 's3://'"),
        ("file:///data/x.gguf", "unknown scheme"),
        ("hf://gpt2", "org/name"),
        ("hf://org/name/extra", "org/name"),
        ("hf://org/na me", "whitespace"),
        ("hf://org/name@", "revision ''"),
        ("hf://org/name@../x", "revision"),
        ("hf://org/name@a..b", "revision"),
        ("hf://-org/name", "org/name"),
        ("hf://org/na--me", "'--'"),
        ("modelscope://only", "org/name"),
        ("http://example.com/x.gguf", "loopback"),
        ("http://10.0.0.5/x.gguf", "loopback"),
        ("https://user:pw@example.com/x.gguf", "user info"),
        ("https://example.com/x.gguf?X-Amz-Signature=abc", "query string"),
        ("https://example.com/x.gguf#frag", "query string"),
        ("https://example.com/", "names no file"),
        ("https://example.com/a/../x.gguf", "'..'"),
        ("https:///x.gguf", "without a host"),
        ("https://example.com:99999/x", "not a valid URL"),
        ("fleet://", "model id"),
        ("fleet://../etc", "model id"),
        ("/data/../etc/passwd", "'..'"),
        ("~/models/x.gguf", "'~'"),
    ],
)
def test_refusals_name_the_field_and_say_what_is_accepted(text: str, says: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_model_source(text)
    assert info.value.field == FIELD
    assert info.value.message.startswith(f"{FIELD}: ")
    assert says in info.value.message
    assert "hf://org/name[@revision]" in info.value.message  # what is accepted


def test_the_field_named_is_the_callers() -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_model_source("ftp://x/y", field="model_path")
    assert info.value.field == "model_path"


_part = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_]{0,20}", fullmatch=True)
_rev = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_]{0,12}(/[A-Za-z0-9]{1,8})?", fullmatch=True)
_hub = st.builds(
    lambda scheme, org, name, rev: f"{scheme}://{org}/{name}" + (f"@{rev}" if rev else ""),
    st.sampled_from(["hf", "modelscope"]), _part, _part, st.none() | _rev,
)
_url = st.builds(
    lambda host, path, ext: f"https://{host}.example/{path}{ext}",
    _part, _part, st.sampled_from(["", ".gguf", ".tar", ".tar.gz", ".zip"]),
)
_any = _hub | _url | st.builds(lambda i: f"fleet://{i}", _part)


@given(_any)
def test_cache_key_is_a_directory_name_and_stable(text: str) -> None:
    s = parse_model_source(text)
    key = s.cache_key
    assert KEY.match(key) and len(key) <= MAX_KEY_CHARS
    assert key not in (".", "..")
    assert parse_model_source(text).cache_key == key
    assert parse_model_source(s.text).cache_key == key


@given(_any, _any)
def test_distinct_sources_have_distinct_keys(a: str, b: str) -> None:
    sa, sb = parse_model_source(a), parse_model_source(b)
    assert (sa == sb) == (sa.cache_key == sb.cache_key)


@given(_part, _part, _rev, _rev)
def test_each_revision_has_its_own_key(org: str, name: str, r1: str, r2: str) -> None:
    k1 = parse_model_source(f"hf://{org}/{name}@{r1}").cache_key
    k2 = parse_model_source(f"hf://{org}/{name}@{r2}").cache_key
    assert (k1 == k2) == (r1 == r2)


def test_keys_that_slug_alike_still_differ() -> None:
    a = parse_model_source("hf://a/b-c@x").cache_key
    b = parse_model_source("hf://a-b/c@x").cache_key
    assert a != b


def test_a_default_revision_is_the_same_key_as_writing_it() -> None:
    assert (parse_model_source("hf://o/n").cache_key
            == parse_model_source("hf://o/n@main").cache_key)
    assert (parse_model_source("modelscope://o/n").cache_key
            == parse_model_source("modelscope://o/n@master").cache_key)


def test_a_manifest_keys_on_the_resolved_revision() -> None:
    commit = "a" * 40
    f = ManifestFile("config.json", 2, None, "https://h/x")
    at_main = Manifest(parse_model_source("hf://o/n"), commit, (f,))
    at_commit = Manifest(parse_model_source(f"hf://o/n@{commit}"), commit, (f,))
    assert at_main.cache_key == at_commit.cache_key
    assert at_main.cache_key == parse_model_source(f"hf://o/n@{commit}").cache_key
    assert Manifest.from_json(at_main.to_json()) == at_main


@pytest.mark.parametrize(
    "path", ["../x", "/etc/passwd", "a/../../b", "a//b", "./a", "a\\b", "", "a/", "a\x00b"]
)
def test_manifest_refuses_unsafe_file_names(path: str) -> None:
    assert safe_relative(path) is None
    with pytest.raises(ValueError, match="unsafe"):
        ManifestFile(path, 1, None, "https://h/x")


def test_a_path_is_not_remote() -> None:
    assert ModelSource(SourceKind.PATH, "/x").remote is False
