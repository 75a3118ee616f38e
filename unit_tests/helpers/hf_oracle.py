"""transformers as the independent reference for tiny checkpoints: fp32, CPU, pure-torch linear-attention paths.

transformers binds fla / causal_conv1d kernels when the modeling module is imported (if `import fla` works), and on
CPU those run only under Triton's interpreter (100-700x slower). Rather than hiding `fla` in `sys.modules` (which
would break other tests that import it), `torch_paths()` swaps the modeling modules' kernel wrappers for their
torch fallbacks while a load or forward runs, and restores them afterwards; every `HFOracle` method uses it.

Only APIs present in both transformers 5.17 and 5.24 are used (caches are passed as `past_key_values=`).

    from unit_tests.helpers.hf_oracle import HFOracle
    oracle = HFOracle(model_dir)
    oracle.prefill_logits(ids)              # [B, T, V] fp32; ids is [T] or [B, T]
    oracle.decode_logits(ids, prefill_len)  # [B, T, V]: prefill, then one token at a time through the cache
    oracle.hidden_states(ids)               # [B, T, H] final-normed
    oracle.greedy(prompt, max_new_tokens)   # list[int], optional eos_token_id stops early
    oracle.mtp_draft_logits(ids)            # [B, T-1, V] (Qwen checkpoints with mtp.* weights)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

# re-exported: tests patch transformers through this name
from lightllm.tools.hf_torch_paths import torch_paths  # noqa: F401


@contextlib.contextmanager
def _reference_mode():
    """torch paths, on one intra-op thread: tiny shapes gain nothing from threads, and on a busy machine
    multi-threaded small kernels slow down by 10-50x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch_paths():
            yield
    finally:
        torch.set_num_threads(threads)


def _as_batch(ids) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    return t[None] if t.dim() == 1 else t


