"""The relay: moves PeerReqs between the workers of token-level presets."""
