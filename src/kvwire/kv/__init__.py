"""K/V surgery: packets from the store joined into the cache an agent reads.

In: packets in a :class:`~kvwire.store.Store` (published by upstream agents), the
receiver's model. Out: one packet whose K/V cover the receiver's context, ready for
:func:`kvwire.hf.build_cache`.

- :mod:`.chain` -- publish a packet; fetch and assemble a chain of them (an exact prefix).
- :mod:`.splice` -- place upstream segments inside the receiver's own context: keys
  re-rotated (:mod:`kvwire.wire.rope`), a share of tokens recomputed (approximate).
"""
