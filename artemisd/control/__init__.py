"""The acting half's shared parts: the action table (``actions``), the decisions on an incident and
their effects (``reconcile``), and what a person is told (``escalation``).  Nothing here does I/O."""
