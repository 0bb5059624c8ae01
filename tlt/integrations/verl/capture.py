"""Target hidden states from verl's old-log-prob forward, as drafter training samples.

Owns the capture: forward hooks on the HF model (post-norm last hidden state = the final norm's
output; EAGLE-3 layers = the inputs of the chosen decoder layers, index ``L`` = the last layer's
output), a wrapper around the engine's ``prepare_model_inputs`` that remembers each micro-batch,
and the split of each captured tensor back into per-sequence samples in both layouts verl 0.9.1
feeds the model:

- remove-padding (``use_remove_padding=True``): one packed row ``[1, total_nnz, H]``, sequence
  boundaries at the micro-batch's nested ``input_ids`` offsets;
- padded: ``[B, max_len, H]``, each sequence right-padded from its nested length.

A sample is ``(input_ids [n], loss_mask [n] (True on response tokens), hidden [n, H],
aux [n, A*H] | None)``: the drafter pairs feature t with token t + 1 itself (EAGLE convention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, Sequence[torch.nn.Module]]:
    """(final norm, decoder layers) of a HF causal LM (``model.model.norm`` / ``.layers``)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "norm") or not hasattr(inner, "layers"):
        raise ValueError(f"{type(model).__name__}: TLT captures hidden states of Llama-family models "
                         "(model.model.norm and model.model.layers)")
    return inner.norm, inner.layers


class HiddenCapture:
    """Hooks that record, per forward call, the post-norm hidden state and the aux layers."""

    def __init__(self, model: torch.nn.Module, aux_layers: Sequence[int] = ()) -> None:
        self.norm, self.layers = decoder_parts(model)
        n = len(self.layers)
        if any(not 0 <= i <= n for i in aux_layers):
            raise ValueError(f"aux layers {tuple(aux_layers)} must lie in 0..{n}")
        self.aux_layers = tuple(aux_layers)
        self.hidden: list[torch.Tensor] = []
        self.aux: list[dict[int, torch.Tensor]] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[HiddenCapture]:
        handles = [self.norm.register_forward_hook(self._on_norm)]
        n = len(self.layers)
        for i in self.aux_layers:
            if i < n:
                handles.append(self.layers[i].register_forward_pre_hook(self._pre(i), with_kwargs=True))
            else:
                handles.append(self.layers[n - 1].register_forward_hook(self._post(i)))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _current_aux(self) -> dict[int, torch.Tensor]:
        if len(self.aux) <= len(self.hidden):
            self.aux.append({})
        return self.aux[-1]

    def _pre(self, i: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self._current_aux()[i] = x.detach().float().cpu()
        return hook

    def _post(self, i: int):
        def hook(module, args, out):
            x = out[0] if isinstance(out, tuple) else out
            self._current_aux()[i] = x.detach().float().cpu()
        return hook

    def _on_norm(self, module, args, out) -> None:
        if self.aux_layers:
            self._current_aux()
        self.hidden.append(out.detach().float().cpu())

    def features(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward call ``k``: hidden [.., H] and concatenated aux [.., A*H] (or None)."""
        aux = None
        if self.aux_layers:
            aux = torch.cat([self.aux[k][i] for i in self.aux_layers], -1)
        return self.hidden[k], aux


def split_sequences(hidden: torch.Tensor, aux: torch.Tensor | None, lengths: Sequence[int],
                    packed: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per-sequence features; hidden: [1, sum(lengths) (+pad), H] packed or [B, L, H] padded."""
    out = []
    if packed:
        assert hidden.shape[0] == 1 and hidden.shape[1] >= sum(lengths), (tuple(hidden.shape), lengths)
        start = 0
        for n in lengths:
            out.append((hidden[0, start:start + n], None if aux is None else aux[0, start:start + n]))
            start += n
    else:
        assert hidden.shape[0] == len(lengths), (tuple(hidden.shape), lengths)
        for b, n in enumerate(lengths):
            out.append((hidden[b, :n], None if aux is None else aux[b, :n]))
    return out


def micro_batch_samples(micro_batch, hidden: torch.Tensor, aux: torch.Tensor | None,
                        packed: bool) -> list[Sample]:
    """Samples of one micro-batch (verl TensorDict with nested ``input_ids`` and ``prompts``)."""
    ids = micro_batch["input_ids"]
    offsets = ids.offsets().tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    prompt_lens = _prompt_lengths(micro_batch, len(lengths))
    values = ids.values().cpu()
    samples = []
    for i, (h, a) in enumerate(split_sequences(hidden, aux, lengths, packed)):
        n = lengths[i]
        mask = torch.zeros(n, dtype=torch.bool)
        mask[prompt_lens[i]:] = True
        samples.append((values[offsets[i]:offsets[i + 1]].clone(), mask, h.clone(),
                        None if a is None else a.clone()))
    return samples


def _prompt_lengths(micro_batch, n: int) -> list[int]:
    if "prompts" in micro_batch.keys():
        p = micro_batch["prompts"]
        if getattr(p, "is_nested", False):
            return p.offsets().diff().tolist()
        return [int(p.shape[-1])] * n
    if "response_mask" in micro_batch.keys():
        total = micro_batch["input_ids"].offsets().diff().tolist()
        resp = micro_batch["response_mask"].offsets().diff().tolist()
        return [t - r for t, r in zip(total, resp)]
    raise ValueError("the old-log-prob micro-batch has neither 'prompts' nor 'response_mask': cannot tell "
                     "response tokens from prompt tokens")
