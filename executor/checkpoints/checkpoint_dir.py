"""The checkpoint directory: one folder per saved step, a manifest per folder, a pointer, a lock.

    DIR/.lock                   flock'ed by the run that owns DIR (the OS drops it when the process dies)
    DIR/latest.json             {"latest": "step-000040", "previous": ["step-000039"]}, replaced atomically
    DIR/step-000040/            the files of one checkpoint (whatever the format writes) + manifest.json
    DIR/step-000039/            the previous good one, kept so a damaged latest falls back to it

This module knows nothing of torch: it moves folders, hashes files and decides which checkpoint is good;
hplan.executor.checkpoints.checkpoint decides what goes inside a folder.

[Note: checkpoint commit] A save writes into a fresh hidden folder `.step-000041.<random>.tmp`, fsyncs every
file, writes `manifest.json` (each file's size and checksum, the global step) last, renames the folder to
`step-000041`, replaces `latest.json` (naming the new folder and the one this run resumed from or saved
before), and only then removes the folders the pointer no longer names. A folder is trusted only when its
manifest exists and every file it lists is a regular file (never read through a link or from a FIFO) with the
listed size and checksum, so a torn, truncated, replaced or bit-flipped file is refused naming it. The checksums
catch damage, not malice (they have no key): what a folder holds is read without running code
([Note: safe DCP metadata] in hplan.executor.checkpoints.dcp_index). Resume tries the pointer's folders in order
(newest first) and
nothing else, so a folder of another run (before an --overwrite run's first save) is never mixed in; a
folder renamed into place whose pointer update a kill prevented is simply not used, and goes at the next
save. Without a readable pointer, the step folders are tried newest first. A `kill -9` at any moment thus
leaves the pointer's folders intact; its temp folder (or a `.trash-*` folder, see `install`) is removed at
the next start, under the lock. Checksums use the NVMe tier's algorithms ([Note: nvme checksums]).

[Note: disk full during a save] Before writing, the free space is compared with what the state holds (or the
last checkpoint's size, whichever is larger) and a save that cannot fit is refused; a write that still fails for
space (ENOSPC or EDQUOT anywhere in the error's chain, or torch's zip writer failing with a bare RuntimeError while
the disk could not hold the rest) is named as that, with the bytes needed. Either way the temp folder is removed
and the pointer still names the previous checkpoint.

Several ranks (issue 17) fit the same layout: every rank writes its shard files into one temp folder (the
name chosen by rank 0 and broadcast), and after the format's barrier rank 0 builds the manifest over all of
them and commits, holding the lock (flock is node-local: on a shared file system across nodes only rank 0
may lock). The manifest records every file, so a missing or damaged shard of any rank is named the same way.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hplan.artifacts.io import loads_bounded
from hplan.executor.checkpoints.checkpoint_manifest import (  # re-exported: the manifest's names
    Checkpoint, file_checksum, folder_name, listed_files, verify, write_manifest)  # noqa: F401
from hplan.executor.tiers.durable import current_umask, fsync_path, lock_exclusive, read_regular, write_durably

from hplan.errors import HplanError

POINTER_SCHEMA = "hplan.checkpoint-pointer/1"
POINTER = "latest.json"
LOCK = ".lock"
KEEP = 2
"""Folders the pointer names after a save: the new one and the one it was built on (the fallback)."""
OLD_FORMAT = "state.pt"
"""The single-file checkpoint of hplan before manifests; recognised so it is never silently mixed in."""
PAUSE_ENV = "HPLAN_TEST_SAVE_PAUSE_S"
"""Tests only: seconds to sleep between the phases of a save, so a `kill -9` can be aimed inside one."""

_STEP = re.compile(r"step-(\d{6,})")
_LEFTOVER = re.compile(r"\.step-\d+\..*\.tmp|\.trash-.*|\.(latest\.json|state\.pt|model\.pt)\..*\.tmp")

Warn = Callable[[str], None]
FULL_MARGIN = 1 << 20
"""A write that fails while the disk has less than this beyond what the checkpoint still needed failed for space
([Note: disk full during a save])."""


def holds(root: Path) -> str | None:
    """What checkpoint `root` holds (of one process or many ranks), in words, or None; reads names only."""
    if not root.is_dir():
        return None
    steps = step_folders(root)
    if steps:
        return steps[0].name + (f" and {len(steps) - 1} older" if len(steps) > 1 else "")
    if (root / POINTER).exists():
        return POINTER
    return OLD_FORMAT if (root / OLD_FORMAT).exists() else None


def step_folders(root: Path) -> list[Path]:
    """Step folders, newest first (names only; nothing is verified)."""
    found = [p for p in root.iterdir() if _STEP.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


class CheckpointDir:
    """A checkpoint directory owned by this process until `close()` (see the module doc for the layout).

    `resume`: the directory must already hold a checkpoint; otherwise it must hold none unless `overwrite`
    (then this run's first save replaces them). Cheap refusals happen before anything is written; the lock is
    then taken, leftovers of a killed save removed, and the same checks repeated under the lock.
    """

    def __init__(self, directory: str | os.PathLike[str], *, resume: bool, overwrite: bool = False) -> None:
        if resume and overwrite:
            raise HplanError("`resume` continues the checkpoint and `overwrite` replaces it: pass only one")
        self.root = Path(directory)
        self.previous: list[str] = []
        """Folders this run's next save keeps as fallbacks (newest first): what it resumed from or last saved."""
        self._fd = -1
        self._check(resume, overwrite)
        self.root.mkdir(parents=True, exist_ok=True)
        self._fd = _lock(self.root)
        try:
            self._remove_leftovers()
            self._check(resume, overwrite)
        except BaseException:
            self.close()
            raise

    def _check(self, resume: bool, overwrite: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise HplanError(f"`checkpoint_dir` {self.root} is not a directory; name a folder")
        held = self.holds()
        if resume and held is None:
            where = "the folder does not exist" if not self.root.exists() else "it holds no step folder"
            raise HplanError(f"no checkpoint in {self.root} ({where}): run once with `checkpoint_dir` {self.root} "
                             "before `resume`")
        ranks = _written_by_ranks(self.root / POINTER)
        if resume and ranks:
            raise HplanError(f"checkpoint {self.root} was written by {ranks} ranks, this run has 1; resume on "
                             f"{ranks} ranks (`nproc` {ranks}) with a plan for {ranks} ranks (resharding is not "
                             "supported)")
        if resume and held == OLD_FORMAT:
            raise HplanError(f"{self.root} holds a {OLD_FORMAT} of an older hplan, which this one cannot verify; "
                             "start again with `overwrite`")
        if not resume and not overwrite and held is not None:
            raise HplanError(f"{self.root} already holds a checkpoint ({held}): pass `resume` to continue it or "
                             "`overwrite` to replace it")

    def holds(self) -> str | None:
        """What checkpoint the directory holds, in words, or None (read-only; also before the lock)."""
        return holds(self.root)

    def step_folders(self) -> list[Path]:
        """Step folders, newest first (names only; nothing is verified)."""
        return step_folders(self.root)

    # -- resume -------------------------------------------------------------------------------------------

    def find_good(self, warn: Warn) -> Checkpoint:
        """The newest checkpoint that verifies, warning about each damaged one skipped on the way.

        Candidates are the pointer's folders in its order; without a readable pointer, the step folders
        newest first. None good: one HplanError naming the directory and every problem."""
        candidates, notes = self._candidates()
        problems: list[str] = []
        for path in candidates:
            try:
                found = verify(path)
            except HplanError as exc:
                problems.append(str(exc))
                continue
            for note in notes:
                warn(note)
            for problem in problems:
                warn(f"{problem}; falling back to {found.path}")
            self.previous = [found.path.name]
            return found
        reasons = "; ".join(notes + problems) or "no step folder"
        raise HplanError(f"no good checkpoint in {self.root}: {reasons}; restore the folder from a backup or start "
                         "again with `overwrite`")

    def _candidates(self) -> tuple[list[Path], list[str]]:
        pointer = self.root / POINTER
        try:
            data = loads_bounded(read_regular(pointer))
            names = [data["latest"], *data["previous"]]
            if data.get("schema") != POINTER_SCHEMA or not all(isinstance(n, str) and _STEP.fullmatch(n)
                                                               for n in names):
                raise ValueError("unexpected content")
        except FileNotFoundError:
            return self.step_folders(), []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else type(exc).__name__
            return self.step_folders(), [f"{pointer} is damaged ({why}); trying the step folders newest first"]
        return [self.root / n for n in names], []

    # -- save ---------------------------------------------------------------------------------------------

    def save(self, global_step: int, write: Callable[[Path], dict[str, Any]], *, need_bytes: int = 0) -> Path:
        """Commit one checkpoint: `write(folder)` fills a temp folder and returns the `info` to record;
        see [Note: checkpoint commit] for the order of the rest. Returns the new folder. `need_bytes` (what the
        state holds) is checked against the free space first ([Note: disk full during a save])."""
        if self._fd < 0:
            raise HplanError(f"the checkpoint directory {self.root} was closed; open it again to save")
        name = folder_name(global_step)
        need = max(need_bytes, self._last_size())
        if need > (free := free_bytes(self.root)):
            raise self._full(need, free)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=self.root))
        except OSError as exc:
            raise self._failed(exc, need, 0) from None
        try:
            info = write(tmp)
            tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes 0700; a checkpoint gets the usual permissions
            pause()
            write_manifest(tmp, global_step=global_step, info=info)
            pause()
            final = install(tmp, self.root / name)
        except BaseException as exc:
            written, free = tree_bytes(tmp), free_bytes(self.root)  # as the write left it
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception):
                raise self._failed(exc, need, written, free) from None
            raise
        pause()
        keep = [name, *[n for n in self.previous if n != name]][:KEEP]
        try:
            write_durably(self.root / POINTER,
                          json.dumps({"schema": POINTER_SCHEMA, "latest": keep[0], "previous": keep[1:]}) + "\n")
        except OSError as exc:
            if name not in self.previous:  # complete but named by no pointer: not left behind for a later run
                shutil.rmtree(final, ignore_errors=True)
            raise self._failed(exc, need, 0) from None
        self.previous = keep
        pause()
        self._remove_unlisted(set(keep))
        return final

    def _last_size(self) -> int:
        """Bytes of the newest checkpoint this run knows of (0 when none): the next one is about as large."""
        return tree_bytes(self.root / self.previous[0]) if self.previous else 0

    def _full(self, need: int, free: int, *, at_least: bool = False, why: str = "not enough free space") -> HplanError:
        latest = f"the previous checkpoint there ({self.previous[0]}) is intact and stays the latest" \
            if self.previous else "no checkpoint of this run was saved"
        needs = f"{'more than' if at_least else 'about'} {format_bytes(need)}"
        return HplanError(f"cannot save a checkpoint in {self.root}: {why} — it needs {needs} and the disk has "
                          f"{format_bytes(free)} free; {latest}; free space or pass another `checkpoint_dir`, then "
                          "`resume`")

    def _failed(self, exc: Exception, need: int, written: int = 0, free: int | None = None) -> Exception:
        """The error to raise for a write that failed: disk full (named with the bytes needed) when the error says
        so or the disk (`free` as the write left it) could not hold the rest, any other OSError as one line,
        anything else as it is."""
        free = free_bytes(self.root) if free is None else free
        if (full := _says_full(exc)) is not None:
            return self._full(need, free_bytes(self.root), why=full)
        if not isinstance(exc, (OSError, HplanError)) and free < max(need - written, 0) + FULL_MARGIN:
            more = written + free > need  # the estimate was short: it needs more than it had
            return self._full(written + free if more else need, free_bytes(self.root), at_least=more)
        return _save_error(self.root, exc) if isinstance(exc, OSError) else exc

    def _remove_unlisted(self, keep: set[str]) -> None:
        """After a commit: step folders the pointer does not name (older ones, another run's after
        --overwrite) and an old-format state file."""
        for path in self.step_folders():
            if path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)
        (self.root / OLD_FORMAT).unlink(missing_ok=True)

    def _remove_leftovers(self) -> None:
        remove_leftovers(self.root)

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def saved_step(directory: str | os.PathLike[str]) -> int:
    """The global step the pointer names (0 when there is none); read-only, nothing verified — for progress
    displays and tests, never for deciding what to resume from."""
    try:
        data = loads_bounded(read_regular(Path(directory) / POINTER))
        return int(data["latest"][5:])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


