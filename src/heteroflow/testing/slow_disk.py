"""A slow disk for the tests of D5 (start windows that follow loading): a big model that
really loads for tens of seconds, and a throttle on the disk it is read from.

What throttles here (measured on the CI machine: a Firecracker VM, kernel 6.18, cgroup v1
hybrid with the ``blkio`` controller; root): a block-I/O cgroup with a read limit on one
disk — v1 ``blkio.throttle.read_bps_device`` or v2 ``io.max rbps=`` — holding the process
that reads. Buffered reads and page faults on an mmap are throttled alike (a page-cache
miss issues its read in the faulting task's cgroup): a 540 MB GGUF read through a 20 MB/s
limit loads in 27 s with its ``read_bytes`` growing by 20 MB/s, and at a limit of 1
byte/s the loader hangs in D state having read nothing, its process still killable. The
model's pages must not be in the page cache: ``drop_cache`` asks the kernel to forget one
file's clean pages (``posix_fadvise(DONTNEED)``), which leaves every other file of the
machine alone (``/proc/sys/vm/drop_caches`` would not). Docker's ``--device-read-bps`` is
the same v1/v2 limit on a container's cgroup; the agent's container plan sets none, so the
tests throttle the process runtime's agent (its engines are its children and inherit its
cgroup).

**The models live on a disk of their own** (``LoopDisk``: an ext4 image file on a loop
device, mounted where the node keeps its models), and only that disk is throttled — as in
production, where the model volume is slow or dies and the node's system disk does not.
Throttling the machine's one disk instead (how this began) throttled every read of the
agent too: once the page cache let go of a page of its Python, its libraries or the
engine's binary (a busy CI machine, or ``drop_caches``), the agent itself hung at 1 byte/s
and never stopped the hung load; a CI run failed so.

``SlowDisk`` makes such a cgroup for one disk; ``prefix()`` is the argv that runs a command
inside it (``spawn(..., prefix=...)`` in tests/e2e). ``SlowDiskUnavailable`` says why there
is none (not root, no block-I/O controller, no loop device, the file not on a block
device).

``write_big_gguf`` writes a loadable llama GGUF of about the size asked (f32 weights,
byte-level vocabulary, random-ish weights tiled from a small seeded block so writing
half a gigabyte takes about two seconds); llama.cpp reads all of it while it loads and
warms up.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import subprocess
from pathlib import Path

import gguf
import numpy as np

V1_ROOT = Path("/sys/fs/cgroup/blkio")
V2_ROOT = Path("/sys/fs/cgroup")
_N_EMBD = 1024
_N_FF = 4096
_LAYER_BYTES = 4 * (4 * _N_EMBD * _N_EMBD + 3 * _N_EMBD * _N_FF + 2 * _N_EMBD)


class SlowDiskUnavailable(RuntimeError):
    """No read throttle can be made here (the reason says why)."""


def disk_of(path: Path) -> str:
    """``major:minor`` of the whole disk holding ``path``."""
    dev = path.stat().st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not node.exists():
        raise SlowDiskUnavailable(f"{path} is not on a block device (st_dev {dev})")
    if (node / "partition").exists():
        return (node.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


def drop_cache(path: Path) -> None:
    """Forget ``path``'s pages in the page cache (written back first): its next read
    comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class LoopDisk:
    """A disk of its own: an ext4 file system in a sparse image file at ``image``, on a
    loop device, mounted at ``at`` (made when missing); ``disk`` is its ``major:minor``.
    ``close()`` unmounts it, frees the loop device and deletes the image."""

    def __init__(self, image: Path, at: Path, size_mb: int) -> None:
        if os.geteuid() != 0:
            raise SlowDiskUnavailable("a loop device and a mount need root")
        self.image, self.at, self.device = image, at, ""
        try:
            with image.open("wb") as f:
                f.truncate(size_mb * 1_000_000)
            _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0", str(image))
            self.device = _run("losetup", "--find", "--show", str(image))
            at.mkdir(parents=True, exist_ok=True)
            _run("mount", self.device, str(at))
            self.disk = disk_of(at)
        except (OSError, SlowDiskUnavailable) as exc:
            self.close()
            raise SlowDiskUnavailable(f"no loop disk at {at}: {exc}") from exc

    def close(self) -> None:
        if self.device:
            if os.path.ismount(self.at):
                try:
                    _run("umount", str(self.at))
                except SlowDiskUnavailable:  # busy: lazily, a hung reader lets go later
                    with contextlib.suppress(SlowDiskUnavailable):
                        _run("umount", "-l", str(self.at))
            with contextlib.suppress(SlowDiskUnavailable):
                _run("losetup", "-d", self.device)  # deferred while still in use
            self.device = ""
        with contextlib.suppress(OSError):
            self.image.unlink()

    def __enter__(self) -> LoopDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run(*argv: str) -> str:
    """Run a system tool; its stdout, or ``SlowDiskUnavailable`` with its complaint."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlowDiskUnavailable(f"{argv[0]}: {exc}") from exc
    if done.returncode != 0:
        raise SlowDiskUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


class SlowDisk:
    """A block-I/O cgroup whose members read ``disk`` (``major:minor``) at most ``bps``
    bytes a second."""

    def __init__(self, disk: str, bps: int) -> None:
        if os.geteuid() != 0:
            raise SlowDiskUnavailable("making a block-I/O cgroup needs root")
        self.disk = disk
        name = f"heteroflow-slow-{secrets.token_hex(4)}"
        if (V1_ROOT / "blkio.throttle.read_bps_device").exists():
            self.v2 = False
            self.path = V1_ROOT / name
        elif (V2_ROOT / "cgroup.controllers").exists():
            if "io" not in (V2_ROOT / "cgroup.controllers").read_text().split():
                raise SlowDiskUnavailable("cgroup v2 without the io controller")
            self.v2 = True
            self.path = V2_ROOT / name
            with contextlib.suppress(OSError):  # may already be on
                (V2_ROOT / "cgroup.subtree_control").write_text("+io")
        else:
            raise SlowDiskUnavailable("no blkio (v1) or io (v2) cgroup controller mounted")
        try:
            self.path.mkdir()
            self.set_rate(bps)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            raise SlowDiskUnavailable(f"cannot make a throttled cgroup: {exc}") from exc

    def set_rate(self, bps: int) -> None:
        """Reads of the disk at most ``bps`` bytes a second (0: no limit)."""
        if self.v2:
            value = "max" if bps <= 0 else str(bps)
            (self.path / "io.max").write_text(f"{self.disk} rbps={value}")
        else:
            (self.path / "blkio.throttle.read_bps_device").write_text(f"{self.disk} {bps}")

    def prefix(self) -> tuple[str, ...]:
        """An argv prefix that runs the rest of the command inside this cgroup."""
        procs = shlex.quote(str(self.path / "cgroup.procs"))
        return ("sh", "-c", f'echo $$ > {procs} && exec "$@"', "slow-disk")

    def close(self) -> None:
        """Lift the limit (reads held by it complete) and remove the cgroup once empty."""
        with contextlib.suppress(OSError):
            self.set_rate(0)
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def __enter__(self) -> SlowDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_big_gguf(path: Path, size_mb: int = 540) -> Path:
    """A loadable llama GGUF of about ``size_mb`` MB at ``path`` (kept when already
    there with the same size asked: the name should say the size)."""
    n_layer = max(1, round(size_mb * 1_000_000 / _LAYER_BYTES))
    if path.is_file() and path.stat().st_size >= n_layer * _LAYER_BYTES:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    block = (np.random.default_rng(20_261_202).standard_normal(1 << 16) * 0.02).astype(
        np.float32
    )

    def tensor(*shape: int) -> np.ndarray:
        return np.resize(block, int(np.prod(shape))).reshape(shape)

    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(path.stem)
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_vocab_size(len(tokens))
    w.add_context_length(2048)
    w.add_embedding_length(_N_EMBD)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(_N_FF)
    w.add_head_count(8)
    w.add_head_count_kv(8)
    w.add_rope_dimension_count(_N_EMBD // 8)
    w.add_rope_freq_base(10_000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([int(t) for t in types])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", tensor(len(tokens), _N_EMBD))
    shapes = {
        "attn_norm": (_N_EMBD,), "attn_q": (_N_EMBD, _N_EMBD), "attn_k": (_N_EMBD, _N_EMBD),
        "attn_v": (_N_EMBD, _N_EMBD), "attn_output": (_N_EMBD, _N_EMBD),
        "ffn_norm": (_N_EMBD,), "ffn_gate": (_N_FF, _N_EMBD), "ffn_up": (_N_FF, _N_EMBD),
        "ffn_down": (_N_EMBD, _N_FF),
    }  # fmt: skip
    for i in range(n_layer):
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", tensor(*shape))
    w.add_tensor("output_norm.weight", tensor(_N_EMBD))
    w.add_tensor("output.weight", tensor(len(tokens), _N_EMBD))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
