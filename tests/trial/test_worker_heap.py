"""A trial worker leaves what it holds once set up out of Python's later full collections: each
trial's and each round's memory account starts with one, and in a worker of a real model that
walked half a million objects each time. What the setup left as garbage is collected first, and
what a trial makes later is collected as before."""

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import gc, io, threading, weakref
    from multiprocessing import Pipe

    import torch

    from autotune.config import Config
    from autotune.trial.measure import MeasureSettings
    from autotune.trial.spec import WorkerSpec
    from autotune.trial.worker import serve
    from tests.models import MLP, classification_data

    class Cycle:
        def __init__(self):
            self.me = self

    before = Cycle()
    dead_before = weakref.ref(before)
    del before  # garbage left behind before the worker is set up

    spec = WorkerSpec(model=MLP(), dataset=classification_data(64), metric=None, device="cpu",
                      baseline=dict(Config({"batch_size": 8})), val_indices=list(range(16)),
                      measure=MeasureSettings(n_windows=1, window_s=0.01, warmup_batches=1, n_remeasure=0))
    buffer = io.BytesIO()
    torch.save(spec, buffer)
    ours, theirs = Pipe()
    assert gc.get_freeze_count() == 0
    worker = threading.Thread(target=serve, args=(theirs,), daemon=True)  # a failed check ends the script
    worker.start()
    ours.send(("init", buffer.getvalue()))
    reply = ours.recv()
    assert reply[0] == "ready", reply
    assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()  # torch, the model, the samples
    assert dead_before() is None  # the setup's garbage was collected, not frozen
    later = Cycle()
    dead_later = weakref.ref(later)
    del later
    ours.send(("trial", dict(Config({"batch_size": 16}))))
    while (reply := ours.recv())[0] == "phase":
        pass
    assert reply[0] == "result" and reply[1].status == "ok", reply
    gc.collect()
    assert dead_later() is None  # what comes after the setup is collected as before
    ours.send(("stop",))
    worker.join()
    print("ok")
    """
)


def test_a_worker_freezes_its_setup_out_of_later_collections_and_still_collects_what_comes_after():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
