"""Bad input to many ranks (issue 17) and the disk tier (issue 16), and names planted in --nvme-dir or
--checkpoint: one line, exit 2, nothing followed, opened blocking or deleted (tests/bad_input_table.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bad_input_table import (  # noqa: F401 (fixtures, used by name)
    NV, P, artifacts, both, check_row, fifo, folder, _host_peak_huge, link, nvme_plan, _one_click_command,
    _read_dropped, _release_locks, Row, sharded_checkpoint, text, two_rank_plan,
)

ROWS: list[Row] = [
    # many ranks (issue 17)
    Row("plan_gpus_not_divisible_by_shard", "plan {T} --gpu-mem 1GB --gpus 8 --shard P=1,G=3,OS=3 -o {D}/p.json"),
    Row("plan_shard_params_inside_grads", "plan {T} --gpu-mem 1GB --gpus 8 --shard P=2,G=4,OS=8 -o {D}/p.json"),
    Row("plan_shard_factor_missing", "plan {T} --gpu-mem 1GB --gpus 2 --shard P=1,G=2 -o {D}/p.json"),
    Row("plan_shard_more_than_ranks", "plan {T} --gpu-mem 1GB --gpus 2 --shard P=4,G=4,OS=4 -o {D}/p.json"),
    Row("plan_gpus_zero", "plan {T} --gpu-mem 1GB --gpus 0 -o {D}/p.json"),
    Row("plan_inter_gbps_negative", "plan {T} --gpu-mem 1GB --gpus 2 --inter-gbps -3 -o {D}/p.json"),
    Row("plan_network_unknown", "plan {T} --gpu-mem 1GB --gpus 2 --network infiniband -o {D}/p.json"),
    Row("plan_latency_negative", "plan {T} --gpu-mem 1GB --gpus 2 --inter-latency-us -1 -o {D}/p.json"),
    Row("plan_collectives_unknown", "plan {T} --gpu-mem 1GB --gpus 2 --collectives mesh -o {D}/p.json"),
    Row("plan_many_ranks_with_compare", "plan {T} --gpu-mem 1GB --gpus 2 --compare -o {D}/p.json"),
    Row("run_plan_for_another_world_size", "run {W} --plan {D}/p2.json --steps 2 --nproc 3", two_rank_plan("p2.json")),
    Row("run_many_rank_plan_without_nproc", "run {W} --plan {D}/p2.json --steps 2", two_rank_plan("p2.json")),
    Row("run_one_rank_plan_with_nproc", "run {W} " + P + " --nproc 2"),
    Row("run_nproc_zero", "run {W} --plan {D}/p2.json --steps 2 --nproc 0", two_rank_plan("p2.json")),
    Row("run_many_ranks_with_metrics", "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --metrics {D}/m.parquet",
        two_rank_plan("p2.json")),
    Row("run_checkpoint_from_another_world_size",
        "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --resume --checkpoint {D}/ck",
        both(two_rank_plan("p2.json"), sharded_checkpoint("ck", world=4))),
    Row("run_one_rank_plan_resuming_a_sharded_checkpoint", "run {W} " + P + " --resume --checkpoint {D}/ck",
        sharded_checkpoint("ck", world=2)),
    Row("run_resume_without_a_sharded_checkpoint",
        "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --resume --checkpoint {D}/ck",
        both(two_rank_plan("p2.json"), folder("ck"))),
    # the third tier (issue 16): plan --cpu-mem/--nvme, run --nvme-dir
    Row("plan_cpu_mem_below_the_minimum", "plan {T} --gpu-mem min --cpu-mem 4KB --nvme 1GB -o {D}/p.json"),
    Row("plan_nvme_size_text", "plan {T} --gpu-mem min --cpu-mem 1GB --nvme lots -o {D}/p.json"),
    Row("plan_nvme_preset_unknown", "plan {T} --gpu-mem min --cpu-mem 1GB --nvme 1TB --nvme-preset floppy -o {D}/p.json"),
    Row("plan_host_preset_unknown", "plan {T} --gpu-mem min --cpu-mem 1GB --nvme 1TB --host abacus -o {D}/p.json"),
    Row("plan_nvme_read_rate_zero", "plan {T} --gpu-mem min --cpu-mem 1GB --nvme 1TB --nvme-read-gbps 0 -o {D}/p.json"),
    Row("plan_nvme_too_small", "plan {T} --gpu-mem min --cpu-mem 16KB --nvme 1KB -o {D}/p.json"),
    Row("run_nvme_plan_without_nvme_dir", f"run {{W}} {NV}", nvme_plan("n.json")),
    Row("run_nvme_dir_missing", f"run {{W}} {NV} --nvme-dir {{D}}/nope", nvme_plan("n.json")),
    Row("run_nvme_dir_is_a_file", f"run {{W}} {NV} --nvme-dir {{D}}/f", both(nvme_plan("n.json"), text("f", "x"))),
    Row("run_nvme_dir_unwritable", f"run {{W}} {NV} --nvme-dir {{D}}/ro", both(nvme_plan("n.json"), folder("ro", 0o555)),
        unprivileged=True),
    Row("run_nvme_host_budget_above_this_machine", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json", _host_peak_huge), folder("nv"))),
    Row("run_nvme_plan_read_removed", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json", _read_dropped), folder("nv"))),
    # names planted in --nvme-dir or --checkpoint (issue 22): never followed, opened blocking or deleted
    Row("run_nvme_lock_is_a_symlink_to_a_file_outside", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json"), folder("nv"), text("outside", "precious"), link("nv/.hplan-nvme.lock", "{D}/outside"))),
    Row("run_nvme_lock_is_a_fifo", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json"), folder("nv"), fifo("nv/.hplan-nvme.lock"))),
    Row("run_nvme_region_folder_is_a_symlink_to_a_folder_outside", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json"), folder("nv"), folder("elsewhere"), text("elsewhere/r0.0.region", "precious"),
             link("nv/hplan-regions", "{D}/elsewhere"))),
    Row("run_nvme_plan_inside_the_region_folder", "run {W} --plan {D}/nv/hplan-regions/r0.0.region --steps 2 "
        "--nvme-dir {D}/nv", both(folder("nv/hplan-regions"), nvme_plan("nv/hplan-regions/r0.0.region"))),
    Row("run_nvme_region_folder_with_a_forged_record", f"run {{W}} {NV} --nvme-dir {{D}}/nv",
        both(nvme_plan("n.json"), folder("nv/hplan-regions"), text("nv/hplan-regions/.owner", "hplan.nvme-owner/1\n= "
             "../../n.json 1\n"), text("nv/hplan-regions/r0.0.region", "precious"))),
    Row("run_checkpoint_lock_is_a_symlink_to_a_file_outside", f"run {{W}} {P} --checkpoint {{D}}/ck",
        both(folder("ck"), text("outside", "precious"), link("ck/.lock", "{D}/outside"))),
    Row("run_checkpoint_lock_is_a_fifo", f"run {{W}} {P} --checkpoint {{D}}/ck", both(folder("ck"), fifo("ck/.lock"))),
    # the two together are refused, not half-applied
    Row("plan_nvme_with_many_gpus", "plan {T} --gpu-mem 1GB --gpus 2 --cpu-mem 1GB --nvme 1TB -o {D}/p.json"),
    Row("run_many_rank_plan_with_nvme_dir", "run {W} --plan {D}/p2.json --steps 2 --nproc 2 --nvme-dir {D}",
        two_rank_plan("p2.json")),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_is_refused_in_one_line_and_touches_nothing(row: Row, artifacts: Path, tmp_path: Path) -> None:
    check_row(row, artifacts, tmp_path)
