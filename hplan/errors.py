"""The one exception library code raises for problems a user can fix.

Only the CLI turns it into an exit code (2); anything else that escapes is an
internal error (exit 1).

[Note: arguments in messages] A library error names the fix in the library's own terms: the Python argument
that changes it, in backticks (`gpu_bytes`, `overrides`), never a command-line flag, since a Python caller
has none. The CLI shows each such name as the flag that sets it (hplan.cli.common.cli_terms, table `FLAGS`),
so `hplan plan` says "--gpu-mem" where `make_hardware` says `gpu_bytes`; the few pieces of advice that are no
argument (an environment variable the CLI sets from a flag of its own) are translated whole (table `PHRASES`).
"""

from __future__ import annotations


class HplanError(Exception):
    """Bad input or an impossible request, explained in one line with its fix."""

    exit_code: int = 2


FLAGS: dict[str, str] = {
    "gpu_bytes": "--gpu-mem", "host_bytes": "--cpu-mem", "nvme_bytes": "--nvme", "slack_bytes": "--slack",
    "chunk_bytes": "--chunk-size", "overrides": "--set", "batch_size": "--batch-size", "seq_len": "--seq-len",
    "iters": "--iters", "device": "--device", "accumulate": "--accumulate", "max_grad_norm": "--max-grad-norm",
    "defer_updates": "--defer-updates", "precision": "--precision", "steps": "--steps",
    "checkpoint_dir": "--checkpoint", "resume": "--resume", "overwrite": "--overwrite", "nvme_dir": "--nvme-dir",
    "nproc": "--nproc", "gpus_per_node": "--gpus", "nodes": "--nodes", "factors": "--shard",
    "budget_guard": "--budget-guard", "nonfinite": "--on-nonfinite", "allocator": "--allocator",
}
"""Python argument named in a library error (see [Note: arguments in messages]) → the flag that sets it."""

PHRASES: dict[str, str] = {
    "set HPLAN_DEBUG=1 to see each rank's traceback": "rerun with `hplan --debug` to see each rank's traceback",
}
"""Library advice that is not an argument (an environment variable the CLI sets from its own flag) → the CLI's."""
