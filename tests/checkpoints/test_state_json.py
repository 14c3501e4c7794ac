"""The non-tensor training state as typed JSON ([Note: checkpoint state as JSON]): exact round trips, refusals at
save naming the value, and hostile state records refused in one line within bounded time and memory."""

from __future__ import annotations

import math
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from hplan.errors import HplanError
from hplan.executor.checkpoints.state_json import pack, unpack

FOLDER = Path("/ck/step-000001")


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_the_state_comes_back_with_its_types_and_bit_equal_floats():
    groups = [{"lr": 0.1 * 3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "foreach": None, "initial_lr": math.inf, "odd": -math.inf, "nan": math.nan, "tensor_lr": torch.tensor(
                   1e-3, dtype=torch.float64), "nested": {"a": [1, (2, [3.5, None])], 7: "int key", None: True}}]
    state = {"global_step": 12, "param_groups": groups, "rng": torch.get_rng_state(),
             "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16), "empty": torch.empty(0, 3)}
    back = unpack(pack(state), FOLDER)
    g, b = groups[0], back["param_groups"][0]
    assert type(b["betas"]) is tuple and b["betas"] == g["betas"] and _bits(b["lr"]) == _bits(g["lr"])
    assert b["initial_lr"] == math.inf and b["odd"] == -math.inf and math.isnan(b["nan"])
    assert b["tensor_lr"].dtype == torch.float64 and torch.equal(b["tensor_lr"], g["tensor_lr"])
    assert b["nested"] == {"a": [1, (2, [3.5, None])], 7: "int key", None: True}
    assert type(b["nested"]["a"][1]) is tuple and b["foreach"] is None and b["amsgrad"] is False
    assert torch.equal(back["rng"], state["rng"]) and torch.equal(back["bf16"], state["bf16"])
    assert back["empty"].shape == (0, 3) and back["global_step"] == 12


def test_a_value_json_cannot_keep_is_refused_at_save_naming_where_it_is():
    with pytest.raises(HplanError, match=r"cannot checkpoint state\.scheduler\.lr_lambdas\[0\]: it holds a function"):
        pack({"scheduler": {"lr_lambdas": [lambda s: s]}})
    with pytest.raises(HplanError, match=r"a float32 tensor of 1048576 elements inside the training state"):
        pack({"big": torch.zeros(1 << 20)})


def _record(text: str | bytes) -> torch.Tensor:
    data = text.encode() if isinstance(text, str) else text
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


HOSTILE = {
    "nested_200000_deep": ("[" * 200_000 + "]" * 200_000, "nested 200000 deep"),
    "an_object_that_asks_to_be_reduced": ('{"__reduce__": ["posix.system", ["touch x"]]}', "an object tagged "
                                                                                          "'__reduce__'"),
    "a_class_by_name": ('{"dict": [["k", {"class": "torch.nn.Module"}]]}', "an object tagged 'class'"),
    "a_huge_tag_name": ('{"' + "t" * 1_200_000 + '": 1}', "an object tagged 'tttt"),
    "an_untagged_object": ('{"a": 1, "b": 2}', "an untagged object"),
    "a_tensor_claiming_a_terabyte": ('{"tensor": {"dtype": "float32", "shape": [1099511627776], "hex": ""}}',
                                     "a malformed tensor"),
    "a_tensor_of_400000_dims": ('{"tensor": {"dtype": "uint8", "shape": [' + ",".join(["1"] * 400_000) +
                                '], "hex": "00"}}', "a malformed tensor"),
    "a_tensor_whose_bytes_are_short": ('{"tensor": {"dtype": "float32", "shape": [4], "hex": "00"}}',
                                       "bytes do not match"),
    "a_repeated_key": ('{"dict": [["k", 1], ["k", 2]]}', "a repeated key"),
    "a_5000_digit_step": ('{"dict": [["global_step", ' + "9" * 5000 + "]]}", "a number of over 64 digits"),
    "not_utf8": (b"\xff\xfe", "not UTF-8"),
    "nan": ('{"dict": [["lr", NaN]]}', "non-standard value NaN"),
}


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_state_record_is_refused_in_one_line_in_bounded_time_and_memory(kind):
    text, expected = HOSTILE[kind]
    record = _record(text)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(HplanError) as info:
            unpack(record, FOLDER)
        seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert expected in message and str(FOLDER) in message and "\n" not in message and len(message) < 600, message[:600]
    assert seconds < 10 and peak < 40 * len(record) + (16 << 20), (seconds, peak)


def test_a_wide_state_of_a_million_values_decodes_without_recursion():
    text = '{"tuple": [' + ",".join(['{"tuple": [1, 2.5, "x"]}'] * 300_000) + "]}"
    back = unpack(_record(text), FOLDER)
    assert len(back) == 300_000 and back[-1] == (1, 2.5, "x")
