"""Runtime: what runs one forward pass. The model (the torch reference), loading it from safetensors or
GGUF (one reader, `gguf`), which arithmetic runs it (`weights`: the kernels or torch), the kernels, the
KV cache, the mask-token adapter, and the files and checks they share (`artifacts`, `checks`).
Imports nothing else of mtp: decoding and policy build on it (tests/test_layers.py)."""
