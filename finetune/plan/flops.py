"""The model FLOPs of training: what the matmuls of the forward and backward passes cost, counted from the model's
shape, the recipe and the real lengths of the data's examples.

Matmuls only, 2 FLOPs per multiply-add, as MFU counts them (norms, activations, softmax and the optimizer are
memory-bound and left out):

  forward    the decoder's Linear layers on every token (of a mixture of experts, the router and the k experts a
             token goes to), LoRA's two small matmuls per adapted layer, attention's scores and weighted values
             (a full square per example and layer, capped at the window on sliding-window layers, as
             torch.utils.flop_counter counts them), and the head only on the tokens that carry loss (TRL's
             chunked loss never computes the others)
  backward   full: the gradients of the inputs and of the weights (2x the forward); LoRA and QLoRA: the input
             gradients through the frozen base (1x), the adapter's both; attention 2x its forward; the head's input
             gradient, and its weight gradient when it trains
  recompute  gradient checkpointing runs each decoder layer's forward again during the backward pass, up to the
             last tensor the backward needs

The rules of thumb, 6N per token for full fine-tuning and 4N for a frozen base (N: parameters), count every
parameter on every token: the embedding (a lookup, no matmul), the head on prompt tokens the loss skips, and every
expert; they leave out attention. `Flops.rule_of_thumb` is shown beside the count so the difference is visible.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    """What a set of examples asks of a model: its tokens, the tokens that carry loss, and each example's length."""

    tokens: int
    trained_tokens: int
    lengths: tuple[int, ...]  # one per example (packed rows hold several)


@dataclass(frozen=True)
class Layout:
    """What the count needs of a model besides shapes.Shape: which layers attend through a window."""

    window: int | None  # the sliding window, on the layers that have one
    windowed_layers: int
    experts: int  # experts per MoE layer, 0 for a dense model


@dataclass(frozen=True)
class Flops:
    forward: float
    backward: float
    recompute: float
    tokens: int
    rule_of_thumb: float  # 6N or 4N per token, times the tokens

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute

    @property
    def per_token(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0

    def times(self, factor: float) -> Flops:
        """The same mix of examples, `factor` times as much (epochs, or the steps of part of an epoch)."""
        return Flops(self.forward * factor, self.backward * factor, self.recompute * factor,
                     round(self.tokens * factor), self.rule_of_thumb * factor)


def layout_of(config) -> Layout:
    text = config.get_text_config()
    types = getattr(text, "layer_types", None) or []
    window = getattr(text, "sliding_window", None)
    windowed = sum(1 for kind in types if kind == "sliding_attention") if window else 0
    return Layout(window if windowed else None, windowed, getattr(text, "num_local_experts", 0) or 0)


def attention_keys(length: int, window: int | None) -> int:
    """Query-key pairs one example computes: the full square, or each query's window of keys."""
    if window is None or length <= window:
        return length * length
    return length * window


def count(shape, layout: Layout, method: str, checkpointing: bool, work: Work) -> Flops:
    """The FLOPs of training on `work` once (one pass over those examples)."""
    experts_active = shape.experts * shape.experts_per_token / layout.experts if layout.experts else 0
    linear = 2 * (shape.linear + experts_active) * work.tokens
    adapter = 2 * shape.adapter * work.tokens if method != "full" else 0
    full_layers = shape.layers - layout.windowed_layers
    pairs = (full_layers * sum(attention_keys(n, None) for n in work.lengths)
             + layout.windowed_layers * sum(attention_keys(n, layout.window) for n in work.lengths))
    attention = 4 * shape.q_width * pairs  # scores (q.k) and weighted values, 2 FLOPs per multiply-add each
    head = 2 * shape.hidden * shape.vocab * work.trained_tokens
    if method == "full":
        backward = 2 * linear + 2 * attention + 2 * head
        rule = 6 * shape.parameters * work.tokens
    else:  # the frozen base and head pass on input gradients only
        backward = linear + 2 * adapter + 2 * attention + head
        if not checkpointing:  # nothing below the first layer's q, k and v projections needs a gradient
            backward -= 2 * shape.hidden * (shape.q_width + 2 * shape.kv_width) * work.tokens
        rule = 4 * shape.parameters * work.tokens
    recompute = 0
    if checkpointing:
        # torch's checkpoint stops recomputing once it has every tensor the backward needs: under full fine-tuning
        # each layer's last matmul (the MLP's down projection, whose output nothing saves) is not run again
        last = 2 * shape.hidden * shape.intermediate * max(shape.experts_per_token, 1) * shape.layers * work.tokens
        recompute = linear + adapter + attention - (last if method == "full" else 0)
    return Flops(linear + adapter + attention + head, backward, recompute, work.tokens, rule)
