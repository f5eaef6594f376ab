"""Small builders shared by tests."""

from __future__ import annotations

import json

import torch

from kvwire import ModelSpec, Packet


def spec(num_layers: int = 2, kv_heads: int = 2, head_dim: int = 4, sliding: tuple[int, ...] = (),
         window: int | None = None, dtype: str = "float32", fingerprint: str = "f" * 64) -> ModelSpec:
    kinds = tuple("sliding_attention" if i in sliding else "full_attention" for i in range(num_layers))
    return ModelSpec(architecture="TinyForCausalLM", model_type="tiny", num_layers=num_layers, num_kv_heads=kv_heads,
                     head_dim=head_dim, dtype=dtype, vocab_size=1000, layer_kinds=kinds,
                     sliding_window=window if sliding else None, rope={"rope_type": "default", "rope_theta": 1e4},
                     fingerprint=fingerprint)


def packet(s: ModelSpec | None = None, tokens: int = 5, batch: int = 1, start: int = 0, seed: int = 0,
           parent: Packet | None = None) -> Packet:
    """A random but valid packet; with ``parent`` it continues that packet."""
    s = s or spec()
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(batch, s.num_kv_heads, s.kept_tokens(i // 2, tokens), s.head_dim, generator=g)
          .to(s.torch_dtype) for i in range(2 * s.num_layers)]
    ids = torch.randint(0, s.vocab_size, (batch, tokens), generator=g)
    return Packet(spec=s, keys=tuple(kv[0::2]), values=tuple(kv[1::2]), token_ids=ids,
                  mask=torch.ones(batch, tokens, dtype=torch.uint8),
                  start=parent.end if parent is not None else start,
                  parent=parent.id if parent is not None else None,
                  parent_checksum=parent.checksum if parent is not None else None,
                  producer="tester", session="s1")


# -- editing encoded packets (to show what decode refuses) -------------------------------------------


def header_of(data: bytes) -> tuple[int, dict]:
    """The header length and the parsed safetensors header of an encoded packet."""
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8 : 8 + n])


def rewrite(data: bytes, edit) -> bytes:
    """Edit the parsed header and write it back compactly (a signature stays first)."""
    n, header = header_of(data)
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def edit_meta(field, value):
    """A header edit setting one kvwire metadata field."""
    def edit(header):
        meta = json.loads(header["__metadata__"]["kvwire"])
        meta[field] = value
        header["__metadata__"]["kvwire"] = json.dumps(meta, sort_keys=True)
    return edit
