"""Cache-to-cache between different models (C2C): what flows in and out.

In: the sharer's cache (its own tokens, its layers, heads and RoPE) and the
receiver's cache of the same text. Out: a cache the receiver can use as its own
(``[B, H_kv, N, D]`` per receiver layer, keys rotated at the receiver's positions).

- :mod:`.fuser`      the learned fuser: per receiver layer, own K/V + gate x weight x projection
- :mod:`.train`      training it (both models frozen) and the LoRA-tuned receiver baseline
- :mod:`.data`       training examples -> token ids, alignment and the sharer's precomputed K/V
- :mod:`.stdlib_qa`  training questions built from Python's standard library
- :mod:`.checkpoint` the checkpoint format (safetensors + JSON config naming both models)
"""
