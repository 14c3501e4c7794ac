"""DiskStore (executor/tiers/nvme.py): round trips, ordering, checksums, disk errors, O_DIRECT fallback, resume.
(Hostile names planted in its directory: tests/tiers/test_nvme_ownership.py.)

Everything runs in pytest tmp dirs on the real disk; the largest region is 8 MiB.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from hplan.errors import HplanError
from hplan.executor.tiers import nvme_format, nvme_io
from hplan.executor.tiers.nvme_folder import FOLDER
from hplan.executor.tiers.nvme import DiskStore, aligned_empty, is_aligned, measure_raw_bandwidth, storage_bytes
from nvme_regions import one_line, rand, region_files

SIZES = [0, 1, 4095, 4096, (1 << 20) + 3]


def direct_supported(d: Path) -> bool:
    probe = d / "probe"
    probe.mkdir()
    with DiskStore(probe) as store:
        direct = store.direct
    shutil.rmtree(probe)
    return direct


@pytest.mark.parametrize("mode", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("n", SIZES)
def test_round_trip(tmp_path: Path, n: int, mode: bool) -> None:
    if mode and not direct_supported(tmp_path):
        pytest.skip("the file system under the tmp dir refuses O_DIRECT")
    with DiskStore(tmp_path, direct=mode) as store:
        assert store.direct is mode and (store.fallback_reason is None) is mode
        src, dst = rand(n, n), aligned_empty(n)
        store.write_async("r", src).result()
        store.read_async("r", dst)
        store.wait("r")
        assert torch.equal(src, dst)
        assert store.size("r") == n
        assert (tmp_path / FOLDER / "r.0.region").stat().st_size == n
        stats = store.stats()
        assert (stats.read_bytes, stats.write_bytes, stats.reads, stats.writes) == (n, n, 1, 1)
        assert stats.buffered == (0 if mode else 2)


def test_unaligned_buffers_still_round_trip_buffered(tmp_path: Path) -> None:
    """A host buffer off the 4096 boundary cannot use O_DIRECT: that transfer runs buffered, and says so."""
    with DiskStore(tmp_path) as store:
        src = aligned_empty(70_001)[1:]
        src.copy_(rand(70_000, 3))
        dst = aligned_empty(70_003)[3:]
        assert not is_aligned(src) and not is_aligned(dst)
        store.write_async("u", src)
        store.read_async("u", dst)
        store.wait_all()
        assert torch.equal(src, dst)
        assert store.stats().buffered == 2


def test_many_concurrent_distinct_keys_and_counters(tmp_path: Path) -> None:
    sizes = [(i * 37_813) % 200_000 + i for i in range(32)]
    srcs = {f"k{i}": rand(n, i) for i, n in enumerate(sizes)}
    with DiskStore(tmp_path, threads=4) as store:
        for key, src in srcs.items():
            store.write_async(key, src)
        dsts = {key: aligned_empty(src.numel()) for key, src in srcs.items()}
        for key, dst in dsts.items():  # queued behind their writes, without waiting for them
            store.read_async(key, dst)
        store.wait_all()
        for key in srcs:
            assert torch.equal(srcs[key], dsts[key]), key
        stats = store.stats()
        assert stats.write_bytes == stats.read_bytes == sum(sizes)
        assert stats.reads == stats.writes == len(sizes)
        assert stats.read_seconds > 0 and stats.write_seconds > 0 and stats.read_bandwidth > 0
        store.reset_stats()
        assert store.stats().read_bytes == 0


def test_read_issued_right_after_a_write_sees_the_new_bytes(tmp_path: Path) -> None:
    n = 4 << 20
    with DiskStore(tmp_path, threads=4) as store:
        store.write_async("w", rand(n, 0)).result()
        for seed in range(1, 4):
            new, dst = rand(n, seed), aligned_empty(n)
            store.write_async("w", new)
            store.read_async("w", dst)  # no wait between: the store orders them
            store.wait("w")
            assert torch.equal(dst, new), seed


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_checksum_detects_a_flipped_byte(tmp_path: Path, algorithm: str) -> None:
    n = (1 << 20) + 3
    with DiskStore(tmp_path, checksum=algorithm) as store:
        assert store.checksum_name == algorithm
        store.write_async("f", rand(n, 5)).result()
        path = tmp_path / FOLDER / "f.0.region"
        with open(path, "r+b") as fh:
            fh.seek(n // 2)
            byte = fh.read(1)[0]
            fh.seek(n // 2)
            fh.write(bytes([byte ^ 0x10]))
        store.read_async("f", aligned_empty(n))
        with pytest.raises(HplanError, match="does not match its .*checksum") as exc:
            store.wait("f")
        assert str(path) in one_line(exc)


def test_truncated_or_deleted_file_is_refused(tmp_path: Path) -> None:
    n = 4096 * 3
    with DiskStore(tmp_path) as store:
        store.write_async("t", rand(n, 6))
        store.write_async("gone", rand(10, 7))
        manifest = store.commit()
        os.truncate(tmp_path / FOLDER / "t.0.region", n - 1)
        store.read_async("t", aligned_empty(n))
        with pytest.raises(HplanError, match="truncated") as exc:
            store.wait("t")
        assert "t.0.region" in one_line(exc)
        (tmp_path / FOLDER / "gone.0.region").unlink()
        store.read_async("gone", aligned_empty(10))
        with pytest.raises(HplanError, match="missing"):
            store.wait("gone")
    with pytest.raises(HplanError, match="truncated") as exc:  # a resume refuses it before any step
        DiskStore(tmp_path, manifest=manifest)
    one_line(exc)


def test_bad_requests_are_one_line_errors(tmp_path: Path) -> None:
    with DiskStore(tmp_path) as store:
        with pytest.raises(HplanError, match="never written") as exc:
            store.read_async("nope", aligned_empty(4))
        one_line(exc)
        store.write_async("s", rand(100, 1)).result()
        with pytest.raises(HplanError, match="holds 100 bytes but the buffer has 99"):
            store.read_async("s", aligned_empty(99))
        with pytest.raises(HplanError, match="not a plain file name"):
            store.write_async("../escape", rand(1, 1))
        with pytest.raises(HplanError, match="uint8"):
            store.write_async("f32", torch.zeros(4))
        with pytest.raises(HplanError, match="in use by another DiskStore"):
            DiskStore(tmp_path)
        with pytest.raises(HplanError, match="TB free but needs .* TB"):
            store.check_free(1 << 60)
    store = DiskStore(tmp_path)  # the lock was released on close
    store.close()
    with pytest.raises(HplanError, match="is closed"):
        store.write_async("s", rand(1, 1))


def test_missing_and_non_directory_paths(tmp_path: Path) -> None:
    with pytest.raises(HplanError, match="does not exist: create it") as exc:
        DiskStore(tmp_path / "absent")
    one_line(exc)
    (tmp_path / "file").write_text("x")
    with pytest.raises(HplanError, match="is not a directory"):
        DiskStore(tmp_path / "file")


def test_read_only_directory(tmp_path: Path) -> None:
    """Mode bits do not stop root, so as root the directory is made immutable (chattr +i) instead."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(d)]).returncode != 0:
            pytest.skip("running as root and chattr +i is unavailable here")
    else:
        d.chmod(0o500)
    try:
        with pytest.raises(HplanError, match="not writable") as exc:
            DiskStore(d)
        assert str(d) in one_line(exc)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(d)], check=True)
        d.chmod(0o700)
    assert list(d.iterdir()) == []


