"""Gradient-cached steps: global batches larger than memory, with the gradients of the whole batch.

``train.chunk_size: C`` makes the step GradCache (Gao et al. 2021,
arXiv:2101.06983) over the rank's P×K batch:

1. the batch is embedded C images at a time without a graph (each chunk's
   RNG state is recorded first);
2. the embeddings are all-gathered as in the plain step, and the loss (with
   its miner, its cross-batch memory, ...) sees the whole global batch; its
   gradient with respect to this rank's embeddings is kept (one backward
   through the loss and the all-gather, nothing through the network);
3. each chunk runs again, with its RNG state replayed, and is backpropagated
   with its slice of that gradient. The parameters' gradients add up to those
   of one backward pass over the whole batch.

Memory is that of one chunk's activations plus an embedding per image; time
is one extra forward pass. The gradient is reduced across ranks once per
step: DDP skips the reduction for all chunks but the last
(:meth:`~pksampler.train.runtime.distributed.Backend.accumulating`), and
Horovod's optimizer is told how many backward passes make a step.

What it needs: a forward pass that treats each image alone. BatchNorm in
train mode computes statistics over the batch it sees, so a chunk's
statistics are not the batch's and the first and second passes would not
even agree; the application refuses it (:func:`check_chunkable`). Group
norm, layer norm, frozen BatchNorm and no norm are per image. A BatchNorm
neck is not in the chunks' forward pass: the step applies it to the gathered
global batch in step 2 (:mod:`.global_neck`), so it sees the whole batch
here too.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from pksampler.train.engine.trainer import Trainer
from pksampler.train.errors import ConfigError
from pksampler.train.modeling.frozen_norm import FrozenBatchNorm2d

__all__ = ["CachedTrainer", "check_chunkable"]


def check_chunkable(model: torch.nn.Module, chunk_size: int | None, *, apart: torch.nn.Module | None = None) -> None:
    """Refuse ``train.chunk_size`` with a model whose BatchNorm layers train (their statistics span the chunk);
    ``apart``: the neck the step applies to the gathered batch, outside the chunks."""
    if chunk_size is None:
        return
    training = [name for name, module in model.named_modules()
                if isinstance(module, _BatchNorm) and not isinstance(module, FrozenBatchNorm2d) and module is not apart]
    if training:
        raise ConfigError(
            f"train.chunk_size={chunk_size}: the model has BatchNorm layers in train mode ({training[0]}, "
            f"{len(training)} in all): their statistics would be those of a chunk, not of the batch, and differ "
            "between the two passes; set model.norm: group (or none) or model.freeze_norm: true "
            "(a BatchNorm neck may stay: the step applies it to the gathered batch)")


@contextlib.contextmanager
def _replayed(state: tuple[torch.Tensor, list[torch.Tensor]]) -> Iterator[None]:
    """Run the block with the RNG states of ``state`` (CPU, CUDA); the caller's states are restored after."""
    devices = list(range(torch.cuda.device_count())) if state[1] else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1]:
            torch.cuda.set_rng_state_all(state[1])
        yield


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


class CachedTrainer(Trainer):
    """:class:`Trainer` whose step embeds, takes the loss's gradient, then backpropagates chunk by chunk.

    Only :meth:`forward_backward` differs; the loop, hooks, state and the
    optimizer step are the plain trainer's.
    """

    def __init__(self, *args, chunk_size: int, **kwargs) -> None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"CachedTrainer(chunk_size=) expects a positive int, got {chunk_size!r}")
        super().__init__(*args, **kwargs)
        self.chunk_size = chunk_size

    def _chunks(self, count: int) -> list[slice]:
        return [slice(start, min(start + self.chunk_size, count)) for start in range(0, count, self.chunk_size)]

    def _embed(self, images: torch.Tensor, chunks: list[slice]) -> tuple[torch.Tensor, list]:
        """Embeddings of every chunk, without a graph, and the RNG state each chunk started from."""
        parts, setup = self.parts, self.parts.backend.setup
        states, pieces = [], []
        with torch.no_grad():
            for chunk in chunks:
                states.append(_rng_state())
                with setup.autocast():
                    pieces.append(parts.train_model(images[chunk]).float())
        return torch.cat(pieces), states

    def _embedding_gradient(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The (scaled) loss's gradient with respect to this rank's embeddings, through the all-gather."""
        local = embeddings.detach().requires_grad_(True)
        self.loss_backward(local, labels)  # the plain step's loss and backward, stopping at the embeddings
        return local.grad

    def forward_backward(self, images: torch.Tensor, labels: torch.Tensor, *, reduce: bool) -> None:
        """The plain step's gradients, one chunk's activations at a time; reduced when ``reduce``."""
        parts, setup = self.parts, self.parts.backend.setup
        parts.train_model.train()
        images = setup.to_device(images)
        labels = labels.to(setup.device, non_blocking=True)
        chunks = self._chunks(images.shape[0])
        parts.backend.expect_backward_passes(parts.optimizer, len(chunks) * parts.passes)
        embeddings, states = self._embed(images, chunks)
        gradient = self._embedding_gradient(embeddings, labels)
        for number, (chunk, state) in enumerate(zip(chunks, states)):
            last = reduce and number == len(chunks) - 1
            context = contextlib.nullcontext() if last else parts.backend.accumulating(parts.train_model)
            with context, _replayed(state):
                with setup.autocast():
                    again = parts.train_model(images[chunk]).float()
                again.backward(gradient[chunk])
