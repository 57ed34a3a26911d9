"""Tiny models and datasets for the tests, including models that fail on purpose.

Every faulty model misbehaves only at one batch size (or under autocast), so the baseline
(batch 8, float32) runs and the study can go on past the fault.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn


def _projection(features: int = 16, classes: int = 4) -> torch.Tensor:
    return torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))


def classification_data(n: int = 256, features: int = 16, classes: int = 4, seed: int = 0) -> list:
    """(features,) float inputs with integer labels from a fixed projection."""
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed))
    y = (x @ _projection(features, classes)).argmax(1)
    return list(zip(x, y, strict=True))


def image_data(n: int = 64, seed: int = 0) -> list:
    """(3, 8, 8) images with labels."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 8, 8, generator=gen), torch.tensor(i % 4)) for i in range(n)]


class MLP(nn.Module):
    def __init__(self, features: int = 16, classes: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


class HangAt(MLP):
    """Sleeps far past any trial timeout at one batch size."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.batch:
            time.sleep(3600)
        return super().forward(x)


class KillAt(MLP):
    """Kills its own process at one batch size, as a segfault in a kernel would."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


class OomAt(MLP):
    """Raises the allocator's out-of-memory error from a batch size on."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.batch:
            raise torch.OutOfMemoryError(f"Tried to allocate {x.shape[0] * 1024} MiB (test)")
        return super().forward(x)


class NanUnderAutocast(MLP):
    """Overflows to NaN in reduced precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if torch.is_autocast_enabled("cpu"):
            return out * float("nan")
        return out


class Oracle(nn.Module):
    """Knows the projection behind :func:`classification_data`: 100% accuracy."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(_projection().T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class WrongButFastUnderAutocast(Oracle):
    """Under autocast skips its work and returns negated logits: the fastest candidate, and a wrong one."""

    def __init__(self) -> None:
        super().__init__()
        self.heavy = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            return -super().forward(x)  # top-1 becomes the least likely class
        for _ in range(50):
            x = x + 0.0 * self.heavy(x)
        return super().forward(x)


class CudaMemoryHog(MLP):
    """Allocates 1 GiB of GPU memory per sample: a real CUDA out-of-memory at large batches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(x.shape[0], 2**28, device=x.device)  # 2**28 float32 = 1 GiB per sample
        return super().forward(x) + 0 * scratch[:, :4].sum()


class TinyEncoder(nn.Module):
    """Token ids (B, 16) and a padding mask (B, 16) -> 4 logits: a transformer encoder classifier."""

    def __init__(self, vocab: int = 100, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(ids), src_key_padding_mask=mask)
        keep = (~mask).unsqueeze(-1).float()
        return self.head((hidden * keep).sum(1) / keep.sum(1).clamp_min(1.0))


def token_data(n: int = 256, seed: int = 0) -> list:
    """Dict samples {"ids", "mask", "labels"}: the model's keyword inputs and a target."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        ids = torch.randint(0, 100, (16,), generator=gen)
        mask = torch.zeros(16, dtype=torch.bool)
        mask[12 + i % 4 :] = True  # the last 0-3 positions are padding
        samples.append({"ids": ids, "mask": mask, "labels": torch.tensor(int(ids[0]) % 4)})
    return samples


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


class ItemBranch(nn.Module):
    """Branches on a tensor's value: torch.export refuses it, and a trace bakes in one branch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if x.sum().item() > 0 else -self.linear(x)


class Quirky(MLP):
    """Right at batch sizes 8 and 16, wrong (negated logits) at 32, out of memory from 64 on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 64:
            raise torch.OutOfMemoryError(f"Tried to allocate {x.shape[0] * 1024} MiB (test)")
        out = super().forward(x)
        return -out if x.shape[0] == 32 else out


class StateProbe(MLP):
    """An MLP that records, at each forward, the batch size and the process-wide state it ran
    under (threads, autocast, flush-denormal-sensitive math aside), in a class-level log that
    survives the deep copies each build makes."""

    log: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch._inductor.config as inductor_config

        StateProbe.log.append(
            {
                "batch": x.shape[0],
                "threads": torch.get_num_threads(),
                "autocast": torch.is_autocast_enabled("cpu"),
                "inductor_freezing": inductor_config.freezing,
                "mha_fastpath": torch.backends.mha.get_fastpath_enabled(),
            }
        )
        return super().forward(x)


class ReturnsNone(MLP):
    """A forward that computes and returns nothing (a common bug: a missing ``return``)."""

    def forward(self, x: torch.Tensor) -> None:
        super().forward(x)


class BigActivations(nn.Module):
    """Allocates about ``mib`` MiB of activations per call: memory a trial must count as its own."""

    def __init__(self, mib: int = 200) -> None:
        super().__init__()
        self.n = mib * 2**20 // 4
        self.linear = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.ones(self.n)  # touched, so it is resident
        return self.linear(x) + big[:1]


class CpuHog:
    """A process that keeps one core busy for at most ``seconds``, as another user's work would.

    It is started through a launcher that exits at once, so it is not a descendant of the test
    process: autotune counts its own process tree (loader workers) as its own work, and another
    user's process is not in it.
    """

    def __init__(self, seconds: float = 120.0) -> None:
        import subprocess
        import sys

        busy = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
        launch = (
            "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', "
            f"{busy!r}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True).pid)"
        )
        done = subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, check=True)
        self.pid = int(done.stdout.strip())
        # Busy before the caller goes on: an interpreter still starting uses little CPU, and a
        # short first trial could end before the loop began (a flaky "the run says so" test).
        import time

        import psutil

        proc, deadline = psutil.Process(self.pid), time.monotonic() + 10.0
        while time.monotonic() < deadline and sum(proc.cpu_times()[:2]) < 0.3:
            time.sleep(0.02)

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class TinyEmbedder(nn.Module):
    """Token ids (B, 16) and an ``attention_mask`` (B, 16; 1 = real) -> a (B, 64) sentence embedding.

    Like real encoders, one dimension carries a large constant ("massive activation"), so the
    embedding's argmax never moves however the others are damaged.
    """

    def __init__(self, vocab: int = 100, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.register_buffer("outlier", torch.eye(width)[0] * 10.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        keep = attention_mask.unsqueeze(-1).float()
        return (hidden * keep).sum(1) / keep.sum(1).clamp_min(1.0) + self.outlier


def sentence_data(n: int = 128, seed: int = 0) -> list:
    """Dict samples {"input_ids", "attention_mask"} with 0-3 padded positions and no target."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        mask = torch.ones(16, dtype=torch.long)
        mask[12 + i % 4 :] = 0
        samples.append({"input_ids": torch.randint(0, 100, (16,), generator=gen), "attention_mask": mask})
    return samples


class TextEncoder(nn.Module):
    """A sentence encoder as Hugging Face models take their inputs: ``input_ids`` and
    ``attention_mask`` (B, S), 1 on real tokens -> a mean-pooled, normalised embedding (B, 32)."""

    def __init__(self, vocab: int = 200, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(128, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.embed(input_ids) + self.position(positions)
        hidden = self.encoder(hidden, src_key_padding_mask=attention_mask == 0)
        keep = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return nn.functional.normalize(pooled, dim=-1)


def text_data(n: int = 128, seed: int = 0, pad_to: int | None = None, mask: bool = True) -> list:
    """Token-id samples of natural lengths (4 to 48 tokens): ``{"input_ids", "attention_mask"}``
    at their own length, or right-padded to ``pad_to`` (a pre-padded dataset); without ``mask``,
    ``input_ids`` alone."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(4, 49, (1,), generator=gen))
        ids = torch.randint(1, 200, (length,), generator=gen)
        width = pad_to or length
        padded = torch.zeros(width, dtype=torch.long)
        padded[:length] = ids
        real = torch.zeros(width, dtype=torch.long)
        real[:length] = 1
        samples.append({"input_ids": padded, "attention_mask": real} if mask else {"input_ids": padded})
    return samples


class FragileMLP(nn.Module):
    """Linear 16-32-32-32-8 whose second layer (``fc.2``) reads an outlier channel: per-tensor
    int8 of its input crushes every other channel, while the other layers quantize well."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)
        )
        with torch.no_grad():
            self.fc[0].bias[0] = 300.0  # channel 0 of fc.2's input is ~300, the rest ~1
            self.fc[2].weight[:, 0] /= 300.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class FragileCNN(nn.Module):
    """Three 3x3 convolutions and a linear head whose second convolution (``convs.2``) reads an
    outlier channel: per-tensor int8 of its input crushes every other channel, while the other
    layers quantize well. The convolutional twin of :class:`FragileMLP`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(16, 8)
        with torch.no_grad():
            self.convs[0].bias[0] = 300.0  # channel 0 of convs.2's input is ~300, the rest ~1
            self.convs[2].weight[:, 0] /= 300.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.convs(x).mean(dim=(2, 3)))


def bare_images(n: int = 128, seed: int = 0) -> list:
    """Images of 3 x 8 x 8 normal values, no target."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 8, 8, generator=gen) for _ in range(n)]


def vector_data(n: int = 128, seed: int = 0) -> list:
    """Samples of 16 normal features, no target."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, generator=gen) for _ in range(n)]


class LineRecognizer(nn.Module):
    """A text-line recognizer in miniature: conv layers, then a sequence over the width.
    ``(batch, 1, 16, W)`` images in, ``(batch, W / 4, classes)`` scores out."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.convs(x)  # (batch, 16, 4, W / 4)
        return self.head(f.permute(0, 3, 1, 2).flatten(2))  # (batch, W / 4, classes)


def line_data(n: int = 40, seed: int = 0) -> list:
    """``((1, 16, W) image, (W / 4,) labels)`` with widths from 16 to 60 in steps of 4."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        width = 4 * int(torch.randint(4, 16, (1,), generator=gen))
        out.append((torch.randn(1, 16, width, generator=gen), torch.randint(0, 10, (width // 4,), generator=gen)))
    return out


def pad_to_widest(samples: list) -> tuple:
    """A collate as users write one for text lines: images padded with zeros to the batch's
    widest, labels with -1."""
    width = max(x.shape[-1] for x, _ in samples)
    images = torch.stack([nn.functional.pad(x, (0, width - x.shape[-1])) for x, _ in samples])
    labels = nn.utils.rnn.pad_sequence([y for _, y in samples], batch_first=True, padding_value=-1)
    return images, labels


class HalfMap(nn.Module):
    """A dense predictor in miniature: ``(batch, 3, H, W)`` images in, ``(batch, 2, H / 2, W / 2)``
    score maps out. One strided convolution, then a pointwise one, so a pixel's score depends
    on its own neighbourhood only and padding beyond the image changes no real pixel's score."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.score = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(torch.relu(self.down(x)))


def page_data(n: int = 32, seed: int = 0) -> list:
    """``((3, H, W) image, label)`` pages of several aspect ratios, even sides from 8 to 30."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        h, w = (2 * int(v) for v in torch.randint(4, 16, (2,), generator=gen))
        out.append((torch.randn(3, h, w, generator=gen), torch.tensor(i % 2)))
    return out


class EncodedImages(torch.utils.data.Dataset):
    """Images stored compressed (zlib over uint8 pixels, as PNG stores them), decoded, converted
    and normalised in ``__getitem__``: a pipeline whose loader does real work per sample."""

    def __init__(self, n: int = 48, size: int = 8, seed: int = 0) -> None:
        import zlib

        gen = torch.Generator().manual_seed(seed)
        self.size = size
        self.blobs = [
            zlib.compress(torch.randint(0, 256, (3, size, size), generator=gen, dtype=torch.uint8).numpy().tobytes())
            for _ in range(n)
        ]
        self.labels = [i % 4 for i in range(n)]

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple:
        import zlib

        pixels = torch.frombuffer(bytearray(zlib.decompress(self.blobs[i])), dtype=torch.uint8)
        image = pixels.reshape(3, self.size, self.size).float().div(255).sub(0.5).div(0.25)
        return image, torch.tensor(self.labels[i])


class SleeperMLP(FragileMLP):
    """:class:`FragileMLP` whose outlier wakes with the data: input feature 15 passes into
    channel 0 of ``fc.2``'s input. Where it is moderate (the calibration samples of
    :func:`sleeper_data`) every layer quantizes within the guard; where it is large (its
    validation samples) per-tensor int8 of ``fc.0``'s and ``fc.2``'s inputs crushes every other
    channel."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.fc[0].bias[0] = 0.0  # no outlier of its own: channel 0 is feature 15 alone
            self.fc[0].weight[0] = 0.0
            self.fc[0].weight[:, 15] = 0.0  # feature 15 reaches channel 0 alone
            self.fc[0].weight[0, 15] = 1.0


def sleeper_data(n: int = 160, n_val: int = 32, quiet: float = 20.0, loud: float = 300.0) -> list:
    """Samples of 15 normal features and a 16th that is ``loud`` in the ``n_val`` the guard
    scores (:func:`autotune.samples.validation_indices`) and ``quiet`` in the rest, which
    calibration draws from."""
    from autotune.samples import validation_indices

    gen = torch.Generator().manual_seed(0)
    samples = [torch.randn(16, generator=gen) for _ in range(n)]
    scored = set(validation_indices(n, n_val))
    for i, x in enumerate(samples):
        x[15] = loud if i in scored else quiet
    return samples
