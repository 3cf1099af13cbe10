"""Read-only registry of the zoo model factories."""

from __future__ import annotations

from types import MappingProxyType

from .bert import bert_base, bert_small
from .inception import inception_small, inception_v3
from .llama import llama_decoder, llama_small
from .recsys import deepfm, deepfm_small, dlrm, dlrm_small
from .resnet import (resnet50, resnet50_small, resnet101, resnet152, wide_resnet101_2,
                     wrn_small)
from .vgg import vgg16, vgg16_small, vgg19

ZOO = MappingProxyType(
    {
        "vgg16": vgg16,
        "vgg16_small": vgg16_small,
        "vgg19": vgg19,
        "resnet50": resnet50,
        "resnet50_small": resnet50_small,
        "resnet101": resnet101,
        "resnet152": resnet152,
        "wide_resnet101_2": wide_resnet101_2,
        "wrn_small": wrn_small,
        "inception_v3": inception_v3,
        "inception_small": inception_small,
        "bert_base": bert_base,
        "bert_small": bert_small,
        "llama_decoder": llama_decoder,
        "llama_small": llama_small,
        "dlrm": dlrm,
        "dlrm_small": dlrm_small,
        "deepfm": deepfm,
        "deepfm_small": deepfm_small,
    }
)
"""Model name -> zero-argument factory returning a freshly initialised ``nn.Module``."""

SMALL_MODELS: tuple[str, ...] = (
    "vgg16_small",
    "resnet50_small",
    "wrn_small",
    "inception_small",
    "bert_small",
    "llama_small",
)
"""Names in :data:`ZOO` of the tiny models (a forward + backward takes milliseconds on CPU)."""
