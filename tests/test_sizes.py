import pytest
from hypothesis import given
from hypothesis import strategies as st

from hplan import HplanError, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9), ("24GiB", 24 * 2**30), ("512MB", 512 * 10**6), ("1.5TB", 1_500_000_000_000),
        ("1024", 1024), ("7 gib", 7 * 2**30), ("64KiB", 65536), ("3B", 3), (4096, 4096), ("0.5GB", 500_000_000),
    ],
)
def test_parse_accepts_decimal_and_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GB", "24XB", "0", "0GB", "", "GB", "1e9", "1.2.3GB", "24 G B", 0, -5, True])
def test_parse_rejects_with_accepted_forms(bad):
    with pytest.raises(HplanError) as err:
        parse_size(bad, what="GPU memory")
    message = str(err.value)
    assert "GPU memory" in message and "24GB" in message and "24GiB" in message
    assert "\n" not in message


@given(st.integers(min_value=1, max_value=10**15))
def test_plain_bytes_round_trip(n):
    assert parse_size(str(n)) == n


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(["KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"]))
def test_unit_round_trip(n, unit):
    base = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    assert parse_size(f"{n}{unit}") == n * base


def test_format_size_states_units():
    assert format_size(24 * 10**9) == "24.00 GB"
    assert format_size(24 * 2**30, binary=True) == "24.00 GiB"
    assert format_size(12) == "12 B"
    assert parse_size(format_size(1_500_000_000).replace(" ", "")) == 1_500_000_000


def test_sizes_compared_in_one_message_read_differently():
    """Issue 22: a 1 MiB tmpfs was "0.00 GB free but needs 0.00 GB". Compared sizes share the larger's unit and
    take the digits that tell them apart; equal sizes read equal."""
    from hplan.sizes import format_sizes

    assert format_sizes(1 << 20, 1_190_000) == ("1.05 MB", "1.19 MB")
    assert format_sizes(16_384, 16_383) == ("16.384 KB", "16.383 KB")
    assert format_sizes(1_048_576, 1_048_577) == ("1.048576 MB", "1.048577 MB")
    assert format_sizes(0, 10**9) == ("0.00 GB", "1.00 GB")
    assert format_sizes(5 * 10**12, 5 * 10**12) == ("5.00 TB", "5.00 TB")
    assert format_sizes(12, 900) == ("12 B", "900 B")
    assert format_sizes(2**30, 2**30 + 1, binary=True) == ("1.000000000 GiB", "1.000000001 GiB")
