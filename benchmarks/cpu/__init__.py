"""The small CPU workloads (:mod:`.workloads`: the digits CNN, a transformer encoder, an LSTM), and
what compression does to them (:mod:`.compression`, ``python -m benchmarks.cpu.compression``)."""
