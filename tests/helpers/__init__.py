"""Test helpers: a batch recorder for real runs, a reader of offline W&B runs, reference decoders."""
