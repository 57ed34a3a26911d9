"""The small CPU workloads (:mod:`.workloads`: the quickstart, the digits CNN, transformer encoders,
an LSTM, a ResNet-shaped CNN, two digits models to train), what compression does to them
(:mod:`.compression`, ``python -m benchmarks.cpu.compression``) and CNNs beside OpenVINO's hand
recipes (:mod:`.openvino`). This file registers the family's workloads: each is built only when a
benchmark asks for it."""

from benchmarks.core import CPU_MEASURE, Workload, register
from benchmarks.cpu import workloads as w

_INFERENCE = {"n_trials": {"inference": 10}, "measure": CPU_MEASURE}
# Trained in part 4 of the cpu suite too: its training budget beside the inference one.
_BOTH = {"n_trials": {"inference": 10, "train": 16}, "modes": ("inference", "train"), "measure": CPU_MEASURE}

for _fields in (
    dict(name="quickstart", description="examples/quickstart.py: its MLP and data, as the cfg.py has them",
         build=w.quickstart, benchmarks=("claims",), **_INFERENCE),
    dict(name="digits", description="the CNN of examples/digits.py on scikit-learn's handwritten digits",
         build=w.digits, benchmarks=("run.cpu", "claims", "cpu.compression", "cpu.openvino"), **_BOTH),
    dict(name="transformer", description="a 6-layer encoder (hidden 384, MiniLM's shape), random weights, "
         "on 128 token sequences", build=w.encoder, benchmarks=("run.cpu", "claims"), **_INFERENCE),
    dict(name="transformer-small", description="a 2-layer encoder (d_model 128) trained on keyword counts "
         "in token sequences", build=w.transformer, benchmarks=("cpu.compression",), **_INFERENCE),
    dict(name="lstm", description="a one-layer LSTM trained on noisy multichannel sines",
         build=w.lstm, benchmarks=("run.cpu", "cpu.compression"), **_BOTH),
    dict(name="resnet", description="a ResNet-50-shaped CNN (a block per stage, 64 wide), random weights, "
         "on 256 float images of 64x64", build=w.resnet, n_trials={"inference": 16},
         benchmarks=("cpu.openvino",)),
    dict(name="digits-mlp", description="a 3-layer MLP trained from fresh weights on every digit",
         build=w.digits_mlp, modes=("train",), n_trials={"train": 8}, benchmarks=("ddp",)),
    dict(name="digits-cnn", description="a 2-convolution CNN trained from fresh weights on every digit",
         build=w.digits_cnn, modes=("train",), n_trials={"train": 8}, benchmarks=("ddp",)),
):  # fmt: skip
    register(Workload(family="cpu", **_fields))
