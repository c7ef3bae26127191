"""What drafting proposers share: draft caches, artifact loading, tree growth, exit-layer
checks and cost models. Proposers (``specdecode.proposers``) compose these parts."""
