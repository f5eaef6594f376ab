"""Cache-to-cache between different models (C2C): a sharer's cache, made usable by a receiver.

Two agents run different models -- other layer counts, KV heads, head sizes, RoPE bases
and tokenizers -- so a cache cannot be handed over as is. This subpackage turns the
sharer's cache for a context into K/V the receiver can attend over for the same context.

What flows in and out::

    sharer packet  (sharer's K/V for the context; through a store like any packet)
    receiver ids   (the receiver's tokens of the same context) and its own K/V for them
        |
        |  align.align_texts / align.align_chat   receiver token i <- sharer token(s) over the same characters
        |  adapters.layer_map_*                    receiver layer t <- sharer layer s(t)
        |  a projector: ridge.RidgeProjector or fuser.Fuser (position-free sharer K/V -> receiver K/V,
        |               fused as own + gate x projection)
        v
    fused packet   (the receiver's spec, keys rotated at the receiver's positions: hf.build_cache, generate)

- :mod:`.adapters`   structural mappings, pure functions: layers (terminal, proportional),
  heads (GQA repeat, group mean), head_dim (a projection matrix)
- :mod:`.align`      token alignment by character offsets; chat templates by sections
- :mod:`.check`      two models side by side and the verdict: same weights, a fine-tuned
  variant (partial-layer transfer), or different (a fuser is needed, and is there one)
- :mod:`.registry`   where projector/fuser checkpoints live and which pair each one is for
- :mod:`.checkpoint` the checkpoint format (safetensors + JSON config naming both models)
- :mod:`.fuser`      the learned fuser: per receiver layer, own K/V + gate x weight x projection
- :mod:`.train`      training it (both models frozen) and the LoRA-tuned receiver baseline; its parts
  :mod:`.precompute` (the sharer's K/V and both models' losses, the gap filter),
  :mod:`.evaluation` (held-out loss, the bundled questions, the other-context control, the best
  checkpoint) and :mod:`.train_state` (final and resumable checkpoints)
- :mod:`.gain`       a projector's validated gain over the receiver alone, and the refusal of one without
- :mod:`.data`       training examples -> token ids, alignment and the sharer's precomputed K/V
- :mod:`.dense`      dense (context, response) pairs from Python's standard library, split by module
- :mod:`.distill`    sharer-written responses: the sharer's own greedy answer as the training target
- :mod:`.stdlib_qa`  multiple-choice questions built from it (the earlier recipe)

Only :mod:`kvwire.hf` touches transformers; this package reaches models and tokenizers
through it.
"""
