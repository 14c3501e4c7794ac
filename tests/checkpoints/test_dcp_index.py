"""The JSON index of a DCP folder ([Note: safe DCP metadata]): every kind of tensor hplan saves comes back exactly
through the raw-offset reader, views included, and plain DCP still reads the folder."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hplan.executor.checkpoints.checkpoint import _read
from hplan.executor.checkpoints.checkpoint_manifest import verify, write_manifest
from hplan.executor.checkpoints.dcp_index import compact, write_index


def _state() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {"views": {"transposed": base.t(), "sliced": base[1:3, 2:5], "strided": base[:, ::2],
                      "offset": base.reshape(-1)[5:11]},
            "dtypes": {"bf16": torch.randn(3, 5).bfloat16(), "f16": torch.randn(7).half(),
                       "f64": torch.randn(2, 2, 2).double(), "i64": torch.arange(-3, 4), "u8": torch.arange(9,
                       dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
                       "c64": torch.randn(3, dtype=torch.complex64)},
            "shapes": {"scalar": torch.tensor(3.25), "empty": torch.empty(0, 4), "one": torch.ones(1)}}


def _save(folder: Path, state: dict, *, compacted: bool = True) -> None:
    folder.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metadata = dcp.save(compact(state) if compacted else state,
                            storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    write_index(folder, metadata)
    write_manifest(folder, global_step=1, info={})


def _equal(a: dict, b: dict) -> None:
    for group, tensors in a.items():
        for name, t in tensors.items():
            got = b[group][name]
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), (group, name)


def test_every_kind_of_tensor_comes_back_exactly_through_the_raw_reader(tmp_path):
    state = _state()
    folder = tmp_path / "step-000001"
    _save(folder, state)
    _equal(state, _read(folder, verify(folder).files))
    template = {g: {n: torch.zeros_like(t) for n, t in ts.items()} for g, ts in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    _equal(state, template)


def test_views_are_compacted_before_saving_or_their_bytes_would_be_read_out_of_order(tmp_path):
    """Without `compact`, DCP's torch.save record of a transposed view holds its base's storage in base order:
    the index would be refused at save (another storage size) or read back permuted. With it, exact."""
    state = {"views": {"transposed": torch.arange(6.0).reshape(2, 3).t()}}
    folder = tmp_path / "step-000001"
    _save(folder, state)
    assert torch.equal(_read(folder, verify(folder).files)["views"]["transposed"], state["views"]["transposed"])
    raw = tmp_path / "raw" / "step-000001"
    raw.parent.mkdir()
    try:
        _save(raw, state, compacted=False)
    except Exception:  # noqa: BLE001 (refused at save is fine; a silent permutation is not)
        return
    with pytest.raises(AssertionError):
        assert torch.equal(_read(raw, verify(raw).files)["views"]["transposed"], state["views"]["transposed"])


def test_a_template_of_another_dtype_is_refused_not_converted(tmp_path):
    """A many-rank load reads into the plan's regions: a saved dtype that differs from the region's is refused in
    one line, never silently converted (DCP's own reader would `copy_` across dtypes)."""
    from hplan.errors import HplanError
    from hplan.executor.checkpoints.checkpoint import _unwrap
    from hplan.executor.checkpoints.dcp_index import read_index
    from hplan.executor.checkpoints.dcp_safe import SafePlanner, SafeReader

    folder = tmp_path / "step-000001"
    _save(folder, {"r": {"w": torch.randn(4, 3)}})
    template = {"r": {"w": torch.zeros(4, 3, dtype=torch.float64)}}
    with warnings.catch_warnings(), pytest.raises(HplanError, match=r"holds 'r\.w' as float32, this run needs float64"):
        warnings.simplefilter("ignore")
        try:
            dcp.load(template, storage_reader=SafeReader(folder, read_index(folder, verify(folder).files)),
                     planner=SafePlanner(), no_dist=True)
        except dcp.api.CheckpointException as exc:
            raise _unwrap(exc) from None
