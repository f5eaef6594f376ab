"""The packet and its wire format: what a KV-cache is, and how it crosses a process boundary.

In: a :class:`~kvwire.wire.packet.Packet` (made by :func:`kvwire.hf.extract` from a model's
cache, layout ``[B, H_kv, T, D]``). Out: bytes (safetensors, checksummed, optionally
quantized and signed) that any store can hold -- and back: bytes in, a verified packet out.

- :mod:`.spec` -- :class:`~.spec.ModelSpec`: the shape of a cache, independent of any framework.
- :mod:`.packet` -- :class:`~.packet.Packet`: one agent's K/V for a run of tokens, and ``join``.
- :mod:`.layers` -- partial-layer packets: which layers travel, which the receiver computes.
- :mod:`.quant` -- encodings (``fp32`` .. ``int4``) and the quantization math.
- :mod:`.signing` -- HMAC-SHA256 signatures with a shared key.
- :mod:`.codec` -- packet <-> bytes and files; its docstring is the format spec.
- :mod:`.checks` -- what the codec checks in untrusted bytes, in order.
- :mod:`.options` -- :class:`~.options.CodecOptions`, from arguments or the environment.
- :mod:`.rope` -- exact RoPE re-rotation of cached keys (strip, apply at other positions).
- :mod:`.atomic` -- atomic file writes (a reader sees the old file or the whole new one).
"""
