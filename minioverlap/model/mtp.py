# >>> ch09 file: the MTP layer
"""The multi-token-prediction (MTP) layer, in DeepSeek-V3's layout.

One extra decoder layer that predicts the token after next. For position i it takes the main model's
final hidden state h[i] (which predicted token i+1) and the embedding of token i+1, and mixes them:

    x = eh_proj([enorm(embed(token[i+1])); hnorm(h[i])])      # 2H -> H
    out = shared_head.norm(decoder_layer(x))                  # own attention, own KV cache
    logits = lm_head(out)                                     # the main model's head, shared

Fed its own output as the next h, the layer drafts several tokens in a row. Its weights are stored
after the main layers as `model.layers.{num_hidden_layers}.*` (DeepSeek-V3 naming); the embedding and
the LM head are the main model's. Reference: DeepSeek-V3 technical report (2024), section 2.2.
"""

from __future__ import annotations

import torch
from torch import nn

from minioverlap.model.qwen3 import AttentionContext, DecoderLayer, Qwen3Config, RMSNorm


class SharedHead(nn.Module):
    """Holds only the norm: the head's matrix is the main model's lm_head."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """A decoder layer with an input mixer (enorm, hnorm, eh_proj) and an output norm."""

    def __init__(self, config: Qwen3Config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """embeds of tokens i+1 and main hidden states of tokens i, [T, H] each -> MTP hidden [T, H]."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin, ctx))
