"""The engines a user deploys to and compares against: llama.cpp (build from the pinned sdist, GGUF export and
conversion, the server and CLI runners: llamacpp.py) and OpenVINO GenAI (its venv, IR export, a worker process per
pipeline: openvino.py, openvino_worker.py). Their benchmarks are eval/engines/."""
