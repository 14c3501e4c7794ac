"""DiskStore among hostile names in its directory (issue 22): nothing is written through, opened blocking or deleted
that the store did not create; see [Note: nvme ownership] in executor/tiers/nvme_folder.py.

Everything runs in pytest tmp dirs on the real disk.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from hplan.errors import HplanError
from hplan.executor.tiers import birth
from hplan.executor.tiers.nvme import DiskStore, aligned_empty
from hplan.executor.tiers.nvme_folder import FOLDER, RECORD
from nvme_regions import one_line, rand, region_files


def outside(tmp_path: Path) -> Path:
    """A user's file outside the store's directory, which a planted link points at."""
    target = tmp_path / "outside" / "precious.txt"
    target.parent.mkdir()
    target.write_bytes(b"the user's data\n")
    return target


def no_hang(seconds: int = 30) -> None:
    """Fail, rather than hang the suite, if a FIFO is ever opened blocking."""
    def hung(signum: int, frame: object) -> None:
        raise TimeoutError("the store blocked on a FIFO")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)


@pytest.fixture
def nv(tmp_path: Path) -> Path:
    d = tmp_path / "nv"
    d.mkdir()
    yield d
    signal.alarm(0)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_symlink_or_fifo_at_the_lock_is_refused_and_nothing_is_written(tmp_path: Path, nv: Path, kind: str) -> None:
    target = outside(tmp_path)
    lock = nv / ".hplan-nvme.lock"
    if kind == "symlink":
        lock.symlink_to(target)
    else:
        os.mkfifo(lock)
    no_hang()
    with pytest.raises(HplanError, match="symbolic link" if kind == "symlink" else "not a regular file") as exc:
        DiskStore(nv)
    assert str(lock) in one_line(exc)
    assert target.read_bytes() == b"the user's data\n" and sorted(p.name for p in nv.iterdir()) == [lock.name]


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_something_else_at_the_stores_folder_name_is_refused(tmp_path: Path, nv: Path, kind: str) -> None:
    target = outside(tmp_path)
    if kind == "symlink":
        (nv / FOLDER).symlink_to(target.parent, target_is_directory=True)
    else:
        (nv / FOLDER).write_bytes(b"x")
    with pytest.raises(HplanError, match="is a symbolic link, not a folder" if kind == "symlink"
                       else "is a regular file, not a folder") as exc:
        DiskStore(nv)
    one_line(exc)
    assert sorted(p.name for p in target.parent.iterdir()) == ["precious.txt"]
    assert target.read_bytes() == b"the user's data\n" and sorted(p.name for p in nv.iterdir()) == [FOLDER]


def test_user_files_at_region_names_in_the_directory_are_never_touched(tmp_path: Path, nv: Path) -> None:
    """The plan itself under a region's name, a symlink and a FIFO at others: the store works beside them."""
    target = outside(tmp_path)
    (nv / "k.0.region").write_bytes(b'{"schema": "hplan.plan/2"}')
    (nv / "k.1.region").symlink_to(target)
    os.mkfifo(nv / "j.0.region")
    (nv / ".hplan-nvme-probe").symlink_to(target)
    no_hang()
    with DiskStore(nv) as store:
        for key in ("k", "j"):
            store.write_async(key, rand(5000, 1))
            store.commit()
            store.write_async(key, rand(5000, 2))
        store.wait_all()
        store.close(discard=True)
    assert (nv / "k.0.region").read_bytes() == b'{"schema": "hplan.plan/2"}'
    assert target.read_bytes() == b"the user's data\n"
    assert sorted(p.name for p in nv.iterdir()) == [".hplan-nvme-probe", "j.0.region", "k.0.region", "k.1.region"]


@pytest.mark.parametrize("swap", ["symlink", "hardlink", "fifo", "file"])
def test_a_region_file_swapped_behind_the_store_is_never_written_through(tmp_path: Path, nv: Path,
                                                                         swap: str) -> None:
    target = outside(tmp_path)
    no_hang()
    with DiskStore(nv) as store:
        store.write_async("s", rand(8192, 1)).result()
        victim = nv / FOLDER / "s.0.region"
        os.link(victim, tmp_path / "kept")  # its inode stays in use, so the new file cannot get it
        victim.unlink()
        if swap == "symlink":
            victim.symlink_to(target)
        elif swap == "hardlink":
            os.link(target, victim)
        elif swap == "fifo":
            os.mkfifo(victim)
        else:
            victim.write_bytes(b"someone else's file")
        store.write_async("s", rand(8192, 2))
        with pytest.raises(HplanError, match="was replaced since hplan wrote it") as exc:
            store.wait("s")
        assert str(victim) in one_line(exc)
        store.close(discard=True)
    assert target.read_bytes() == b"the user's data\n"
    assert victim.is_symlink() or victim.exists()  # not ours: not deleted either
    assert [p.name for p in (nv / FOLDER).iterdir()] == [victim.name]


