"""What drafting proposers share: draft caches, artifact loading, tree growth, exit-layer
checks and cost models, and the exit adapters early exits draft through. Proposers (``specdecode.proposers``) compose these parts."""
