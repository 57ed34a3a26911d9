"""Ship the winner: tune, then serve each exported artifact the way a deployment would.

    python examples/deploy.py --out deploy-out

1. autotune.optimize writes model.onnx and model.pt with their parity into --out.
2. The ONNX file is served by plain onnxruntime + numpy, in a fresh process with no torch.
3. The TorchScript file is served by torch.jit.load, in a fresh process with no autotune.
4. autotune.load serves either with the batch size and runtime settings the search chose.
"""

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch
from torch import nn

import autotune


def make_data(n: int = 2048) -> list:
    """(32,) float features, labels from a fixed projection: a learnable 4-class task."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=gen)
    y = (x @ torch.randn(32, 4, generator=gen)).argmax(1)
    return list(zip(x, y, strict=True))


def make_model(data: list) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x, y = torch.stack([s[0] for s in data]), torch.stack([s[1] for s in data])
    for _ in range(100):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval()


ONNX_SERVER = """
import sys, numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])
name = session.get_inputs()[0].name
print(session.run(None, {name: x})[0].argmax(1).tolist())
"""

TORCHSCRIPT_SERVER = """
import sys, numpy as np, torch
model = torch.jit.load(sys.argv[1])
x = torch.from_numpy(np.load(sys.argv[2]))
with torch.inference_mode():
    print(model(x).argmax(1).tolist())
"""


def serve_in_fresh_process(code: str, artifact: Path, inputs: Path) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(artifact), str(inputs)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="deploy-out")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--timeout", type=float, help="seconds for the whole run (default: none)")
    args = parser.parse_args()

    data = make_data()
    model = make_model(data)
    result = autotune.optimize(
        model, data, space="quick", n_trials=args.trials, timeout=args.timeout, out_dir=args.out, device="cpu"
    )
    out = Path(args.out)
    record = json.loads((out / "best_config.json").read_text())
    for fmt, art in record["artifacts"].items():
        print(f"{fmt}: {art['path']} {art['bytes']:,} bytes, status {art['status']}, parity {art['parity']}")

    x = np.stack([s[0].numpy() for s in data[:64]])  # (64, 32) float32
    np.save(out / "inputs.npy", x)
    expected = model(torch.from_numpy(x)).argmax(1).tolist()
    served = {"reference": expected}
    if "onnx" in result.artifacts:
        served["onnxruntime"] = serve_in_fresh_process(ONNX_SERVER, out / "model.onnx", out / "inputs.npy")
    if "torchscript" in result.artifacts:
        served["torch.jit"] = serve_in_fresh_process(TORCHSCRIPT_SERVER, out / "model.pt", out / "inputs.npy")
    served["autotune.load"] = autotune.load(out)(x).argmax(1).tolist()
    for name, labels in served.items():
        agree = np.mean(np.array(labels) == np.array(expected))
        print(f"{name:>14}: top-1 agreement with the original model {agree:.3f}")
        if agree < 0.95:
            sys.exit(f"{name} disagrees with the original model: {agree:.3f}")


if __name__ == "__main__":
    main()
