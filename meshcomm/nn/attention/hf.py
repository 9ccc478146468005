"""Hugging Face transformers models under context parallelism: an attention function for
transformers' registry (`AttentionInterface`) that runs `mc.nn.attention` on this rank's
query, key and value, whose sequence is split as `layout` says.

    name = mc.nn.register_hf_attention(bound, "(dp b) h (cp s) d")
    model.set_attn_implementation(name)       # or config._attn_implementation = name
    logits = model(input_ids=my_ids, position_ids=my_positions).logits

Each rank passes its own tokens and their global positions (`Layout.indices` of the same
layout; the rotary embedding reads them), so token ids, positions and labels follow one
layout. The model's own mask is not used (the registered mask function returns None): the
mask comes from the positions (`causal`, and a module's `sliding_window` when it has one).
Labels must be shifted before they are split (a rank's last token predicts the next rank's
first), so compute the loss outside the model. Needs transformers (the `test` extra has it).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...core.layout import Layout
from ...runtime.bind import BoundMesh, require_bound
from . import attention


def register_hf_attention(bound: BoundMesh, layout: str | Layout = "(dp b) h (cp s) d", *,
                          name: str = "meshcomm", strategy: str = "auto") -> str:
    """Register `name` in transformers' attention and mask registries, running
    `mc.nn.attention(q, k, v, bound, layout, causal=True, strategy=strategy)` on every
    attention layer; returns `name` (give it to `model.set_attn_implementation`). The
    layout names q's dims in transformers' order (batch, heads, sequence, head dim)."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    bound = require_bound(bound, "register_hf_attention")
    lay = Layout.parse(layout)

    def forward(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[Tensor, None]:
        if dropout:
            raise ValueError(f"register_hf_attention: attention dropout {dropout} is not"
                             " supported under context parallelism; fix: attention_dropout=0")
        window = getattr(module, "sliding_window", None)
        out = attention(query, key, value, bound, lay, causal=getattr(module, "is_causal", True),
                        window=window, scale=scaling, strategy=strategy)
        return out.transpose(1, 2).contiguous(), None

    def no_mask(*args: Any, **kwargs: Any) -> None:
        return None

    transformers.AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, no_mask)
    return name
