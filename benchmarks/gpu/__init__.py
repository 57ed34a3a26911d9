"""One CUDA GPU: the models and data (:mod:`.models`, :mod:`.workloads`), the headline benchmark
(:mod:`.bench`, ``python -m benchmarks.gpu``) and its timing (:mod:`.timing`), and the GPU check
(:mod:`.check`, ``python -m benchmarks.gpu.check``) with its pytest plugin (:mod:`.check_log`).
This file registers the family's workloads: each is built only when a benchmark asks for it."""

from functools import partial

from benchmarks.core import Workload, register
from benchmarks.gpu import models as m
from benchmarks.gpu import workloads as w

_HEADLINE = {"n_trials": {"inference": 12}, "benchmarks": ("gpu",)}
_COMPARED = {"n_trials": {"inference": 8}, "benchmarks": ("run.gpu-compare",), "extras": {"unit": "images/s"}}
# The suite tunes the training step too, on the data sets in memory.
_TRAINED = {**_COMPARED, "n_trials": {"inference": 8, "train": 6}, "modes": ("inference", "train")}

for _fields in (
    dict(name="resnet50-float", description="ResNet-50 on 224x224 float32 images held in memory",
         build=partial(w.headline, m.resnet50, w.FloatImageTensors), extras={"unit": "images/s"}, **_HEADLINE),
    dict(name="resnet50-uint8", description="ResNet-50 on the images held as uint8, cast and normalized by its "
         "first step on the GPU", build=partial(w.headline, w.resnet50_uint8, w.Uint8ImageTensors),
         extras={"unit": "images/s"}, **_HEADLINE),
    dict(name="bert-text", description="a BERT-base-shaped encoder on sentences of 16 to 128 tokens, padded to 128 "
         "by the user's collate", build=partial(w.headline, w.bert_base, w.TokenSequences, w.pad_to_max),
         extras={"unit": "sequences/s"}, **_HEADLINE),
    dict(name="resnet50-memory", description="a ResNet-50-shaped CNN on float images already in memory",
         build=partial(w.compared, m.resnet50, m.FloatImages), **_TRAINED),
    dict(name="resnet50-uint8-cpu", description="a ResNet-50-shaped CNN on uint8 images converted per sample on "
         "the CPU", build=partial(w.compared, m.resnet50, m.Uint8Images), **_COMPARED),
    dict(name="vit_b16-memory", description="a ViT-B/16-shaped encoder on float images already in memory",
         build=partial(w.compared, m.vit_b16, m.FloatImages), **_TRAINED),
    dict(name="vit_b16-uint8", description="a ViT-B/16-shaped encoder on uint8 images converted per sample on "
         "the CPU", build=partial(w.compared, m.vit_b16, m.Uint8Images), **_COMPARED),
):  # fmt: skip
    register(Workload(family="gpu", device="cuda", **_fields))
