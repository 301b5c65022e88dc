"""Token-level routing on a worker: the route hook API, the policies and the runtime
that turns the engine's hand-offs into PeerReqs (docs/token-routing.md)."""
