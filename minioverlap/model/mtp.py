# >>> ch09 file: the MTP layer
"""The MTP (multi-token prediction) layer, in DeepSeek-V3's layout: the drafter of chapter 09.

One decoder layer that predicts the token after next. Its row at position p mixes two inputs, the
embedding of token t(p+1) and the main model's final hidden state h(p) (after its last norm):

    x = eh_proj(cat(enorm(embed(t(p+1))), hnorm(h(p))))      # [T, 2H] -> [T, H]
    out = shared_head.norm(decoder_layer(x))                  # its own attention, over its own KV cache
    logits = lm_head(out)                                     # a guess at t(p+2)

The embedding and the LM head are the main model's (shared, not stored twice). The layer keeps its own
K and V, at the same KV slots as the main model's (a one-layer KV pool of its own), so a row at position
p attends to rows 0..p, as a main-model layer does. A checkpoint stores it after the decoder layers, as
`model.layers.{num_hidden_layers}.*` (enorm, hnorm, eh_proj, self_attn, mlp, shared_head.norm).

References: DeepSeek-V3 technical report (2024), section 2.2; SGLang's deepseek_nextn.py, whose order
of the concatenation (embedding first) this file keeps.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from minioverlap.model.loader import CheckpointError, check_shapes, read_tensors, weight_files
from minioverlap.model.qwen3 import AttentionContext, DecoderLayer, Qwen3Config, Qwen3ForCausalLM, RMSNorm, rope_cos_sin


class SharedHead(nn.Module):
    """The MTP layer's own final norm (its `head` is the main model's, shared)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(DecoderLayer):
    """A decoder layer with an input mixer (enorm, hnorm, eh_proj) and an output norm."""

    def __init__(self, target: Qwen3ForCausalLM) -> None:
        c = target.config
        super().__init__(c, layer_id=0)          # its K and V: layer 0 of the drafter's own KV pool
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.shared_head = SharedHead(c.hidden_size, c.rms_norm_eps)
        self.target = [target]         # in a list: the shared embedding and head are not this module's weights

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """Tokens t(p+1) [T], hidden states h(p) [T, H] and positions p [T] -> the MTP hidden state [T, H]."""
        target = self.target[0]
        cos, sin = rope_cos_sin(positions, target.config.head_dim, target.config.rope_theta)
        embeds = target.model.embed_tokens(input_ids)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.block(x, cos, sin, ctx)

    def block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The decoder layer over the mixed input, then the output norm."""
        return self.shared_head.norm(super().forward(x, cos, sin, ctx))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(hidden)


def mtp_tensors(model_dir: Path, config: Qwen3Config, layer: MTPLayer) -> tuple[str, dict[str, Path], dict[str, tuple[int, ...]]]:
    """The MTP layer's tensors in the checkpoint: their name prefix (model.layers.{L}.), the files by
    tensor name, and each tensor's full shape (those of `layer`, a layer of the checkpoint's shapes). A
    checkpoint without an MTP layer is a ValueError naming it; a missing tensor, a CheckpointError."""
    if config.num_nextn_predict_layers < 1:
        raise ValueError(f"mtp_steps > 0 needs an MTP layer, but {model_dir} has none "
                         f"(config.json: num_nextn_predict_layers = {config.num_nextn_predict_layers})")
    prefix, files = f"model.layers.{config.num_hidden_layers}.", weight_files(model_dir)
    expected = {prefix + name: tuple(p.shape) for name, p in layer.state_dict().items()}
    missing = [name for name in expected if name not in files]
    if missing:
        raise CheckpointError(f"{model_dir}: MTP tensor {missing[0]!r} is missing")
    return prefix, files, expected


def load_mtp(model_dir: Path, target: Qwen3ForCausalLM,
             # >>> ch15: the layer's class, chosen once at load (the fast path's, or this one)
             mtp_class: type[MTPLayer] = MTPLayer,
             # <<< ch15
             ) -> MTPLayer:
    """The checkpoint's first MTP layer, on the target's device and in its dtype. A checkpoint without one
    is a ValueError naming it."""
    # >>> ch15 replaces ch09: of the class chosen at load
    #| with torch.device("meta"):
    #|     mtp = MTPLayer(target)
    with torch.device("meta"):
        mtp = mtp_class(target)
    # <<< ch15
    prefix, files, expected = mtp_tensors(model_dir, target.config, mtp)
    tensors = read_tensors(files, list(expected))
    check_shapes(files, expected, tensors)
    weight = target.model.embed_tokens.weight
    state = {name[len(prefix):]: t.to(device=weight.device, dtype=weight.dtype) for name, t in tensors.items()}
    mtp.load_state_dict(state, assign=True)
    return mtp.eval()
