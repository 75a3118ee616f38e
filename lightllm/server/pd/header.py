"""The transfer header: everything two nodes must agree on for a prefilled request to continue on the other.

A node sends its header when it registers with the master. The model's fields (`MODEL_FIELDS`) are checked
against the master's own checkpoint (`model_reference`), never against what a node claims; the fields a node's
flags decide (`RUNTIME_FIELDS`: dtypes, MTP steps) must agree between the nodes registered at the same time. The
master refuses a node whose header differs, naming each field that differs. The header's fingerprint travels
with every transfer, so a decode node also refuses a payload from an incompatible sender.
"""

from __future__ import annotations

import hashlib
import json
import os

import msgspec

from lightllm.models.registry import load_model_config


class TransferHeader(msgspec.Struct, frozen=True):
    # sha256 of config.json and of the safetensors files' names and sizes
    model_fingerprint: str
    architecture: str
    full_layer_ids: list[int]
    linear_layer_ids: list[int]
    # global (all tensor-parallel ranks) head counts: payload state is laid out by global head
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    # full-attention KV: per component, the shape of one token (global heads)
    kv_token_shapes: list[list[int]]
    conv_kernel_size: int
    state_dtype: str
    act_dtype: str
    # the MTP drafter's steps: its KV and hidden state travel only when both sides draft alike
    mtp_step: int

    def fingerprint(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]


def model_fingerprint(model_dir: str) -> str:
    digest = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        digest.update(json.dumps(json.load(f), sort_keys=True).encode())
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            digest.update(f"{name}:{os.path.getsize(os.path.join(model_dir, name))}".encode())
    return digest.hexdigest()[:16]


RUNTIME_FIELDS = ("state_dtype", "act_dtype", "mtp_step")
MODEL_FIELDS = tuple(name for name in TransferHeader.__struct_fields__ if name not in RUNTIME_FIELDS)


def model_fields(cfg, model_dir: str) -> dict:
    """The header's fields that the checkpoint alone decides (`cfg`: its `ModelConfig`), by global head."""
    spec = cfg.linear
    return dict(
        model_fingerprint=model_fingerprint(model_dir),
        architecture=cfg.arch,
        full_layer_ids=list(cfg.full_layer_ids),
        linear_layer_ids=list(cfg.linear_layer_ids),
        num_k_heads=spec.num_k_heads,
        num_v_heads=spec.num_v_heads,
        head_k_dim=spec.head_k_dim,
        head_v_dim=spec.head_v_dim,
        # GQA: (K, V) of [heads, dim]; MLA: the latent [dim]
        kv_token_shapes=[list(s) for s in cfg.attention.kv_cache_shapes],
        conv_kernel_size=spec.conv_kernel_size,
    )


def model_reference(model_dir: str) -> dict:
    """What the master checks every node's model fields against: its own checkpoint's."""
    return model_fields(load_model_config(model_dir), model_dir)


def runner_header(runner, model_dir: str) -> TransferHeader:
    """The header of a runner (rank 0's with `--tp`): shapes by global head, whatever the ranks."""
    return TransferHeader(
        **model_fields(runner.model_config, model_dir),
        state_dtype=str(runner.config.state_dtype()).removeprefix("torch."),
        act_dtype=str(runner.dtype).removeprefix("torch."),
        mtp_step=runner.mtp_step,
    )


def header_mismatch(expected: dict, found: TransferHeader, source: str = "registered nodes") -> str | None:
    """None when `found` agrees with every field `expected` names, else one line naming every field that differs
    (`source`: whose values `expected` holds)."""
    diffs = [
        f"{name}: {value} ({source}) vs {getattr(found, name)} (this node)"
        for name, value in expected.items()
        if value != getattr(found, name)
    ]
    return "; ".join(diffs) or None