# -- helpers ------------------------------------------------------------------------------------------------

def _written_by_ranks(pointer: Path) -> int:
    """The world size of a many-rank checkpoint's pointer (hplan.executor.ranks.dist_checkpoint), else 0."""
    try:
        data = loads_bounded(read_regular(pointer))
    except (OSError, ValueError):
        return 0
    world = data.get("world_size") if isinstance(data, dict) and data.get("schema", "").startswith(
        "hplan.dist-checkpoint/") else None
    return world if type(world) is int and world > 1 else 0


def install(tmp: Path, final: Path) -> Path:
    """Rename the finished temp folder onto `final`. A folder already there (a damaged one being redone
    after a fallback, or another run's after --overwrite) is renamed aside first — a rename cannot replace
    a non-empty folder — and removed after; a kill in between leaves a `.trash-*` folder for the next start."""
    trash = None
    if final.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".trash-{final.name}.", dir=final.parent))
        os.rename(final, trash / final.name)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 2**63  # unknown: the write itself will tell
    return st.f_bavail * st.f_frsize


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files directly in folder `path` (0 when it is gone); links are not followed."""
    total = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def _says_full(exc: BaseException) -> str | None:
    """The OS's words when `exc` or an error it was raised from is ENOSPC or EDQUOT, else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return cur.strerror or os.strerror(cur.errno)
        cur = cur.__cause__ or cur.__context__
    return None


