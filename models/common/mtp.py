"""Multi-token-prediction (MTP) layers: a small extra depth that predicts the token after next.

DeepSeek-V3 (and Kimi K2) and Qwen3.5 / Qwen3-Next ship MTP layers of one shape. At position t, given
the main model's final hidden state h_t (after its final norm, which is what it feeds its head) and
the embedding of the next token x_{t+1}:

    x = projection(cat[embedding_norm(embed(x_{t+1})), hidden_norm(h_t)])      2D -> D
    y = norm(block(x))                                                           one decoder layer
    logits = output_head(y)                                                      the model's own head

which predicts token t+2. `y` is also the hidden state the next depth starts from (a checkpoint
with one MTP layer reuses it for every depth of a longer draft, as vLLM does). The block is one
decoder layer of the family (full attention for the hybrid families) with its own position in the
sequence, so a generation cache holds it as one more layer.

Archon names the parts of layer i `mtp.<i>.{hidden_norm, embedding_norm, projection, block, norm}`;
each family's state-dict converter maps them to its checkpoint's names (`mtp_hf_name`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from archon.head import full_vocab_logits

# The checkpoint names of the parts of a hybrid family's MTP layer (Qwen3.5, Qwen3-Next), whose block
# is `mtp.layers.<i>`.
HYBRID_MTP_PARTS = {
    "hidden_norm": "mtp.pre_fc_norm_hidden",
    "embedding_norm": "mtp.pre_fc_norm_embedding",
    "projection": "mtp.fc",
    "norm": "mtp.norm",
}
MTP_PARTS = ("hidden_norm", "embedding_norm", "projection", "block", "norm")
_MTP_KEY = re.compile(r"mtp\.(\d+)\.(" + "|".join(MTP_PARTS) + r")(?:\.(.+))?")


class MTPLayer(nn.Module):
    """One multi-token-prediction layer (see the module docstring).

    block: a decoder layer of the family, called as the model calls its layers.
    norm_cls: the family's norm (`norm_cls(dim, eps)`) for the two input norms and the output norm.
    zero_first_position: the embedding at sequence position 0 is replaced by zeros before its norm
        (DeepSeek-V3 as vLLM runs it; position 0 has no previous hidden state to pair it with).
    """

    def __init__(self, dim: int, eps: float, block: nn.Module, norm_cls, zero_first_position: bool = False) -> None:
        super().__init__()
        self.hidden_norm = norm_cls(dim, eps)
        self.embedding_norm = norm_cls(dim, eps)
        self.projection = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = norm_cls(dim, eps)
        self.zero_first_position = zero_first_position

    def combine(
        self,
        hidden_TD: torch.Tensor,
        next_token_ids_T: torch.Tensor,
        embed: nn.Module,
        positions_T: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block's input [T, D]: hidden_TD, the main model's final (normed) hidden states at
        positions t, next_token_ids_T the tokens at t+1, embed the model's embedding module.
        positions_T: the positions t, needed by a layer with `zero_first_position`."""
        embedded = embed(next_token_ids_T)
        if self.zero_first_position:
            if positions_T is None:
                raise ValueError("this MTP layer zeroes the embedding at position 0; combine needs positions_T")
            embedded = torch.where(positions_T.unsqueeze(-1) == 0, 0, embedded)
        joined = torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden_TD.to(embedded.dtype))], dim=-1)
        return self.projection(joined)


class MultiTokenPredictionLM:
    """Mixin for a `PackedDecoderLM` with an `mtp` ModuleList of `MTPLayer`s (empty unless loaded)."""

    def mtp_logits(
        self,
        hidden_TD: torch.Tensor,
        next_token_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        depth: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, V], hidden [T, D]) of MTP depth `depth` over whole packed sequences, no cache.

        hidden_TD: `forward(..., return_hidden=True)` of the main model (depth 0) or the hidden this
        method returned for the previous depth; next_token_ids_T: the token after each position
        (the last token of a sequence has none: pass any id, its row predicts nothing);
        positions_T, cu_seqlens, max_seqlen: as for `forward`. Depth d runs MTP layer d modulo the
        number loaded (one layer serves every depth).
        """
        hidden = self.mtp_hidden(hidden_TD, next_token_ids_T, positions_T, cu_seqlens, max_seqlen, depth)
        return full_vocab_logits(hidden, self.output_weight), hidden

    def mtp_hidden(
        self,
        hidden_TD: torch.Tensor,
        next_token_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        depth: int = 0,
        embed=None,
    ) -> torch.Tensor:
        """`mtp_logits`' hidden [T, D] alone (the output head's input), for a chunked head. embed:
        what embeds the next tokens (default the model's embedding)."""
        if len(self.mtp) == 0:
            raise ValueError(
                "this model has no MTP layers loaded; build it with the checkpoint's MTP layers (build_model(mtp=True))"
            )
        layer = self.mtp[depth % len(self.mtp)]
        x = layer.combine(hidden_TD, next_token_ids_T, self.embed_tokens if embed is None else embed, positions_T)
        cos, sin = (None, None) if self.rotary is None else self.rotary(positions_T, x.dtype)
        return layer.norm(layer.block(x, cos, sin, cu_seqlens, max_seqlen, None, None))


def split_mtp_key(archon_key: str) -> tuple[int, str, str] | None:
    """(layer index, part, rest) of an archon name under `mtp.<i>.<part>`, rest "" for the part
    itself; None for a name outside the MTP layers."""
    match = _MTP_KEY.fullmatch(archon_key)
    if match is None:
        return None
    return int(match.group(1)), match.group(2), match.group(3) or ""


def mtp_hf_name(archon_key: str, block_name: str, part_names: dict[str, str], first_layer: int = 0) -> str | None:
    """The checkpoint name of an archon MTP name (a parameter or a module), or None for a name
    outside the MTP layers. block_name: the checkpoint name of layer i's block; part_names: the
    checkpoint name of each other part; each formatted with `layer` = first_layer + i (DeepSeek-V3
    numbers its MTP layers after the decoder layers) and `i`."""
    split = split_mtp_key(archon_key)
    if split is None:
        return None
    index, part, rest = split
    template = block_name if part == "block" else part_names[part]
    head = template.format(layer=first_layer + index, i=index)
    return f"{head}.{rest}" if rest else head