def test_leftovers_are_removed_only_as_far_as_the_record_proves(tmp_path: Path, nv: Path) -> None:
    """What a store left (closed keeping its files, or killed) goes at the next fresh start; a user's file or link
    placed in its folder stays, and the start is refused naming it, until it is moved out."""
    target = outside(tmp_path)
    with DiskStore(nv) as store:
        for key in ("a", "b"):
            store.write_async(key, rand(4096 + 7, 3))
        store.commit()
    folder = nv / FOLDER
    assert region_files(nv) == ["a.0.region", "b.0.region"]
    (folder / "a.0.region").unlink()
    (folder / "a.0.region").write_bytes(b"a user's file at a name the record lists")  # another inode
    (folder / "c.0.region").symlink_to(target)
    with pytest.raises(HplanError, match="was not written by hplan") as exc:
        DiskStore(nv)
    assert "a.0.region" in one_line(exc)
    assert sorted(p.name for p in folder.iterdir()) == ["a.0.region", "c.0.region"]  # b.0 (hplan's) is gone
    assert (folder / "a.0.region").read_bytes() == b"a user's file at a name the record lists"
    assert target.read_bytes() == b"the user's data\n"
    for name in ("a.0.region", "c.0.region"):
        (folder / name).unlink()
    with DiskStore(nv) as store:  # an empty folder without a record is an interrupted setup: removed
        store.write_async("a", rand(10, 1)).result()
    with DiskStore(nv):
        assert region_files(nv) == []


def _with_births(folder: Path, shift: int) -> None:
    """Rewrite the record's `= NAME INODE BIRTH` lines with BIRTH + shift (a file born at another time)."""
    lines = (folder / RECORD).read_text().splitlines()
    out = []
    for line in lines:
        parts = line.split(" ")
        if parts[0] == "=" and len(parts) == 4:
            parts[3] = str(int(parts[3]) + shift)
        out.append(" ".join(parts))
    (folder / RECORD).write_text("\n".join(out) + "\n")


@pytest.mark.skipif(birth.of_name(os.open("/", os.O_RDONLY), "tmp", os.stat("/tmp").st_ino) is None,
                    reason="no birth times on this system (statx)")
def test_a_new_file_at_a_reused_inode_is_not_taken_for_hplans(nv: Path) -> None:
    """ext4 hands a freed inode number to the next file at once: a user's file there has hplan's recorded inode
    but another birth time, so a fresh store neither deletes it nor reads it as its own, and names it."""
    with DiskStore(nv) as store:
        store.write_async("a", rand(4096 + 7, 3))
        store.commit()
    folder = nv / FOLDER
    assert len((folder / RECORD).read_text().splitlines()[-1].split(" ")) == 4  # `= NAME INODE BIRTH`
    data = (folder / "a.0.region").read_bytes()
    _with_births(folder, 1)  # what the record says no longer matches the file at that inode
    with pytest.raises(HplanError, match="was not written by hplan") as exc:
        DiskStore(nv)
    assert "a.0.region" in one_line(exc)
    assert region_files(nv) == ["a.0.region"] and (folder / "a.0.region").read_bytes() == data


def test_a_record_from_before_births_still_cleans_up_by_inode(nv: Path) -> None:
    with DiskStore(nv) as store:
        store.write_async("a", rand(100, 4))
        store.commit()
    folder = nv / FOLDER
    lines = [" ".join(line.split(" ")[:3]) for line in (folder / RECORD).read_text().splitlines()[1:]]
    (folder / RECORD).write_text("\n".join(["hplan.nvme-owner/1", *lines]) + "\n")
    with DiskStore(nv):
        assert region_files(nv) == []


@pytest.mark.parametrize("record", [b"not hplan\n", b"hplan.nvme-owner/1\n= ../../etc/passwd 5\n",
                                    b"hplan.nvme-owner/1\n" + b"+ x.0.region\n" * 10])
def test_a_record_hplan_did_not_write_removes_nothing(nv: Path, record: bytes) -> None:
    folder = nv / FOLDER
    folder.mkdir()
    (folder / RECORD).write_bytes(record)
    (folder / "x.0.region").write_bytes(b"data")  # not empty: an announced name alone proves nothing
    with pytest.raises(HplanError, match="not an hplan ownership record|was not written by hplan") as exc:
        DiskStore(nv)
    one_line(exc)
    assert (folder / "x.0.region").read_bytes() == b"data"


def test_a_symlinked_directory_is_resolved_once(tmp_path: Path) -> None:
    """--nvme-dir may be a symlink (resolved when the store opens); re-pointing it later redirects nothing: the
    store keeps using the folder it opened."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    link = tmp_path / "nvme"
    link.symlink_to(first, target_is_directory=True)
    with DiskStore(link) as store:
        assert store.directory == first
        store.write_async("a", rand(5000, 1)).result()
        link.unlink()
        link.symlink_to(second, target_is_directory=True)
        store.write_async("b", rand(5000, 2)).result()
        dst = aligned_empty(5000)
        store.read_async("a", dst).result()
        assert torch.equal(dst, rand(5000, 1))
        assert region_files(first) == ["a.0.region", "b.0.region"] and list(second.iterdir()) == []
        store.close(discard=True)
    assert list(first.iterdir()) == []
