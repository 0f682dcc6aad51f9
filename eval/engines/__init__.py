"""Benchmarks of the engines a user compares against, on the goal bench's prompts: llama.cpp
(llamacpp_bench.py) and OpenVINO GenAI (openvino_bench.py), with their shared config, plain options and tables
(common.py). Building, converting and running the engines themselves is models/engines/."""
