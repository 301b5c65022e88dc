"""The delayed-batching controller (TokenRouter's B*): the chain (`dtmc`), its Monte-Carlo
check (`simulate`), online estimates (`estimates`), the hold rule (`hold`) and the service."""
