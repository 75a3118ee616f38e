"""The PD control plane's seal (`lightllm.server.pd.auth`): a sealed frame opens with the same secret on the same
channel, once; a wrong secret, another channel, a changed byte, a stale timestamp, a replay or a truncated frame
are refused (Unauthenticated, a msgspec.DecodeError the node's inbox drops). Endpoint checks at registration."""

from __future__ import annotations

import os

import msgspec
import pytest

from lightllm.server.pd.auth import PdAuth, SealedDecoder, Unauthenticated, endpoint_problem

CHANNEL = "tcp://127.0.0.1:5555"


def test_a_sealed_frame_opens_once_with_the_same_secret_and_channel():
    payload = os.urandom(1000)
    sender, receiver = PdAuth("s3cret"), PdAuth("s3cret")
    frame = sender.seal(CHANNEL, payload)
    assert receiver.open(CHANNEL, frame) == payload
    # teeth: the same frame again is a replay
    with pytest.raises(Unauthenticated, match="replayed"):
        receiver.open(CHANNEL, frame)


@pytest.mark.parametrize(
    "attack",
    ["wrong_secret", "other_channel", "flipped_payload_byte", "flipped_tag_byte", "truncated", "no_secret"],
)
def test_a_forged_or_altered_frame_is_refused(attack):
    payload = os.urandom(64)
    frame = PdAuth("wrong" if attack == "wrong_secret" else None if attack == "no_secret" else "s3cret").seal(
        CHANNEL, payload
    )
    channel = "tcp://127.0.0.1:5556" if attack == "other_channel" else CHANNEL
    if attack == "flipped_payload_byte":
        frame = frame[:-1] + bytes([frame[-1] ^ 1])
    if attack == "flipped_tag_byte":
        frame = frame[:30] + bytes([frame[30] ^ 1]) + frame[31:]
    if attack == "truncated":
        frame = frame[:40]
    with pytest.raises(Unauthenticated):
        PdAuth("s3cret").open(channel, frame)


def test_a_stale_frame_is_refused_and_nonces_expire():
    now = [1000.0]
    auth = PdAuth("k", max_skew_s=10.0, clock=lambda: now[0])
    frame = auth.seal(CHANNEL, b"x")
    now[0] += 11.0
    with pytest.raises(Unauthenticated, match="stale"):
        auth.open(CHANNEL, frame)
    for _ in range(50):
        auth.open(CHANNEL, auth.seal(CHANNEL, b"y"))
    now[0] += 25.0
    auth.open(CHANNEL, auth.seal(CHANNEL, b"z"))
    # the remembered nonces are bounded by the window, not by the traffic seen
    assert len(auth._seen) == 1


def test_the_sealed_decoder_drops_what_the_engine_loop_drops():
    auth = PdAuth("k")
    decoder = SealedDecoder(auth, CHANNEL, msgspec.msgpack.Decoder(list[int]))
    assert decoder.decode(auth.seal(CHANNEL, msgspec.msgpack.encode([1, 2]))) == [1, 2]
    # both kinds of bad input are a msgspec.DecodeError: the engine loop's `dispatch` drops them
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(msgspec.msgpack.encode([1, 2]))
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(auth.seal(CHANNEL, b"\xc1 not msgpack"))


@pytest.mark.parametrize("addr", ["tcp://127.0.0.1:5555", "tcp://node-3.example:1", "tcp://[::1]:65535"])
def test_endpoints_others_can_connect_to_are_accepted(addr):
    assert endpoint_problem(addr) is None


@pytest.mark.parametrize(
    "addr",
    [
        "nonsense",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:70000",
        "tcp://0.0.0.0:5555",
        "ipc:///tmp/x",
        "tcp://a b:1",
        "tcp://127.0.0.1:5555/extra",
        5555,
        "tcp://" + "a" * 300 + ":1",
    ],
)
def test_endpoints_nobody_can_connect_to_are_refused(addr):
    assert endpoint_problem(addr) is not None
