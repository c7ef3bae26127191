"""Draft heads: small networks on the target's own hidden states (Hydra, Clover, EAGLE), their
artifacts and the draft cache the head proposers grow trees with."""
