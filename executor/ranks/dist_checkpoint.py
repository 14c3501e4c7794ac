"""Sharded checkpoints of a many-rank run: each rank writes its own shards with torch.distributed.checkpoint (DCP).

    DIR/latest.json              {"schema": ..., "latest": "step-000010", "world_size": 2, "shard": {...}, ...}
    DIR/step-000010/             DCP's `.metadata` + one `__<rank>_0.distcp` per rank + `dcp.json` + manifest.json

What a rank saves is what it holds: its shard of every parameter, master and optimizer-state region (current
contents, wherever they are), its per-parameter optimizer step counters, its RNG state, and the global step and
LR scheduler (the same on every rank). Gradients are dead between iterations and not saved. Keys carry the rank
(`rank1/region/12`), so DCP never merges two ranks' different shards as one replicated tensor.
Commit order, as one process's ([Note: checkpoint commit] in hplan.executor.checkpoints.checkpoint_dir): every rank
checks
its state is finite (all agree before anything is written: a non-finite value on any rank stops every rank with
the same message), then writes into a fresh `DIR/.step-000010.<random>.tmp` that rank 0 made and named to all
(DCP's save is collective and ends with a barrier); rank 0 writes the manifest over every rank's files, renames
the folder to `step-000010`, replaces `latest.json` atomically and durably, then removes the step folders but
the new one and its fallback. The fallback is the folder this run resumed from (not the
pointer's latest, which may be the damaged one it skipped) or saved last; a fresh run (`--overwrite`) keeps
none of the earlier run's folders. A kill before the pointer is replaced leaves the previous checkpoint as latest.
Resume needs the same world size and shard factors: a rank's keys are its shards under the plan's layout
([Note: shard layout] in hplan.artifacts.shard), and another world size cuts chunks into other pieces. DCP could
reshard if every region were saved as a DTensor over the logical chunk; hplan refuses instead, in one line
(`check_resumable` chooses the folder every rank then loads). A run that does not resume refuses a folder holding
a checkpoint unless told to overwrite it (`check_fresh`). Both run under the folder's lock, `claim`: the same
DIR/.lock a one-process run takes, held by the launching process for spawned ranks and by rank 0 under torchrun,
from before any rank writes until the run ends, so a one-process run and a many-rank run never share a folder. Each step folder gets
the one-process checkpoints' manifest (hplan.executor.checkpoints.checkpoint_dir.write_manifest); what leaves hplan is
`model.pt`, the final weights by name (`save_weights`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hplan.artifacts.io import loads_bounded
from hplan.artifacts import Plan, atomic_path
from hplan.errors import HplanError
from hplan.executor.checkpoints.checkpoint_dir import POINTER, folder_name, holds, write_manifest
from hplan.executor.tiers.durable import read_regular

SCHEMA = "hplan.dist-checkpoint/1"
WEIGHTS = "model.pt"
"""The run's final weights by parameter name, beside the step folders: what leaves hplan (see save_weights)."""
WEIGHTS_FORMAT = "hplan.final-weights/1"