def test_read_only_file_system_mid_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EROFS (a disk remounted read-only) while writing: one line naming the directory, no region left."""
    with DiskStore(tmp_path) as store:
        real_open = os.open

        def refuse(path: object, flags: int, *args: int, **kw: int) -> int:
            if str(path).endswith(".region") and flags & os.O_WRONLY:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return real_open(path, flags, *args, **kw)

        monkeypatch.setattr(os, "open", refuse)
        store.write_async("x", rand(10, 1))
        with pytest.raises(HplanError, match="read-only file system") as exc:
            store.wait("x")
        assert str(tmp_path) in one_line(exc)
        assert region_files(tmp_path) == []


def test_disk_full_mid_write_leaves_no_valid_region(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 1 << 20
    old, new = rand(n, 1), rand(n, 2)
    with DiskStore(tmp_path) as store:
        store.write_async("m", old)
        manifest = json.loads(json.dumps(store.commit()))  # as a checkpoint would save it
        real_pwritev, calls = os.pwritev, []

        def half_then_enospc(fd: int, buffers: list[memoryview], offset: int) -> int:
            calls.append(offset)
            if len(calls) == 1:  # a short write, then the error: how Linux reports a disk filling up
                return real_pwritev(fd, [buffers[0][:len(buffers[0]) // 2]], offset)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwritev", half_then_enospc)
        store.write_async("m", new)
        with pytest.raises(HplanError, match="disk full while writing") as exc:
            store.wait("m")
        assert "m.1.region" in one_line(exc)
        assert len(calls) == 2 and not (tmp_path / FOLDER / "m.1.region").exists()
        with pytest.raises(HplanError, match="last write failed"):
            store.read_async("m", aligned_empty(n))
        with pytest.raises(HplanError, match="cannot commit .* region 'm' has no valid copy") as exc:
            store.commit()  # a manifest never silently lacks a region
        one_line(exc)
        calls.clear()
        store.write_async("fresh", new)
        with pytest.raises(HplanError, match="disk full"):
            store.wait("fresh")
        monkeypatch.undo()
        assert region_files(tmp_path) == ["m.0.region"]
    with DiskStore(tmp_path, manifest=manifest) as store:  # the committed version is intact
        dst = aligned_empty(n)
        store.read_async("m", dst).result()
        assert torch.equal(dst, old)


def test_o_direct_refused_falls_back_with_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses O_DIRECT (EINVAL, as tmpfs did before Linux 6.6): auto falls back."""
    if not nvme_io.O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open

    def no_direct(path: object, flags: int, *args: int, **kw: int) -> int:
        if flags & nvme_io.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(HplanError, match="O_DIRECT is not available") as exc:
        DiskStore(tmp_path, direct=True)
    one_line(exc)
    with DiskStore(tmp_path) as store:
        assert not store.direct and "refuses O_DIRECT" in (store.fallback_reason or "")
        src, dst = rand(5000, 9), aligned_empty(5000)
        store.write_async("b", src)
        store.read_async("b", dst).result()
        assert torch.equal(src, dst) and store.stats().buffered == 2
    with DiskStore(tmp_path, direct=False) as store:
        assert "disabled by the caller" in (store.fallback_reason or "")


