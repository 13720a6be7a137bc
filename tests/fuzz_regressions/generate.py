"""Writes the hand-made malformed files of this folder and EXPECTED.json (what each must raise).

Every ``*.bin`` here is replayed by ``rust/core/tests/hostile_inputs.rs`` (parser and reader invariants) and by
``tests/test_hostile_files.py`` (every Python loader raises exactly the class in EXPECTED.json, or loads).
Crashing inputs found by fuzzing are added as ``crash-<target>-<sha1>.bin`` with the class they must raise once
fixed. Run ``python tests/fuzz_regressions/generate.py`` to rewrite the hand-made ones.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

HERE = Path(__file__).parent


def _file(header: str | bytes, data: bytes = b"", *, n: int | None = None) -> bytes:
    raw = header.encode("utf-8") if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


def _entry(dtype: str = "F32", shape=(2,), offsets=(0, 8)) -> str:
    return json.dumps({"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)})


CASES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "TruncatedFileError"),
    "seven_bytes": (b"\x08\x00\x00\x00\x00\x00\x00", "TruncatedFileError"),
    "header_len_u64_max": (_file("{}", n=2**64 - 1), "HeaderError"),
    "header_len_over_limit": (_file("{}", n=100_000_001), "HeaderError"),
    "header_len_past_eof": (_file("{}", n=64), "TruncatedFileError"),
    "header_not_utf8": (_file(b'{"\xff\xfe":1}'), "HeaderError"),
    "header_not_json": (_file("{not json}"), "HeaderError"),
    "header_is_array": (_file("[]"), "HeaderError"),
    "header_leading_space": (_file(" {}"), "HeaderError"),
    "header_trailing_garbage": (_file("{}x"), "HeaderError"),
    "header_deep_nesting": (_file('{"__metadata__":' + "[" * 5000 + "]" * 5000 + "}"), "HeaderError"),
    "header_lone_surrogate": (_file('{"\\ud800":' + _entry() + "}", b"\0" * 8), "HeaderError"),
    "metadata_not_object": (_file('{"__metadata__":[1]}'), "HeaderError"),
    "metadata_int_value": (_file('{"__metadata__":{"epoch":3}}'), "HeaderError"),
    "metadata_duplicate_key": (_file('{"__metadata__":{"k":"a","k":"b"}}'), "HeaderError"),
    "entry_not_object": (_file('{"w":[1,2]}'), "HeaderError"),
    "entry_extra_field": (_file('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}}', b"\0" * 8),
                          "HeaderError"),
    "entry_missing_field": (_file('{"w":{"dtype":"F32","shape":[2]}}', b"\0" * 8), "HeaderError"),
    "entry_duplicate_name": (_file('{"w":' + _entry() + ',"w":' + _entry() + "}", b"\0" * 8), "HeaderError"),
    "dtype_unknown": (_file('{"w":' + _entry("F128") + "}", b"\0" * 8), "DtypeError"),
    "dtype_lowercase": (_file('{"w":' + _entry("f32") + "}", b"\0" * 8), "DtypeError"),
    "dtype_not_string": (_file('{"w":{"dtype":32,"shape":[2],"data_offsets":[0,8]}}', b"\0" * 8), "HeaderError"),
    "shape_negative": (_file('{"w":' + _entry(shape=(-2,)) + "}", b"\0" * 8), "HeaderError"),
    "shape_float": (_file('{"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', b"\0" * 8), "HeaderError"),
    "shape_overflow": (_file('{"w":' + _entry(shape=(2**32, 2**32, 16)) + "}", b"\0" * 8), "HeaderError"),
    "shape_bytes_overflow": (_file('{"w":' + _entry("F64", shape=(2**62,)) + "}", b"\0" * 8), "HeaderError"),
    "shape_not_whole_bytes_f4": (_file('{"w":' + _entry("F4", shape=(3,), offsets=(0, 2)) + "}", b"\0" * 2),
                                 "HeaderError"),
    "offsets_reversed": (_file('{"w":' + _entry(offsets=(8, 0)) + "}", b"\0" * 8), "HeaderError"),
    "offsets_wrong_span": (_file('{"w":' + _entry(offsets=(0, 12)) + "}", b"\0" * 12), "HeaderError"),
    "offsets_past_data": (_file('{"w":' + _entry(offsets=(8, 16)) + "}", b"\0" * 8), "HeaderError"),
    "offsets_u64_max": (_file('{"w":' + _entry(offsets=(2**64 - 8, 2**64)) + "}", b"\0" * 8), "HeaderError"),
    "offsets_too_big_for_u64": (_file('{"w":' + _entry(offsets=(0, 2**64)) + "}", b"\0" * 8), "HeaderError"),
    "offsets_overlap": (_file('{"a":' + _entry() + ',"b":' + _entry(offsets=(4, 12)) + "}", b"\0" * 12),
                        "HeaderError"),
    "offsets_gap": (_file('{"a":' + _entry() + ',"b":' + _entry(offsets=(12, 20)) + "}", b"\0" * 20), "HeaderError"),
    "data_short": (_file('{"w":' + _entry() + "}", b"\0" * 5), "TruncatedFileError"),
    "data_long": (_file('{"w":' + _entry() + "}", b"\0" * 9), "HeaderError"),
    "data_without_tensors": (_file("{}", b"\0"), "HeaderError"),
    # Files that are fine, however odd: they must load.
    "ok_json_order_free": (_file('{"b":' + _entry(offsets=(8, 16)) + ',"a":' + _entry() + "}", bytes(range(16))),
                           "ok"),
    "ok_zero_size_tensors": (_file('{"z":' + _entry(shape=(0, 3), offsets=(0, 0)) + ',"w":' + _entry() + "}",
                                   bytes(range(8))), "ok"),
    "ok_unaligned_offsets": (_file('{"a":' + _entry("U8", (3,), (0, 3)) + ',"b":' + _entry("F32", (1,), (3, 7))
                                   + "}", bytes(range(7))), "ok"),
    "ok_empty_header": (_file("{}"), "ok"),
}


def main() -> None:
    for old in HERE.glob("*.bin"):
        if not old.name.startswith("crash-"):
            old.unlink()
    expected = json.loads((HERE / "EXPECTED.json").read_text()) if (HERE / "EXPECTED.json").exists() else {}
    expected = {k: v for k, v in expected.items() if k.startswith("crash-")}
    for name, (data, outcome) in CASES.items():
        (HERE / f"{name}.bin").write_bytes(data)
        expected[f"{name}.bin"] = outcome
    (HERE / "EXPECTED.json").write_text(json.dumps(dict(sorted(expected.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
