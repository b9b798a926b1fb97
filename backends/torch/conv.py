"""LFM2's short convolution layers, computed over the paged cache.

An LFM2 conv layer projects each token to three vectors ``B``, ``C`` and ``x`` (``in_proj``),
convolves ``B * x`` along the sequence, each channel with its own ``kernel``-tap filter (causal:
a token sees itself and the ``kernel - 1`` tokens before it), multiplies the result by ``C``
and projects it back (``out_proj``). Transformers and vLLM keep each sequence's last inputs as a
recurrent state (``kernel`` of them, and ``kernel - 1``).

Here a token's convolution input ``B * x`` is cached in its own slot, as a layer's keys are (one
"head" of ``hidden_size`` numbers), and the filter reads the slots of the token's ``kernel``
positions: attention over a fixed window with fixed weights. So everything the paged cache does
holds for these layers unchanged: chunked prompts read the inputs of earlier chunks, shared
prefixes are reused from the prefix cache, a preempted sequence recomputes its slots, a
cancelled one frees them. The price is memory: ``hidden_size`` numbers a token a conv layer
where the recurrent state is ``(kernel - 1) x hidden_size`` a sequence (LFM2-1.2B: 2,048 a token,
where an attention layer's keys and values take 1,024).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionMetadata


class ShortConv(nn.Module):
    """One LFM2 conv layer (``layer``: its index, which cache tensor holds its inputs)."""

    sliding = False  # what the decoder asks of a layer's mixer: no window, no rotary
    rotates = False

    def __init__(self, hidden_size: int, kernel: int, bias: bool, layer: int) -> None:
        super().__init__()
        self.layer, self.hidden, self.kernel = layer, hidden_size, kernel
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        # The filters as [kernel, hidden] (tap j reads position p - kernel + 1 + j); the
        # checkpoint's Conv1d weight is [hidden, 1, kernel].
        self.taps = nn.Parameter(torch.empty(kernel, hidden_size), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if bias else None
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, rope: object, meta: AttentionMetadata, q_scale: object = None) -> torch.Tensor:
        n = x.shape[0]
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        inputs = b * v
        cache = meta.k_cache[self.layer]  # [slots, 1, hidden]
        cache.index_copy_(0, meta.slot_mapping, inputs.unsqueeze(1).to(cache.dtype))
        # Each row's window of inputs, positions p - kernel + 1 .. p (those before the sequence
        # began read slot 0 and are zeroed), multiplied out in float32 and rounded once, as
        # transformers' conv1d does.
        window = cache.index_select(0, meta.conv_slots.view(-1)).view(n, self.kernel, self.hidden).float()
        window = window * meta.conv_valid[..., None]
        out = (window * self.taps.float()).sum(dim=1)
        if self.conv_bias is not None:
            out = out + self.conv_bias.float()
        return self.out_proj(c * out.to(x.dtype))

    def load(self, prefix: str, weights) -> None:
        """The layer's weights (``prefix``: ``layers.N.conv.``) from an LFM2 checkpoint."""
        weights.copy(self.in_proj.weight, prefix + "in_proj.weight")
        weights.copy(self.out_proj.weight, prefix + "out_proj.weight")
        name = prefix + "conv.weight"
        weights.copy(self.taps, name, weights.filters(name, self.hidden, self.kernel).T)
        if self.conv_bias is not None:
            weights.copy(self.in_proj.bias, prefix + "in_proj.bias")
            weights.copy(self.out_proj.bias, prefix + "out_proj.bias")
            weights.copy(self.conv_bias, prefix + "conv.bias")


def conv_windows(positions: torch.Tensor, tables: torch.Tensor, table_of: torch.Tensor, block_size: int,
                 kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``kernel`` cache slots (positions ``p - kernel + 1`` .. ``p`` of its sequence,
    ``tables[table_of[row]]`` its block table) and which of them are in the sequence."""
    back = torch.arange(kernel - 1, -1, -1, device=positions.device)
    pos = positions[:, None] - back  # [rows, kernel]
    valid = pos >= 0
    pos = pos.clamp(min=0)
    blocks = tables[table_of].gather(1, pos // block_size)
    return blocks * block_size + pos % block_size, valid