def mtp_state_dict(model_dir: str | Path, num_mtp_layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's `mtp.*` tensors renamed to `transformers.modeling_layers.MtpModel` parameter names.

    mtp.fc -> eh_proj, pre_fc_norm_embedding -> enorm, pre_fc_norm_hidden -> hnorm, mtp.norm -> post_norm,
    mtp.layers.{i}.* -> layers.{i}.mtp_block.*, per-expert gate/up/down -> fused experts.gate_up_proj [E, 2I, H]
    (gate rows first) and experts.down_proj [E, H, I]. With one MTP layer the shared fc/norms belong to layer 0.
    """
    from safetensors import safe_open

    raw: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            raw.update({k: f.get_tensor(k).float() for k in f.keys() if k.startswith("mtp.")})
    assert num_mtp_layers == 1, "only single-layer MTP checkpoints are mapped"
    shared = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "post_norm"}
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in raw.items():
        parts = name.split(".")
        if parts[1] in shared:
            state[f"layers.0.{shared[parts[1]]}.{'.'.join(parts[2:])}"] = tensor
            continue
        assert parts[1] == "layers", name
        rest = ".".join(parts[3:])
        if ".experts." in rest and rest.split(".experts.")[1][0].isdigit():
            prefix, tail = rest.split(".experts.")
            index, proj = int(tail.split(".")[0]), tail.split(".")[1]
            experts.setdefault(f"layers.{parts[2]}.mtp_block.{prefix}.experts|{proj}", {})[index] = tensor
            continue
        state[f"layers.{parts[2]}.mtp_block.{rest}"] = tensor
    bases = {key.split("|")[0] for key in experts}
    for base in bases:
        stack = {proj: experts[f"{base}|{proj}"] for proj in ("gate_proj", "up_proj", "down_proj")}
        order = sorted(stack["down_proj"])
        gate_up = [torch.cat([stack["gate_proj"][e], stack["up_proj"][e]], dim=0) for e in order]
        state[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{base}.down_proj"] = torch.stack([stack["down_proj"][e] for e in order])
    return state


class HFOracle:
    """A tiny checkpoint loaded with transformers (fp32, CPU, eval) plus reference forward passes."""

    def __init__(self, model_dir: str | Path):
        import transformers

        self.model_dir = str(model_dir)
        with _reference_mode():
            self.model = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        self.config = self.model.config
        self._mtp = None

    @torch.no_grad()
    def prefill_logits(self, ids) -> torch.Tensor:
        """Logits [B, T, V] of one full forward over `ids` ([T] or [B, T])."""
        with _reference_mode():
            return self.model(input_ids=_as_batch(ids)).logits.float()

    @torch.no_grad()
    def hidden_states(self, ids) -> torch.Tensor:
        """Final-normed last hidden states [B, T, H] (what the LM head and the MTP head consume)."""
        with _reference_mode():
            out = self.model(input_ids=_as_batch(ids), output_hidden_states=True)
        return out.hidden_states[-1].float()

    @torch.no_grad()
    def decode_logits(self, ids, prefill_len: int = 1) -> torch.Tensor:
        """Logits [B, T, V]: a prefill of the first `prefill_len` tokens, then one cached decode step per token."""
        ids = _as_batch(ids)
        assert 1 <= prefill_len <= ids.shape[1]
        with _reference_mode():
            out = self.model(input_ids=ids[:, :prefill_len], use_cache=True)
            logits, cache = [out.logits], out.past_key_values
            for t in range(prefill_len, ids.shape[1]):
                out = self.model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                logits.append(out.logits)
                cache = out.past_key_values
        return torch.cat(logits, dim=1).float()

    @torch.no_grad()
    def greedy(self, prompt, max_new_tokens: int, eos_token_id: int | list[int] | None = None) -> list[int]:
        """Greedy continuation of one prompt ([T]) through the cache; stops after an eos id if one is given."""
        ids = _as_batch(prompt)
        assert ids.shape[0] == 1, "greedy() takes one prompt"
        stop = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        generated: list[int] = []
        with _reference_mode():
            out = self.model(input_ids=ids, use_cache=True)
            for _ in range(max_new_tokens):
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
                if token in stop:
                    break
                step = torch.tensor([[token]], dtype=torch.long)
                out = self.model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
        return generated

    def _mtp_model(self):
        if self._mtp is None:
            from transformers.modeling_layers import MtpModel

            text_config = self.config.get_text_config()
            # Released configs name the MTP depth `mtp_num_hidden_layers` (or not at all); MtpModel reads these two.
            num_mtp = getattr(text_config, "mtp_num_hidden_layers", None) or 1
            text_config.num_mtp_layers = num_mtp
            text_config.mtp_layer_types = ["full_attention"] * num_mtp
            # MtpModel.from_pretrained only maps Qwen's mtp.* names from 5.24 on, so load them here (same mapping).
            with torch.random.fork_rng(devices=[]):
                mtp = MtpModel(self.model, num_mtp).float().eval()
            state = mtp_state_dict(self.model_dir, num_mtp)
            missing, unexpected = mtp.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.startswith(("embed_tokens.", "shared_head.", "rotary_emb."))]
            assert not missing and not unexpected, f"MTP load: missing {missing}, unexpected {unexpected}"
            mtp.tie_with_main_model(self.model)
            self._mtp = mtp
        return self._mtp

    @torch.no_grad()
    def mtp_draft_logits(self, ids, position_ids=None) -> torch.Tensor:
        """Draft logits [B, T-1, V] of the first MTP layer over a whole sequence.

        Row t combines the main model's final-normed hidden state at position t with the embedding of token t+1 and
        predicts token t+2: `lm_head(norm(block(fc(cat[enorm(embed(x[t+1])), hnorm(h[t])]))))`. Positions default to
        0..T-2 (the main model's positions of h); with RoPE only relative positions matter for a whole sequence.
        """
        ids = _as_batch(ids)
        mtp = self._mtp_model()
        hidden = self.hidden_states(ids)[:, :-1]
        next_ids = ids[:, 1:]
        if position_ids is None:
            position_ids = torch.arange(next_ids.shape[1])[None].expand(ids.shape[0], -1)
        with _reference_mode():
            embeds = mtp.embed_tokens(next_ids)
            masks = mtp.create_masks_for_mtp_layer(0, embeds, None, position_ids)
            rope_positions = position_ids
            if "mrope_section" in (getattr(mtp.config, "rope_parameters", None) or {}):
                # Text-only M-RoPE: the three position streams are equal; 5.17's rotary wants them spelled out.
                rope_positions = position_ids[None].expand(3, -1, -1)
            rope = mtp.rotary_emb(embeds, position_ids=rope_positions)
            # Positional call: the cache keyword is `past_key_values` in 5.17 and `cache` in 5.24.
            out = mtp.layers[0](embeds, hidden, rope, masks.get("attention_mask"), position_ids, None)
            return mtp.shared_head(out).float()
