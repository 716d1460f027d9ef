"""Packed token arrays: list-compatible where consumers rely on it, byte-exact on the wire."""

from __future__ import annotations

import copy
import dataclasses
import operator
import pickle
import struct

import numpy as np
import orjson
import pyarrow as pa
import pytest
import torch

from pipeline import events
from pipeline.events import F64Array, U8Array, U32Array, examples


def test_compares_equal_to_the_list_it_stands_for_and_not_to_another() -> None:
    ids = U32Array([5, 0, 4_000_000_000])
    assert ids == [5, 0, 4_000_000_000] and operator.eq([5, 0, 4_000_000_000], ids)
    assert ids == (5, 0, 4_000_000_000)
    assert ids != [5, 0] and ids != [5, 0, 4_000_000_001] and (ids == [5, 0]) is False
    assert ids == U32Array([5, 0, 4_000_000_000])
    assert F64Array([0.5, -1.25]) == [0.5, -1.25]
    assert U8Array() == [] and not U8Array() and U8Array([0])  # truthiness follows length
    with pytest.raises(TypeError):
        hash(ids)


def test_slices_and_copies_keep_the_class() -> None:
    ids = U32Array([1, 2, 3, 4])
    for other in (ids[1:3], copy.copy(ids), copy.deepcopy(ids), pickle.loads(pickle.dumps(ids))):
        assert type(other) is U32Array
    assert ids[1:3] == [2, 3] and ids[-1] == 4 and type(ids[0]) is int
    clone = copy.deepcopy(ids)
    clone[0] = 9
    assert ids[0] == 1  # a real copy
    assert repr(F64Array([0.5])) == "F64Array([0.5])"


def test_little_endian_bytes_round_trip() -> None:
    ids = U32Array([1, 258, 2**32 - 1])
    assert ids.le_bytes() == struct.pack("<3I", 1, 258, 2**32 - 1)
    assert U32Array.from_le_bytes(ids.le_bytes()) == ids
    lp = F64Array([-0.1, 3.5])
    assert lp.le_bytes() == struct.pack("<2d", -0.1, 3.5)
    with pytest.raises(ValueError):
        U32Array.from_le_bytes(b"\x00\x01\x02")  # not a whole item
    with pytest.raises(OverflowError):
        U32Array([-1])


def test_consumers_read_them_like_lists() -> None:
    ids, lp = U32Array([3, 1, 2]), F64Array([-0.5, -1.5, -2.0])
    assert torch.tensor(ids, dtype=torch.long).tolist() == [3, 1, 2]
    assert np.frombuffer(ids, dtype="<u4").tolist() == [3, 1, 2]
    assert (max(ids), min(ids), sum(lp), len(lp)) == (3, 1, -4.0, 3)
    assert [*ids[:1], 7, *ids[1:]] == [3, 7, 1, 2]
    column = pa.array([ids, U32Array()], type=pa.list_(pa.int32()))
    assert column.to_pylist() == [[3, 1, 2], []]
    assert orjson.dumps({"ids": ids, "lp": lp}, default=events.json_default) == (
        b'{"ids":[3,1,2],"lp":[-0.5,-1.5,-2.0]}'
    )
    with pytest.raises(TypeError, match="not JSON serializable"):
        orjson.dumps({"x": object()}, default=events.json_default)


def test_v1_and_v2_events_with_packed_arrays_encode_as_with_lists() -> None:
    built = examples.interaction(prompt_tokens=64, response_tokens=16)
    packed = dataclasses.replace(
        built,
        prompt_token_ids=U32Array(built.prompt_token_ids),
        response_token_ids=U32Array(built.response_token_ids),
        response_logprobs=F64Array(built.response_logprobs),
    )
    for version in (1, 2):
        assert events.encode(packed, version=version) == events.encode(built, version=version)
    assert events.decode(events.encode(packed, version=1)) == built
    assert events.to_dict(packed) == events.to_dict(built)
