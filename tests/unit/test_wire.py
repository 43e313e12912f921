"""The Jupyter wire codec: both WebSocket framings, signatures and malformed frames."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)

from nbfleet.agent.wire import (
    DELIMITER,
    V1_PROTOCOL,
    WireCodec,
    WireError,
    pack_legacy_binary,
    pack_v1,
    parse_client_frame,
    unpack_legacy_binary,
    unpack_v1,
)

HEADER = {"msg_id": "m1", "msg_type": "execute_request", "session": "s", "username": "u",
          "version": "5.3", "date": "2026-01-01T00:00:00Z"}


def kernel_frames(codec: WireCodec, content: dict[str, object], parent: str = "p1") -> list[bytes]:
    parts = [json.dumps({**HEADER, "msg_type": "stream"}).encode(),
             json.dumps({"msg_id": parent}).encode(), b"{}", json.dumps(content).encode()]
    return [b"routing-id", DELIMITER, codec.sign(parts), *parts]


def test_kernel_message_renders_in_both_protocols() -> None:
    codec = WireCodec(b"secret")
    message = codec.from_kernel("iopub", kernel_frames(codec, {"name": "stdout", "text": "hi"}))
    assert (message.msg_type, message.parent_msg_id) == ("stream", "p1")
    legacy = json.loads(message.frame(None))
    assert legacy["channel"] == "iopub" and legacy["content"]["text"] == "hi"
    assert legacy["msg_id"] == "m1" and legacy["parent_header"]["msg_id"] == "p1"
    v1 = message.frame(V1_PROTOCOL)
    assert isinstance(v1, bytes)
    channel, parts = deserialize_msg_from_ws_v1(v1)  # jupyter_server's own decoder
    assert channel == "iopub" and json.loads(parts[3])["text"] == "hi"


def test_forged_or_truncated_kernel_frames_are_refused() -> None:
    codec = WireCodec(b"secret")
    frames = kernel_frames(codec, {"text": "x"})
    frames[2] = b"0" * 64
    with pytest.raises(WireError, match="signature"):
        codec.from_kernel("iopub", frames)
    with pytest.raises(WireError, match="delimiter"):
        codec.from_kernel("iopub", [b"a", b"b"])
    with pytest.raises(WireError, match="truncated"):
        codec.from_kernel("iopub", [DELIMITER, b"sig", b"{}"])


def test_client_frames_in_both_protocols_sign_the_same_parts() -> None:
    codec = WireCodec(b"k")
    legacy = parse_client_frame(json.dumps({
        "channel": "shell", "header": HEADER, "parent_header": {}, "metadata": {},
        "content": {"code": "1"}}), None)
    parts = [json.dumps(HEADER).encode(), b"{}", b"{}", b'{"code": "1"}']
    v1 = parse_client_frame(serialize_msg_to_ws_v1(parts, "shell"), V1_PROTOCOL)
    assert legacy.msg_id == v1.msg_id == "m1"
    assert legacy.channel == v1.channel == "shell"
    assert v1.parts == parts  # v1 parts are forwarded byte for byte
    frames = codec.to_kernel(v1)
    assert frames[0] == DELIMITER and frames[1] == codec.sign(parts)


def test_a_json_frame_without_a_channel_goes_to_shell() -> None:
    """jupyter_server's gateway kernel client (nbclient, papermill) leaves the channel
    out; jupyter_server itself takes a missing one as shell."""
    for message in ({"header": HEADER, "parent_header": {}, "metadata": {},
                     "content": {"code": "1"}},
                    {"channel": None, "header": HEADER, "content": {"code": "1"}}):
        parsed = parse_client_frame(json.dumps(message), None)
        assert (parsed.channel, parsed.msg_id, parsed.msg_type) == ("shell", "m1",
                                                                   "execute_request")
    binary = pack_legacy_binary(json.dumps({"header": HEADER, "content": {}}).encode(), [b"b"])
    parsed = parse_client_frame(binary, None)
    assert parsed.channel == "shell" and parsed.buffers == [b"b"]


@pytest.mark.parametrize(("frame", "protocol", "message"), [
    (json.dumps({"channel": "", "header": HEADER}), None, "channel"),
    (json.dumps({"channel": 5, "header": HEADER}), None, "channel"),
    (pack_v1("", [json.dumps(HEADER).encode(), b"{}", b"{}", b"{}"], []), V1_PROTOCOL,
     "channel"),
    ("{not json", None, "Expecting property name"),
    ("[1, 2]", None, "JSON object"),
    (json.dumps({"channel": "iopub", "header": HEADER}), None, "channel"),
    (json.dumps({"channel": "shell", "header": {}}), None, "msg_id"),
    (b"\x00\x01", None, "too short"),
    ("text frame", V1_PROTOCOL, "binary"),
    (b"\x01" + b"\x00" * 7, V1_PROTOCOL, "header"),
    (pack_v1("shell", [b"not json", b"{}", b"{}", b"{}"], []), V1_PROTOCOL, "JSON"),
    (pack_v1("iopub", [json.dumps(HEADER).encode(), b"{}", b"{}", b"{}"], []), V1_PROTOCOL,
     "channel"),
])
def test_malformed_client_frames_raise_wire_errors(frame: str | bytes, protocol: str | None,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_client_frame(frame, protocol)


@given(st.sampled_from(["shell", "iopub", "control", "stdin"]),
       st.lists(st.binary(max_size=50), min_size=4, max_size=4),
       st.lists(st.binary(max_size=50), max_size=3))
def test_v1_round_trip_matches_jupyter_server(channel: str, parts: list[bytes],
                                              buffers: list[bytes]) -> None:
    packed = pack_v1(channel, parts, buffers)
    assert packed == serialize_msg_to_ws_v1(parts + buffers, channel)
    assert unpack_v1(packed) == (channel, parts, buffers)


@given(st.binary(max_size=50), st.lists(st.binary(max_size=50), max_size=3))
def test_legacy_binary_round_trip(json_part: bytes, buffers: list[bytes]) -> None:
    assert unpack_legacy_binary(pack_legacy_binary(json_part, buffers)) == [json_part, *buffers]
