"""Container images for the Docker runtime's tests, built locally (no registry is pulled from).

Owns two images, each a root filesystem assembled from Debian packages and imported into
the given Docker Engine (``docker import`` of a tar; no Dockerfile, no base image):

- ``heteroflow-test/llama.cpp:server`` (:func:`ensure_engine_image`): Debian's python3.11
  plus the ``xllamacpp`` wheel (the very files installed in this environment, so the same
  version) and a copy of ``heteroflow/engines/llamacpp_server.py``. It behaves like the
  official ``ghcr.io/ggml-org/llama.cpp:server``: the ENTRYPOINT is the server and the
  container's arguments are llama-server flags only, so the Docker runtime's command line
  is the one it would give the official image. It runs the real llama.cpp engine.
- ``heteroflow-test/busybox:1`` (:func:`ensure_busybox_image`): busybox-static with its
  applets linked (``sh``, ``httpd``, ``sleep`` ...) for generic container tests.

The ``.deb`` files are downloaded once with ``apt-get download`` into
``~/.cache/heteroflow/debs`` (``$XDG_CACHE_HOME`` honoured) and unpacked with
``dpkg-deb --fsys-tarfile`` into one tar, merged-/usr style (``/lib`` → ``/usr/lib`` ...).
Each image carries a content-hash label (package file names, copied sources, the wheel's
RECORD, this recipe's version); a call whose hash matches the tagged image returns at once.
Debian 12 (bookworm) packages are assumed: other releases lack ``python3.11``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import docker
import docker.errors

import heteroflow

ENGINE_TAG = "heteroflow-test/llama.cpp:server"
BUSYBOX_TAG = "heteroflow-test/busybox:1"
HASH_LABEL = "heteroflow.test-image.content-hash"
RECIPE_VERSION = "1"
SITE_DIR = "opt/heteroflow/site"  # PYTHONPATH of the engine image
ENGINE_ENTRYPOINT = ("python3.11", "-m", "heteroflow.engines.llamacpp_server")

BUSYBOX_DEBS = ("busybox-static",)
ENGINE_DEBS = (
    "libc6",
    "libgcc-s1",
    "libstdc++6",
    "libgomp1",
    "zlib1g",
    "libexpat1",
    "libffi8",
    "libssl3",
    "media-types",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "python3.11-minimal",
    "busybox-static",
)
APPLETS = (
    "sh", "ash", "cat", "cp", "date", "df", "echo", "env", "false", "grep", "head", "httpd",
    "id", "kill", "ln", "ls", "mkdir", "mount", "mv", "nc", "printf", "ps", "pwd", "rm",
    "sed", "sleep", "sort", "tail", "tee", "test", "touch", "true", "uname", "wc", "wget",
)  # fmt: skip
# The engine's own package files copied into the image (the launcher imports only stdlib
# and xllamacpp; the two __init__ files make the package importable).
HETEROFLOW_FILES = ("__init__.py", "engines/__init__.py", "engines/llamacpp_server.py")
_MERGED_USR = ("bin", "sbin", "lib", "lib64")
_SKIPPED = ("./usr/share/doc/", "./usr/share/man/", "./usr/share/locale/", "./usr/share/lintian/")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

AddExtra = Callable[[tarfile.TarFile], None]


class ImageBuildError(RuntimeError):
    """A test image could not be built here (no apt, no Debian package, Engine refused it)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "heteroflow"


