"""Cache-to-cache between different models (C2C): a sharer's cache, made usable by a receiver.

Two agents run different models -- other layer counts, KV heads, head sizes, RoPE bases
and tokenizers -- so a cache cannot be handed over as is. This subpackage turns the
sharer's cache for a context into K/V the receiver can attend over for the same context.

What flows in and out::

    sharer packet  (sharer's K/V for its own rendering of the messages; through a store like any packet)
    receiver ids   (the receiver's rendering of the same messages) and its own K/V for them
        |
        |  align.align_chat / align.align_texts   receiver token i <- sharer token(s) over the same characters
        |  adapters.layer_map_*                    receiver layer t <- sharer layer s(t)
        |  a Projector (ridge.RidgeProjector, or the learned fuser)   position-free sharer K/V -> receiver K/V
        v
    fused packet   (receiver's spec: build it with kvwire.hf.build_cache and generate)

Modules:

- :mod:`.adapters`  structural mappings, pure functions: layers (terminal, proportional),
  heads (GQA repeat, group mean), head_dim (a projection matrix);
- :mod:`.align`     token alignment by character offsets, chat templates handled by sections;
- :mod:`.check`     two models side by side and the verdict: same weights, a fine-tuned
  variant (partial-layer transfer), or different (a fuser is needed, and is there one);
- :mod:`.registry`  where projector/fuser checkpoints live and which pair each one is for.

Only :mod:`kvwire.hf` touches transformers; this package reaches models and tokenizers
through it.
"""
