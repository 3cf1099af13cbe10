"""Deterministic example inputs, targets and default losses for the model zoo.

The mixins in this module give each zoo model ``example_inputs(batch_size)``,
``example_targets(batch_size)`` and ``default_loss(outputs, targets)``. All
random data comes from a fresh ``torch.Generator`` seeded with 0, so repeated
calls return identical tensors. Data is generated on the CPU and then moved to
the device of the model's parameters (which may be ``meta``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EXAMPLE_SEED = 0


def seeded_generator(seed: int = EXAMPLE_SEED) -> torch.Generator:
    """Return a new CPU generator seeded with ``seed``."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def module_device(module: nn.Module) -> torch.device:
    """Return the device of the first parameter (or buffer) of ``module``; CPU if it has none."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def random_images(batch_size: int, channels: int, size: int) -> Tensor:
    """Standard-normal float32 images ``[batch_size, channels, size, size]``."""
    return torch.randn(
        batch_size, channels, size, size, generator=seeded_generator(), dtype=torch.float32
    )


def random_labels(batch_size: int, num_classes: int) -> Tensor:
    """Class indices ``[batch_size]`` (int64) uniform in ``[0, num_classes)``."""
    return torch.randint(num_classes, (batch_size,), generator=seeded_generator())


def random_tokens(batch_size: int, seq_len: int, vocab_size: int) -> Tensor:
    """Token ids ``[batch_size, seq_len]`` (int64) uniform in ``[0, vocab_size)``."""
    return torch.randint(vocab_size, (batch_size, seq_len), generator=seeded_generator())


def classification_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Cross entropy of logits ``[B, C]`` against class indices ``[B]``."""
    return F.cross_entropy(outputs, targets)


def causal_lm_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Cross entropy of LM logits ``[B, T, V]`` against token ids ``[B, T]`` (flattened to ``B*T``)."""
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())


class ImageClassifierIO:
    """Mixin for image classifiers; needs ``in_channels``, ``input_size``, ``num_classes`` attributes."""

    in_channels: int
    input_size: int
    num_classes: int

    def example_inputs(self, batch_size: int) -> tuple[Tensor, ...]:
        """Return ``(images,)`` with images ``[batch_size, in_channels, input_size, input_size]``."""
        images = random_images(batch_size, self.in_channels, self.input_size)
        return (images.to(module_device(self)),)

    def example_targets(self, batch_size: int) -> Tensor:
        """Return class indices ``[batch_size]``."""
        return random_labels(batch_size, self.num_classes).to(module_device(self))

    default_loss = staticmethod(classification_loss)


class SequenceClassifierIO:
    """Mixin for token-sequence classifiers; needs ``config.vocab_size``, ``config.num_labels``
    and an ``example_seq_len`` attribute."""

    example_seq_len: int

    def example_inputs(self, batch_size: int) -> tuple[Tensor, ...]:
        """Return ``(input_ids,)`` with input_ids ``[batch_size, example_seq_len]``."""
        ids = random_tokens(batch_size, self.example_seq_len, self.config.vocab_size)
        return (ids.to(module_device(self)),)

    def example_targets(self, batch_size: int) -> Tensor:
        """Return class indices ``[batch_size]``."""
        return random_labels(batch_size, self.config.num_labels).to(module_device(self))

    default_loss = staticmethod(classification_loss)


class CausalLMIO:
    """Mixin for causal language models; needs ``config.vocab_size`` and ``example_seq_len``.

    Inputs and targets are the two shifted views of one random sequence of
    ``example_seq_len + 1`` tokens, i.e. the targets are the next tokens.
    """

    example_seq_len: int

    def _example_sequence(self, batch_size: int) -> Tensor:
        return random_tokens(batch_size, self.example_seq_len + 1, self.config.vocab_size).to(
            module_device(self)
        )

    def example_inputs(self, batch_size: int) -> tuple[Tensor, ...]:
        """Return ``(input_ids,)`` with input_ids ``[batch_size, example_seq_len]``."""
        return (self._example_sequence(batch_size)[:, :-1].contiguous(),)

    def example_targets(self, batch_size: int) -> Tensor:
        """Return next-token ids ``[batch_size, example_seq_len]``."""
        return self._example_sequence(batch_size)[:, 1:].contiguous()

    default_loss = staticmethod(causal_lm_loss)
