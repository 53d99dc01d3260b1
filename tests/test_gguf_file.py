"""models/gguf_file.py reads what gguf.GGUFReader reads (every field decoded the same, every tensor's bytes), with
tensor data left in the mapped file; a file that is not GGUF or is cut short is a clear error."""
from __future__ import annotations

import numpy as np
import pytest

from stallfree.node_daemon.models.gguf_file import GGUFFile
from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path


def test_the_embedded_file_reads_as_gguf_reader_reads_it():
    import gguf

    path = embedded_gguf_path()
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own pseudo-fields
    assert set(ours.fields) == set(want)
    for key, value in want.items():
        assert ours.fields[key] == pytest.approx(value) if isinstance(value, float) else ours.fields[key] == value, key
        assert type(ours.fields[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.shape == tuple(int(d) for d in b.shape) and a.tensor_type == b.tensor_type, a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.owndata and not a.data.flags.writeable  # a view of the read-only mapping


def test_not_gguf_and_cut_short_are_errors(tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(other))
    whole = open(embedded_gguf_path(), "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(str(cut))
