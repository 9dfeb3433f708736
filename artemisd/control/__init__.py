"""The acting half's shared parts: the action table (``actions``) and, as they move here, the pure
reconcile and its effects.  Nothing here does I/O."""