def test_commit_pins_versions_and_a_stale_manifest_is_caught(tmp_path: Path) -> None:
    n = 3 * 4096 + 5
    v = [rand(n, s) for s in range(4)]
    with DiskStore(tmp_path) as store:
        store.write_async("p", v[0])
        m0 = store.commit()
        store.write_async("p", v[1])
        m1 = store.commit()
        store.write_async("p", v[2])  # overwrites m0's slot, never m1's
        store.write_async("p", v[3])
        store.wait_all()
    assert [m0["regions"]["p"][2], m1["regions"]["p"][2]] == [0, 1]
    with DiskStore(tmp_path, manifest=m1) as store:
        dst = aligned_empty(n)
        store.read_async("p", dst).result()
        assert torch.equal(dst, v[1])
    with DiskStore(tmp_path, manifest=m0) as store:  # an older checkpoint's slot was reused: refused
        store.read_async("p", aligned_empty(n))
        with pytest.raises(HplanError, match="does not match its .*checksum"):
            store.wait("p")
    with pytest.raises(HplanError, match="schema"):
        DiskStore(tmp_path, manifest={"schema": "hplan.nvme-manifest/0", "regions": {}})
    with pytest.raises(HplanError, match="not \\[size, checksum, slot\\]"):  # a string would iterate as digits
        DiskStore(tmp_path, manifest={**m1, "regions": {"p": "123"}})
    with DiskStore(tmp_path):  # a fresh store removes the files: the manifest can no longer be resumed
        pass
    with pytest.raises(HplanError, match="p.1.region named by the manifest is missing") as exc:
        DiskStore(tmp_path, manifest=m1)
    one_line(exc)
    DiskStore(tmp_path).close(discard=True)  # and its folder
    with pytest.raises(HplanError, match="is missing, and with it the region files") as exc:
        DiskStore(tmp_path, manifest=m1)
    one_line(exc)


