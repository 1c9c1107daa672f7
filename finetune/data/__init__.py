"""Data: sources, formats normalized to one conversation, rendering with exact masks, encoding, packing, the cache and
the data report."""