def format_bytes(n: int) -> str:
    return f"{n:,} bytes" if n < 10**6 else f"{n / 1e6:,.1f} MB ({n:,} bytes)"


def _save_error(root: Path, exc: OSError) -> HplanError:
    """A save that the file system refused (disk full, permissions): the previous checkpoint is untouched."""
    return HplanError(f"cannot save a checkpoint in {root}: {exc.strerror or exc} — the previous checkpoint there is "
                      "intact; free space or pass another `checkpoint_dir`, then `resume`")


def remove_leftovers(root: Path) -> None:
    """Temp and trash folders of saves killed half way (ours by name; nothing else is touched). Call under the
    lock: one process or many ranks, whoever holds DIR/.lock owns what is in DIR."""
    for path in root.iterdir():
        if _LEFTOVER.fullmatch(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _lock(root: Path) -> int:
    """flock DIR/.lock, or say who holds it (hplan.executor.tiers.durable.lock_exclusive)."""
    def cannot_create(exc: OSError) -> HplanError:
        return HplanError(f"cannot create the lock file {root / LOCK}: {exc.strerror}; check the folder's "
                          "permissions")

    return lock_exclusive(root / LOCK, cannot_create=cannot_create,
                          busy=f"checkpoint directory {root} is in use by another hplan run (it holds "
                               f"{root / LOCK}); wait for it to finish or pass another `checkpoint_dir`")


def lock(root: Path) -> int:
    """The one lock of a checkpoint folder, taken by a one-process run and by a many-rank run's launcher (or rank 0
    under torchrun) alike; the returned fd's closing releases it."""
    return _lock(root)


def pause() -> None:
    """Tests only: sleep PAUSE_ENV seconds between the phases of a save (many-rank saves too)."""
    seconds = os.environ.get(PAUSE_ENV)
    if seconds:
        time.sleep(float(seconds))
