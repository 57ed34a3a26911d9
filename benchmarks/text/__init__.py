"""Real text: the pretrained all-MiniLM-L6-v2 on real English sentences (:mod:`.workload`), the
hand recipes and their run (:mod:`.recipes`, ``python -m benchmarks.text``), autotune against
them (:mod:`.tune`), OpenVINO beside them (:mod:`.openvino`), the Hugging Face pipeline
(:mod:`.hf`) and a cfg.py of the workload (:mod:`.cfg`)."""
