"""In-repo model zoo: torchvision-/HF-shaped reference models built from plain ``nn.Module``s.

It also holds DLRM and DeepFM click models (:mod:`.recsys`) for the embedding-cache work.

Every model is ``torch.fx.symbolic_trace``-able and provides
``example_inputs(batch_size)``, ``example_targets(batch_size)`` and
``default_loss(outputs, targets)``. ``ZOO`` maps model names to factories;
``SMALL_MODELS`` lists the tiny variants meant for fast tests.
"""

from .bert import BertConfig, BertForSequenceClassification, BertModel, bert_base, bert_small
from .generation import generate
from .inception import Inception3, inception_small, inception_v3
from .llama import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    llama_decoder,
    llama_small,
    smollm2_135m_config,
)
from .recsys import DLRM, DeepFM, deepfm, deepfm_small, dlrm, dlrm_small
from .resnet import (
    Bottleneck,
    ResNet,
    resnet50,
    resnet50_small,
    resnet101,
    resnet152,
    wide_resnet101_2,
    wrn_small,
)
from .vgg import VGG, vgg16, vgg16_small, vgg19
from .zoo import SMALL_MODELS, ZOO

__all__ = [
    "BertConfig",
    "BertForSequenceClassification",
    "BertModel",
    "Bottleneck",
    "DLRM",
    "DeepFM",
    "Inception3",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "ResNet",
    "SMALL_MODELS",
    "VGG",
    "ZOO",
    "bert_base",
    "bert_small",
    "deepfm",
    "deepfm_small",
    "dlrm",
    "dlrm_small",
    "generate",
    "inception_small",
    "inception_v3",
    "llama_decoder",
    "llama_small",
    "resnet152",
    "resnet50",
    "resnet50_small",
    "resnet101",
    "smollm2_135m_config",
    "vgg16",
    "vgg16_small",
    "vgg19",
    "wide_resnet101_2",
    "wrn_small",
]