def read_pointer(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The pointer of a sharded checkpoint directory, or a one-line refusal."""
    path = Path(directory) / POINTER
    if not path.is_file():
        one = holds(Path(directory)) is not None
        what = " (it holds a one-process checkpoint: resume it in one process, without `nproc`)" if one else ""
        raise HplanError(f"no sharded checkpoint in {directory}{what}; run once with `checkpoint_dir` {directory} "
                         "first")
    try:
        info = loads_bounded(read_regular(path))
    except (OSError, ValueError) as exc:
        raise HplanError(f"{path} cannot be read ({type(exc).__name__}); the checkpoint is damaged") from None
    if not isinstance(info, dict) or info.get("schema") != SCHEMA:
        schema = info.get("schema") if isinstance(info, dict) else None
        raise HplanError(f"{path} is not an hplan sharded checkpoint (schema {schema!r})")
    return info


def check_resumable(directory: str | os.PathLike[str], plan: Plan, world: int) -> dict[str, Any]:
    """Refuse, before any rank starts, a checkpoint of another world size, factors or model, or one whose metadata
    is not hplan's JSON index (hplan.executor.checkpoints.dcp_index); returns the pointer with the folder to resume from."""
    info = read_pointer(directory)
    _check_pointer(info, directory, plan, world)
    return choose_folder(directory, info)


def _check_pointer(info: dict[str, Any], directory: str | os.PathLike[str], plan: Plan, world: int) -> None:
    """What the pointer says about the run that wrote it: the same world size, shard factors and model."""
    if info.get("world_size") != world:
        raise HplanError(f"checkpoint {directory} was written by {info.get('world_size')} ranks, this run has {world}; "
                         f"resume on that many ranks (`nproc` {info.get('world_size')}; resharding to another world "
                         "size is not supported)")
    shard = plan.summary.shard or (plan.sharding.factors if plan.sharding else {})
    if info.get("shard") != shard:
        raise HplanError(f"checkpoint {directory} holds shards for factors {info.get('shard')}, the plan uses {shard}; "
                         "resume with a plan of the same factors (`factors`)")
    mine = {k: plan.fingerprint.get(k) for k in ("params_sha", "precision")}
    if info.get("fingerprint") != mine:
        raise HplanError(f"checkpoint {directory} was written for another model or precision; resume with the same "
                         "ones")


def choose_folder(directory: str | os.PathLike[str], info: dict[str, Any]) -> dict[str, Any]:
    """The pointer with `latest` set to the newest step folder whose manifest and every file check out (each
    file's checksum, as one-process checkpoints do), and `warning` saying so when that is the previous one."""
    from hplan.executor.checkpoints.checkpoint_dir import verify

    from hplan.executor.checkpoints.dcp_index import read_index

    problems = []
    for i, name in enumerate(n for n in (info.get("latest"), info.get("previous")) if isinstance(n, str)):
        try:
            found = verify(Path(directory) / name)
        except HplanError as exc:
            problems.append(str(exc))
            continue
        read_index(found.path, found.files)  # verified bytes that are not hplan's index: refused, no fallback
        warning = (f"checkpoint {directory}: {problems[0]}; resuming from the previous step folder {name}"
                   if i else None)
        return {**info, "latest": name, "warning": warning}
    raise HplanError(f"no good checkpoint in {directory}: {'; '.join(problems) or 'the pointer names no folder'}; "
                     "restore the folder from a backup or start again without `resume`")


def _state(run: Any, *, global_step: int, scheduler: Any) -> dict[str, Any]:
    """This rank's saved state (see the module docstring)."""
    import torch
    from hplan.executor.checkpoints.state_json import pack

    store, key = run.store, f"rank{run.rank}"
    regions = {}
    for rid, slot in store.slots.items():
        if slot.region.kind != "grad":
            regions[str(rid)] = store.typed(rid, host=not slot.state.on_fast_tier).detach().clone()
    steps = {}
    for update in run.updates.values():
        for n in update.names:
            if n in update.started and "step" in update.states[n]:
                steps[n] = float(update.states[n]["step"])
    extra = {"global_step": global_step, "steps": steps,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "rng": torch.get_rng_state()}
    return {key: {"regions": regions, "extra": pack(extra)}}


def check_fresh(directory: str | os.PathLike[str], *, overwrite: bool) -> None:
    """Before any rank starts, a run that does not resume: refuse a directory that holds a checkpoint (of many
    ranks or one process) unless `overwrite`, so another run's state is never replaced by accident."""
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise HplanError(f"`checkpoint_dir` {root} is not a directory; name a folder")
    held = None if overwrite else holds(root)
    if held is not None:
        raise HplanError(f"{root} already holds a checkpoint ({held}): pass `resume` to continue it or `overwrite` "
                         "to replace it")


@dataclass(kw_only=True, slots=True)
class Claim:
    """This run's hold on its checkpoint folder (see `claim`); `close()` releases the lock."""

    root: Path
    fd: int
    resume_from: str | None
    """The step folder every rank loads (chosen and verified under the lock), or None for a fresh run."""
    warning: str | None
    """Said once when the newest folder was damaged and the previous one is used."""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def claim(directory: str | os.PathLike[str], plan: Plan, world: int, *, resume: bool, overwrite: bool) -> Claim:
    """Before any rank writes: take DIR/.lock (hplan.executor.checkpoints.checkpoint_dir.lock, the one a one-process run
    takes), remove leftovers of killed saves, then — under the lock — refuse what the run could not finish:
    nothing to resume (or another world size, factors or model), a checkpoint a fresh run would replace without
    --overwrite, and a `model.pt` that is not a file this run may replace. Cheap refusals come first, before the
    folder is created."""
    from hplan.executor.checkpoints.checkpoint_dir import lock, remove_leftovers

    root = Path(directory)
    if resume and overwrite:
        raise HplanError("`resume` continues the checkpoint and `overwrite` replaces it: pass only one")
    _check_before_lock(root, plan, world, resume=resume, overwrite=overwrite)
    root.mkdir(parents=True, exist_ok=True)
    fd = lock(root)
    try:
        remove_leftovers(root)
        _check_before_lock(root, plan, world, resume=resume, overwrite=overwrite)  # again: it may have changed
        chosen = check_resumable(root, plan, world) if resume else None
    except BaseException:
        os.close(fd)
        raise
    return Claim(root=root, fd=fd, resume_from=chosen["latest"] if chosen else None,
                 warning=chosen.get("warning") if chosen else None)


def _check_before_lock(root: Path, plan: Plan, world: int, *, resume: bool, overwrite: bool) -> None:
    """The checks that read names and the pointer only: a pointer of this world, factors and model to resume
    from, or no checkpoint a fresh run would replace unasked; `model.pt` absent or a regular file (and absent for
    a fresh run without --overwrite)."""
    if resume:
        _check_pointer(read_pointer(root), root, plan, world)
    else:
        check_fresh(root, overwrite=overwrite)
    weights = root / WEIGHTS
    kind = _not_a_file(weights)
    if kind is not None:
        raise HplanError(f"{weights} is {kind}, where this run writes its final weights; move it away or name "
                         "another `checkpoint_dir`")
    if not resume and not overwrite and weights.exists():
        raise HplanError(f"{weights} holds the final weights of an earlier run: pass `overwrite` to replace them or "
                         "name another `checkpoint_dir`")


def _not_a_file(path: Path) -> str | None:
    """What is at `path` when it is something this run may not replace (anything but a regular file), or None."""
    import stat

    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    return {stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO",
            stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(mode), "not a regular file")


def save(directory: str | os.PathLike[str], run: Any, *, global_step: int, scheduler: Any = None,
         fallback: str | None = None) -> None:
    """Collective: every rank writes its shards; rank 0 commits the folder and the pointer, naming `fallback`
    (the folder this run resumed from or saved last; None for a fresh run's first save) as the previous one.
    Call it under the folder's lock (`claim`) when other runs may use the folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from hplan.executor.checkpoints.checkpoint_dir import install, pause
    from hplan.executor.checkpoints.dcp_index import compact, write_index
    from hplan.executor.tiers.durable import current_umask, write_durably

    root = Path(directory)
    state = _state(run, global_step=global_step, scheduler=scheduler)
    _agree_finite(run, state, global_step=global_step, root=root)
    name = [None]
    if run.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        name = [Path(tempfile.mkdtemp(prefix=f".{folder_name(global_step)}.", suffix=".tmp", dir=root)).name]
    dist.broadcast_object_list(name, src=0)
    tmp = root / name[0]
    metadata = dcp.save(compact(state), checkpoint_id=str(tmp))  # the global metadata, on every rank
    dist.barrier()
    if run.rank == 0:
        write_index(tmp, metadata)  # DCP's metadata again, as JSON: what a resume reads
        pause()  # tests only (PAUSE_ENV): a signal or kill aimed inside a save
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes 0700; a checkpoint gets the usual permissions
        write_manifest(tmp, global_step=global_step, info={"world_size": run.world})  # last: checksums of all
        final = install(tmp, root / folder_name(global_step))
        previous = fallback if fallback != final.name else None
        plan = run.plan
        info = {"schema": SCHEMA, "latest": final.name, "previous": previous, "global_step": global_step,
                "world_size": run.world, "shard": plan.sharding.factors,
                "fingerprint": {k: plan.fingerprint.get(k) for k in ("params_sha", "precision")}}
        write_durably(root / POINTER, json.dumps(info, indent=2) + "\n")
        if fallback is None:  # a fresh run: the weights of the run it replaces are not this run's
            (root / WEIGHTS).unlink(missing_ok=True)
        for old in root.glob("step-*"):
            if old.name not in (final.name, previous) and old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _agree_finite(run: Any, state: dict[str, Any], *, global_step: int, root: Path) -> None:
    """[Note: finite checkpoints] on ranks: each rank checks the weights, masters and optimizer state it is about to
    save (its pieces of the trainable parameters: padding is never updated), then all agree ([Note: ranks stop
    together] in hplan.executor.ranks.dist_comm), so a non-finite value anywhere stops every rank before anything is
    written, with the finding rank's words."""
    from hplan.executor.ranks.dist_comm import stop_together

    problem = _nonfinite(run)
    if problem is not None:
        problem = (f"after step {global_step - 1} the {problem} on rank {run.rank} is not finite (inf or NaN); not "
                   f"saved — the latest checkpoint in {root} holds the state before this step")
    stop_together(problem, rank=run.rank, world=run.world, device=run.tier.device)


def _nonfinite(run: Any) -> str | None:
    """What of this rank's weights, masters and optimizer state holds an inf or NaN first, in words, or None."""
    import torch

    store = run.store
    for slot in store.slots.values():
        kind = slot.region.kind
        if kind == "grad":
            continue
        views = slot.fast_views if slot.state.on_fast_tier else slot.host_views
        for key, t in views.items():
            if t.is_floating_point() and t.numel() and not all(bool(torch.isfinite(v)) for v in torch.aminmax(t)):
                name, what = (key, {"param": "weight", "master": "fp32 master"}[kind]) if isinstance(key, str) else \
                    (key[0], f"optimizer state {key[1]}")
                return f"{what} {name}"
    return None


def save_weights(directory: str | os.PathLike[str], model: Any, *, global_step: int) -> Path:
    """Rank 0, after the run's block (every parameter holds its full value): `DIR/model.pt`, a plain
    `torch.save` of {"model": model.state_dict() on the CPU, "global_step", "format"}, written atomically.

    The step folders hold each rank's plan regions, which only hplan (same world size and factors) reads back;
    this file is the run's result in the model's own terms, for `model.load_state_dict(torch.load(f)["model"])`
    without hplan. Optimizer state stays sharded in the step folders."""
    import torch

    path = Path(directory) / WEIGHTS
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        torch.save({"format": WEIGHTS_FORMAT, "global_step": global_step, "model": weights}, tmp)
    return path


def load(directory: str | os.PathLike[str], run: Any, folder: str | None = None) -> dict[str, Any]:
    """Collective: read this rank's shards of step folder `folder` (the one `check_resumable` chose before the
    ranks started, so all agree; None: choose it here) into the run's region host copies and step counters
    (call from DistRun's on_setup, before the initial fetches); returns global step and scheduler."""
    import torch
    import torch.distributed.checkpoint as dcp

    if folder is None:
        folder = check_resumable(directory, run.plan, run.world)["latest"]

    from hplan.executor.checkpoints.checkpoint_dir import listed_files
    from hplan.executor.checkpoints.dcp_index import read_index
    from hplan.executor.checkpoints.dcp_safe import SafePlanner, SafeReader
    from hplan.executor.checkpoints.state_json import unpack

    store, key = run.store, f"rank{run.rank}"
    path = Path(directory) / folder
    index = read_index(path, listed_files(path))  # never DCP's pickle.load ([Note: safe DCP metadata])
    metadata = index.metadata
    template = {key: {"regions": {str(rid): store.typed(rid, host=True).clone()
                                  for rid, slot in store.slots.items() if slot.region.kind != "grad"},
                      "extra": torch.empty(_extra_size(path, metadata, key), dtype=torch.uint8)}}
    try:
        dcp.load(template, storage_reader=SafeReader(path, index), planner=SafePlanner())
    except dcp.api.CheckpointException as exc:
        from hplan.executor.checkpoints.checkpoint import _unwrap

        error = _unwrap(exc)
        if isinstance(error, HplanError):
            raise error from None
        raise HplanError(f"checkpoint {path} passed its checksums but this rank cannot read its shards "
                         f"({type(error).__name__}: {' '.join(str(error).split())[:200]}); resume with the plan and "
                         "world size it was written for") from None
    with torch.no_grad():
        for rid, value in template[key]["regions"].items():
            store.typed(int(rid), host=True).copy_(value)
    extra = unpack(template[key]["extra"], path)
    if not isinstance(extra, dict) or not {"global_step", "steps", "scheduler", "rng"} <= set(extra):
        raise HplanError(f"checkpoint {path} has no training state record; restore it or start again")
    for update in run.updates.values():
        for n in update.names:
            if n in extra["steps"]:
                state = update.states[n]  # the dict the update's optimizer steps with: changed in place
                state["step"] = torch.tensor(extra["steps"][n], dtype=torch.float32,
                                             device=state["step"].device if "step" in state else "cpu")
                update.started.add(n)
    torch.set_rng_state(extra["rng"])
    return {"global_step": int(extra["global_step"]), "scheduler": extra["scheduler"], "path": str(path)}


def _extra_size(folder: Path, metadata: Any, key: str) -> int:
    """Bytes of the packed extras this rank saved, from the (checked) index."""
    entry = metadata.state_dict_metadata.get(f"{key}.extra")
    if entry is None or len(entry.size) != 1:
        raise HplanError(f"checkpoint {folder} has no shards for {key}; it was written by another world size")
    return int(entry.size[0])