def _cached_deb(dest: Path, name: str) -> Path | None:
    found = sorted(dest.glob(f"{name}_*.deb"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _apt_download(names: list[str], dest: Path) -> subprocess.CompletedProcess[str]:
    cmd = ["apt-get", "download", *names]
    if os.geteuid() == 0:  # _apt cannot write into root's cache dir; skip its sandbox
        cmd[1:1] = ["-o", "APT::Sandbox::User=root"]
    try:
        return subprocess.run(cmd, cwd=dest, capture_output=True, text=True, timeout=300)
    except FileNotFoundError as exc:
        raise ImageBuildError("apt-get is missing: the test images need Debian packages") from exc


def fetch_debs(names: Iterable[str]) -> list[Path]:
    """The ``.deb`` of each package, from the cache or ``apt-get download`` (once)."""
    dest = cache_dir() / "debs"
    dest.mkdir(parents=True, exist_ok=True)
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if _cached_deb(dest, n) is None]
    if missing:
        result = _apt_download(missing, dest)
        if result.returncode != 0 and os.geteuid() == 0:  # empty package lists: update once
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
            result = _apt_download(missing, dest)
        if result.returncode != 0:
            raise ImageBuildError(
                f"apt-get download {' '.join(missing)} failed: {result.stderr.strip()[-500:]}"
            )
    debs = [_cached_deb(dest, n) for n in wanted]
    absent = [n for n, d in zip(wanted, debs, strict=True) if d is None]
    if absent:
        raise ImageBuildError(f"apt-get download left no .deb for {', '.join(absent)}")
    return [d for d in debs if d is not None]


def _usr_merged(name: str) -> str:
    for top in _MERGED_USR:
        if name == f"./{top}" or name.startswith(f"./{top}/"):
            return "./usr/" + name[2:]
    return name


def _add_deb(out: tarfile.TarFile, deb: Path, seen: set[str]) -> None:
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    with tarfile.open(fileobj=proc.stdout, mode="r|") as src:
        for member in src:
            name = _usr_merged(member.name if member.name.startswith("./") else "./" + member.name)
            if name in seen or name.startswith(_SKIPPED):
                continue
            seen.add(name)
            member.name = name
            if member.islnk():
                member.linkname = _usr_merged("./" + member.linkname.removeprefix("./"))
            out.addfile(member, src.extractfile(member) if member.isfile() else None)
    if proc.wait() != 0:
        deb.unlink(missing_ok=True)  # a damaged download: fetched again next time
        raise ImageBuildError(f"dpkg-deb could not unpack {deb.name}")


def _add_dir(out: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    out.addfile(info)


def _add_symlink(out: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    out.addfile(info)


def _add_bytes(out: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    out.addfile(info, io.BytesIO(data))


def _write_rootfs(path: Path, debs: list[Path], extra: AddExtra | None) -> None:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as out:
        for top in _MERGED_USR:
            _add_symlink(out, f"./{top}", f"usr/{top}")
        for name in ("./usr", "./usr/bin", "./usr/sbin", "./usr/lib", "./usr/lib64", "./etc"):
            _add_dir(out, name)
        _add_dir(out, "./tmp", 0o1777)
        _add_bytes(out, "./etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        _add_bytes(out, "./etc/group", b"root:x:0:\nvideo:x:44:\nrender:x:105:\n")
        seen = {"./usr", "./usr/bin", "./usr/sbin", "./usr/lib", "./usr/lib64", "./etc"}
        for deb in debs:
            _add_deb(out, deb, seen)
        for applet in APPLETS:
            if f"./usr/bin/{applet}" not in seen:
                _add_symlink(out, f"./usr/bin/{applet}", "busybox")
        if extra is not None:
            extra(out)


def _image_hash(client: docker.DockerClient, tag: str) -> str | None:
    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    labels = image.labels or {}
    return labels.get(HASH_LABEL)


def _ensure(
    client: docker.DockerClient,
    tag: str,
    debs: list[Path],
    parts: list[str],
    changes: list[str],
    extra: AddExtra | None = None,
) -> str:
    recipe = [RECIPE_VERSION, *(d.name for d in debs), *APPLETS, *parts, *changes]
    digest = hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]
    if _image_hash(client, tag) == digest:
        return tag
    repository, _, version = tag.rpartition(":")
    with tempfile.TemporaryDirectory(prefix="heteroflow-image-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        _write_rootfs(rootfs, debs, extra)
        try:
            client.api.import_image(
                str(rootfs),
                repository=repository,
                tag=version,
                changes=[*changes, f"LABEL {HASH_LABEL}={digest}"],
            )
        except docker.errors.APIError as exc:
            raise ImageBuildError(f"docker import of {tag} failed: {exc}") from exc
    if _image_hash(client, tag) != digest:
        raise ImageBuildError(f"docker import did not tag {tag} with content hash {digest}")
    return tag


def ensure_busybox_image(client: docker.DockerClient, tag: str = BUSYBOX_TAG) -> str:
    """Tag ``tag`` as a busybox-static image (CMD ``sh``); returns the tag."""
    return _ensure(client, tag, fetch_debs(BUSYBOX_DEBS), [], ['CMD ["sh"]', f"ENV PATH={_PATH}"])


def _engine_files() -> list[tuple[str, Path]]:
    """(path in the image, file here): the launcher's package files and xllamacpp's wheel."""
    package = Path(heteroflow.__file__).parent
    files = [(f"{SITE_DIR}/heteroflow/{rel}", package / rel) for rel in HETEROFLOW_FILES]
    dist = importlib.metadata.distribution("xllamacpp")
    for entry in dist.files or ():
        if "__pycache__" in entry.parts:
            continue
        files.append((f"{SITE_DIR}/{entry.as_posix()}", Path(str(dist.locate_file(entry)))))
    return files


def ensure_engine_image(client: docker.DockerClient, tag: str = ENGINE_TAG) -> str:
    """Tag ``tag`` as the llama.cpp server image (ENTRYPOINT = the server); returns the tag."""
    files = _engine_files()
    record = importlib.metadata.distribution("xllamacpp").read_text("RECORD") or ""
    parts = [
        f"xllamacpp {importlib.metadata.version('xllamacpp')}",
        hashlib.sha256(record.encode()).hexdigest(),
        *(
            f"{dest} {hashlib.sha256(src.read_bytes()).hexdigest()}"
            for dest, src in files
            if dest.startswith(f"{SITE_DIR}/heteroflow/")
        ),
    ]
    changes = [
        f"ENTRYPOINT {json.dumps(list(ENGINE_ENTRYPOINT))}",
        f"ENV PATH={_PATH}",
        f"ENV PYTHONPATH=/{SITE_DIR}",
        "ENV PYTHONUNBUFFERED=1",
        "EXPOSE 8080",
    ]

    def add_engine(out: tarfile.TarFile) -> None:
        added: set[str] = set()
        for dest, src in files:
            parts = Path(dest).parent.parts
            for i in range(1, len(parts) + 1):
                if (sub := "./" + "/".join(parts[:i])) not in added:
                    added.add(sub)
                    _add_dir(out, sub)
            info = out.gettarinfo(str(src), arcname=f"./{dest}")
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            with open(src, "rb") as fh:
                out.addfile(info, fh)

    return _ensure(client, tag, fetch_debs(ENGINE_DEBS), parts, changes, add_engine)
