"""kvconnect's GGUF parser against the `gguf` package's reader on a file written with `gguf`'s
writer (every value kind, F32, F16 and Q8_0 tensors); malformed files are a ValueError naming
the file. (SmolLM2's own file is read by every test of tests/model/test_smollm2.py, whose
tokenizer and logits equal transformers' from the same file.)"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kvconnect.model.gguf_file import GGUFFile


def assert_same_as_gguf_reader(path: Path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected: dict[str, Any] = {}
    for name, field in theirs.fields.items():
        if name.startswith("GGUF."):  # the reader's own header fields, not key-values
            continue
        expected[name] = field.contents()
    assert ours.metadata == expected
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type, t.name
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert np.array_equal(mine.data, t.data), t.name
        assert mine.shape == tuple(reversed(t.shape.tolist())), t.name


def write_small(path: Path) -> Path:
    """A file with every kind of value and F32, F16 and Q8_0 tensors."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int32("t.i32", -5)
    w.add_uint64("t.u64", 1 << 40)
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", -2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.strs", ["a", "bc", ""])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5)).astype(np.float16))
    q8 = gguf.quants.quantize(
        rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_kind_and_tensor_type_reads_as_the_gguf_package_reads_it(
    tmp_path: Path,
) -> None:
    path = write_small(tmp_path / "small.gguf")
    assert_same_as_gguf_reader(path)
    f = GGUFFile(path)
    assert f.metadata["t.strs"] == ["a", "bc", ""] and f.metadata["t.str"] == "héllo"
    assert f.tensors["q8"].shape == (4, 64) and f.tensors["q8"].data.shape == (4, 68)


def test_malformed_files_are_a_value_error_naming_the_file(tmp_path: Path) -> None:
    path = write_small(tmp_path / "good.gguf")
    good = path.read_bytes()
    end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(path).tensors)  # then padding
    kv_start = 24

    def bad(data: bytes, match: str) -> None:
        path = tmp_path / "bad.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=match) as err:
            GGUFFile(path).tensors  # noqa: B018 (the table is read on first use)
        assert str(path) in str(err.value) and "not a readable GGUF file" in str(err.value)

    bad(b"", "cannot mmap an empty file|empty")
    bad(b"GGML" + good[4:], "magic")
    bad(good[:4] + struct.pack("<I", 1) + good[8:], "version 1")
    bad(good[:8] + struct.pack("<Q", 1 << 60) + good[16:], "tensors")
    bad(good[: kv_start + 5], "corrupt")
    long_key = good[:kv_start] + struct.pack("<Q", 1 << 40) + good[kv_start + 8 :]
    bad(long_key, "string runs past the end")
    for cut in (len(good) // 2, end - 1):  # inside the table or the tensor data
        bad(good[:cut], "past the end|truncated or corrupt")
    for cut in range(0, end, 7):  # every shorter file is refused, whatever is cut
        path = tmp_path / "cut.gguf"
        path.write_bytes(good[:cut])
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            GGUFFile(path).tensors  # noqa: B018