def test_kill_9_during_writes_then_resume_reads_the_committed_bytes(tmp_path: Path) -> None:
    """A real SIGKILL while a forked writer rewrites a region: the committed version survives, bit for bit.

    Forked rather than spawned (no second torch import); the child uses numpy and the store only, so no
    OpenMP pool inherited from the parent runs after the fork."""
    n = 8 << 20
    committed = rand(n, 1)
    expected = committed.clone()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            store = DiskStore(tmp_path)
            store.write_async("k", committed)
            (tmp_path / "m.json").write_text(json.dumps(store.commit()))
            arr = committed.numpy()
            while True:
                arr += 1
                store.write_async("k", committed).result()
                os.write(ready_w, b"r")  # after one rewrite: the kill lands in a later one
        finally:
            os._exit(1)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"r"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
    assert (tmp_path / FOLDER / "k.1.region").exists()  # the uncommitted slot the writer was rewriting
    manifest = json.loads((tmp_path / "m.json").read_text())
    with DiskStore(tmp_path, manifest=manifest) as store:  # the dead writer's lock went with it
        dst = aligned_empty(n)
        store.read_async("k", dst).result()
        assert torch.equal(dst, expected)


def test_checksum_choice_and_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with DiskStore(tmp_path) as store:
        assert store.checksum_name == "xxh3_64"
        store.write_async("c", rand(9, 1))
        manifest = store.commit()
    assert manifest["checksum"] == "xxh3_64"
    with pytest.raises(HplanError, match="leave checksum='auto'"):
        DiskStore(tmp_path, checksum="crc32", manifest=manifest)
    monkeypatch.setitem(nvme_format.CHECKSUMS, "xxh3_64", None)  # an environment without xxhash
    with DiskStore(tmp_path) as store:
        assert store.checksum_name == "crc32"
    with pytest.raises(HplanError, match="pip install xxhash") as exc:
        DiskStore(tmp_path, manifest=manifest)
    one_line(exc)
    with pytest.raises(HplanError, match="unknown checksum"):
        DiskStore(tmp_path, checksum="md5")


def test_aligned_empty() -> None:
    for n in (0, 1, 4097, 1 << 20):
        t = aligned_empty(n)
        assert t.numel() == n and t.dtype == torch.uint8 and is_aligned(t)
        assert t.untyped_storage().nbytes() == storage_bytes(n)
    assert aligned_empty(10, alignment=512).data_ptr() % 512 == 0
    with pytest.raises(HplanError):
        aligned_empty(10, alignment=3000)


def test_measure_raw_bandwidth(tmp_path: Path) -> None:
    write, read = measure_raw_bandwidth(tmp_path, 4 << 20)
    assert write > 0 and read > 0
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone
    with pytest.raises(HplanError, match="does not exist"):
        measure_raw_bandwidth(tmp_path / "absent", 1 << 20)
