"""cfg.py as most users write one: the model is a class of the file's own, wrapping real
all-MiniLM-L6-v2 (the encoder's token states, pooled and normalised here), over 384 real
sentences at natural length.

    python -m benchmarks.predict --cfg benchmarks/text/wrapped_cfg.py --compiled --n-trials 8

Every compiled trial of such a file failed once ("No module named '__autotune_cfg__'"): the
class lives in the cfg, which the trial workers receive by value.
"""

import torch
from torch import nn

from benchmarks.text.workload import dataset as _sentences
from benchmarks.text.workload import minilm


class Embedder(nn.Module):
    """The encoder's token states, mean-pooled over the real tokens and L2-normalised."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = minilm()

    def token_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        enc = self.encoder
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = enc.norm(enc.word(input_ids) + enc.position(positions) + enc.token_type(torch.zeros_like(input_ids)))
        mask = (1.0 - attention_mask.to(x.dtype))[:, None, None, :] * torch.finfo(x.dtype).min
        for layer in enc.layers:
            x = layer(x, mask)
        return x  # (B, T, 384)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.token_states(input_ids, attention_mask)
        keep = attention_mask.unsqueeze(-1).to(states.dtype)  # (B, T, 1)
        pooled = (states * keep).sum(1) / keep.sum(1).clamp(min=1)
        return nn.functional.normalize(pooled, dim=-1)


def model() -> Embedder:
    return Embedder().eval()


def dataset() -> list:
    """384 real sentences, tokenized at their natural lengths."""
    return [{k: v for k, v in s.items() if k != "token_type_ids"} for s in _sentences(384)]
